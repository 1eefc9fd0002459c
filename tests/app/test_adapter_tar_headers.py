"""An uploaded tar's headers are walked before tarfile parses it (contracts/tar_headers.py; hostile
probe, 2026-11-29): on Python < 3.11.10 (CVE-2024-6232) a 42 KB tar whose pax header held 40,000
digits took 19.5 s to be refused by POST /v1/adapters, holding the GIL, so every other tenant's
requests waited as long. Such an archive is now a 422 naming what is wrong, tarfile never opens it,
and nothing is stored; the archives tools write (and the SDK's own) still pass."""

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.adapters.upload import MAX_TAR_EXTENDED_BYTES, MAX_TAR_MEMBERS
from app.adapters.uploads import uploads_dir
from app.config import Settings
from contracts.tar_headers import MAX_EXTENDED_HEADER_BYTES
from orchestrator.archive import adapter_dir_tar, extract_adapter
from tests.app.api import POOL_SPEC, TenantHandle, create_run, register
from tests.app.test_adapters import FILES, save, upload
from tests.hostile_tars import (
    END,
    extended,
    largest_accepted_pax,
    member,
    pax_digit_bomb,
    pax_record,
    refused_archives,
    refusing,
)

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
TENSORS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4),
}
ADAPTER = {FILES[0]: json.dumps(CONFIG).encode(), FILES[1]: save(TENSORS)}


@pytest.fixture
def pool(client: TestClient) -> None:
    """A live pool of the adapters' model: without one, POST /v1/adapters is refused (`no_pool`)
    before its tar is read."""
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)


@pytest.fixture
def tarfile_opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """What tarfile was asked to do: open an archive, or parse a pax or GNU long-name header. Each
    call is recorded, then refused as tarfile refuses a bad archive (a 422, never a 500)."""
    calls: list[str] = []

    monkeypatch.setattr(tarfile, "open", refusing(calls, "tarfile.open"))
    monkeypatch.setattr(tarfile.TarInfo, "_proc_pax", refusing(calls, "TarInfo._proc_pax"))
    monkeypatch.setattr(tarfile.TarInfo, "_proc_gnulong", refusing(calls, "TarInfo._proc_gnulong"))
    yield calls


def _post(client: TestClient, tenant: TenantHandle, body: bytes) -> Any:
    return client.post(
        "/v1/adapters",
        params={"name": "mine"},
        content=body,
        headers=tenant.headers | {"Content-Type": "application/x-tar"},
    )


def _assert_refused(answer: Any, reason: str) -> None:
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_adapter"
    [detail] = error["details"]
    assert detail["type"] == "invalid_tar" and detail["loc"] == ["body"]
    assert reason in detail["msg"] and reason in error["message"], (reason, error)


def _nothing_stored(client: TestClient, tenant: TenantHandle, settings: Settings) -> None:
    assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []
    root = uploads_dir(settings)
    assert not root.exists() or list(root.iterdir()) == []  # no adapter, no staging left behind


def test_the_pax_digit_bomb_is_refused_before_tarfile_parses_any_header(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    pool: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed: list[bytes] = []
    monkeypatch.setattr(tarfile.TarInfo, "_proc_pax", lambda self, tar: parsed.append(self.name))
    body = pax_digit_bomb(40_000)
    assert len(body) < 42 * 1024  # the prober's archive
    _assert_refused(_post(client, tenant, body), "pax extended header at byte 0 is 40000 bytes")
    assert parsed == []  # tarfile never ran its regex over the digits
    _nothing_stored(client, tenant, settings)


@pytest.mark.parametrize("case", sorted(refused_archives()))
def test_hostile_headers_are_refused_by_name_and_tarfile_never_opens_them(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    pool: None,
    tarfile_opened: list[str],
    case: str,
) -> None:
    body, reason = refused_archives(ADAPTER[FILES[0]])[case]
    _assert_refused(_post(client, tenant, body), reason)
    assert tarfile_opened == []
    _nothing_stored(client, tenant, settings)


def test_the_uploads_own_bounds_on_members_and_extended_headers(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool: None, tarfile_opened: list[str]
) -> None:
    members = b"".join(member(f"m{i}") for i in range(MAX_TAR_MEMBERS + 1)) + END
    _assert_refused(_post(client, tenant, members), f"one of more than {MAX_TAR_MEMBERS} members")
    near_the_bound = extended(pax_record(b"comment", b"x" * (MAX_EXTENDED_HEADER_BYTES - 100)))
    count = MAX_TAR_EXTENDED_BYTES // (MAX_EXTENDED_HEADER_BYTES - 100) + 1
    headers = b"".join(near_the_bound + member(f"m{i}") for i in range(count)) + END
    _assert_refused(_post(client, tenant, headers), f"extended headers past {MAX_TAR_EXTENDED_BYTES} bytes")
    assert tarfile_opened == []
    _nothing_stored(client, tenant, settings)


def test_the_pool_upload_refuses_the_bomb_too(
    client: TestClient, tenant: TenantHandle, settings: Settings, tarfile_opened: list[str]
) -> None:
    run = create_run(client, tenant)
    _assert_refused(upload(client, run["id"], 1, pax_digit_bomb()), "is 40000 bytes")
    assert tarfile_opened == []
    assert list((settings.runs_dir / run["id"] / "broadcast").iterdir()) == []


def _python_tar(tmp_path: Path, fmt: int) -> bytes:
    """The adapter as `tarfile` writes a directory's files by default: their float mtimes make a pax
    header for each in PAX_FORMAT, their owners' names go in too."""
    for name, data in ADAPTER.items():
        (tmp_path / name).write_bytes(data)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name in FILES:
            tar.add(tmp_path / name, arcname=name)
    return buf.getvalue()


def _at_the_bounds() -> bytes:
    """Each file after the largest pax header accepted (8 KiB, runs of MAX_DIGIT_RUN digits), a global one first."""
    body = extended(pax_record(b"comment", b"global"), tarfile.XGLTYPE)
    for name, data in ADAPTER.items():
        body += extended(largest_accepted_pax()) + member(name, data)
    return body + END


@pytest.mark.parametrize("kind", ["pax", "gnu", "ustar", "at the bounds", "the SDK's upload"])
def test_legitimate_archives_still_pass(
    client: TestClient, tenant: TenantHandle, tmp_path: Path, kind: str
) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
    body = {
        "pax": lambda: _python_tar(tmp_path, tarfile.PAX_FORMAT),
        "gnu": lambda: _python_tar(tmp_path, tarfile.GNU_FORMAT),
        "ustar": lambda: _python_tar(tmp_path, tarfile.USTAR_FORMAT),
        "at the bounds": _at_the_bounds,
        "the SDK's upload": lambda: adapter_dir_tar(_written(tmp_path)),
    }[kind]()
    if kind == "pax":
        assert b"mtime=" in body  # a pax header really is there
    answer = _post(client, tenant, body)
    assert answer.status_code == 201, answer.text


def _written(directory: Path) -> Path:
    for name, data in ADAPTER.items():
        (directory / name).write_bytes(data)
    return directory


def test_an_adapter_the_service_serves_passes_the_sdks_check(
    client: TestClient, tenant: TenantHandle, tmp_path: Path
) -> None:
    run = create_run(client, tenant)
    assert upload(client, run["id"], 1, _at_the_bounds()).status_code == 201
    served = client.get(f"/v1/runs/{run['id']}/adapters/1", headers=tenant.headers)
    assert served.status_code == 200, served.text
    out = extract_adapter(served.content, tmp_path / "adapter")
    for name, data in ADAPTER.items():
        assert (out / name).read_bytes() == data
