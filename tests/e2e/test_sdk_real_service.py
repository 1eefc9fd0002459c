"""The SDK against the real service (uvicorn on Postgres): idempotent submits, typed errors,
eviction surfacing as RunEvicted with its reason, heartbeat-timeout eviction, waiting for a slot."""

import threading

import msgspec
import pytest

from contracts.wire import TrainingBatch
from orchestrator import Conflict, LoraloomClient, RunEvicted, ValidationError
from tests.e2e.helpers import run_config, synthetic_batch, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]


def _sdk(live_service, name: str, quota: int = 4) -> LoraloomClient:
    with live_service.tenant_client(name, quota=quota) as http:
        key = http.headers["Authorization"].removeprefix("Bearer ")
    return LoraloomClient(live_service.url, key)


def test_submit_is_idempotent_and_errors_are_typed(live_service):
    with _sdk(live_service, "sdk") as client:
        run = client.create_run("sdk-run", run_config())
        batch = msgspec.convert(synthetic_batch(1, n_samples=2), TrainingBatch)
        first = client.submit_batch(run.id, batch, idempotency_key="same-key")
        again = client.submit_batch(run.id, batch, idempotency_key="same-key")
        assert first.id == again.id
        assert len(client.list_batches(run.id).items) == 1

        bad = msgspec.convert(synthetic_batch(2, n_samples=2), TrainingBatch)
        bad.examples[1].completion_logprobs = bad.examples[1].completion_logprobs[:-1]
        with pytest.raises(ValidationError) as err:
            client.submit_batch(run.id, bad)
        assert err.value.status == 422 and "1" in str(err.value.details)

        client.evict_run(run.id, "reward plateaued", by="orchestrator")
        with pytest.raises(RunEvicted) as evicted:
            client.submit_batch(run.id, batch)
        assert evicted.value.reason == "reward plateaued"
        assert evicted.value.evicted_by == "orchestrator"


def test_silent_orchestrator_is_evicted_by_heartbeat_timeout(live_service):
    with _sdk(live_service, "hb") as client:
        run = client.create_run("hb-run", run_config(heartbeat_timeout=1.0))
        client.heartbeat(run.id)
        stopped = wait_for(
            lambda: (r := client.get_run(run.id)).status == "evicted" and r,
            timeout=20,
            what="heartbeat eviction",
        )
        assert stopped.evicted_by == "heartbeat"
        assert "heartbeat" in stopped.eviction_reason


def test_wait_until_active_then_submit(live_service):
    """The README's snippet: a run created beyond the tenant's quota is queued, and its batch a 409,
    until a slot frees up; `wait_until_active` says why it waits and returns once it may submit."""
    with _sdk(live_service, "queue", quota=1) as client:
        first = client.create_run("first", run_config())
        run = client.create_run("second", run_config())
        assert run.status == "queued"
        batch = msgspec.convert(synthetic_batch(0, n_samples=2), TrainingBatch)
        with pytest.raises(Conflict):
            client.submit_batch(run.id, batch)
        with pytest.raises(TimeoutError, match="quota of 1 concurrent runs is in use"):
            client.wait_until_active(run.id, timeout=0.5, poll=0.1)

        threading.Timer(0.5, client.evict_run, (first.id, "make room")).start()
        assert client.wait_until_active(run.id, timeout=20, poll=0.1).status == "active"
        client.submit_batch(run.id, batch)
        with pytest.raises(RunEvicted, match="make room"):
            client.wait_until_active(first.id)
