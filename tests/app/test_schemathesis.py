"""Schemathesis over both OpenAPI documents (public and pool), valid (positive) and invalid (negative)
requests from a fixed seed, a bounded number per operation. Two properties in one pass:

- no input, however odd, is a server error (the robustness issue's fuzz test: 0 responses ≥ 500);
- every other answer conforms to the documents: a documented status, content type and body schema
  (the OpenAPI issue).

Every operation gets the credential of its scheme and, when it has path parameters, also the ids of
real objects, so success bodies are checked as well as errors.
"""

import contextlib
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
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from app.openapi import build_documents
from tests.app.api import ADMIN_HEADERS, WORKER_HEADERS, LiveServer, create_run, new_tenant, register

EXAMPLES_PER_OPERATION = 12
SEED = 20261122
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value).encode()


@schemathesis.serializer("application/x-tar", "application/toml")
def _raw_serializer(_ctx: Any, value: Any) -> bytes:
    return _as_bytes(value)


@schemathesis.serializer("application/msgpack")
def _msgpack_serializer(_ctx: Any, value: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except (TypeError, OverflowError):
        return _as_bytes(value)


def _credentials(operation: Any, tenant_headers: dict[str, str]) -> dict[str, str]:
    schemes = {name for req in operation.definition.raw.get("security", []) for name in req}
    if "WorkerToken" in schemes:
        return WORKER_HEADERS
    if "AdminKey" in schemes:
        return ADMIN_HEADERS
    return tenant_headers


def _exercise(
    strategy: Any,
    *,
    base_url: str,
    headers: dict[str, str],
    failures: list[str],
    server_errors: list[str],
    checked: list[int],
) -> None:
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
        # What is checked is conformance, not latency: schemathesis's default 10 s read timeout was
        # passed once by a list of batches on SQLite with two test runs sharing a 2-core machine (a
        # flaky failure: the same request answered at once when hypothesis tried it again).
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        if response.status_code >= 500:
            # A bug of its own, not a documentation gap: reported apart from the conformance failures.
            server_errors.append(f"{case.method} {case.formatted_path} -> {response.status_code}")
            return
        checked.append(response.status_code)
        try:
            case.validate_response(response, checks=CHECKS)
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis raises a group of the failed checks
            failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: {exc}"[:600])

    call()


@pytest.mark.parametrize(
    "mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"]
)
def test_no_server_error_and_every_response_conforms(settings, mode):
    app = create_app(settings)
    failures: list[str] = []
    server_errors: list[str] = []
    checked: list[int] = []
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        for document in build_documents(app):
            schema = schemathesis.openapi.from_dict(document)
            for result in schema.get_all_operations():
                operation = result.ok()
                tenant = new_tenant(client)
                run = create_run(client, tenant)
                # Fresh objects per operation: a fuzzed delete or revoke must not blind the next one.
                pool_id = register(client)
                real = {
                    "run_id": run["id"],
                    "tenant_id": tenant.id,
                    "key_id": tenant.key_id,
                    "pool_id": pool_id,
                }
                wanted = {p.name for p in operation.path_parameters}
                rounds: list[dict[str, Any]] = [{}]
                if wanted & set(real):
                    rounds.append({k: v for k, v in real.items() if k in wanted})
                for path_parameters in rounds:
                    strategy = operation.as_strategy(
                        generation_mode=mode, path_parameters=path_parameters or None
                    )
                    # Unsatisfiable: negative mode cannot make anything of this operation invalid.
                    with contextlib.suppress(Unsatisfiable):
                        _exercise(
                            strategy,
                            base_url=server.url,
                            headers=_credentials(operation, tenant.headers),
                            failures=failures,
                            server_errors=server_errors,
                            checked=checked,
                        )
    print(
        f"{len(checked)} responses checked: {sorted(Counter(checked).items())}; server errors: {server_errors}"
    )
    assert server_errors == [], "\n".join(server_errors[:20])
    assert failures == [], "\n".join(failures[:20])
    # Not vacuous: successes were checked too, not only refusals.
    assert len([s for s in checked if s < 300]) >= 10
