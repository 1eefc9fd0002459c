"""Work the pool executes for Tinker models: forward, forward_backward and optim_step requests.

Submitted requests are stored as pending futures (one per model and `seq_id`: a retried
submission finds the first one, so it is applied once). The pool of the model's base model claims
the pending work of its active runs, per model in `seq_id` order up to and including the next
`optim_step` or `load_weights` (the step boundary: the pool runs the passes first, then the step),
and posts each result back. A claim is held by the claiming pool while it lives (app.tinker.leases);
a new pool replays the step's delivered forward_backwards, whose requests are kept until the step's
optim_step is recorded (docs/contracts.md, "Exactly-once across restarts"). A request whose run
has left (evicted, deleted, failed, completed) fails with the reason, at the next sweep or when it
is polled if that comes first (app.tinker.leases), and the pool never receives it.
"""

import functools
import math
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import numpy as np
from pydantic import ValidationError
from sqlalchemy import (
    ColumnElement,
    Select,
    and_,
    bindparam,
    case,
    func,
    not_,
    null,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer

from app.config import Settings
from app.db import utcnow
from app.errors import AppError, RateLimited, ValidationFailed, problem
from app.pools.models import Pool
from app.pools.service import get_alive_pool
from app.runs.admission import live_pool
from app.runs.models import Run
from app.runs.schemas import validation_problems
from app.tinker import checkpoints, leases, proto
from app.tinker.finite import FINITE, all_finite, require_finite
from app.tinker.leases import request_cleared
from app.tinker.models import (
    REPLAYED_KINDS,
    SAVE_KINDS,
    TinkerFuture,
    TinkerModel,
    claimable,
    current_saves,
    unfinished,
)
from app.tinker.schemas import (
    BODY_LOC,
    MAX_SAVE_NAME_CHARS,
    LoadWeightsRequest,
    OptimStepRequest,
    OrderedRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    body_problem,
    invalid,
    parse_request,
    shown,
)
from app.tinker.service import NotSupported, get_model, get_session, new_model_run, touch_model
from contracts.arrays import MAX_TOKEN_ID
from contracts.ids import new_id
from contracts.run_config import RunConfig
from contracts.status import MOVABLE_RUN_STATUSES, RunStatus
from contracts.tinker_work import (
    LOSS_FN_CONFIG_KEYS,
    AdamStep,
    ClipThresholds,
    ManualDatum,
    ManualResult,
    ManualWorkItem,
)

LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo", "cispo")
SAVE_NAME_RE = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_SAVE_NAME_CHARS - 1}}}")
PENDING, RUNNING = "pending", "running"
MAX_LOSS_FN_CONFIG_KEYS = 32
"""Counted before the keys are read (a loss reads two at most: LOSS_FN_CONFIG_KEYS)."""
MAX_DATUMS_PER_REQUEST = 1024
"""Datums of one forward/forward_backward request: the SDK's own chunk length, which it is told
(app.tinker.schemas.ClientConfig); its tokens are bounded by `Settings.tinker_max_tokens_per_round`."""


class RunNotActive(AppError):
    status = 400
    code = "run_not_active"


def _flat(tensor: proto.Tensor | None) -> np.ndarray | None:
    return None if tensor is None else tensor.data.ravel()


def _bad_field(index: int, name: str, problem: str) -> ValidationFailed:
    return ValidationFailed(
        f"datum {index}: {name} {problem}",
        details=[body_problem(("data", index, name), problem)],
    )


def _token_ids(index: int, name: str, values: np.ndarray) -> list[int]:
    """Token ids as ints: whole numbers in [0, 2^31) whatever the tensor's dtype (a float tensor of
    ids is accepted when its values are whole; 1.7, NaN or -5 are refused, never truncated)."""
    ids = np.asarray(values, dtype=np.float64)  # exact for every id in range
    if ids.size and not (
        np.isfinite(ids).all()
        and (ids == np.floor(ids)).all()
        and ids.min() >= 0
        and ids.max() <= MAX_TOKEN_ID
    ):
        raise _bad_field(index, name, f"must hold token ids: whole numbers in [0, {MAX_TOKEN_ID}]")
    out: list[int] = ids.astype(np.int64).tolist()
    return out


def _finite(index: int, name: str, values: np.ndarray | None) -> list[float] | None:
    if values is None:
        return None
    numbers = np.asarray(values, dtype=np.float64)
    if not np.isfinite(numbers).all():
        raise _bad_field(index, name, "must be finite (no NaN or infinity)")
    out: list[float] = numbers.tolist()
    return out


def _aligned(index: int, raw: proto.Datum, names: tuple[str, ...]) -> None:
    """Each loss input one value per model-input token, checked on the decoded views before any
    becomes a Python list (a one-token datum with a 16M-value tensor was 500 MB of floats)."""
    n = len(raw.token_ids)
    for name in names:
        tensor = raw.loss_fn_inputs.get(name)
        if tensor is not None and tensor.data.size != n:
            problem = f"{name} has {tensor.data.size} entries; the model input has {n} tokens"
            raise ValidationFailed(
                f"datum {index}: invalid loss_fn_inputs: {problem}",
                details=[body_problem(("data", index, name), problem)],
            )


def _datum(index: int, raw: proto.Datum, loss_fn: str) -> ManualDatum:
    inputs = raw.loss_fn_inputs
    unknown = sorted(set(inputs) - {"target_tokens", "weights", "logprobs", "advantages"})
    if unknown:
        raise NotSupported(f"loss_fn_inputs {unknown} (datum {index})")
    # `loc` as the other loss input problems' (`_bad_field`): the input's name under its datum.
    if "target_tokens" not in inputs:
        raise ValidationFailed(
            f"datum {index}: loss_fn_inputs needs target_tokens",
            details=[body_problem(("data", index, "target_tokens"), "needed in loss_fn_inputs", "missing")],
        )
    if loss_fn != "cross_entropy" and not {"logprobs", "advantages"} <= set(inputs):
        raise ValidationFailed(
            f"datum {index}: {loss_fn} needs loss_fn_inputs logprobs and advantages",
            details=[
                body_problem(("data", index, name), f"{loss_fn} needs it in loss_fn_inputs", "missing")
                for name in ("logprobs", "advantages")
                if name not in inputs
            ],
        )
    rl = loss_fn != "cross_entropy"
    _aligned(
        index,
        raw,
        ("target_tokens", "weights", "logprobs", "advantages") if rl else ("target_tokens", "weights"),
    )
    weights = _finite(index, "weights", _flat(inputs.get("weights"))) or [1.0] * len(raw.token_ids)
    target = _flat(inputs["target_tokens"])
    try:
        return ManualDatum(
            tokens=_token_ids(index, "tokens", raw.token_ids),
            target_tokens=_token_ids(index, "target_tokens", target) if target is not None else [],
            weights=weights,
            logprobs=_finite(index, "logprobs", _flat(inputs.get("logprobs"))) if rl else None,
            advantages=_finite(index, "advantages", _flat(inputs.get("advantages"))) if rl else None,
        )
    except ValidationError as exc:
        raise ValidationFailed(
            f"datum {index}: invalid loss_fn_inputs",
            details=validation_problems(exc, prefix=(*BODY_LOC, "data", str(index))),
        ) from exc


def _check_request_size(data: list[proto.Datum], *, max_tokens: int) -> None:
    """A request one pool round can take alone: a larger one would hold every other tenant's work
    for longer than the round's bound (the SDK chunks to fit: it is told both limits). A round
    therefore holds at most max(max_tokens, the pool's max_seq_len) tokens of training data.
    Counted on the decoded views, before any token becomes a Python int."""
    if len(data) > MAX_DATUMS_PER_REQUEST:
        raise ValidationFailed(
            f"{len(data)} datums in one request; at most {MAX_DATUMS_PER_REQUEST} (split the batch)",
            details={"kind": "datums_per_request", "datums": len(data), "limit": MAX_DATUMS_PER_REQUEST},
        )
    tokens = sum(len(d.token_ids) for d in data)
    # One datum always passes here: its length is bounded by max_seq_len (`_check_lengths`). The
    # SDK sends a datum larger than its chunk alone, and cannot split it further.
    if tokens > max_tokens and len(data) > 1:
        raise ValidationFailed(
            f"{tokens} tokens in one request; at most {max_tokens} (split the batch)",
            details={"kind": "tokens_per_request", "tokens": tokens, "limit": max_tokens},
        )


def _datum_bound(session: Session, run: Run) -> tuple[int, Pool | None]:
    """(the most model-input tokens one datum may have, the live pool of the run's base model): the
    pool's max_seq_len, or with no live pool the run's own seq_len."""
    pool = live_pool(session, base_model=run.base_model)
    return (pool.max_seq_len if pool is not None else RunConfig.model_validate(run.config).seq_len), pool


def _check_lengths(data: list[proto.Datum], *, max_len: int, pool: Pool | None) -> None:
    """Every datum within `max_len` tokens (`_datum_bound`), on the decoded views: a single datum of
    any length passed the request's bound, and became a list of Python ints before this check (a
    63 MB datum took 1.2 GB; hostile probe, finding 5)."""
    for i, d in enumerate(data):
        if len(d.token_ids) > max_len:
            whose = "the pool's max_seq_len" if pool is not None else "the model's seq_len"
            too_long = f"{len(d.token_ids)} tokens; {whose} is {max_len}"
            raise ValidationFailed(
                f"datum {i}: {too_long}",
                details=[body_problem(("data", i, "model_input"), too_long, "too_long")],
            )


def _check_vocabulary(pool: Pool | None, data: list[ManualDatum]) -> None:
    """Ids within the live pool's vocabulary. With no live pool the vocabulary is unknown (ids are
    already non-negative int32): a pool fails a request with an id outside it on its own (it never
    reaches the model: trainer_core.manual)."""
    if pool is None:
        return
    outside = f"a token id is outside the vocabulary [0, {pool.vocab_size})"
    for i, d in enumerate(data):
        problems = [
            body_problem(("data", i, name), outside)
            for name, ids in (("model_input", d.tokens), ("target_tokens", d.target_tokens))
            if ids and max(ids) >= pool.vocab_size
        ]
        if problems:
            raise ValidationFailed(f"datum {i}: {outside}", details=problems)


def _existing(session: Session, *, model_id: str, seq_id: int) -> TinkerFuture | None:
    return session.scalar(
        select(TinkerFuture).where(TinkerFuture.model_id == model_id, TinkerFuture.seq_id == seq_id)
    )


PENDING_RETRY_AFTER_SECONDS = 2


def request_json_bytes(item: ManualWorkItem) -> int:
    """The size of `item` stored as `TinkerFuture.request`, measured before it is stored, within ~1%.

    The ORM writes the JSON with `json.dumps`, which puts a space after every `,` and `:`; pydantic's
    compact JSON plus those spaces is that size but for the spelling of some floats (`0.00001` for
    `1e-05`; at most a few bytes each). Exact would mean serializing with `json.dumps` twice, +0.6 s
    for a round's worth of tokens; this costs ~0.1 s there. (A comma or colon inside a string counts
    a space too many: a few bytes high.)"""
    text = item.model_dump_json()
    return len(text) + text.count(",") + text.count(":")


def unfinished_query(tenant_id: str) -> Select[int, int]:
    """(the tenant's pending requests, the bytes of its pending and running ones' JSON), read from the
    partial index `ix_tinker_futures_unfinished` alone. Its predicate is said literally, as the
    claim's is (`claim_query`): a generic plan cannot see into bound values."""
    return select(
        func.coalesce(func.sum(case((TinkerFuture.status == PENDING, 1), else_=0)), 0),
        func.coalesce(func.sum(TinkerFuture.request_bytes), 0),
    ).where(TinkerFuture.tenant_id == tenant_id, text(f"({unfinished(TinkerFuture.__tablename__)})"))


def check_pending_room(session: Session, *, tenant_id: str, request_bytes: int, settings: Settings) -> None:
    """429 when the tenant has `Settings.tinker_max_pending_per_tenant` requests waiting, or when a
    request of `request_bytes` would take its unfinished (pending or running) requests' JSON past
    `Settings.tinker_max_pending_bytes_per_tenant`. A request fits when nothing of the tenant's is
    unfinished whatever its size (a request may be larger than the bound, which is at least 1 MiB:
    refusing it would make the SDK retry it forever)."""
    # int(): Postgres sums a BIGINT as a NUMERIC (a Decimal here), which the error body cannot carry.
    pending, stored = map(int, session.execute(unfinished_query(tenant_id)).one())
    most = settings.tinker_max_pending_per_tenant
    if pending >= most:
        raise RateLimited(
            f"{pending} Tinker requests of this tenant are waiting for the pool; at most {most}. "
            "Retry once some are done",
            details={"kind": "pending_requests", "pending": pending, "max_pending": most},
            retry_after=PENDING_RETRY_AFTER_SECONDS,
        )
    most_bytes = settings.tinker_max_pending_bytes_per_tenant
    if stored and stored + request_bytes > most_bytes:
        raise RateLimited(
            f"this tenant's unfinished Tinker requests hold {stored} bytes; this one adds {request_bytes}, "
            f"past the limit of {most_bytes}. Retry once some are done",
            details={
                "kind": "pending_bytes",
                "pending_bytes": stored,
                "request_bytes": request_bytes,
                "max_pending_bytes": most_bytes,
            },
            retry_after=PENDING_RETRY_AFTER_SECONDS,
        )


def require_active(run: Run, *, model_id: str) -> None:
    """400 `run_not_active` unless the model's run takes requests (queued or active)."""
    if run.status not in MOVABLE_RUN_STATUSES:
        raise RunNotActive(f"model {model_id}: its run {run.id} is {run.status}; it takes no more requests")


def _submit(
    session: Session,
    *,
    tenant_id: str,
    model_id: str,
    run: Run,
    item: ManualWorkItem,
    settings: Settings,
    ordered: bool = True,
) -> TinkerFuture:
    """Store the work as a pending future. `ordered`: it takes its model's seq_id (sampling
    requests do not: they are numbered per sampling client, and order among them is free)."""
    require_active(run, model_id=model_id)
    size = request_json_bytes(item)
    check_pending_room(session, tenant_id=tenant_id, request_bytes=size, settings=settings)
    future = TinkerFuture(
        id=item.request_id,
        tenant_id=tenant_id,
        kind=item.kind,
        model_id=model_id,
        seq_id=item.seq_id if ordered else None,
        run_id=run.id,
        status=PENDING,
        request=item.model_dump(mode="json"),
        request_bytes=size,
        tokens=work_tokens(item),
    )
    try:
        with session.begin_nested():  # a savepoint: a concurrent twin's insert wins, not a 500
            session.add(future)
            session.flush()
    except IntegrityError:
        # The same request (model, seq_id) sent twice at once, both past `_existing`: the
        # second waited on the unique index until the first committed; answer with that one.
        if ordered and (twin := _existing(session, model_id=model_id, seq_id=item.seq_id)) is not None:
            return twin
        raise
    touch_model(session, model_id=model_id)
    session.flush()
    return future


def submit_forward_backward(
    session: Session, *, tenant_id: str, body: bytes, settings: Settings
) -> TinkerFuture:
    """Queue a forward/forward_backward; it may carry a pool round's tokens at most
    (`Settings.tinker_max_tokens_per_round`).

    The model (and an earlier request with the same seq_id) is found from the message's top level
    before any of its data is decoded, so another tenant's or an unknown model costs a skim of the
    body; the decode is bounded in fields (`proto.MAX_FIELDS`) and leaves tokens and tensors as views
    of the body, whose lengths are checked before any becomes a Python list."""
    try:
        model_id, seq_id = proto.forward_backward_target(body)
    except proto.ProtoError as exc:
        raise _malformed(exc) from exc
    # The same checks as a JSON body's (a 1 KiB model_id came back whole in its 404).
    target = parse_request(OrderedRequest, {"model_id": model_id, "seq_id": seq_id}, call="forward_backward")
    run, existing = _in_order(session, tenant_id=tenant_id, body=target)
    if existing is not None:
        return existing
    try:
        req = proto.decode_forward_backward_request(body)
    except proto.ProtoError as exc:
        raise _malformed(exc) from exc
    if req.loss_fn not in LOSS_FNS:
        raise NotSupported(f"loss_fn {req.loss_fn!r} (supported: {', '.join(LOSS_FNS)})")
    if not req.data:
        raise ValidationFailed(
            "forward_backward needs at least one datum",
            details=[body_problem(("data",), "needs at least one datum", "too_short")],
        )
    _check_request_size(req.data, max_tokens=settings.tinker_max_tokens_per_round)
    max_len, pool = _datum_bound(session, run)
    _check_lengths(req.data, max_len=max_len, pool=pool)
    numbers = _loss_fn_config(req.loss_fn, req.loss_fn_config)
    data = [_datum(i, d, req.loss_fn) for i, d in enumerate(req.data)]
    _check_vocabulary(pool, data)
    item = ManualWorkItem(
        request_id=new_id("req"),
        run_id=run.id,
        seq_id=seq_id,
        kind="forward" if req.forward_only else "forward_backward",
        loss_fn=req.loss_fn,  # checked against LOSS_FNS above
        loss_fn_config=numbers,
        data=data,
    )
    return _submit(session, tenant_id=tenant_id, model_id=model_id, run=run, item=item, settings=settings)


def _malformed(exc: proto.ProtoError) -> ValidationFailed:
    """The 422 of a body that is not a ForwardBackwardRequest: the body as a whole is at fault (as a
    malformed run create body's, `type` named after its format as pydantic's `json_invalid`)."""
    return ValidationFailed(
        f"malformed ForwardBackwardRequest: {exc}", details=[problem(("body",), str(exc), "protobuf_invalid")]
    )


def _loss_fn_config(loss_fn: str, config: dict[str, float | str]) -> dict[str, float]:
    """The request's loss_fn_config, as the loss reads it: numbers only, finite, keys the loss
    reads (`LOSS_FN_CONFIG_KEYS`: any other is refused by name, not ignored: a misspelt bound
    trained with the default), and clip bounds that make an interval around 1 (`ClipThresholds`)."""
    numbers = {k: v for k, v in config.items() if isinstance(v, float)}
    if len(numbers) != len(config):
        raise NotSupported("text values in loss_fn_config")
    if len(numbers) > MAX_LOSS_FN_CONFIG_KEYS:
        most = f"at most {MAX_LOSS_FN_CONFIG_KEYS} keys"
        raise ValidationFailed(
            f"loss_fn_config has {len(numbers)} keys; {most}",
            details=[body_problem(("loss_fn_config",), f"{len(numbers)} keys; {most}", "too_long")],
        )
    if not all(np.isfinite(list(numbers.values()))):
        raise ValidationFailed(
            "loss_fn_config values must be finite (no NaN or infinity)",
            details=[
                body_problem(("loss_fn_config", shown(key)), FINITE, "finite_number")
                for key, value in numbers.items()
                if not math.isfinite(value)
            ],
        )
    known = LOSS_FN_CONFIG_KEYS[loss_fn]
    unknown = [key for key in numbers if key not in known]
    if unknown:
        reads = f"it reads {', '.join(known)}" if known else "it reads none"
        not_read = f"not a key {loss_fn} reads ({reads})"
        raise invalid(
            "loss_fn_config",
            [body_problem(("loss_fn_config", shown(key)), not_read, "extra_forbidden") for key in unknown],
        )
    if known:
        try:
            ClipThresholds.model_validate(numbers)
        except ValidationError as exc:
            raise invalid(
                "loss_fn_config",
                validation_problems(exc, prefix=(*BODY_LOC, "loss_fn_config")),
                note=" (the clip bounds: 0 <= clip_low_threshold <= 1 <= clip_high_threshold)",
            ) from exc
    return numbers


def _in_order(session: Session, *, tenant_id: str, body: OrderedRequest) -> tuple[Run, TinkerFuture | None]:
    """(the model's run, the future an earlier request with the request's seq_id made)."""
    _, run = get_model(session, tenant_id=tenant_id, model_id=body.model_id)
    return run, _existing(session, model_id=body.model_id, seq_id=body.seq_id)


_T = TypeVar("_T")


def _needed(value: _T | None, field: str, *, when: str) -> _T:
    """`value`, a field load_weights needs `when` it is given another (a 422 naming it if absent)."""
    if value is None:
        raise invalid("load_weights request", [body_problem((field,), f"needed {when}", "missing")])
    return value


def _save_name(path: str | None, default: str) -> str:
    """The name weights are saved under: the request's `path`, or `default` when it sends none (an
    empty name is refused, not taken as none)."""
    name = default if path is None else path
    if not SAVE_NAME_RE.fullmatch(name):
        problem = (
            f"the weights' name must be 1-{MAX_SAVE_NAME_CHARS} of [A-Za-z0-9._-], not starting with a dot"
        )
        raise invalid("name", [body_problem(("path",), problem)])
    return name


def submit_optim_step(
    session: Session, *, tenant_id: str, body: dict[str, Any], settings: Settings
) -> TinkerFuture:
    request = parse_request(OptimStepRequest, body, call="optim_step")
    model_id, seq_id = request.model_id, request.seq_id
    run, existing = _in_order(session, tenant_id=tenant_id, body=request)
    if existing is not None:
        return existing
    params = request.adam_params
    if not isinstance(params, dict):
        raise NotSupported("optimizers other than Adam (send adam_params)")
    # Before the bounds: a NaN fails them too, but as "should be less than or equal to 1".
    require_finite(params, loc=(*BODY_LOC, "adam_params"))
    defaults = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0}
    try:
        adam = AdamStep.model_validate({"grad_clip_norm": 0.0, **defaults, **params})
    except ValidationError as exc:
        raise invalid("adam_params", validation_problems(exc, prefix=(*BODY_LOC, "adam_params"))) from exc
    item = ManualWorkItem(
        request_id=new_id("req"), run_id=run.id, seq_id=seq_id, kind="optim_step", adam=adam
    )
    return _submit(session, tenant_id=tenant_id, model_id=model_id, run=run, item=item, settings=settings)


def submit_save_for_sampler(
    session: Session, *, tenant_id: str, body: dict[str, Any], settings: Settings
) -> TinkerFuture:
    request = parse_request(SaveWeightsForSamplerRequest, body, call="save_weights_for_sampler")
    model_id, seq_id = request.model_id, request.seq_id
    run, existing = _in_order(session, tenant_id=tenant_id, body=request)
    if existing is not None:
        return existing
    if request.kind != "snapshot":
        raise NotSupported(f"save_weights_for_sampler kind {request.kind!r}")
    name = _save_name(request.path, checkpoints.DEFAULT_SAVE_NAME["save_weights_for_sampler"])
    # Before the quota: a save to a model whose run left is refused for that, not for want of room
    # that deleting a checkpoint would not make usable.
    require_active(run, model_id=model_id)
    checkpoints.check_sampler_quota(
        session,
        tenant_id=tenant_id,
        path=sampler_path(model_id, name),
        most=settings.tinker_max_sampler_checkpoints_per_tenant,
    )
    item = ManualWorkItem(
        request_id=new_id("req"), run_id=run.id, seq_id=seq_id, kind="save_weights_for_sampler", name=name
    )
    return _submit(session, tenant_id=tenant_id, model_id=model_id, run=run, item=item, settings=settings)


def submit_save_weights(
    session: Session, *, tenant_id: str, body: dict[str, Any], settings: Settings
) -> TinkerFuture:
    """save_state: the adapter and optimizer state, by name, at this point of the request order."""
    request = parse_request(SaveWeightsRequest, body, call="save_weights")
    model_id, seq_id = request.model_id, request.seq_id
    run, existing = _in_order(session, tenant_id=tenant_id, body=request)
    if existing is not None:
        return existing
    name = _save_name(request.path, checkpoints.DEFAULT_SAVE_NAME["save_weights"])
    require_active(run, model_id=model_id)  # before the quota, as in `submit_save_for_sampler`
    checkpoints.check_save_quota(
        session,
        tenant_id=tenant_id,
        path=weights_path(model_id, name),
        most=settings.tinker_max_saves_per_tenant,
    )
    item = ManualWorkItem(
        request_id=new_id("req"), run_id=run.id, seq_id=seq_id, kind="save_weights", name=name
    )
    return _submit(session, tenant_id=tenant_id, model_id=model_id, run=run, item=item, settings=settings)


def weights_path(model_id: str, name: str) -> str:
    return f"tinker://{model_id}/weights/{name}"


def _saved_state(session: Session, *, tenant_id: str, path: str) -> tuple[Run, str]:
    """`tinker://{model_id}/weights/{name}` (load_weights' `path`), a live training checkpoint of the
    tenant (`checkpoints.live_saves`) → (its run, the name)."""
    _, run, _ = checkpoints.live_saves(
        session, tenant_id=tenant_id, path=path, kind="save_weights", loc=(*BODY_LOC, "path")
    )
    return run, path.rsplit("/", 1)[1]


def _lora_mismatch(mine: dict[str, Any], saved: dict[str, Any]) -> ValidationFailed:
    """The 422 of saved weights (`path`) whose LoRA shape is not the model's: one item per field."""
    fields = sorted(k for k in mine.keys() | saved.keys() if mine.get(k) != saved.get(k))
    return ValidationFailed(
        "the saved weights have another LoRA shape (rank, alpha, target modules)",
        details=[
            body_problem(
                ("path",),
                f"lora.{field}: the saved weights have {saved.get(field)!r}, the model {mine.get(field)!r}",
                "lora_mismatch",
            )
            for field in fields
        ],
    )


def submit_load_weights(
    session: Session, *, tenant_id: str, api_key_id: str, body: dict[str, Any], settings: Settings
) -> TinkerFuture:
    """Load saved weights (and optimizer state) into a new model (the SDK's create-from-state:
    session_id + model_seq_id, same LoRA as the source) or into an existing one (model_id + seq_id)."""
    request = parse_request(LoadWeightsRequest, body, call="load_weights")
    source, name = _saved_state(session, tenant_id=tenant_id, path=request.path)
    if request.session_id is not None:
        owner = get_session(session, tenant_id=tenant_id, session_id=request.session_id)
        model_seq_id = _needed(request.model_seq_id, "model_seq_id", when="with session_id")
        user_metadata = request.user_metadata
        model_id = f"{owner.id}:train:{model_seq_id}"
        if session.get(TinkerModel, model_id) is not None:
            existing = _existing(session, model_id=model_id, seq_id=0)
            if existing is not None:
                return existing
            raise ValidationFailed(
                f"model {model_id} exists already",
                details=[
                    body_problem(("model_seq_id",), f"model {model_id} exists already", "already_exists")
                ],
            )
        config = RunConfig.model_validate(source.config)
        try:
            with session.begin_nested():  # a savepoint: a concurrent twin's load wins, not a 500
                _, run = new_model_run(
                    session,
                    tenant_id=tenant_id,
                    api_key_id=api_key_id,
                    owner=owner,
                    model_seq_id=model_seq_id,
                    config=config,
                    user_metadata=user_metadata,
                    settings=settings,
                )
        except IntegrityError:
            if (twin := _existing(session, model_id=model_id, seq_id=0)) is not None:
                return twin
            raise
        seq_id = 0
    else:
        model_id = _needed(request.model_id, "model_id", when="without session_id")
        _, run = get_model(session, tenant_id=tenant_id, model_id=model_id)
        seq_id = _needed(request.seq_id, "seq_id", when="with model_id")
        existing = _existing(session, model_id=model_id, seq_id=seq_id)
        if existing is not None:
            return existing
        if run.config["lora"] != source.config["lora"]:
            raise _lora_mismatch(run.config["lora"], source.config["lora"])
    item = ManualWorkItem(
        request_id=new_id("req"),
        run_id=run.id,
        seq_id=seq_id,
        kind="load_weights",
        name=name,
        source_run_id=source.id,
        with_optimizer=request.optimizer,
    )
    return _submit(session, tenant_id=tenant_id, model_id=model_id, run=run, item=item, settings=settings)


def sampler_path(model_id: str, name: str) -> str:
    return f"tinker://{model_id}/sampler_weights/{name}"


def resolve_sampler_path(
    session: Session, *, tenant_id: str, path: str, loc: Sequence[str] = ("query", "path")
) -> tuple[str, int]:
    """`tinker://{model_id}/sampler_weights/{name}`, a live sampler checkpoint of the tenant
    (`checkpoints.live_saves`) → (run id, the adapter step its newest save named). Every sample of a
    sampling client resolves its path again (app.tinker.sampling): the query reads this path's
    saves only, not the model's every step. `loc`: where the request carried the path (the default:
    GET /api/v1/loraloom/resolve's query parameter)."""
    _, run, saves = checkpoints.live_saves(
        session, tenant_id=tenant_id, path=path, kind="save_weights_for_sampler", loc=loc
    )
    return run.id, int((saves[0].result or {})["loraloom_step"])


# --- the pool's side ----------------------------------------------------------------------------


BOUNDARY_KINDS = ("optim_step", "load_weights")
"""A run's claim ends at the first of these: the pool runs the passes before it, then it."""


def _to_replay(pool_id: str) -> ColumnElement[bool]:
    """Done work whose effect another pool held in memory (and lost, or it would still hold the
    run): the claiming pool rebuilds it from the kept request."""
    return and_(
        TinkerFuture.status == "complete",
        TinkerFuture.kind.in_(REPLAYED_KINDS),
        not_(request_cleared()),
        or_(TinkerFuture.pool_id.is_(None), TinkerFuture.pool_id != pool_id),
    )


def _served_at() -> ColumnElement[datetime]:
    """When a claim last took the future's run's work (`TinkerModel.served_at`), or, never served,
    when its model was created: a model created after another's last service is dealt after it, so
    that a tenant creating models cannot put a never-served one ahead of everyone forever."""
    return (
        select(func.max(func.coalesce(TinkerModel.served_at, TinkerModel.created_at)))
        .where(TinkerModel.run_id == TinkerFuture.run_id)
        .scalar_subquery()
    )


def _deal_order(
    served_at: ColumnElement[datetime],
    waiting_since: ColumnElement[datetime],
    run_id: ColumnElement[str | None],
) -> tuple[ColumnElement[Any], ...]:
    """Runs' order within a turn: served longest ago first (`_served_at`), then waiting longest.

    Served-longest-ago first bounds a run's wait by the number of runs: a round is cut at a token
    budget (`within_tokens`), so ordering by age alone let the tenant whose queue is oldest fill
    round after round with budget-sized requests while a later tenant's one request waited for all
    of them (up to 1,024 rounds). Waiting longest breaks ties (a tie broken by run id would leave
    the same runs out of every claim past ``max_items``). A run without a model (None) first, as a
    portable NULLS FIRST: SQLite and Postgres sort NULL at opposite ends."""
    return (served_at.is_not(None), served_at, waiting_since, run_id)


STATEMENTS_CACHED = 256
"""Built claim statements kept per process (`claim_query` and the sampling module's): one per pool
and base model (the number of items is a parameter given at execution), so a handful; the bound only
caps what re-registered pools leave behind."""

MAX_ITEMS = "max_items"
"""The bound parameter of a cached claim statement's LIMIT, given at execution:
``session.execute(claim_query(pool, base), {MAX_ITEMS: n})`` (64 when not given)."""


@functools.lru_cache(maxsize=STATEMENTS_CACHED)
def claim_query(pool_id: str, base_model: str) -> Select[TinkerFuture, int]:
    """The futures `claim` takes, locked, read through the partial index `app.tinker.models.CLAIMABLE`,
    each with its position in the deal (1 first), in lock order (run, seq_id); at most the `MAX_ITEMS`
    parameter; their requests and results deferred (`claim` reads only the requests it keeps:
    `kept_requests`).

    Built once per arguments and kept (`STATEMENTS_CACHED`): every pool runs it every poll interval,
    work or not, and building it cost ~1.5 ms of CPU, more than Postgres takes to run it on an idle
    queue (bench/tinker_claim_loads.py --runs 0). A statement is immutable, so threads share it;
    execute it as it is, never derive one from it (`.where()`, `.options()`, `.params()`): a derived
    copy may carry the cached one's memoized cache key.

    Fair across runs: each run's claimable futures up to and including its first step boundary,
    dealt round-robin (every run's first, then every run's second, ...) into the ``max_items``;
    within a turn, the run served longest ago first (`_deal_order`). A plain ``ORDER BY run_id,
    seq_id LIMIT`` let a run whose id sorts first and that keeps many requests queued fill every
    claim, rows past its boundary included, while another tenant's one request waited (review of
    2026-11-23, H2). Window functions cannot share a query level with ``FOR UPDATE``, so the pick
    is a subquery and the lock is taken by id."""
    claimable_now = (
        or_(TinkerFuture.status == PENDING, _to_replay(pool_id)),
        # Implied by the line above; said literally so that every plan can use the partial index.
        text(f"({claimable(TinkerFuture.__tablename__)})"),
        Run.status == RunStatus.ACTIVE,
        Run.base_model == base_model,
    )
    is_boundary = case((TinkerFuture.kind.in_(BOUNDARY_KINDS), 1), else_=0)
    # A run's samples (no seq_id) after its numbered work on both backends: Postgres sorts NULL
    # last, SQLite first.
    in_run_order = (TinkerFuture.seq_id.is_(None), TinkerFuture.seq_id)
    ranked = (
        select(
            TinkerFuture.id,
            TinkerFuture.run_id,
            func.row_number().over(partition_by=TinkerFuture.run_id, order_by=in_run_order).label("turn"),
            _served_at().label("served_at"),
            func.min(TinkerFuture.created_at).over(partition_by=TinkerFuture.run_id).label("waiting_since"),
            # Boundaries before this future in its run: only those with none are this claim's.
            func.coalesce(
                func.sum(is_boundary).over(
                    partition_by=TinkerFuture.run_id, order_by=in_run_order, rows=(None, -1)
                ),
                0,
            ).label("boundaries_before"),
        )
        .join(Run, Run.id == TinkerFuture.run_id)
        .where(*claimable_now)
        .subquery()
    )
    deal = (ranked.c.turn, *_deal_order(ranked.c.served_at, ranked.c.waiting_since, ranked.c.run_id))
    picked = (
        select(ranked.c.id, func.row_number().over(order_by=deal).label("position"))
        .where(ranked.c.boundaries_before == 0)
        .order_by(*deal)
        .limit(bindparam(MAX_ITEMS, 64))
        .subquery()
    )
    return (
        select(TinkerFuture, picked.c.position)
        .join(picked, picked.c.id == TinkerFuture.id)
        .join(Run, Run.id == TinkerFuture.run_id)
        .where(*claimable_now)
        .order_by(TinkerFuture.run_id, TinkerFuture.seq_id)
        .with_for_update(of=TinkerFuture, skip_locked=True)
        # A size is read only by a submission (`check_pending_room`), never by a claim.
        .options(defer(TinkerFuture.request), defer(TinkerFuture.result), defer(TinkerFuture.request_bytes))
    )


def claim(session: Session, *, pool_id: str, max_items: int, max_tokens: int) -> list[ManualWorkItem]:
    """The work of the pool's active runs, per run in seq_id order up to and including its next
    optim_step or load_weights: pending work, marked running and held by this pool, and done work
    to replay (`_to_replay`), marked `replay`. At most `max_items`, and work of at most `max_tokens`
    tokens (`within_tokens`); what is left waits for the next claim."""
    pool = get_alive_pool(session, pool_id=pool_id)
    # The deal reads each row's stored token count; only the requests it keeps are read
    # (`kept_requests`): the rows past the budget stay queued and are fetched again by every claim,
    # so their (up to megabytes of) data is left in the database.
    rows = session.execute(claim_query(pool_id, pool.base_model), {MAX_ITEMS: max_items}).tuples().all()
    kept = within_tokens(rows, max_tokens)
    requests = kept_requests(session, kept)
    taken: list[ManualWorkItem] = []
    running: list[str] = []
    # No row past a run's step boundary: `claim_query` leaves them out.
    for future in kept:
        if (request := requests.get(future.id)) is None:
            continue
        replay = future.status != PENDING
        if not replay:
            running.append(future.id)
        taken.append(ManualWorkItem.model_validate({**request, "replay": replay}))
    mark_running(session, future_ids=running, pool_id=pool_id)
    if taken:
        session.execute(
            update(TinkerModel)
            .where(TinkerModel.run_id.in_({item.run_id for item in taken}))
            .values(served_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    return taken


def kept_requests(session: Session, futures: Sequence[TinkerFuture]) -> dict[str, dict[str, Any]]:
    """The stored requests of `futures` (loaded with their request deferred) by future id, in one
    query; a cleared request (None) is left out."""
    if not futures:
        return {}
    rows = session.execute(
        select(TinkerFuture.id, TinkerFuture.request).where(TinkerFuture.id.in_([f.id for f in futures]))
    )
    return {future_id: request for future_id, request in rows if request is not None}


def mark_running(session: Session, *, future_ids: list[str], pool_id: str) -> None:
    """The claimed futures are running, held by `pool_id` (its lease: app.tinker.leases), in one
    UPDATE: setting them one by one on the loaded rows flushed one UPDATE per future."""
    if future_ids:
        session.execute(
            update(TinkerFuture)
            .where(TinkerFuture.id.in_(future_ids))
            .values(status=RUNNING, pool_id=pool_id)
            .execution_options(synchronize_session="evaluate")
        )


def sample_tokens(num_samples: int, prompt_len: int, max_tokens: int) -> int:
    """The tokens a sample request costs a round: each sequence its prompt and up to max_tokens."""
    return num_samples * (prompt_len + max_tokens)


def work_tokens(item: ManualWorkItem) -> int:
    """What a request costs a pool's round, stored with it (`TinkerFuture.tokens`): its data's
    tokens, or a sample's sequences' (`sample_tokens`); 0 for a step, a save or a load."""
    if item.sampling is not None:
        spec = item.sampling
        return sample_tokens(spec.num_samples, len(spec.prompt), spec.max_tokens)
    return sum(len(datum.tokens) for datum in item.data)


DATA_KINDS = ("forward", "forward_backward", "sample")
"""Kinds whose requests always cost tokens (a datum or a prompt has at least one)."""


def _round_tokens(future: TinkerFuture) -> int:
    """`future.tokens`, or, for a request that has data but counts 0, the count of its request: a
    process still running the code from before migration 0012 writes rows without the column (its
    default 0), which the cut would take as free. Rare and only until every process is upgraded, so
    the lazy load of its request is acceptable."""
    if future.tokens or future.kind not in DATA_KINDS or future.request is None:
        return future.tokens
    return work_tokens(ManualWorkItem.model_validate(future.request))


def within_tokens(
    rows: Sequence[tuple[TinkerFuture, int]],
    max_tokens: int,
    *,
    turn_of: Callable[[TinkerFuture], str | None] = lambda future: future.run_id,
) -> list[TinkerFuture]:
    """The claim's rows (each with its position in the deal) cut to `max_tokens` tokens of work, in
    the rows' own order.

    The rows are dealt in the order `claim_query` picked them (every run's first, then every run's
    second, in each turn the runs in `_deal_order`); a request that would pass the budget is left, and
    with it the rest of its run (`turn_of`: whose turns the deal gives, the run, or the tenant for
    base-model samples), while the deal goes on with the others (so a small request of
    another tenant still fits beside a large one). The first request is always taken (one request
    fits a round: `_check_request_size`). Each run's taken requests are a prefix of its own, so the
    rest, replays included, is the next claim's, as with `max_items`. Without it a claim took
    everything queued up to each run's step boundary: one tenant's long queue made a round, and
    every other tenant's request in it, last as long as all of that queue's work."""
    kept: set[int] = set()
    left: set[str | None] = set()
    tokens = 0
    for future, _ in sorted(rows, key=lambda row: row[1]):
        if turn_of(future) in left:
            continue
        cost = _round_tokens(future)
        if kept and tokens + cost > max_tokens:
            left.add(turn_of(future))
            continue
        kept.add(id(future))
        tokens += cost
    # The rows' order, not a sort: a sample has no seq_id (None beside its run's numbered work).
    return [f for f, _ in rows if id(f) in kept]


def _result_json(future: TinkerFuture, result: ManualResult) -> dict[str, Any]:
    if future.kind == "optim_step":
        return {"metrics": result.metrics}
    if future.kind == "sample":
        sequences = [seq.model_dump(mode="json") for seq in result.sequences or []]
        return {"sequences": sequences, "prompt_logprobs": result.prompt_logprobs}
    if future.kind == "save_weights":
        name = str((future.request or {}).get("name") or checkpoints.DEFAULT_SAVE_NAME[future.kind])
        return {"path": weights_path(str(future.model_id), name), "type": "save_weights"}
    if future.kind == "load_weights":
        return {"model_id": future.model_id, "type": "load_weights"}
    if future.kind == "save_weights_for_sampler":
        name = str((future.request or {}).get("name") or checkpoints.DEFAULT_SAVE_NAME[future.kind])
        return {
            "path": sampler_path(str(future.model_id), name),
            "type": "save_weights_for_sampler",
            # Ours, not the SDK's: which adapter the path names (left out of the SDK's answer).
            "loraloom_step": int(result.metrics.get("step", 0)),
        }
    return {
        "logprobs": result.logprobs or [],
        "elementwise_loss": result.elementwise_loss or [],
        "metrics": result.metrics,
    }


def _step_checkpointed(session: Session, *, step: TinkerFuture) -> None:
    """The run's optim_step `step` is applied and checkpointed (or dropped the gradients): the
    requests of the work before it are no longer needed to rebuild anything."""
    session.execute(
        update(TinkerFuture)
        .where(
            TinkerFuture.run_id == step.run_id,
            TinkerFuture.status == "complete",
            TinkerFuture.kind.in_(REPLAYED_KINDS),
            TinkerFuture.seq_id < step.seq_id,
        )
        .values(request=null())
        .execution_options(synchronize_session=False)
    )


def _supersede_older_saves(session: Session, *, save: TinkerFuture, path: str) -> None:
    """`save` completed: the older completed saves of its path are no longer its newest
    (`TinkerFuture.superseded_at`), so the quotas on saves read one row per path, not one per save
    (app.tinker.checkpoints `kept_query`). Found through the same partial index, among the tenant's
    newest saves of that kind; a deleted checkpoint's saves too (a save under its name makes it live
    again). Only saves of a lower request number: one recorded out of order leaves the newer
    current beside it, and the reads take the highest (the UPDATE flushes the session first, so a
    save completed earlier in the same post is seen)."""
    table = TinkerFuture.__tablename__
    session.execute(
        update(TinkerFuture)
        .where(
            TinkerFuture.tenant_id == save.tenant_id,
            TinkerFuture.kind == save.kind,
            text(f"({current_saves(table)})"),
            TinkerFuture.model_id == save.model_id,
            checkpoints.saved_path() == path,
            # Older by the model's request number, as a path's reads pick its save: one recorded out
            # of order leaves the newer current (the reads take the highest of those left).
            TinkerFuture.seq_id < save.seq_id,
        )
        .values(superseded_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def non_finite_field(result: ManualResult) -> str | None:
    """The first field of the pool's result that holds a non-finite number, named; None if none.
    The pool fails such work itself (trainer_core.manual), so this guards the service's storage and
    answers against a pool that does not: the body's JSON may carry NaN and Infinity literals
    (app.tinker.finite), which the float fields of `ManualResult` take."""
    for name, rows in (("logprobs", result.logprobs), ("elementwise_loss", result.elementwise_loss)):
        for i, row in enumerate(rows or ()):
            if not all_finite(row):
                return f"{name} of datum {i}"
    for i, sequence in enumerate(result.sequences or ()):
        if not all_finite(sequence.logprobs):
            return f"the logprobs of sequence {i}"
    if result.prompt_logprobs is not None and not all_finite(
        [v for v in result.prompt_logprobs if v is not None]
    ):
        return "prompt_logprobs"
    return next((f"metrics[{key!r}]" for key, v in result.metrics.items() if not math.isfinite(v)), None)


def record_results(session: Session, *, pool_id: str, results: list[ManualResult]) -> int:
    """Complete (or fail) the futures this pool holds; returns how many were recorded. A result for
    a future the pool no longer holds (failed because its run left; returned to pending because the
    pool was declared dead, then claimed by another) is ignored: a result is recorded once. A result
    holding a non-finite number fails its future alone, nothing of it kept (`non_finite_field`)."""
    get_alive_pool(session, pool_id=pool_id)
    recorded = 0
    for result in results:
        future = session.get(TinkerFuture, result.request_id, with_for_update=True)
        if future is None:
            continue
        if result.replayed:
            if future.status == "complete":
                future.pool_id = pool_id  # its effect is in this pool's memory now
            continue
        if future.status != RUNNING or future.pool_id != pool_id:
            continue
        if result.release:
            future.status, future.pool_id = PENDING, None
            continue
        if result.error is not None:
            future.status, future.error, future.error_category = "failed", result.error, "user"
        elif (field := non_finite_field(result)) is not None:
            # Not kept: Postgres refuses it (the whole post a 422), and SQLite stores it for a JSON
            # answer that cannot be written (every poll a 500, which the SDK retries at once).
            future.status, future.error, future.error_category = (
                "failed",
                f"the pool's result holds a non-finite number (NaN or infinity) in {field}; it is not kept",
                "server",
            )
        else:
            future.status, future.result = "complete", _result_json(future, result)
            if future.kind in SAVE_KINDS and (path := future.saved_path()) is not None:
                _supersede_older_saves(session, save=future, path=path)
        if future.status == "failed" or future.kind not in REPLAYED_KINDS:
            future.request = None
        if future.kind == "optim_step":
            _step_checkpointed(session, step=future)
        future.completed_at = utcnow()
        recorded += 1
    return recorded


def fail_if_run_left(session: Session, *, future: TinkerFuture) -> None:
    """A pending or running future whose run has left fails now, with the reason (the sweeper
    fails the others: app.tinker.leases.fail_work_of_left_runs)."""
    if future.status in (PENDING, RUNNING) and future.run_id is not None:
        leases.fail_if_run_left(future, session.get(Run, future.run_id), now=utcnow())


def forward_backward_proto(result: dict[str, Any]) -> bytes:
    """The stored result of a forward / forward_backward as the SDK's ForwardBackwardOutput (a
    field is sent only when it has one array per datum)."""
    logprobs = [np.asarray(x, dtype=np.float32) for x in result.get("logprobs", [])]
    outputs = {"logprobs": logprobs}
    losses = [np.asarray(x, dtype=np.float32) for x in result.get("elementwise_loss", [])]
    if len(losses) == len(logprobs):
        outputs["elementwise_loss"] = losses
    return proto.encode_forward_backward_output(
        outputs=outputs,
        num_datums=len(logprobs),
        metrics={str(k): float(v) for k, v in result.get("metrics", {}).items()},
    )
