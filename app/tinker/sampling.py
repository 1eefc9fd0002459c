"""Tinker sampling clients and `sample` requests (the pool decodes them: trainer_core.sample_server).

A sampling client samples one of

- **sampler weights of the tenant's own model** (`model_path` `tinker://{model}/sampler_weights/{name}`):
  a stored `TinkerSamplingSession` names the run and the step the weights were saved at; the pool
  samples the run's live adapter while it is still at that step, and the copy it kept at
  `save_weights_for_sampler` once the run has trained on;
- **the base model** (`base_model`, no adapter): nothing to store or to keep private (every tenant may
  sample a base model a live pool serves), so its sampling session id is the base model's name,
  encoded (`smpbase_…`), and its `sample` futures carry no run: `model_id` is a fixed-length key of
  the base model, by which the base model's pool claims them.
"""

import base64
import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import ColumnElement, Select, bindparam, func, select
from sqlalchemy.orm import Session, defer

from app.config import Settings
from app.db import conflict_insert, utcnow
from app.errors import NotFound, ValidationFailed
from app.pools.service import get_alive_pool
from app.runs.admission import live_pool
from app.runs.models import Run
from app.runs.schemas import validation_problems
from app.tinker import proto
from app.tinker.finite import require_finite
from app.tinker.models import TinkerBaseTurn, TinkerFuture, TinkerModel, TinkerSamplingSession
from app.tinker.schemas import (
    BASE_MODEL_PATTERN,
    BASE_SAMPLER_PREFIX,
    BODY_LOC,
    MAX_BASE_MODEL_CHARS,
    MAX_SAMPLER_ID_CHARS,
    CreateSamplingSessionRequest,
    SampleRequest,
    body_problem,
    invalid,
    parse_request,
    shown,
)
from app.tinker.service import NotSupported, get_session, touch_model
from app.tinker.work import (
    MAX_ITEMS,
    PENDING,
    STATEMENTS_CACHED,
    RunNotActive,
    check_pending_room,
    kept_requests,
    mark_running,
    request_json_bytes,
    resolve_sampler_path,
    sample_tokens,
    within_tokens,
)
from contracts.ids import new_id
from contracts.status import MOVABLE_RUN_STATUSES
from contracts.tinker_work import ManualWorkItem, SamplingSpec

DEFAULT_MAX_TOKENS = 64
UNSUPPORTED_OPTIONS = (
    "topk_prompt_logprobs",
    "topk_sample_logprobs",
    "target_prompt_logprobs",
    "prompt_alt_tokens_k",
    "record_stability_info",
)


@dataclass(frozen=True)
class Sampler:
    """A sampling client's weights: a run at a step, or the base model (`run_id` None)."""

    id: str
    base_model: str
    model_path: str | None
    run_id: str | None = None
    step: int | None = None


def base_sampler_id(base_model: str) -> str:
    return BASE_SAMPLER_PREFIX + base64.urlsafe_b64encode(base_model.encode()).decode().rstrip("=")


_BASE_MODEL_NAME = re.compile(BASE_MODEL_PATTERN)


def _base_model_of(sampler_id: str) -> str | None:
    """The base model a base sampler id names; None for any other id, and for one that is not
    `base_sampler_id` of a name a base model may have (`smpbase_AAAA`, three NUL characters, went to
    Postgres as a pool's name: a vague 422, hostile probe h1, finding 7). Such an id is then looked
    up as a stored sampling session, and not found (404)."""
    if not sampler_id.startswith(BASE_SAMPLER_PREFIX) or len(sampler_id) > MAX_SAMPLER_ID_CHARS:
        return None  # bounded before it is decoded
    encoded = sampler_id.removeprefix(BASE_SAMPLER_PREFIX)
    try:
        name = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except ValueError:  # binascii.Error (not base64), UnicodeDecodeError (not UTF-8)
        return None
    if len(name) > MAX_BASE_MODEL_CHARS or not _BASE_MODEL_NAME.fullmatch(name):
        return None
    # The one spelling base_sampler_id gives: urlsafe_b64decode skips characters outside its
    # alphabet, and a last character's spare bits are free, so other ids decode to the same name.
    return name if base_sampler_id(name) == sampler_id else None


def base_model_key(base_model: str) -> str:
    """The `model_id` of the base model's sample futures (any base model name fits the column)."""
    return "base:" + hashlib.sha256(base_model.encode()).hexdigest()[:40]


def create_sampling_session(session: Session, *, tenant_id: str, body: dict[str, Any]) -> Sampler:
    """A sampling client for `tinker://` sampler weights of the tenant's own model, or for the
    base model of a live pool, in the caller's own session (`session_id`, which the SDK always
    sends): another tenant's session, or a missing one, is the 404 of every Tinker route (`get_session`).
    It was ignored, so any id was taken. Checked after what to sample (whose 404s and 422s say
    what is wrong with it) and before anything is stored."""
    request = parse_request(CreateSamplingSessionRequest, body, call="create_sampling_session")
    path, base_model = request.model_path, request.base_model
    if path is not None:
        run_id, step = resolve_sampler_path(
            session, tenant_id=tenant_id, path=path, loc=(*BODY_LOC, "model_path")
        )
        _check_own_session(session, tenant_id=tenant_id, session_id=request.session_id)
        # A session samples nothing but (run, step, path), so one row serves every client of the
        # same weights: a new row per call let a tenant add rows without bound (hostile probe,
        # finding 11). Rows are bounded by the sampler saves, and purged once their run has left
        # (`app.tinker.service.purge_finished_sessions`).
        row = session.scalar(
            select(TinkerSamplingSession)
            .where(
                TinkerSamplingSession.run_id == run_id,
                TinkerSamplingSession.tenant_id == tenant_id,
                TinkerSamplingSession.step == step,
                TinkerSamplingSession.model_path == path,
            )
            .order_by(TinkerSamplingSession.created_at, TinkerSamplingSession.id)
            .limit(1)
        )
        if row is None:
            row = TinkerSamplingSession(
                id=new_id("smp"), tenant_id=tenant_id, run_id=run_id, step=step, model_path=path
            )
            session.add(row)
            session.flush()
        run = session.get(Run, run_id)
        assert run is not None  # resolve_sampler_path found it
        return Sampler(row.id, run.base_model, path, run_id, step)
    if base_model is not None:
        if live_pool(session, base_model=base_model) is None:
            raise NotFound(f"no pool serves the base model {base_model!r}", code="pool_not_found")
        _check_own_session(session, tenant_id=tenant_id, session_id=request.session_id)
        return Sampler(base_sampler_id(base_model), base_model, None)
    needed = "one of model_path (a tinker:// sampler path) or base_model is needed"
    raise ValidationFailed(
        "create_sampling_session needs model_path (a tinker:// sampler path) or base_model",
        details=[body_problem((field,), needed, "missing") for field in ("model_path", "base_model")],
    )


def _check_own_session(session: Session, *, tenant_id: str, session_id: str | None) -> None:
    """The 404 of a `session_id` that is not one of the tenant's sessions. A body without one
    (a hand-made request; the SDK always sends it) is still taken: a sampler belongs to the tenant
    and its weights, never to a session."""
    if session_id is not None:
        get_session(session, tenant_id=tenant_id, session_id=session_id)


def get_sampling_session(session: Session, *, tenant_id: str, sampler_id: str) -> Sampler:
    """The tenant's sampling session (or a base model's); another tenant's is not found."""
    base_model = _base_model_of(sampler_id)
    if base_model is not None and live_pool(session, base_model=base_model) is not None:
        return Sampler(sampler_id, base_model, None)
    row = session.get(TinkerSamplingSession, sampler_id)
    run = None if row is None else session.get(Run, row.run_id)
    if row is None or run is None or row.tenant_id != tenant_id:
        raise NotFound(f"sampling session {shown(sampler_id)} not found")
    if row.model_path is not None:
        # Deleting the saved weights retires the samplers made from them (app.tinker.checkpoints).
        try:
            _, step = resolve_sampler_path(session, tenant_id=tenant_id, path=row.model_path)
        except NotFound:
            step = None
        if step != row.step:  # deleted (a name saved again holds other weights)
            raise NotFound(f"sampling session {shown(sampler_id)}: its weights {row.model_path} were deleted")
    return Sampler(row.id, run.base_model, row.model_path, run.id, row.step)


def _prompt_tokens(prompt: Any) -> list[int]:
    if not isinstance(prompt, dict):
        wrong = ("needed", "missing") if prompt is None else ("must be an object with chunks", "model_type")
        raise ValidationFailed("prompt needs chunks", details=[body_problem(("prompt",), *wrong)])
    chunks = prompt.get("chunks")
    if not isinstance(chunks, list):
        missing = "chunks" not in prompt
        raise ValidationFailed(
            "prompt needs chunks",
            details=[
                body_problem(
                    ("prompt", "chunks"),
                    "needed" if missing else "must be a list of chunks",
                    "missing" if missing else "list_type",
                )
            ],
        )
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise NotSupported("prompt chunks other than tokens (images, audio)")
        chunk_tokens = chunk.get("tokens", [])
        if not isinstance(chunk_tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in chunk_tokens
        ):
            raise ValidationFailed(
                "prompt chunks' tokens must be lists of integer token ids",
                details=[
                    body_problem(
                        ("prompt", "chunks", i, "tokens"),
                        "must be a list of integer token ids",
                        "int_type" if isinstance(chunk_tokens, list) else "list_type",
                    )
                ],
            )
        tokens.extend(chunk_tokens)
    return tokens


def _stop(stop: Any) -> dict[str, Any]:
    """The SDK's `stop` as SamplingSpec fields: None keeps the model's EOS, [] stops at nothing,
    a string or strings stop on the decoded text, token ids on those tokens."""
    if stop is None:
        return {"stop_at_eos": True}
    if isinstance(stop, str):
        return {"stop_strings": [stop]}
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return {"stop_strings": stop}
    if isinstance(stop, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        return {"stop_tokens": stop}
    raise ValidationFailed(
        "sampling_params.stop must be a string, a list of strings or a list of token ids",
        details=[
            body_problem(
                ("sampling_params", "stop"), "must be a string, a list of strings or a list of token ids"
            )
        ],
    )


_SPEC_FIELD_LOC = {
    **{name: ("sampling_params", name) for name in ("max_tokens", "temperature", "top_k", "top_p", "seed")},
    **{name: ("sampling_params", "stop") for name in ("stop_tokens", "stop_strings", "stop_at_eos")},
}
"""Where in the request a `SamplingSpec` field came from (the others are the request's own fields)."""


def _spec_problems(exc: ValidationError) -> list[dict[str, Any]]:
    """The SamplingSpec's errors, each at the request field it came from (under "body")."""
    problems = validation_problems(exc, prefix=())
    for item in problems:
        field, *rest = item["loc"] or [""]
        where = _SPEC_FIELD_LOC.get(field, (field,)) if field else ()  # (): the spec as a whole
        item["loc"] = [*BODY_LOC, *where, *rest]
    return problems


def _check_vocabulary(prompt: list[int], stop_tokens: list[int], *, vocab_size: int) -> None:
    """A 422 naming the prompt and/or the stop tokens when an id is outside the pool's vocabulary."""
    outside = f"a token id is outside the vocabulary [0, {vocab_size})"
    problems = [
        body_problem(loc, outside)
        for loc, ids in ((("prompt", "chunks"), prompt), (("sampling_params", "stop"), stop_tokens))
        if any(not 0 <= t < vocab_size for t in ids)
    ]
    if problems:
        raise ValidationFailed(
            f"a prompt or stop token id is outside the vocabulary [0, {vocab_size})", details=problems
        )


def submit_sample(
    session: Session, *, tenant_id: str, body: dict[str, Any], settings: Settings
) -> TinkerFuture:
    """Queue a sample; its sequences may cost a pool round's tokens at most, num_samples × (prompt +
    max_tokens) (`Settings.tinker_max_tokens_per_round`: one request fits a round, as for
    forward_backward)."""
    request = parse_request(SampleRequest, body, call="sample")
    sampler = get_sampling_session(session, tenant_id=tenant_id, sampler_id=request.sampling_session_id)
    run = None if sampler.run_id is None else session.get(Run, sampler.run_id)
    if run is not None and run.status not in MOVABLE_RUN_STATUSES:
        raise RunNotActive(
            f"sampler {sampler.id}: its run {run.id} is {run.status}; it takes no more requests"
        )
    pool = live_pool(session, base_model=sampler.base_model)
    max_seq_len = (
        pool.max_seq_len if pool is not None else int((run.config if run else {}).get("seq_len", 512))
    )
    for option in UNSUPPORTED_OPTIONS:
        if body.get(option):
            raise NotSupported(f"sample option {option}")
    params = {} if request.sampling_params is None else request.sampling_params
    if not isinstance(params, dict):
        raise ValidationFailed(
            "sampling_params must be an object",
            details=[body_problem(("sampling_params",), "must be an object", "model_type")],
        )
    # Before the bounds: a NaN temperature fails them too, but as "should be less than or equal to 100".
    require_finite(params, loc=(*BODY_LOC, "sampling_params"))
    prompt = _prompt_tokens(request.prompt)
    max_tokens = params.get("max_tokens")
    try:
        spec = SamplingSpec(
            prompt=prompt,
            num_samples=request.num_samples,
            max_tokens=max_tokens
            if max_tokens is not None
            else max(1, min(DEFAULT_MAX_TOKENS, max_seq_len - len(prompt))),
            temperature=params.get("temperature", 1.0),
            top_k=params.get("top_k", -1),
            top_p=params.get("top_p", 1.0),
            seed=params.get("seed"),
            step=sampler.step,
            base_model=sampler.base_model if run is None else None,
            prompt_logprobs=request.prompt_logprobs is True,
            prompt_logprobs_last_n=request.prompt_logprobs_last_n,
            **_stop(params.get("stop")),
        )
    except ValidationError as exc:
        raise invalid("sample request", _spec_problems(exc)) from exc
    if spec.prompt_logprobs_last_n is not None and not (
        spec.prompt_logprobs and spec.prompt_logprobs_last_n <= len(prompt) - 1
    ):
        needs = "needs prompt_logprobs and must be at most len(prompt) - 1"
        raise ValidationFailed(
            f"prompt_logprobs_last_n {needs}", details=[body_problem(("prompt_logprobs_last_n",), needs)]
        )
    if len(prompt) + spec.max_tokens > max_seq_len:
        # Without max_tokens the default fits whatever room the prompt leaves: the prompt is at fault.
        at = ("prompt",) if max_tokens is None else ("sampling_params", "max_tokens")
        raise ValidationFailed(
            f"prompt + max_tokens exceeds the pool's max_seq_len {max_seq_len}",
            details=[
                body_problem(
                    at,
                    f"prompt ({len(prompt)} tokens) + max_tokens ({spec.max_tokens}) exceeds the pool's "
                    f"max_seq_len {max_seq_len}",
                    "too_long",
                )
            ],
        )
    cost, most = (
        sample_tokens(spec.num_samples, len(prompt), spec.max_tokens),
        settings.tinker_max_tokens_per_round,
    )
    if cost > most:
        raise ValidationFailed(
            f"{spec.num_samples} samples of {len(prompt)} + {spec.max_tokens} tokens are {cost} tokens in one "
            f"request; at most {most} (fewer num_samples per request)",
            details={"kind": "tokens_per_request", "tokens": cost, "limit": most},
        )
    if pool is not None:
        _check_vocabulary(spec.prompt, spec.stop_tokens, vocab_size=pool.vocab_size)
    item = ManualWorkItem(
        request_id=new_id("req"), run_id="" if run is None else run.id, seq_id=0, kind="sample", sampling=spec
    )
    size = request_json_bytes(item)
    check_pending_room(session, tenant_id=tenant_id, request_bytes=size, settings=settings)
    if run is None:
        model_id = base_model_key(sampler.base_model)
    else:
        model_id = str(session.scalar(select(TinkerModel.id).where(TinkerModel.run_id == run.id)))
        touch_model(session, model_id=model_id)
    # Not ordered: sampling requests are numbered per sampling client, and order among them is free.
    future = TinkerFuture(
        id=item.request_id,
        tenant_id=tenant_id,
        kind="sample",
        model_id=model_id,
        seq_id=None,
        run_id=None if run is None else run.id,
        status=PENDING,
        request=item.model_dump(mode="json"),
        request_bytes=size,
        tokens=cost,
    )
    session.add(future)
    session.flush()
    return future


def _waiting(base_model: str) -> tuple[ColumnElement[bool], ...]:
    """The pending base-model samples of `base_model`."""
    return (
        TinkerFuture.status == PENDING,
        TinkerFuture.kind == "sample",
        TinkerFuture.run_id.is_(None),
        TinkerFuture.model_id == base_model_key(base_model),
    )


def waiting_base_samples(session: Session, *, pool_id: str, at_most: int) -> int:
    """How many base-model samples of the pool's base model wait, counted up to `at_most`."""
    if at_most <= 0:
        return 0
    base_model = get_alive_pool(session, pool_id=pool_id).base_model
    return int(session.scalar(_waiting_count(base_model), {"at_most": at_most}) or 0)


@functools.lru_cache(maxsize=STATEMENTS_CACHED)
def _waiting_count(base_model: str) -> Select[int]:
    """`waiting_base_samples`' statement, built once per base model (as `work.claim_query`), its
    LIMIT the `at_most` parameter."""
    some = select(TinkerFuture.id).where(*_waiting(base_model)).limit(bindparam("at_most", 1)).subquery()
    return select(func.count()).select_from(some)


@functools.lru_cache(maxsize=STATEMENTS_CACHED)
def base_samples_query(base_model: str) -> Select[TinkerFuture, int]:
    """The pending base-model samples `claim_base_samples` takes, locked, each with its position in
    the deal (1 first), at most the `work.MAX_ITEMS` parameter. Indexed either way: by model_id, or by the partial index of claimable futures
    (`app.tinker.models.CLAIMABLE`).

    Dealt round-robin across tenants (each tenant's oldest first): every tenant may sample the base
    model, so oldest-first across all of them let one tenant's queue hold everyone else's request
    back for as long as it kept it full (review of 2026-11-23, H3). Within a turn, the tenant served
    longest ago first (`TinkerBaseTurn`; never served: from its oldest waiting sample), as the run
    work's claim does (`work._deal_order`): with a round's token budget, oldest-first again let a
    queue of budget-sized samples hold another tenant's one request for all of it. As in
    `work.claim_query`, the window picks in a subquery, the lock is taken by id, the requests are
    deferred and the statement is built once per arguments."""
    waiting = _waiting(base_model)
    served_at = (
        select(TinkerBaseTurn.served_at)
        .where(
            TinkerBaseTurn.tenant_id == TinkerFuture.tenant_id,
            TinkerBaseTurn.model_id == TinkerFuture.model_id,
        )
        .scalar_subquery()
    )
    ranked = (
        select(
            TinkerFuture.id,
            TinkerFuture.created_at,
            func.row_number()
            .over(partition_by=TinkerFuture.tenant_id, order_by=(TinkerFuture.created_at, TinkerFuture.id))
            .label("turn"),
            # Never served: from when the tenant's oldest sample has waited.
            func.coalesce(
                served_at, func.min(TinkerFuture.created_at).over(partition_by=TinkerFuture.tenant_id)
            ).label("served_at"),
        )
        .where(*waiting)
        .subquery()
    )
    deal = (ranked.c.turn, ranked.c.served_at, ranked.c.created_at, ranked.c.id)
    picked = (
        select(ranked.c.id, func.row_number().over(order_by=deal).label("position"))
        .order_by(*deal)
        .limit(bindparam(MAX_ITEMS, 64))
        .subquery()
    )
    return (
        select(TinkerFuture, picked.c.position)
        .join(picked, picked.c.id == TinkerFuture.id)
        .where(*waiting)
        .order_by(TinkerFuture.created_at, TinkerFuture.id)
        .with_for_update(of=TinkerFuture, skip_locked=True)
        # A size is read only by a submission (`check_pending_room`), never by a claim.
        .options(defer(TinkerFuture.request), defer(TinkerFuture.result), defer(TinkerFuture.request_bytes))
    )


def claim_base_samples(
    session: Session, *, pool_id: str, max_items: int, max_tokens: int
) -> list[ManualWorkItem]:
    """The pending base-model sample requests of the pool's base model, dealt round-robin across
    tenants, marked running: at most `max_items`, and sequences of at most `max_tokens` tokens
    (num_samples × (prompt + max_tokens) each; at least one request). The budget is the samples' own,
    beside the training work's (`work.claim`): one shared budget would let either starve the other,
    and base samples not taken within `tinker_base_sample_wait_seconds` fail."""
    if max_items <= 0:
        return []
    base_model = get_alive_pool(session, pool_id=pool_id).base_model
    # As in `work.claim`: the deal reads the stored token counts, only the kept requests are read.
    rows = session.execute(base_samples_query(base_model), {MAX_ITEMS: max_items}).tuples().all()
    kept = within_tokens(rows, max_tokens, turn_of=lambda future: future.tenant_id)
    requests = kept_requests(session, kept)
    taken = []
    served: set[str] = set()
    running: list[str] = []
    for future in kept:
        if (request := requests.get(future.id)) is not None:
            running.append(future.id)
            taken.append(ManualWorkItem.model_validate(request))
            served.add(future.tenant_id)
    # Held by this pool: returned to pending if it dies (app.tinker.leases).
    mark_running(session, future_ids=running, pool_id=pool_id)
    _mark_served(session, tenant_ids=served, model_id=base_model_key(base_model))
    return taken


def _mark_served(session: Session, *, tenant_ids: set[str], model_id: str) -> None:
    """`TinkerBaseTurn.served_at` = now for these tenants' samples of the base model (an upsert)."""
    if not tenant_ids:
        return
    now = utcnow()
    statement = conflict_insert(session.get_bind().dialect.name, TinkerBaseTurn).values(
        [{"tenant_id": t, "model_id": model_id, "served_at": now} for t in sorted(tenant_ids)]
    )
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[TinkerBaseTurn.tenant_id, TinkerBaseTurn.model_id], set_={"served_at": now}
        )
    )


def sample_proto(result: dict[str, Any]) -> bytes:
    return proto.encode_sample_response(
        [(s["tokens"], s["logprobs"], s["stop_reason"]) for s in result.get("sequences", [])],
        prompt_logprobs=result.get("prompt_logprobs"),
    )
