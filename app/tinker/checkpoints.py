"""The checkpoints of Tinker models (the SDK's RestClient): list a model's, list the tenant's,
delete one, and what a `tinker://` path loads into. Keyword-only, raises domain errors, never
commits.

A checkpoint is what a completed save named: `save_state` → a training checkpoint
`tinker://<model>/weights/<name>` (adapter and optimizer state on the pool), and
`save_weights_for_sampler` → a sampler checkpoint `tinker://<model>/sampler_weights/<name>` (the
run's adapter of that step). A name saved again names the newest save. Deleting one forgets the
name: its path no longer lists, loads, resolves or samples; the run's adapters stay the run's
(`/v1/runs/{id}/adapters`) and a saved state stays on the pool's disk until the run is deleted.
Deleting the model's run forgets all its checkpoints the same way (`live_saves` decides, for every
call). Another tenant's models and paths are reported exactly like missing ones (404).

Completed saves are never purged: a tenant saving under one name at every step leaves a row per
step. What a path names is its newest save, so every read here (the checkpoint a call names, the
listings, the quotas) reads the newest save of each path alone, through the partial index
`ix_tinker_futures_current_saves` (`newest_saves_only`): reading a name's whole history took 1.3 s a sample
and 6 s a delete at 50,000 saves of one name (bench/tinker_newest_saves.py). A path is live while
its newest save is, since deleting a checkpoint marks every save of its path (`delete_checkpoint`);
a save recorded out of request order after that delete is live again (`_live_saves`).

A tenant keeps at most `Settings.tinker_max_saves_per_tenant` training states (`check_save_quota`)
and `Settings.tinker_max_sampler_checkpoints_per_tenant` live sampler checkpoints
(`check_sampler_quota`): 403 `save_quota` past either. The listings are built in SQL from the
columns they show, a page at a time; no save row is read whole.
"""

import json
from collections.abc import Sequence
from typing import Any, Literal

from sqlalchemy import (
    JSON,
    ColumnElement,
    Select,
    SQLColumnExpression,
    String,
    TextClause,
    case,
    cast,
    distinct,
    exists,
    func,
    literal,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from app.errors import AppError, NotFound, ValidationFailed, problem
from app.runs.models import Run
from app.tenants.service import lock_tenant
from app.tinker.models import (
    CHECKPOINT_DELETED,
    SAVE_KINDS,
    TinkerFuture,
    TinkerModel,
    current_saves,
    unfinished,
)
from app.tinker.schemas import (
    ATTN_MODULES,
    MLP_MODULES,
    UNEMBED_MODULES,
    CheckpointOut,
    TrainingRunOut,
    WeightsInfoOut,
    shown,
)
from app.tinker.service import get_listed_model, get_model
from contracts.status import RunStatus

CheckpointType = Literal["training", "sampler"]
TYPE_OF_KIND: dict[str, CheckpointType] = {"save_weights": "training", "save_weights_for_sampler": "sampler"}
KIND_OF_SEGMENT = {"weights": "save_weights", "sampler_weights": "save_weights_for_sampler"}


def saved_path() -> ColumnElement[str]:
    """The `tinker://` path a completed save's result names, in SQL (`TinkerFuture.saved_path`)."""
    path: ColumnElement[str] = TinkerFuture.result["path"].as_string()
    return path


def _not_deleted() -> ColumnElement[bool]:
    # Only ever set to true (`delete_checkpoint`): absent is live, whatever each backend reads true as.
    absent: ColumnElement[bool] = TinkerFuture.result[CHECKPOINT_DELETED].as_string().is_(None)
    return absent


def has_sampler_checkpoint(model_id: SQLColumnExpression[str]) -> ColumnElement[bool]:
    """Whether the model `model_id` names (a correlated column) has a live sampler checkpoint: a
    completed `save_weights_for_sampler` whose path is not deleted (a delete marks all the path's
    saves, `delete_checkpoint`), among the newest saves alone (a path's newest live save is never
    superseded: `_live_saves`)."""
    return exists().where(
        TinkerFuture.model_id == model_id,
        TinkerFuture.kind == "save_weights_for_sampler",
        TinkerFuture.status == "complete",
        saved_path().is_not(None),
        _not_deleted(),
        newest_saves_only(),
    )


def newest_saves_only() -> TextClause:
    """The newest save of each path (`TinkerFuture.superseded_at`): the predicate of the partial index
    `ix_tinker_futures_current_saves` said literally, as `app.tinker.models.CLAIMABLE` is, so that
    Postgres reads the index in a generic plan too (bound parameters it cannot look into). An older
    save left unmarked (recorded by a process from before migration 0021) is still read: a path's
    reads rank its unmarked saves, a handful, as they ranked all of them."""
    return text(f"({current_saves(TinkerFuture.__tablename__)})")


def _saves_of(
    tenant_id: str, *, model_id: str | None, kinds: tuple[str, ...]
) -> tuple[ColumnElement[bool], ...]:
    """The tenant's completed saves of `kinds` (of one model, or of all its models), their
    checkpoints not deleted, whether superseded or not."""
    where = (
        TinkerFuture.tenant_id == tenant_id,
        TinkerFuture.kind.in_(kinds),
        TinkerFuture.status == "complete",
        TinkerFuture.completed_at.is_not(None),
        saved_path().is_not(None),
        _not_deleted(),
    )
    return where if model_id is None else (*where, TinkerFuture.model_id == model_id)


def _live_saves(
    tenant_id: str, *, model_id: str | None = None, kinds: tuple[str, ...] = tuple(TYPE_OF_KIND)
) -> tuple[ColumnElement[bool] | TextClause, ...]:
    """The newest completed save of each of the tenant's paths (of one model, or of all its models
    whose runs are not deleted), its checkpoint not deleted: what lists, loads and resolves. The
    query joins TinkerModel and Run (`_joined`). Read from the newest saves alone (`newest_saves_only`):
    a save is superseded only by a newer one completed after it, which a delete of the path marks
    too (`delete_checkpoint`), so a path's newest live save is never superseded. It is the path's
    newest save but where results came out of request order: a newer save deleted before an older
    one completed stays current beside it, and the reads take the highest live one (migration
    0022 made the rows 0021 ranked agree)."""
    return (
        *_saves_of(tenant_id, model_id=model_id, kinds=kinds),
        Run.status != RunStatus.DELETED,
        newest_saves_only(),
    )


def _joined(query: Select[Any]) -> Select[Any]:
    return query.join(TinkerModel, TinkerModel.id == TinkerFuture.model_id).join(
        Run, Run.id == TinkerModel.run_id
    )


def _newest_per_path(tenant_id: str, *, model_id: str | None = None) -> Select[Any]:
    """One row per live checkpoint path, its newest save (a name saved again lists once): kind,
    completed_at, path and id. Done in SQL: reading every save row of the tenant (its request and
    result JSON) took 247 ms at 300 saves, on every call (hostile probe, finding 6). The window
    ranks the newest saves alone (`_live_saves`): one per path, but for an older one left unmarked."""
    ranked = _joined(
        select(
            TinkerFuture.id,
            TinkerFuture.kind,
            TinkerFuture.completed_at,
            saved_path().label("path"),
            func.row_number()
            .over(
                partition_by=saved_path(),
                # The save a path's reads resolve to (`newest_save_query`): by request number first.
                order_by=(
                    TinkerFuture.seq_id.desc(),
                    TinkerFuture.completed_at.desc(),
                    TinkerFuture.id.desc(),
                ),
            )
            .label("newest"),
        )
    ).where(*_live_saves(tenant_id, model_id=model_id))
    sub = ranked.subquery()
    return select(sub.c.id, sub.c.kind, sub.c.completed_at, sub.c.path).where(sub.c.newest == 1)


def _out(kind: str, completed_at: Any, path: str) -> CheckpointOut:
    return CheckpointOut(
        checkpoint_id=path.split("/", 3)[3],
        checkpoint_type=TYPE_OF_KIND[kind],
        time=completed_at.isoformat(),
        tinker_path=path,
    )


def page_query(
    tenant_id: str, *, model_id: str | None = None, limit: int | None = None, offset: int = 0
) -> Select[Any]:
    """A page of the live checkpoints (of one model, or of all the tenant's models), newest first:
    kind, completed_at, path, and how many there are in all (a window over the same rows)."""
    sub = _newest_per_path(tenant_id, model_id=model_id).subquery()
    ordered = select(sub.c.kind, sub.c.completed_at, sub.c.path, func.count().over().label("total")).order_by(
        sub.c.completed_at.desc(), sub.c.id.desc()
    )
    if limit is not None:
        ordered = ordered.limit(limit)
    return ordered.offset(offset) if offset else ordered


def _page(
    session: Session, tenant_id: str, *, model_id: str | None = None, limit: int | None, offset: int
) -> tuple[list[CheckpointOut], int]:
    """A page of the checkpoints, newest first, and how many there are in all: one statement
    (`page_query`; a second one only for a page past the end)."""
    rows = session.execute(page_query(tenant_id, model_id=model_id, limit=limit, offset=offset)).all()
    if rows:
        total = int(rows[0].total)
    elif offset:
        everything = _newest_per_path(tenant_id, model_id=model_id).subquery()
        total = int(session.scalar(select(func.count()).select_from(everything)) or 0)
    else:
        total = 0
    return [_out(kind, at, path) for kind, at, path, _ in rows], total


def model_checkpoints(session: Session, *, tenant_id: str, model_id: str) -> list[CheckpointOut]:
    """The model's checkpoints, newest first (404 for a model that is not the tenant's, or whose run
    is deleted: `get_listed_model`)."""
    get_listed_model(session, tenant_id=tenant_id, model_id=model_id)
    return _page(session, tenant_id, model_id=model_id, limit=None, offset=0)[0]


def user_checkpoints(
    session: Session, *, tenant_id: str, limit: int, offset: int
) -> tuple[list[CheckpointOut], int]:
    """A page of the checkpoints of all the tenant's models, newest first, and their total (in SQL:
    the page's rows are the only ones read)."""
    return _page(session, tenant_id, limit=limit, offset=offset)


SEGMENT_OF_KIND = {kind: segment for segment, kind in KIND_OF_SEGMENT.items()}


def _parse(path: str, *, kind: str | None = None, loc: Sequence[str]) -> tuple[str, str, str]:
    """`tinker://<model>/<weights|sampler_weights>/<name>` → (model id, save kind, path); with
    `kind`, only a path of that kind (`save_weights` or `save_weights_for_sampler`). `loc`: where the
    request carried the path, named by the 422 of a malformed one."""
    parts = path.removeprefix("tinker://").split("/")
    # An empty model id (`tinker:///weights/x`) is a malformed path, not a model that is not found.
    if (
        not path.startswith("tinker://")
        or len(parts) != 3
        or not parts[0]
        or parts[1] not in KIND_OF_SEGMENT
        or not parts[2]
    ):
        shape = "tinker://<model_id>/weights/<name> or .../sampler_weights/<name>"
        raise ValidationFailed(
            f"not a checkpoint path: {shown(path)!r} ({shape})",
            details=[problem(loc, f"not a checkpoint path ({shape})", "checkpoint_path")],
        )
    if kind is not None and KIND_OF_SEGMENT[parts[1]] != kind:
        shape = f"tinker://<model_id>/{SEGMENT_OF_KIND[kind]}/<name>"
        raise ValidationFailed(
            f"not a {TYPE_OF_KIND[kind]} checkpoint path: {shown(path)!r} ({shape})",
            details=[
                problem(loc, f"not a {TYPE_OF_KIND[kind]} checkpoint path ({shape})", "checkpoint_path")
            ],
        )
    return parts[0], KIND_OF_SEGMENT[parts[1]], path


def newest_save_query(tenant_id: str, *, model_id: str, kind: str, path: str) -> Select[TinkerFuture]:
    """The newest live save of the model's checkpoint `path` (of `kind`), whole (`live_saves`)."""
    return (
        _joined(select(TinkerFuture))
        .where(*_live_saves(tenant_id, model_id=model_id, kinds=(kind,)), saved_path() == path)
        # Saves are ordered requests of one model: the highest seq_id is the newest.
        .order_by(TinkerFuture.seq_id.desc(), TinkerFuture.completed_at.desc())
        .limit(1)
    )


def live_saves(
    session: Session,
    *,
    tenant_id: str,
    path: str,
    kind: str | None = None,
    loc: Sequence[str] = ("body",),
) -> tuple[TinkerModel, Run, list[TinkerFuture]]:
    """The tenant's model a checkpoint path names, its run, and the path's newest save (a list of
    that one); 404 `checkpoint ... not found` when it is not live: never saved, its checkpoint
    deleted, its model's run deleted, or another tenant's. The one place that decides whether a
    saved path is live, for every call that takes one: weights_info, delete_checkpoint,
    load_weights, create_sampling_session, a sampling client's every sample and
    /api/v1/loraloom/resolve (load_weights and the samplers read the save's row alone, and took a
    deleted run's path: hostile probe h1, finding 3). `kind`: only a path of that kind (422 for
    the other, naming `loc`: where the request carried the path; every route passes its own).

    One row read, among the tenant's newest saves of that kind (`_live_saves`): this path's older
    saves are not (every sample read them all, 1.3 s at 50,000 saves of one name)."""
    model_id, kind, path = _parse(path, kind=kind, loc=loc)
    model, run = get_model(session, tenant_id=tenant_id, model_id=model_id)
    newest = session.scalar(newest_save_query(tenant_id, model_id=model_id, kind=kind, path=path))
    # The path's own check too: a save's stored path and its kind agree by construction.
    if newest is None or newest.saved_path() != path:
        raise NotFound(f"checkpoint {shown(path)} not found")
    return model, run, [newest]


def _marked_deleted(session: Session) -> ColumnElement[Any]:
    """A save's result with the deleted mark added, in SQL (`result` is JSON on both backends)."""
    if session.get_bind().dialect.name == "postgresql":
        mark = cast(literal(json.dumps({CHECKPOINT_DELETED: True}), String), JSONB)
        return cast(cast(TinkerFuture.result, JSONB).op("||")(mark), JSON)
    return func.json_set(TinkerFuture.result, f"$.{CHECKPOINT_DELETED}", func.json("true"))


def delete_checkpoint(session: Session, *, tenant_id: str, model_id: str, checkpoint_id: str) -> None:
    """Forget `tinker://<model_id>/<checkpoint_id>` (404 when it does not name a live checkpoint).

    Every save of the path not yet marked deleted is marked, the superseded ones too: the
    newest-save reads here and the pruning's pins (app/adapters/pruning.py `_live_sampler_steps`)
    rely on a deleted path having no live save left, and a save recorded out of request order leaves
    an older one current beside the newest. One UPDATE in SQL, nothing read back: it still visits
    the path's history (the first delete of a name saved at every step marks them all), once per
    delete, where the reads above visit one row per call."""
    path = f"tinker://{model_id}/{checkpoint_id}"
    _, _, (newest,) = live_saves(session, tenant_id=tenant_id, path=path, loc=("path", "checkpoint_id"))
    session.execute(
        update(TinkerFuture)
        .where(*_saves_of(tenant_id, model_id=model_id, kinds=(newest.kind,)), saved_path() == path)
        .values(result=_marked_deleted(session))
        .execution_options(synchronize_session=False)
    )
    session.expire(newest, ["result"])  # the UPDATE wrote it in SQL


def weights_info(session: Session, *, tenant_id: str, path: str) -> WeightsInfoOut:
    """What the checkpoint at `path` loads into: base model and LoRA shape."""
    _, run, _ = live_saves(session, tenant_id=tenant_id, path=path, loc=("body", "tinker_path"))
    modules = set(run.config["lora"]["target_modules"])
    return WeightsInfoOut(
        base_model=run.base_model,
        lora_rank=int(run.config["lora"]["rank"]),
        train_unembed=bool(modules & set(UNEMBED_MODULES)),
        train_mlp=bool(modules & set(MLP_MODULES)),
        train_attn=bool(modules & set(ATTN_MODULES)),
    )


def latest_query(tenant_id: str, *, model_ids: list[str]) -> Select[Any]:
    """The newest live checkpoint of each kind of each model: model id, kind, completed_at, path.
    The window ranks the newest save of each path alone (`_live_saves`)."""
    ranked = (
        _joined(
            select(
                TinkerFuture.model_id,
                TinkerFuture.kind,
                TinkerFuture.completed_at,
                saved_path().label("path"),
                func.row_number()
                .over(
                    partition_by=(TinkerFuture.model_id, TinkerFuture.kind),
                    order_by=(TinkerFuture.completed_at.desc(), TinkerFuture.id.desc()),
                )
                .label("newest"),
            )
        )
        .where(*_live_saves(tenant_id), TinkerFuture.model_id.in_(model_ids))
        .subquery()
    )
    return select(ranked.c.model_id, ranked.c.kind, ranked.c.completed_at, ranked.c.path).where(
        ranked.c.newest == 1
    )


def _latest(
    session: Session, *, tenant_id: str, model_ids: list[str]
) -> dict[tuple[str, str], CheckpointOut]:
    """The newest live checkpoint of each kind of each model, by (model id, kind), in one query."""
    if not model_ids:
        return {}
    rows = session.execute(latest_query(tenant_id, model_ids=model_ids))
    return {(str(model_id), kind): _out(kind, at, path) for model_id, kind, at, path in rows}


def with_latest_checkpoints_of(
    session: Session, *, tenant_id: str, run_outs: list[TrainingRunOut]
) -> list[TrainingRunOut]:
    """`run_outs`, each with its newest training and sampler checkpoints (one query for all)."""
    latest = _latest(session, tenant_id=tenant_id, model_ids=[r.training_run_id for r in run_outs])
    return [
        r.model_copy(
            update={
                "last_checkpoint": latest.get((r.training_run_id, "save_weights")),
                "last_sampler_checkpoint": latest.get((r.training_run_id, "save_weights_for_sampler")),
            }
        )
        for r in run_outs
    ]


def with_latest_checkpoints(session: Session, *, tenant_id: str, run_out: TrainingRunOut) -> TrainingRunOut:
    """`run_out` with its newest training and sampler checkpoints."""
    return with_latest_checkpoints_of(session, tenant_id=tenant_id, run_outs=[run_out])[0]


# --- the quota on saved training states ------------------------------------------------------


class SaveQuota(AppError):
    """403: the tenant keeps `Settings.tinker_max_saves_per_tenant` training states, or
    `Settings.tinker_max_sampler_checkpoints_per_tenant` live sampler checkpoints, already
    (`details.kind`: `saved_states` or `sampler_checkpoints`).

    Not a 409: the official SDK retries every 408, 409, 429 and 5xx of a submission for 5 minutes
    (`InternalClientHolder.execute_with_retries`, which reads the status alone, not the
    `x-should-retry` header), and retrying cannot make room. On a 403 it raises at once, a
    `tinker.PermissionDeniedError` carrying this message."""

    status = 403
    code = "save_quota"


STATE_KIND, SAMPLER_KIND = SAVE_KINDS
DEFAULT_SAVE_NAME = {STATE_KIND: "state", SAMPLER_KIND: "sampler"}
"""The name a save of each kind is stored under when its request names none (`app.tinker.work`)."""


def _unfinished_path(kind: str) -> ColumnElement[str]:
    """The path a pending or running save of `kind` will name once the pool runs it (the one
    `app.tinker.work` stores in its result), built in SQL from the model and the request's name."""
    name = func.coalesce(func.nullif(TinkerFuture.request["name"].as_string(), ""), DEFAULT_SAVE_NAME[kind])
    segment = literal(f"/{SEGMENT_OF_KIND[kind]}/", String)
    path: ColumnElement[str] = literal("tinker://", String) + TinkerFuture.model_id + segment + name
    return path


def kept_query(tenant_id: str, *, kind: str, path: str, deleted_kept: bool) -> Select[int, int]:
    """One row: how many paths of `kind` the tenant keeps, and 1 if `path` is one of them (else 0).
    A kept path is one a completed save named, of a model whose run is not deleted, its checkpoint
    not deleted (or deleted too, with `deleted_kept`), or one a pending or running save of such a
    model will name (each is one once the pool runs it). Saves of one path count once.

    Completed saves are never purged: a tenant saving under one name at every step leaves a row per
    step, and counting them all took 207 ms at 50,000, on every save, under the tenant's lock. A
    path is live while its newest save is (deleting a checkpoint marks every save of its path), so
    the completed saves are read from the newest of each path alone, the partial index
    `ix_tinker_futures_current_saves`, and the unfinished ones from `ix_tinker_futures_unfinished`:
    both predicates said literally, for a generic plan (`app.tinker.models.CLAIMABLE`). The count
    is by path, so an older save left unmarked (recorded by a process from before migration 0021)
    costs a row read, never a place."""
    table = TinkerFuture.__tablename__
    tenant_saves = (
        TinkerFuture.tenant_id == tenant_id,
        TinkerFuture.kind == kind,
        Run.status != RunStatus.DELETED,
    )
    completed = _joined(select(saved_path().label("path"))).where(
        *tenant_saves,
        newest_saves_only(),
        TinkerFuture.completed_at.is_not(None),
        saved_path().is_not(None),
        *(() if deleted_kept else (_not_deleted(),)),
    )
    pending = _joined(select(_unfinished_path(kind).label("path"))).where(
        *tenant_saves, text(f"({unfinished(table)})")
    )
    kept = union_all(completed, pending).subquery()
    return select(
        func.count(distinct(kept.c.path)),
        func.coalesce(func.max(case((kept.c.path == path, 1), else_=0)), 0),
    )


def _kept_count(
    session: Session, *, tenant_id: str, kind: str, path: str, deleted_kept: bool
) -> tuple[int, bool]:
    """(how many paths of `kind` the tenant keeps, whether `path` is one of them): `kept_query`."""
    count, has_path = session.execute(
        kept_query(tenant_id, kind=kind, path=path, deleted_kept=deleted_kept)
    ).one()
    return int(count), bool(has_path)


def check_save_quota(session: Session, *, tenant_id: str, path: str, most: int) -> None:
    """403 `save_quota` when a save of `path` would be a training state past the tenant's `most`
    (saving a kept path again overwrites it: always room). Exact under concurrent saves: the
    tenant's row is locked until the commit (`lock_tenant`; SQLite serialises writes already).

    The states counted are the `tinker://.../weights/<name>` paths the pool keeps on its disk
    (`_kept_count`): deleted checkpoints included, since the pool keeps a state until its run is
    deleted (were they not counted, saving, deleting and saving again would fill the disk under the
    quota)."""
    lock_tenant(session, tenant_id=tenant_id)
    kept, is_kept = _kept_count(session, tenant_id=tenant_id, kind=STATE_KIND, path=path, deleted_kept=True)
    if is_kept or kept < most:
        return
    raise SaveQuota(
        f"this tenant keeps {kept} saved training states (save_state), the most it may "
        f"(LORALOOM_TINKER_MAX_SAVES_PER_TENANT = {most}); save under a name already kept, which "
        "overwrites it (a deleted checkpoint's name too: its state stays on the pool until its run "
        "is deleted), or delete a model's run (DELETE /v1/runs/{id}), whose states go with it",
        details={"kind": "saved_states", "kept": kept, "limit": most},
    )


# --- the quota on live sampler checkpoints --------------------------------------------------------


def check_sampler_quota(session: Session, *, tenant_id: str, path: str, most: int) -> None:
    """403 `save_quota` when a save of `path` would be a live sampler checkpoint past the tenant's
    `most` (saving a live path again replaces it: always room). The live ones are what lists and
    resolves (`_live_saves`) and the pending or running saves of models whose runs are not deleted
    (`kept_query`): each pins its step's adapter from the pruning (app/adapters/pruning.py) until it
    is deleted, so deleting one frees its place. Counted in the transaction that stores the save,
    with the tenant's row locked until its commit (`lock_tenant`; SQLite serialises writes already),
    as `check_save_quota`: two saves at once cannot both take the last place.

    A 403, as `check_save_quota`'s, not the 409 of /v1's `adapter_quota` nor a 429: the SDK retries
    a 409 or 429 of a submission for 5 minutes, and only the user can make room."""
    lock_tenant(session, tenant_id=tenant_id)
    live, is_live = _kept_count(
        session, tenant_id=tenant_id, kind=SAMPLER_KIND, path=path, deleted_kept=False
    )
    if is_live or live < most:
        return
    raise SaveQuota(
        f"this tenant keeps {live} live sampler checkpoints (save_weights_for_sampler), the most "
        f"it may (LORALOOM_TINKER_MAX_SAMPLER_CHECKPOINTS_PER_TENANT = {most}); delete one to free its "
        "place (RestClient.delete_checkpoint_from_tinker_path, or DELETE "
        "/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/{name}), delete a model's run "
        "(DELETE /v1/runs/{id}), whose checkpoints go with it, or save under a name already kept, "
        "which replaces it",
        details={"kind": "sampler_checkpoints", "kept": live, "limit": most},
    )
