"""The worker pool's side of the service API (only the master rank talks to the service).

Every request and answer is a model of `contracts.pool_api` (the service's routes use the same
ones); the claim is msgpack, its payloads the stored binary batches (`contracts.arrays.ArrayBatch`). Retries follow the
SDK's policy (`contracts.http`); an error answer raises the typed error of `contracts.http`
(`Conflict`, `NotFound`, ... all `ApiError`s carrying the service's `code`). Never logs the token.
"""

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from contracts.http import Conflict, RetryPolicy, error_from_response, send_with_retries
from contracts.pool_api import (
    AckIn,
    AckItem,
    AckOut,
    AdapterStored,
    CheckpointReport,
    ClaimedBatchStruct,
    ClaimIn,
    ClaimStruct,
    DeletedRunsIn,
    DeletedRunsOut,
    PoolHeartbeatOut,
    PoolRef,
    PoolRegister,
    PoolRegistered,
    PoolRunState,
    PoolStateOut,
    RestartIn,
    RestartOut,
    RunAfterPush,
    StepReport,
    TrainerEvict,
    claimed_batches,
)
from contracts.tinker_work import ManualClaimIn, ManualClaimOut, ManualResult, ManualResultsIn, ManualWorkItem
from trainer_core.export import adapter_tar_bytes

log = logging.getLogger("loraloom.worker")

_claim_decoder = msgspec.msgpack.Decoder(ClaimStruct)

_HOUSEKEEPING_RETRY = RetryPolicy(
    max_attempts=2, backoff_base_s=0.2, backoff_max_s=1.0, max_retry_after_s=1.0
)
"""For the pool's housekeeping questions (`deleted_runs`), asked between training steps: a service that
is down must not hold the loop for the minute the training calls wait out; the next pass asks again."""
_HOUSEKEEPING_TIMEOUT_S = 10.0


class PoolServiceClient:
    """The pool routes over HTTP (docs/contracts.md). Not thread-safe apart from `heartbeat`, which
    the heartbeat thread calls while the loop makes the other calls (httpx.Client allows that)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        max_attempts: int = 24,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """`max_attempts`: with backoff up to 5 s, about a minute of retries (half on average), so the
        pool outlasts a restart of the service instead of dying on its first refused connection.
        `stop`: True once the pool is stopping (Ctrl-C): a failed request then raises `RetryStopped`
        at once instead of retrying that minute against a service that is down."""
        self._http = httpx.Client(
            base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )
        self._retry = RetryPolicy(max_attempts=max_attempts, backoff_base_s=0.2, backoff_max_s=5.0)
        self._stop = stop
        self.pool_id: str | None = None

    def close(self) -> None:
        self._http.close()

    # -- transport -------------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, *, retry: RetryPolicy | None = None, **kwargs: Any
    ) -> httpx.Response:
        # The SDK's retry rules (backoff with jitter; connection errors, 429 with Retry-After and
        # 5xx are retried, every other 4xx is an answer): one implementation for both clients.
        response = send_with_retries(
            lambda: self._http.request(method, path, **kwargs),
            retry or self._retry,
            f"{method} {path}",
            self._stop,
        )
        if response.status_code >= 400:
            raise error_from_response(response)
        return response

    def _pool_id(self) -> str:
        if self.pool_id is None:
            raise RuntimeError("register the pool first")
        return self.pool_id

    # -- pool ------------------------------------------------------------------------------------

    def register(self, capabilities: PoolRegister) -> PoolRegistered:
        response = self._request("POST", "/v1/pool/register", json=capabilities.model_dump(mode="json"))
        registered = PoolRegistered.model_validate_json(response.content)
        self.pool_id = registered.pool_id
        return registered

    def heartbeat(self) -> PoolHeartbeatOut:
        body = PoolRef(pool_id=self._pool_id())
        response = self._request("POST", "/v1/pool/heartbeat", json=body.model_dump(mode="json"))
        return PoolHeartbeatOut.model_validate_json(response.content)

    def deregister(self) -> None:
        """The pool stops: the service returns its leased batches to pending at once."""
        body = PoolRef(pool_id=self._pool_id())
        # One short attempt, no retries: the pool is stopping (a second Ctrl-C must not wait on a
        # backoff), and if this fails the service's pool timeout returns the leases anyway.
        response = self._http.post("/v1/pool/deregister", json=body.model_dump(mode="json"), timeout=5.0)
        if response.status_code >= 400:
            raise error_from_response(response)

    def state(self) -> list[PoolRunState]:
        response = self._request("GET", "/v1/pool/state", params={"pool_id": self._pool_id()})
        return PoolStateOut.model_validate_json(response.content).runs

    def deleted_runs(self, run_ids: list[str]) -> list[str]:
        """Of these runs (at most `MAX_DELETED_QUERY`), those the service says are deleted or gone:
        their files may go. Two short attempts (`_HOUSEKEEPING_RETRY`); a failure raises."""
        body = DeletedRunsIn.model_validate({"run_ids": run_ids})
        response = self._request(
            "POST",
            "/v1/pool/runs/deleted",
            json=body.model_dump(mode="json"),
            retry=_HOUSEKEEPING_RETRY,
            timeout=_HOUSEKEEPING_TIMEOUT_S,
        )
        return DeletedRunsOut.model_validate_json(response.content).deleted

    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
        """Lease up to `max_batches` batches: of the runs `run_ids` names, or of any run (None). A
        service older than the filter refuses it with a 422 (`http_source.refuses_claim_filter`)."""
        body = ClaimIn(pool_id=self._pool_id(), max_batches=max_batches, run_ids=run_ids)
        # msgpack: the stored payloads arrive as stored (binary arrays) and numpy reads them in place.
        response = self._request(
            "POST",
            "/v1/pool/batches/claim",
            # Without the filter, the body an older service knows (it refuses unknown fields).
            json=body.model_dump(mode="json", exclude_none=True),
            headers={"Accept": "application/msgpack"},
        )
        return claimed_batches(_claim_decoder.decode(response.content), msgpack=True)

    def ack(self, acks: list[AckItem]) -> int:
        """Acknowledge trained batches; returns how many the service marked (0 for no acks)."""
        if not acks:
            return 0
        body = AckIn(pool_id=self._pool_id(), acks=acks)
        response = self._request("POST", "/v1/pool/batches/ack", json=body.model_dump(mode="json"))
        return AckOut.model_validate_json(response.content).acked

    def restart_run(
        self, run_id: str, *, checkpoint_step: int, total_samples: int, total_tokens: int
    ) -> list[int]:
        """The run restarts from a checkpoint: the ids of the batches the service returned to pending."""
        body = RestartIn(
            pool_id=self._pool_id(),
            checkpoint_step=checkpoint_step,
            total_samples=total_samples,
            total_tokens=total_tokens,
        )
        response = self._request("POST", f"/v1/pool/runs/{run_id}/restart", json=body.model_dump(mode="json"))
        return RestartOut.model_validate_json(response.content).returned

    def upload_adapter(self, run_id: str, step: int, adapter_dir: Path) -> AdapterStored:
        response = self._request(
            "PUT",
            f"/v1/pool/runs/{run_id}/adapters/{step}",
            content=adapter_tar_bytes(adapter_dir),
            headers={"Content-Type": "application/x-tar"},
        )
        return AdapterStored.model_validate_json(response.content)

    def init_adapter(self, run_id: str) -> bytes:
        """The tar.gz of the adapter the run starts from (its `init_from`)."""
        return self._request("GET", f"/v1/pool/runs/{run_id}/init-adapter").content

    def report_step(self, run_id: str, report: StepReport) -> RunAfterPush:
        response = self._request("POST", f"/v1/pool/runs/{run_id}/steps", json=report.model_dump(mode="json"))
        return RunAfterPush.model_validate_json(response.content)

    def report_checkpoint(self, run_id: str, report: CheckpointReport) -> None:
        # The answer is the service's own record of the checkpoint; the pool needs nothing from it.
        self._request("POST", f"/v1/pool/runs/{run_id}/checkpoints", json=report.model_dump(mode="json"))

    # -- manual-mode work (the Tinker API; trainer_core.manual) --------------------------------------

    def claim_manual(self, max_items: int) -> list[ManualWorkItem]:
        body = ManualClaimIn(pool_id=self._pool_id(), max_items=max_items)
        response = self._request("POST", "/v1/pool/manual/claim", json=body.model_dump(mode="json"))
        return ManualClaimOut.model_validate_json(response.content).items

    def report_manual(self, results: list[ManualResult]) -> None:
        if results:
            body = ManualResultsIn(pool_id=self._pool_id(), results=results)
            self._request("POST", "/v1/pool/manual/results", json=body.model_dump(mode="json"))

    def evict(self, run_id: str, reason: str) -> RunAfterPush | None:
        """Evict a run; None when it had already stopped (evicted, completed, deleted: a 409)."""
        body = TrainerEvict(reason=reason)
        try:
            response = self._request(
                "POST", f"/v1/pool/runs/{run_id}/evict", json=body.model_dump(mode="json")
            )
        except Conflict:
            return None
        return RunAfterPush.model_validate_json(response.content)

    def fail(self, run_id: str, reason: str) -> RunAfterPush | None:
        """Fail a run the pool cannot start (its `failure_reason`); None when it had already stopped
        (a 409)."""
        body = TrainerEvict(reason=reason)  # the same body as an eviction: the reason
        try:
            response = self._request(
                "POST", f"/v1/pool/runs/{run_id}/fail", json=body.model_dump(mode="json")
            )
        except Conflict:
            return None
        return RunAfterPush.model_validate_json(response.content)
