"""The batch route takes the Idempotency-Key values POST /v1/runs takes, and refuses the others with
the same 422 naming the header, on its documented and its fast path, nothing stored. It took any
characters (a space, a tab, latin-1 bytes stored as "ÿþ") while /v1/runs refused them (found by a
hostile-tenant probe)."""

from collections.abc import Iterator

import httpx
import msgspec
import pytest

from app.batches.models import Batch
from app.config import Settings
from app.main import create_app
from app.runs.models import Run
from tests.app.api import MSGPACK, LiveServer, batch_body, create_run, new_tenant, post_batch
from tests.app.factories import Seeded, rollout_files, row_counts

REFUSED: list[bytes] = [b"has space", b"tab\there", b"\xff\xfe-latin1", "é".encode(), b"", b"k" * 129]
"""As sent (bytes: a header's value is bytes on the wire, whatever they decode to)."""


@pytest.fixture(params=["documented", "fast"])
def server(request: pytest.FixtureRequest, settings: Settings) -> Iterator[tuple[httpx.Client, bool]]:
    """A real server whose batch route answers on its documented path only (no key cache) or on its
    fast path (app/batches/lean_route.py) once the key is cached; and whether it is the latter."""
    fast = request.param == "fast"
    app = create_app(settings.model_copy(update={"api_key_cache_seconds": 60.0 if fast else 0.0}))
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        yield client, fast


def _refusal(response: httpx.Response) -> None:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert [d["loc"] for d in error["details"]] == [["header", "Idempotency-Key"]]


@pytest.mark.parametrize("key", REFUSED, ids=repr)
def test_a_key_runs_refuse_is_refused_for_batches(
    settings: Settings, server: tuple[httpx.Client, bool], fast_calls: list[str], key: bytes
) -> None:
    client, fast = server
    tenant = new_tenant(client)
    seeded = Seeded(tenant.id, tenant.key, create_run(client, tenant)["id"])  # caches the key
    runs = row_counts(settings, Run)
    url = f"/v1/runs/{seeded.run_id}/batches"
    body = batch_body(2)
    headers = {b"Authorization": f"Bearer {seeded.secret}".encode(), b"Idempotency-Key": key}
    _refusal(client.post(url, json=body, headers=headers))
    _refusal(
        client.post(
            url, content=msgspec.msgpack.encode(body), headers=headers | {b"Content-Type": MSGPACK.encode()}
        )
    )
    _refusal(client.post("/v1/runs", json={"name": "r"}, headers=headers))
    assert fast_calls == []  # the fast path leaves them to the documented route, which names the header
    assert row_counts(settings, Batch, Run) == (0, *runs) and rollout_files(settings) == []
    # A key both routes take: stored (on the fast path when the key is cached), then replayed.
    ok = "~!key-1:2/3"
    assert post_batch(client, seeded, body, key=ok).status_code == 201
    assert post_batch(client, seeded, body, msgpack=True, key=ok).status_code == 200
    assert fast_calls == ([seeded.run_id] * 2 if fast else [])
    assert row_counts(settings, Batch) == (1,)
