"""Adapter downloads answer one byte range (206), so an interrupted download resumes: `Range`,
`If-Range`, the 416 for a range past the end, and `curl -C -` against a real server."""

import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.adapters.file_response import Unsatisfiable, byte_range
from tests.app.api import LiveServer, TenantHandle, create_run
from tests.app.test_adapters import FILES, adapter_tar, peft_dir, upload

__all__ = ["peft_dir"]  # the module fixture, shared


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("bytes=0-9", (0, 9)),
        ("bytes=10-", (10, 99)),
        ("bytes=-10", (90, 99)),
        ("bytes=-500", (0, 99)),  # a suffix longer than the file is the whole file
        ("bytes=90-500", (90, 99)),  # a last byte past the end is the end
        ("Bytes = 5 - 6", (5, 6)),  # the unit is case-insensitive; spaces are tolerated
        ("bytes=99-99", (99, 99)),
        ("bytes=0-9,20-29", None),  # several ranges: the whole file
        ("bytes=9-0", None),  # invalid: ignored
        ("bytes=-", None),
        ("items=0-9", None),  # another unit
        ("bytes=a-b", None),
    ],
)
def test_byte_range(header: str, expected: tuple[int, int] | None) -> None:
    assert byte_range(header, 100) == expected


@pytest.mark.parametrize(
    ("header", "size"), [("bytes=100-", 100), ("bytes=100-200", 100), ("bytes=-0", 100), ("bytes=0-", 0)]
)
def test_byte_range_unsatisfiable(header: str, size: int) -> None:
    with pytest.raises(Unsatisfiable):
        byte_range(header, size)


def _adapter(client: TestClient, tenant: TenantHandle, peft_dir: Path) -> tuple[str, bytes, str]:
    run = create_run(client, tenant)
    assert upload(client, run["id"], 1, adapter_tar(peft_dir)).status_code == 201
    whole = client.get(f"/v1/runs/{run['id']}/adapters/1", headers=tenant.headers)
    assert whole.status_code == 200
    assert whole.headers["accept-ranges"] == "bytes"
    return run["id"], whole.content, whole.headers["etag"]


def test_range_of_the_archive_and_of_a_file(client: TestClient, tenant: TenantHandle, peft_dir: Path) -> None:
    run_id, whole, etag = _adapter(client, tenant, peft_dir)
    size = len(whole)
    r = client.get(f"/v1/runs/{run_id}/adapters/1", headers=tenant.headers | {"Range": "bytes=10-19"})
    assert r.status_code == 206
    assert r.content == whole[10:20]
    assert r.headers["content-range"] == f"bytes 10-19/{size}"
    assert r.headers["content-length"] == "10"
    assert r.headers["etag"] == etag
    assert r.headers["x-adapter-step"] == "1"

    r = client.get(f"/v1/runs/{run_id}/adapters/1", headers=tenant.headers | {"Range": "bytes=-7"})
    assert (r.status_code, r.content) == (206, whole[-7:])

    weights = (peft_dir / FILES[1]).read_bytes()
    r = client.get(
        f"/v1/runs/{run_id}/adapters/1/files/{FILES[1]}", headers=tenant.headers | {"Range": "bytes=100-"}
    )
    assert (r.status_code, r.content) == (206, weights[100:])
    assert r.headers["content-range"] == f"bytes 100-{len(weights) - 1}/{len(weights)}"


def test_if_range_sends_the_whole_file_when_the_tag_differs(
    client: TestClient, tenant: TenantHandle, peft_dir: Path
) -> None:
    run_id, whole, etag = _adapter(client, tenant, peft_dir)
    url = f"/v1/runs/{run_id}/adapters/1"
    r = client.get(url, headers=tenant.headers | {"Range": "bytes=10-19", "If-Range": etag})
    assert (r.status_code, r.content) == (206, whole[10:20])
    for other in ('"another"', f"W/{etag}", "Wed, 21 Oct 2015 07:28:00 GMT"):
        r = client.get(url, headers=tenant.headers | {"Range": "bytes=10-19", "If-Range": other})
        assert (r.status_code, r.content) == (200, whole), other
        assert "content-range" not in r.headers


def test_a_range_past_the_end_is_a_416_in_the_uniform_body(
    client: TestClient, tenant: TenantHandle, peft_dir: Path
) -> None:
    run_id, whole, _ = _adapter(client, tenant, peft_dir)
    r = client.get(
        f"/v1/runs/{run_id}/adapters/1", headers=tenant.headers | {"Range": f"bytes={len(whole)}-"}
    )
    assert r.status_code == 416
    assert r.headers["content-range"] == f"bytes */{len(whole)}"
    assert r.headers["content-type"] == "application/json"
    assert "content-disposition" not in r.headers
    assert r.json()["error"]["code"] == "range_not_satisfiable"
    assert r.json()["error"]["details"] == {"size": len(whole)}


def test_another_tenant_gets_no_range_of_it(
    client: TestClient, tenant: TenantHandle, other_tenant: TenantHandle, peft_dir: Path
) -> None:
    run_id, _, _ = _adapter(client, tenant, peft_dir)
    r = client.get(f"/v1/runs/{run_id}/adapters/1", headers=other_tenant.headers | {"Range": "bytes=0-9"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


def test_curl_resumes_an_interrupted_download(
    client: TestClient, tenant: TenantHandle, peft_dir: Path, live_server: LiveServer, tmp_path: Path
) -> None:
    """What a user does after a dropped connection: `curl -C -` with the part on disk."""
    run_id, whole, _ = _adapter(client, tenant, peft_dir)
    part = tmp_path / "adapter.tar.gz"
    part.write_bytes(whole[: len(whole) // 3])
    # The key goes in a header file, never on the command line (visible to every user in ps).
    header_file = tmp_path / "headers"
    header_file.write_text(f"Authorization: {tenant.headers['Authorization']}\n")
    header_file.chmod(0o600)
    done = subprocess.run(
        [
            "curl",
            "-sS",
            "-f",
            "-C",
            "-",
            "-H",
            f"@{header_file}",
            "-o",
            str(part),
            "-w",
            "%{http_code}",
            f"{live_server.url.rstrip('/')}/v1/runs/{run_id}/adapters/1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "206"
    assert part.read_bytes() == whole
