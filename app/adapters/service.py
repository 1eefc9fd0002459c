"""What the trainer pushes back per run (adapters, step metrics, checkpoint commits) and
what users read of it.

Adapters arrive as an uncompressed tar of a PEFT directory, checked whole (upload.py) in a
staging directory that appears under `broadcast/step_N/` in one rename, so a reader sees the
old adapter or the new one, never half of one.
"""

import gzip
import logging
import os
import re
import shutil
import tarfile
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar

from sqlalchemy import ScalarSelect, select
from sqlalchemy.orm import Session

from app.adapters.models import Adapter, Checkpoint, StepMetrics
from app.adapters.upload import extract_adapter_tar
from app.config import Settings
from app.db import conflict_insert, utcnow
from app.errors import Conflict, NotFound
from app.events.service import record_event
from app.projection import remove_run_dir, run_dir
from app.runs.admission import lock_admission
from app.runs.models import Run
from app.runs.service import complete_run, evict_run, fail_run, get_run
from contracts.durable import atomic_replace_dir, beside
from contracts.layout import ADAPTER_FILES, BROADCAST_DIR, step_dir_name, step_of_dir_name
from contracts.pool_api import StepReport
from contracts.run_config import RunConfig
from contracts.status import RunStatus

log = logging.getLogger(__name__)

# A run that was never admitted has nothing to push; a deleted run keeps nothing new.
_NO_ARTIFACTS_STATUSES = (RunStatus.QUEUED, RunStatus.DELETED)

ARCHIVE_CACHE_DIR = "cache"
"""Under a run's directory: its adapters' tar.gz archives, built on the first download."""
_ARCHIVE_SHA_CHARS = 16
_ARCHIVE = re.compile(rf"adapter_(.+)_([0-9a-f]{{{_ARCHIVE_SHA_CHARS}}})\.tar\.gz")


def archive_name(step: int, sha256: str) -> str:
    """A step's cached archive: the sha256 in the name gives a step published again a new archive,
    so a stale one is never served."""
    return f"adapter_{step_dir_name(step)}_{sha256[:_ARCHIVE_SHA_CHARS]}.tar.gz"


def archive_of(name: str) -> tuple[int, str] | None:
    """(step, start of the weights' sha256) of a name `archive_name` makes; None for any other."""
    match = _ARCHIVE.fullmatch(name)
    step = step_of_dir_name(match[1]) if match else None
    return None if match is None or step is None else (step, match[2])


# ---------------------------------------------------------------- helpers


_RunStepRow = TypeVar("_RunStepRow", Adapter, StepMetrics, Checkpoint)
"""A row keyed by (run_id, step)."""


def _upsert(session: Session, model: type[_RunStepRow], *, values: dict[str, Any]) -> None:
    """INSERT … ON CONFLICT (run_id, step) DO UPDATE: a retried or repeated report replaces the row,
    and two concurrent ones cannot both insert."""
    key = ("run_id", "step")
    stmt = conflict_insert(session.get_bind().dialect.name, model).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=list(key), set_={col: stmt.excluded[col] for col in values if col not in key}
    )
    session.execute(stmt)


def _one(session: Session, model: type[_RunStepRow], *, run_id: str, step: int) -> _RunStepRow:
    # populate_existing: the upsert bypassed the identity map, which may hold the old row.
    return session.scalars(
        select(model).where(model.run_id == run_id, model.step == step),
        execution_options={"populate_existing": True},
    ).one()


def _require_artifacts_allowed(run: Run, what: str) -> None:
    if run.status in _NO_ARTIFACTS_STATUSES:
        raise Conflict(
            f"run {run.id} is {run.status}; it has no {what}",
            code="run_not_trainable",
            details={"run_id": run.id, "status": run.status},
        )


def broadcast_dir(settings: Settings, run_id: str) -> Path:
    return settings.runs_dir / run_id / BROADCAST_DIR


# ---------------------------------------------------------------- adapter upload


def store_adapter(
    session: Session, *, run_id: str, step: int, body: IO[bytes], settings: Settings
) -> Adapter:
    """Store the adapter of `step` under broadcast/step_N/ and upsert its row.

    A second upload of a step (a trainer restarted from an earlier checkpoint trains the
    step again) replaces the first: files and row.
    """
    run = get_run(session, run_id=run_id)
    _require_artifacts_allowed(run, "adapters")
    run_id = run.id
    # The read ends here: the connection goes back to the pool while the files are extracted and
    # fsynced (no lock was held across them before either).
    session.commit()
    parent = broadcast_dir(settings, run_id)
    try:
        size, sha, staging = _stage_adapter(parent, step, body, settings=settings)
    except FileNotFoundError:  # the run's directory went while the files were written
        session.refresh(run)
        _refuse_if_deleted(run, settings)
        raise
    try:
        # The run's row locked: a deletion from now on waits for this commit, and its after-commit
        # removal takes these files. One that came first is refused here, and the run's path, which
        # the files' directory may have made again, removed again. The files move into place under
        # the lock too, and the row follows in this transaction: the removal of a pruned step's
        # files, which takes the same lock (app/adapters/pruning.py), sees either both or neither.
        session.refresh(run, with_for_update=True)
        _refuse_if_deleted(run, settings)
        final = parent / step_dir_name(step)
        atomic_replace_dir(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful move
    _upsert(
        session,
        Adapter,
        values={
            "run_id": run.id,
            "step": step,
            "path": final.relative_to(settings.data_dir).as_posix(),
            "size_bytes": size,
            "sha256": sha,
            "created_at": utcnow(),
        },
    )
    log.info("run %s: adapter for step %s stored (%s bytes, sha256 %s)", run.id, step, size, sha[:12])
    record_event(
        session,
        action="adapter.published",
        actor="trainer",
        tenant_id=run.tenant_id,
        run_id=run.id,
        details={"step": step, "size_bytes": size, "sha256": sha},
    )
    return _one(session, Adapter, run_id=run.id, step=step)


def _stage_adapter(parent: Path, step: int, body: IO[bytes], *, settings: Settings) -> tuple[int, str, Path]:
    """Unpack and check the adapter in a staging directory beside `parent/step_N` (one filesystem:
    the move into place is one rename); returns (bytes, sha256 of the weights, the staging
    directory). Removes the staging directory if it fails."""
    parent.mkdir(parents=True, exist_ok=True)
    staging = beside(parent / step_dir_name(step))
    staging.mkdir()
    try:
        size, sha = extract_adapter_tar(body, staging, max_bytes=settings.max_body_bytes)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return size, sha, staging


def _refuse_if_deleted(run: Run, settings: Settings) -> None:
    if run.status == RunStatus.DELETED:
        remove_run_dir(run.id, settings)
        _require_artifacts_allowed(run, "adapters")


# ---------------------------------------------------------------- adapter download


def adapters_page(
    session: Session, *, run_id: str, limit: int, after_step: int | None, newest_first: bool = False
) -> tuple[list[Adapter], int | None]:
    """Up to `limit` of the run's adapters by step, ascending (descending when `newest_first`), past
    `after_step` in that order; returns (page, the step to go on after, or None on the last page).

    Keyset on the (run_id, step) unique index: an adapter published or pruned between two pages
    neither shifts nor repeats the others, and `newest_first` with limit 1 is the newest adapter in
    one index probe."""
    stmt = select(Adapter).where(Adapter.run_id == run_id)
    if after_step is not None:
        stmt = stmt.where(Adapter.step < after_step if newest_first else Adapter.step > after_step)
    order = Adapter.step.desc() if newest_first else Adapter.step.asc()
    rows = list(session.scalars(stmt.order_by(order).limit(limit + 1)))
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    return rows, rows[-1].step


def newest_kept_floor(run_id: str, kept: int, by: Any = Adapter.step) -> ScalarSelect[Any]:
    """The oldest `by` (the step; or `created_at`, the publication) of the run's newest `kept`
    adapters in that order (NULL while it has fewer): the rows below it are pruned but for those
    still referred to (app/adapters/pruning.py)."""
    return (
        select(by)
        .where(Adapter.run_id == run_id)
        .order_by(by.desc())
        .offset(kept - 1)
        .limit(1)
        .scalar_subquery()
    )


def get_adapter(session: Session, *, run_id: str, step: int | None, kept: int = 0) -> Adapter:
    """The adapter of `step`, or the newest one when `step` is None. `kept`: the run's retention
    (`Settings.run_adapters_kept`), for a 404 that says a missing step was pruned."""
    query = select(Adapter).where(Adapter.run_id == run_id)
    query = (
        query.order_by(Adapter.step.desc()).limit(1) if step is None else query.where(Adapter.step == step)
    )
    adapter = session.scalar(query)
    if adapter is None:
        if step is not None and kept > 0:
            _refuse_if_pruned(session, run_id=run_id, step=step, kept=kept)
        what = "no adapter yet" if step is None else f"no adapter for step {step}"
        raise NotFound(f"run {run_id} has {what}", code="adapter_not_found")
    return adapter


def _refuse_if_pruned(session: Session, *, run_id: str, step: int, kept: int) -> None:
    """The 404 of a step older than the run's newest `kept` adapters: the trainer publishes every
    step, so such a step missing was pruned (one never published is past the newest)."""
    floor = session.scalar(select(newest_kept_floor(run_id, kept)))
    if floor is not None and step < floor:
        raise NotFound(
            f"run {run_id}'s adapter of step {step} was pruned: a run keeps its newest {kept} step "
            f"adapters (LORALOOM_RUN_ADAPTERS_KEPT), here steps {floor} and later, and older ones only "
            "while a queued or active run starts from them or a Tinker sampler checkpoint names them",
            code="adapter_not_found",
            details={"step": step, "pruned": True, "run_adapters_kept": kept, "oldest_kept_step": floor},
        )


def _files_missing(adapter: Adapter) -> NotFound:
    return NotFound(
        f"the files of run {adapter.run_id}'s adapter {adapter.step} are missing (its run was deleted, "
        "or the step pruned: LORALOOM_RUN_ADAPTERS_KEPT)"
    )


def adapter_dir(adapter: Adapter, *, settings: Settings) -> Path:
    directory = settings.data_dir / adapter.path
    if not directory.is_dir():
        raise _files_missing(adapter)
    return directory


def adapter_file(adapter: Adapter, *, name: str, settings: Settings) -> Path:
    if name not in ADAPTER_FILES:
        raise NotFound(f"an adapter has no file {name!r}; it has {', '.join(ADAPTER_FILES)}")
    return adapter_dir(adapter, settings=settings) / name


def open_adapter_file(adapter: Adapter, *, name: str, settings: Settings) -> BinaryIO:
    """One file of the adapter, open (a 404 if it is gone: its run deleted meanwhile)."""
    try:
        return open(adapter_file(adapter, name=name, settings=settings), "rb")
    except FileNotFoundError:
        raise _files_missing(adapter) from None


def _write_archive(directory: Path, out: IO[bytes]) -> None:
    # Fixed mtimes and owners, and no file name in the gzip header (GzipFile takes the name of the
    # file it writes to, a temporary one's): the same adapter always gives the same bytes.
    with (
        gzip.GzipFile(filename="", fileobj=out, mode="wb", mtime=0, compresslevel=6) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name in ADAPTER_FILES:
            path = directory / name
            with open(path, "rb") as f:
                info = tarfile.TarInfo(name)
                info.size = os.fstat(f.fileno()).st_size
                info.mode = 0o644
                info.mtime = 0
                tar.addfile(info, f)


def _archive_path(adapter: Adapter, settings: Settings) -> Path:
    return run_dir(settings, adapter.run_id) / ARCHIVE_CACHE_DIR / archive_name(adapter.step, adapter.sha256)


def open_adapter_archive(adapter: Adapter, *, settings: Settings) -> BinaryIO:
    """The adapter as a tar.gz of its PEFT directory, open for reading: built once and cached beside
    the run (`runs/<id>/cache/`).

    Its run may be deleted meanwhile (its directory moved away and removed: `remove_run_dir`). An
    archive opened, or built, before that is read whole from its descriptor. A build that finds its
    run's files gone (the adapter's, or the cache directory it writes into) is the adapter's 404, and
    never makes the run's directory again: the cache directory is made only inside an existing one.
    """
    archive = _archive_path(adapter, settings)
    try:
        return open(archive, "rb")
    except FileNotFoundError:
        pass
    directory = adapter_dir(adapter, settings=settings)
    try:
        return _build_archive(directory, archive, step=adapter.step)
    except FileNotFoundError:
        raise _files_missing(adapter) from None


def _build_archive(directory: Path, archive: Path, *, step: int) -> BinaryIO:
    archive.parent.mkdir(exist_ok=True)  # not parents=True: a deleted run's directory stays gone
    tmp = beside(archive)
    out = open(tmp, "w+b")  # noqa: SIM115 - returned open, to be read from the start once written
    try:
        _write_archive(directory, out)
        out.flush()
        os.fsync(out.fileno())  # never a truncated archive under the final name after a crash
        os.replace(tmp, archive)
    except BaseException:
        out.close()
        tmp.unlink(missing_ok=True)
        raise
    for old in archive.parent.iterdir():  # the step's archives of an older publication
        other = archive_of(old.name)
        if old != archive and other is not None and other[0] == step:
            old.unlink(missing_ok=True)
    out.seek(0)
    return out


# ---------------------------------------------------------------- steps, metrics, checkpoints


def record_step(session: Session, *, run_id: str, report: StepReport, settings: Settings) -> Run:
    """Record one completed step of a run: its metrics row and the run's progress.
    The step that reaches `max_steps` completes the run, which frees its slot."""
    run = get_run(session, run_id=run_id)
    max_steps = RunConfig.model_validate(run.config).max_steps
    completes = report.step >= max_steps
    if completes:
        # Completing frees a slot, so it follows admission's lock order: the (global) admission
        # lock before the run row. Other steps lock only the run row and leave admission free.
        lock_admission(session)
    session.refresh(run, with_for_update=True)
    if run.status != RunStatus.ACTIVE:
        already = session.scalar(
            select(StepMetrics.id).where(StepMetrics.run_id == run.id, StepMetrics.step == report.step)
        )
        if already is not None:
            # A retried report whose first attempt went through (e.g. the one that completed the run).
            return run
        raise Conflict(
            f"run {run.id} is {run.status}; steps are recorded for active runs only",
            code="run_not_active",
            details={"run_id": run.id, "status": run.status},
        )
    _upsert(
        session,
        StepMetrics,
        values={
            "run_id": run.id,
            "step": report.step,
            "values": report.metrics.model_dump(mode="json"),
            "created_at": utcnow(),
        },
    )
    record_event(
        session,
        action="run.step",
        actor="trainer",
        tenant_id=run.tenant_id,
        run_id=run.id,
        details={
            "step": report.step,
            "total_tokens": report.total_tokens,
            "total_samples": report.total_samples,
            "metrics": report.metrics.model_dump(mode="json", exclude_none=True),
        },
    )
    # A report older than the run's progress (a late duplicate) updates its metrics only;
    # progress goes back only through the restart route.
    if report.step >= run.step:
        run.step = report.step
        run.total_tokens = report.total_tokens
        run.total_samples = report.total_samples
    if completes:
        log.info("run %s reached max_steps %s: completed", run.id, max_steps)
        complete_run(session, run=run, settings=settings)
    session.flush()
    return run


def list_metrics(session: Session, *, run_id: str) -> list[StepMetrics]:
    return list(
        session.scalars(
            select(StepMetrics).where(StepMetrics.run_id == run_id).order_by(StepMetrics.step)
        ).all()
    )


def record_checkpoint(session: Session, *, run_id: str, step: int, total_samples: int) -> Checkpoint:
    """Commit a trainer checkpoint (the trainer wrote it atomically before reporting it)."""
    run = get_run(session, run_id=run_id)
    _require_artifacts_allowed(run, "checkpoints")
    _upsert(
        session,
        Checkpoint,
        values={"run_id": run.id, "step": step, "total_samples": total_samples, "created_at": utcnow()},
    )
    record_event(
        session,
        action="checkpoint.committed",
        actor="trainer",
        tenant_id=run.tenant_id,
        run_id=run.id,
        details={"step": step, "total_samples": total_samples},
    )
    return _one(session, Checkpoint, run_id=run.id, step=step)


def evict_by_trainer(session: Session, *, run_id: str, reason: str, settings: Settings) -> Run:
    """The trainer evicts a run it cannot train on (NaN/Inf, data that should not have passed)."""
    run = get_run(session, run_id=run_id)
    evict_run(session, run=run, reason=reason, evicted_by="trainer", actor="trainer", settings=settings)
    return run


def fail_by_trainer(session: Session, *, run_id: str, reason: str, settings: Settings) -> Run:
    """The trainer cannot start a run (its `init_from` weights could not be loaded): failed, with the
    reason, as a run whose config the pool cannot train. Not an eviction: nothing the user or the run
    did stopped it, and retrying the same run cannot help."""
    run = get_run(session, run_id=run_id)
    fail_run(session, run=run, reason=reason, settings=settings)
    return run
