"""Fuzz: schemathesis over the service's own OpenAPI document (issue 10).

Every operation, with the credential of its role (tenant key, admin key, worker token) and once
with the ids of real objects in the path, gets a bounded number of generated requests, valid
(positive) and invalid (negative), from a fixed seed. Not one answer may be a 5xx.

Conformance of the responses to the documented schemas is left to the OpenAPI issue: this test
checks only that no input, however odd, is a server error.
"""

import json
from collections import Counter
from typing import Any

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed
from hypothesis import settings as hypothesis_settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from app.main import create_app
from app.openapi import build_documents
from tests.app.api import ADMIN_HEADERS, WORKER_HEADERS, LiveServer, create_run, new_tenant, register

EXAMPLES_PER_OPERATION = 12
SEED = 20261122


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value).encode()


# The media types the document names that schemathesis has no serializer for.
@schemathesis.serializer("application/x-tar", "application/toml")
def _raw_serializer(_ctx: Any, value: Any) -> bytes:
    return _as_bytes(value)


@schemathesis.serializer("application/msgpack")
def _msgpack_serializer(_ctx: Any, value: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except (TypeError, OverflowError):
        return _as_bytes(value)


def _headers_for(path: str, tenant_headers: dict[str, str]) -> dict[str, str]:
    if path.startswith("/v1/pool"):
        return WORKER_HEADERS
    if path.startswith(("/v1/tenants", "/v1/admin/")):
        return ADMIN_HEADERS
    return tenant_headers


def _fuzz(strategy: Any, *, base_url: str, headers: dict[str, str], statuses: list[tuple[int, str]]) -> None:
    """Send EXAMPLES_PER_OPERATION requests drawn from `strategy`; record (status, what) of each."""

    @seed(SEED)
    @hypothesis_settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def call(case: Any) -> None:
        response = case.call(base_url=base_url, headers=headers)
        statuses.append((response.status_code, f"{case.method} {case.formatted_path}: {response.text[:300]}"))

    call()


@pytest.mark.parametrize(
    "mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"]
)
def test_no_input_is_a_server_error(settings, mode):
    app = create_app(settings)
    # Both documents: the public one (tenant + admin) and the pool's.
    public, pool = build_documents(app)
    operations = [
        result.ok()
        for document in (public, pool)
        for result in schemathesis.openapi.from_dict(document).get_all_operations()
    ]
    statuses: list[tuple[int, str]] = []
    unsatisfiable: list[str] = []
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        for operation in operations:
            # Fresh objects per operation: a fuzzed delete or revoke must not blind the next one.
            tenant = new_tenant(client)
            run = create_run(client, tenant)
            pool_id = register(client)
            real_ids: dict[str, Any] = {
                "run_id": run["id"],
                "tenant_id": tenant.id,
                "key_id": tenant.key_id,
                "pool_id": pool_id,
            }
            wanted = {p.name for p in operation.path_parameters}
            # Generated path parameters (mostly unknown ids), then, if it has any, the real ones.
            rounds: list[dict[str, Any]] = [{}]
            if wanted:
                rounds.append({k: v for k, v in real_ids.items() if k in wanted})
            for path_parameters in rounds:
                strategy = operation.as_strategy(
                    generation_mode=mode, path_parameters=path_parameters or None
                )
                try:
                    _fuzz(
                        strategy,
                        base_url=server.url,
                        headers=_headers_for(operation.path, tenant.headers),
                        statuses=statuses,
                    )
                except Unsatisfiable:  # negative mode: nothing of this operation can be made invalid
                    unsatisfiable.append(f"{operation.method.upper()} {operation.path}")
    server_errors = [what for status, what in statuses if status >= 500]
    by_class = Counter(f"{status // 100}xx" for status, _ in statuses)
    print(f"{mode.value}: {len(statuses)} requests {dict(by_class)}; nothing to negate in {unsatisfiable}")
    assert not server_errors, "\n".join(server_errors[:20])
