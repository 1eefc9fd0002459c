"""An adapter archived by bsdtar (xattrs in pax records by default: `SCHILY.xattr.<name>=<value>`)
whose xattr value holds 200 digits is stored: the former bound of 32 digits in a run refused it with a
422 (contracts/tar_headers.py). Runs past MAX_DIGIT_RUN are still refused, nothing stored."""

import io
import tarfile

from fastapi.testclient import TestClient

from app.config import Settings
from contracts.tar_headers import MAX_DIGIT_RUN
from tests.app.api import POOL_SPEC, TenantHandle, register
from tests.app.test_adapter_tar_headers import ADAPTER, _assert_refused, _nothing_stored, _post


def _with_xattrs(value: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in ADAPTER.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1732895123.5
            info.pax_headers = {"SCHILY.xattr.user.x": value, "SCHILY.xattr.user.y": "2" * 100}
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_an_adapter_whose_xattrs_hold_long_digit_runs_is_stored(
    client: TestClient, tenant: TenantHandle
) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
    body = _with_xattrs("7" * 200)
    assert b"SCHILY.xattr.user.x=" + b"7" * 200 + b"\n" in body
    answer = _post(client, tenant, body)
    assert answer.status_code == 201, answer.text
    assert [item["id"] for item in client.get("/v1/adapters", headers=tenant.headers).json()["items"]] == [
        answer.json()["id"]
    ]


def test_an_xattr_past_the_bound_is_refused_and_nothing_stored(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
    answer = _post(client, tenant, _with_xattrs("7" * (MAX_DIGIT_RUN + 1)))
    _assert_refused(
        answer, f"holds a run of {MAX_DIGIT_RUN + 1} digits (at most {MAX_DIGIT_RUN} are accepted)"
    )
    _nothing_stored(client, tenant, settings)
