"""The runs the service says this pool should train, over HTTP (`RunSource` for `loraloom worker --url`).

The service owns the runs: it assigns slots, keeps batches leased to this pool (the heartbeat
thread keeps the pool and its leases alive even while a long step runs), returns a restarted run's
batches after its checkpoint to the queue, and stores adapters, metrics and checkpoints' records.
"""

import logging
import threading
import time
from pathlib import Path
from typing import Protocol

from contracts.http import ApiError
from contracts.pool_api import (
    POOL_GONE,
    AckItem,
    AdapterStored,
    CheckpointReport,
    ClaimedBatchStruct,
    InitFrom,
    PoolHeartbeatOut,
    PoolRegister,
    PoolRegistered,
    PoolRunState,
    RunAfterPush,
    StepReport,
)
from contracts.progress import Progress
from trainer_core.export import unpack_adapter_archive
from trainer_core.run_left import POOL_CODES_PREFIX, run_has_left
from trainer_core.runs import RunRecord

log = logging.getLogger("loraloom.worker")

MAX_REASON_CHARS = 4096
"""The service's limit on an eviction reason (`TrainerEvict.reason`)."""


class PoolClient(Protocol):
    """`PoolServiceClient`'s methods (`MemoryPoolClient` stands in for it in tests and benchmarks)."""

    def register(self, capabilities: PoolRegister) -> PoolRegistered: ...
    def heartbeat(self) -> PoolHeartbeatOut: ...
    def deregister(self) -> None: ...
    def state(self) -> list[PoolRunState]: ...
    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]: ...
    def ack(self, acks: list[AckItem]) -> int: ...
    def restart_run(
        self, run_id: str, *, checkpoint_step: int, total_samples: int, total_tokens: int
    ) -> list[int]: ...
    def upload_adapter(self, run_id: str, step: int, adapter_dir: Path) -> AdapterStored: ...
    def report_step(self, run_id: str, report: StepReport) -> RunAfterPush: ...
    def report_checkpoint(self, run_id: str, report: CheckpointReport) -> None: ...
    def evict(self, run_id: str, reason: str) -> RunAfterPush | None: ...
    def fail(self, run_id: str, reason: str) -> RunAfterPush | None: ...
    def close(self) -> None: ...
    def init_adapter(self, run_id: str) -> bytes: ...
    def deleted_runs(self, run_ids: list[str]) -> list[str]: ...


class HttpRunSource:
    """RunSource over the service's pool routes (docs/contracts.md)."""

    def __init__(self, client: PoolClient, *, heartbeat_file: Path | None = None) -> None:
        self.client = client
        self._heartbeat: _Heartbeat | None = None
        self._heartbeat_file = heartbeat_file
        self._init_from: dict[str, InitFrom] = {}
        """The `init_from` of the runs of the last `list_runs`."""
        self._filter_refused_at: float | None = None
        """When the service last refused a claim's `run_ids` (older than the filter): not asked again
        for CLAIM_FILTER_RETRY_S (a service upgraded under a registered pool is found again)."""

    @property
    def lost(self) -> bool:
        """The service no longer knows this pool (declared dead or replaced): training on would
        duplicate work that it has handed to another pool."""
        return self._heartbeat is not None and self._heartbeat.lost

    def open(self, capabilities: PoolRegister) -> None:
        registered = self.client.register(capabilities)
        self._filter_refused_at = None  # a service registered anew may be a newer one
        log.info(
            "registered pool %s (%d slots, world size %d)",
            registered.pool_id,
            capabilities.slots,
            capabilities.world_size,
        )
        if registered.replaced:
            # The service keeps one live pool per base model: a restart replaces its earlier self,
            # but a second pool started beside a running one stops that one (its runs resume here).
            log.warning(
                "this pool replaced the live pool(s) %s of %s: they stop, and their runs continue here "
                "from their checkpoints (a second worker pool for a base model replaces the first)",
                ", ".join(registered.replaced),
                capabilities.base_model,
            )
        self._heartbeat = _Heartbeat(self.client, registered.heartbeat_interval_s, self._heartbeat_file)
        self._heartbeat.touch()  # registered: healthy from now on
        self._heartbeat.start()

    def close(self) -> None:
        """Stop heartbeating and deregister, so that the batches this pool holds go back to pending
        now rather than after the service's pool timeout (a pool the service dropped has none)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            if not self._heartbeat.lost:
                try:
                    self.client.deregister()
                    log.info("pool deregistered: its leased batches are pending again")
                except Exception as exc:  # the service's timeout returns them anyway
                    log.warning(
                        "deregistering the pool failed (%s); its leases return after the timeout", exc
                    )
        self.client.close()

    # -- runs ------------------------------------------------------------------------------------

    def list_runs(self) -> list[RunRecord]:
        runs = self.client.state()
        self._init_from = {run.run_id: run.init_from for run in runs if run.init_from is not None}
        return [RunRecord(run.run_id, run.config, slot_hint=run.slot, progress=run.progress) for run in runs]

    def init_from(self, run_id: str) -> InitFrom | None:
        return self._init_from.get(run_id)

    def fetch_init_adapter(self, run_id: str, dest: Path) -> bool:
        """Download the run's `init_from` adapter (a tar.gz of the PEFT files) and unpack it into `dest`."""
        spec = self._init_from.get(run_id)
        if spec is None or spec.checkpoint is not None:
            return False
        unpack_adapter_archive(self.client.init_adapter(run_id), dest)
        return True

    def deleted_runs(self, run_ids: list[str]) -> set[str]:
        """Of `run_ids` (at most `MAX_DELETED_QUERY`), those the service holds as deleted (an id it does
        not know is never named): the pool removes their files (`trainer_core.run_files`). Raises when
        the service cannot say."""
        return set(self.client.deleted_runs(run_ids)) & set(run_ids)

    def evict(self, run_id: str, reason: str) -> None:
        try:
            self.client.evict(run_id, reason[:MAX_REASON_CHARS])
        except ApiError as exc:
            if not run_has_left(exc):
                raise
            # Deleted (or its tenant removed) before the pool's evict landed: nothing left to stop.
            log.info("run %s had already left when the pool evicted it: %s", run_id, exc)

    def fail(self, run_id: str, reason: str) -> None:
        """Fail a run the pool cannot start; against a service without the route, evict it instead."""
        try:
            self.client.fail(run_id, reason[:MAX_REASON_CHARS])
        except ApiError as exc:
            if exc.status in (404, 405) and not (exc.code or "").startswith(POOL_CODES_PREFIX):
                # A service older than `POST /v1/pool/runs/{id}/fail` answers its unknown route with
                # the same 404 `not_found` as a missing run, and taking that as "the run left" would
                # leave it active there: admitted again, failing again, forever. Evict it as older
                # pools did; the eviction's own 404 is the answer about a run that is really gone.
                log.info(
                    "the service did not take the pool's failure of run %s (%s): evicting it", run_id, exc
                )
                self.evict(run_id, reason)
                return
            if not run_has_left(exc):
                raise
            log.info("run %s had already left when the pool failed it: %s", run_id, exc)

    def report_invalid_config(self, run_id: str, message: str) -> None:
        self.evict(run_id, f"invalid config: {message}")

    def clear_invalid_config(self, run_id: str) -> None:
        return None  # an invalid run is evicted: there is nothing to withdraw

    # -- batches ---------------------------------------------------------------------------------

    def restart_run(self, run_id: str, progress: Progress) -> None:
        # Exactly-once: everything the service handed out after this checkpoint comes back.
        self.client.restart_run(
            run_id,
            checkpoint_step=progress.step,
            total_samples=progress.total_samples,
            total_tokens=progress.total_tokens,
        )

    def release_run(self, run_id: str) -> None:
        return None  # the service returns the run's leased batches itself (lease expiry, restart)

    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
        """Up to `max_batches` batches, of the runs `run_ids` names (None: of any run). Against a service
        older than that filter, a filtered claim gets nothing, as the pool before it claimed nothing
        while its buffer was full: memory stays bounded, the fairness is that of the older pool."""
        if run_ids is None:
            return self.client.claim(max_batches)
        refused_at = self._filter_refused_at
        if refused_at is not None and time.monotonic() - refused_at < CLAIM_FILTER_RETRY_S:
            return []
        try:
            return self.client.claim(max_batches, run_ids)
        except ApiError as exc:
            if not refuses_claim_filter(exc):
                raise
            log.warning(
                "the service does not take a claim's run_ids (%s): while its buffer is full, this pool "
                "claims nothing, and a run may wait until the buffer drains (upgrade the service)",
                exc,
            )
            self._filter_refused_at = time.monotonic()
            return []

    def ack(self, acks: list[AckItem]) -> None:
        self.client.ack(acks)

    # -- results ---------------------------------------------------------------------------------

    def publish_adapter(self, run_id: str, step: int, adapter_dir: Path) -> None:
        self.client.upload_adapter(run_id, step, adapter_dir)

    def report_checkpoint(self, run_id: str, report: CheckpointReport) -> None:
        self.client.report_checkpoint(run_id, report)

    def report_step(self, run_id: str, report: StepReport) -> None:
        self.client.report_step(run_id, report)


CLAIM_FILTER_RETRY_S = 300.0
"""How long a pool whose service refused a claim's `run_ids` claims without them before asking again."""


def refuses_claim_filter(exc: ApiError) -> bool:
    """The 422 of a service older than `ClaimIn.run_ids`: its claim body forbids unknown fields. Told
    apart from a newer service's refusal of the ids themselves (their loc goes on below `run_ids`),
    which stays an error: taken as "older", it would turn the pool's fair claims off unseen."""
    if exc.status != 422 or not isinstance(exc.details, list):
        return False
    return any(
        isinstance(item, dict)
        and item.get("type") == "extra_forbidden"
        and item.get("loc") == ["body", "run_ids"]
        for item in exc.details
    )


class _Heartbeat(threading.Thread):
    """Keeps the pool alive (and its leases extended) even while a long step runs."""

    def __init__(self, client: PoolClient, interval_s: float, file: Path | None = None) -> None:
        super().__init__(name="pool-heartbeat", daemon=True)
        self._client = client
        self._file = file
        self._interval = interval_s
        self._stopped = threading.Event()
        self.lost = False
        """Set when the service no longer knows this pool."""

    def run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._client.heartbeat()
                self.touch()
            except ApiError as exc:
                if exc.code in POOL_GONE:
                    # The service gave our leases away (or another pool replaced us): training on
                    # would duplicate work. Stop; a restarted pool resumes from checkpoints.
                    log.error("pool no longer registered: %s (%s); stopping", POOL_GONE[exc.code], exc.code)
                    self.lost = True
                    return
                log.warning("heartbeat failed: %s", exc)
            except Exception as exc:  # transient (connection errors after retries): the next beat retries
                log.warning("heartbeat failed: %s", exc)

    def touch(self) -> None:
        """Mark the pool alive for a container healthcheck (the file's age is the test)."""
        if self._file is not None:
            try:
                self._file.parent.mkdir(parents=True, exist_ok=True)
                self._file.touch()
            except OSError as exc:  # a healthcheck must not stop the training
                log.warning("cannot touch the heartbeat file %s: %s", self._file, exc)

    def stop(self) -> None:
        self._stopped.set()
