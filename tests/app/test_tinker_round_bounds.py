"""A pool round of Tinker work is bounded in tokens (`Settings.tinker_max_tokens_per_round`), so a
tenant with a long queue of large forward_backwards cannot make every other tenant's request wait
for all of it: a claim deals requests while their tokens fit, one request may carry at most a
round's tokens (and 1,024 datums), and the official SDK is told both limits and chunks to fit."""

import re
import time

import pytest
import tinker
from fastapi.testclient import TestClient
from sqlalchemy import event, func, inspect, select, update
from tinker import types

from app.config import Settings
from app.tinker import work
from app.tinker.models import TinkerFuture, TinkerModel
from contracts.ids import new_id
from contracts.tinker_work import ManualWorkItem, SamplingSpec
from tests.app.api import WORKER_HEADERS, new_tenant, register
from tests.app.test_tinker_sampling import _base_sampler, _headers, _sample_body
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body, _model, _stored

pytestmark = pytest.mark.postgres_only

ROUND = 1024
"""The tokens of one round in these tests (the setting's least value)."""


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"tinker_max_tokens_per_round": ROUND})


def _tokens(n: int) -> list[int]:
    """A datum of `n` model-input tokens (ids within the registered pool's vocabulary of 256)."""
    return [1 + i % 250 for i in range(n + 1)]


def _queue(client: TestClient, model_id: str, headers: dict[str, str], sizes: list[int]) -> None:
    """One forward_backward per size (a datum of that many tokens), then an optim_step."""
    _queue_more(client, model_id, headers, first_seq_id=1, sizes=sizes)


def _queue_more(
    client: TestClient, model_id: str, headers: dict[str, str], *, first_seq_id: int, sizes: list[int]
) -> None:
    """`_queue` from request `first_seq_id` of the model on."""
    for seq_id, size in enumerate(sizes, start=first_seq_id):
        r = client.post(
            "/api/v1/forward_backward",
            content=_fwdbwd_body(model_id, seq_id, [_datum(_tokens(size))]),
            headers=headers | PROTOBUF,
        )
        assert r.status_code == 200, r.text
    step = {"model_id": model_id, "seq_id": first_seq_id + len(sizes), "adam_params": {"learning_rate": 0.01}}
    assert client.post("/api/v1/optim_step", json=step, headers=headers).status_code == 200


def _claim(client: TestClient, pool_id: str) -> list[dict]:
    r = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 64}, headers=WORKER_HEADERS
    )
    assert r.status_code == 200, r.text
    items: list[dict] = r.json()["items"]
    return items


def _item_tokens(item: dict) -> int:
    return sum(len(d["tokens"]) for d in item["data"])


def test_a_claim_takes_a_rounds_tokens_and_the_quiet_tenant_is_in_the_first(client, tenant, other_tenant, db):
    pool_id = register(client)
    busy, busy_headers = _model(client, tenant)
    quiet, quiet_headers = _model(client, other_tenant)
    _queue(client, busy, busy_headers, sizes=[600, 600, 600, 600])  # queued first: waiting longest
    _queue(client, quiet, quiet_headers, sizes=[10])

    claims = []
    while items := _claim(client, pool_id):
        claims.append(items)
        assert len(claims) < 10, "the claims never drained"
    for items in claims:
        assert sum(_item_tokens(i) for i in items) <= ROUND
    # Without the bound the first claim took all seven requests (2,410 tokens).
    busy_run, quiet_run = (db.get(TinkerModel, m).run_id for m in (busy, quiet))
    assert sorted((i["run_id"], i["kind"], i["seq_id"]) for i in claims[0]) == sorted(
        [(busy_run, "forward_backward", 1), (quiet_run, "forward_backward", 1), (quiet_run, "optim_step", 2)]
    )
    # Every request claimed once, each run's in its own order, the step boundary last.
    seen: dict[str, list[tuple[str, int]]] = {}
    for items in claims:
        for i in items:
            seen.setdefault(i["run_id"], []).append((i["kind"], i["seq_id"]))
    assert seen == {
        quiet_run: [("forward_backward", 1), ("optim_step", 2)],
        busy_run: [("forward_backward", s) for s in range(1, 5)] + [("optim_step", 5)],
    }
    assert len(claims) == 4  # 600 + 10 + the quiet step | 600 | 600 | 600 + the busy step


def test_a_request_larger_than_a_round_is_refused_and_nothing_is_stored(client, tenant, db):
    register(client)
    model_id, headers = _model(client, tenant)
    too_many = _fwdbwd_body(model_id, 1, [_datum([1, 2])] * 1025)
    r = client.post("/api/v1/forward_backward", content=too_many, headers=headers | PROTOBUF)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "1025 datums in one request; at most 1024" in error["message"]
    assert error["details"] == {"kind": "datums_per_request", "datums": 1025, "limit": 1024}

    too_long = _fwdbwd_body(model_id, 1, [_datum(_tokens(600)), _datum(_tokens(600))])
    r = client.post("/api/v1/forward_backward", content=too_long, headers=headers | PROTOBUF)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert f"1200 tokens in one request; at most {ROUND}" in error["message"]
    assert error["details"] == {"kind": "tokens_per_request", "tokens": 1200, "limit": ROUND}
    assert _stored(db) == 0

    # The seq_id was not taken: the same request split to fit is accepted.
    fits = _fwdbwd_body(model_id, 1, [_datum(_tokens(600))])
    assert (
        client.post("/api/v1/forward_backward", content=fits, headers=headers | PROTOBUF).status_code == 200
    )
    assert _stored(db) == 1


def test_the_sdk_is_told_the_limits_and_chunks_a_large_batch_to_fit(http, db):
    tenant = new_tenant(http, quota=2)
    r = http.post("/api/v1/client/config", headers={"X-API-Key": "tml-" + tenant.key})
    assert r.status_code == 200, r.text
    config = r.json()
    assert config["fwdbwd_max_chunk_len"] == 1024
    assert config["fwdbwd_max_chunk_bytes_count"] == 4 * ROUND  # the SDK counts 4 bytes a token

    register(http)
    service = tinker.ServiceClient(base_url=str(http.base_url), api_key="tml-" + tenant.key)
    try:
        training = service.create_lora_training_client(
            base_model="loraloom-tiny", rank=4, train_mlp=False, train_unembed=False
        ).result()
        # 2,400 tokens in all: one request without the limits (the SDK's default chunk is 5 MB).
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(_tokens(200)[:-1]),
                loss_fn_inputs={"target_tokens": _tokens(200)[1:]},
            )
            for _ in range(12)
        ]
        training.forward_backward(data, "cross_entropy")  # queued: no pool serves it here
        deadline = time.monotonic() + 30
        while _queued_tokens(db) < 2400 and time.monotonic() < deadline:
            time.sleep(0.05)
        requests = _queued_requests(db)
        assert sum(requests) == 2400, requests
        assert len(requests) > 1 and max(requests) <= ROUND, requests
    finally:
        service.close("success").result()


def _queued_requests(db) -> list[int]:
    db.expire_all()
    rows = db.scalars(select(TinkerFuture).where(TinkerFuture.kind == "forward_backward")).all()
    return [sum(len(d["tokens"]) for d in (row.request or {}).get("data", [])) for row in rows]


def _queued_tokens(db) -> int:
    return sum(_queued_requests(db))


def test_a_claim_leaves_the_data_of_the_requests_past_its_round_in_the_database(
    client, tenant, db, monkeypatch
):
    """The requests past the budget are fetched again by every claim until their turn: their data
    (up to a round's tokens each) is not read with them."""
    pool_id = register(client)
    busy, headers = _model(client, tenant)
    _queue(client, busy, headers, sizes=[600, 600, 600, 600])

    fetched: list[TinkerFuture] = []
    real = work.within_tokens

    def keeping(rows, max_tokens):  # the claim's rows, kept to be looked at after it
        fetched.extend(future for future, _ in rows)
        return real(rows, max_tokens)

    monkeypatch.setattr(work, "within_tokens", keeping)
    items = work.claim(db, pool_id=pool_id, max_items=64, max_tokens=ROUND)
    assert [i.seq_id for i in items] == [1]
    assert sorted(f.seq_id for f in fetched) == [1, 2, 3, 4, 5]
    # The deal reads the stored token counts: no dealt row's data is loaded with it (the one kept
    # is read on its own: test_the_claim_reads_only_the_kept_requests_and_in_one_query).
    unread = {f.seq_id for f in fetched if "request" in inspect(f).unloaded}
    assert unread == {1, 2, 3, 4, 5}
    db.rollback()


def test_a_request_that_does_not_fit_leaves_its_run_and_the_deal_goes_on(client, db):
    pool_id = register(client, slots=3)
    tenants = [new_tenant(client) for _ in range(3)]
    (big, big_headers), (late, late_headers), (small, small_headers) = (_model(client, t) for t in tenants)
    _queue(client, big, big_headers, sizes=[600, 600])
    _queue(client, late, late_headers, sizes=[600])  # does not fit beside big's first
    _queue(client, small, small_headers, sizes=[10])  # dealt after it, and fits
    runs = {
        db.get(TinkerModel, m).run_id: name for m, name in ((big, "big"), (late, "late"), (small, "small"))
    }
    first = sorted((runs[i["run_id"]], i["kind"]) for i in _claim(client, pool_id))
    assert first == [("big", "forward_backward"), ("small", "forward_backward"), ("small", "optim_step")]
    # A stopping deal (the first version) left small's request behind late's for a whole round.
    second = sorted((runs[i["run_id"]], i["seq_id"]) for i in _claim(client, pool_id))
    assert second == [("late", 1), ("late", 2)]  # created before big's last service: before big
    third = sorted((runs[i["run_id"]], i["seq_id"]) for i in _claim(client, pool_id))
    assert third == [("big", 2), ("big", 3)]


def test_a_tenant_with_an_older_queue_of_full_rounds_does_not_keep_a_later_one_waiting(client, db):
    """Each of busy's requests fills a round. Dealt by age alone, busy's queue (older than quiet's
    request) came first in every round, and quiet waited for all of it (up to 1,024 rounds: the
    pending limit); served longest ago first, quiet's request is in the second round."""
    pool_id = register(client)
    (busy, busy_headers), (quiet, quiet_headers) = (_model(client, new_tenant(client)) for _ in range(2))
    _queue(client, busy, busy_headers, sizes=[1000, 1000, 1000, 1000])
    _queue(client, quiet, quiet_headers, sizes=[1000])
    runs = {db.get(TinkerModel, m).run_id: name for m, name in ((busy, "busy"), (quiet, "quiet"))}

    def claimed() -> list[tuple[str, int]]:
        return sorted((runs[i["run_id"]], i["seq_id"]) for i in _claim(client, pool_id))

    assert claimed() == [("busy", 1)]  # neither served yet: the one created first
    assert claimed() == [("quiet", 1), ("quiet", 2)]  # by age: busy's second
    # quiet queues again: the run served longest ago is busy now.
    _queue_more(client, quiet, quiet_headers, first_seq_id=3, sizes=[1000])
    assert claimed() == [("busy", 2)]
    assert claimed() == [("quiet", 3), ("quiet", 4)]
    assert claimed() == [("busy", 3)]
    assert claimed() == [("busy", 4), ("busy", 5)]
    assert claimed() == []


def test_a_sample_of_a_trained_model_is_claimed_beside_its_runs_numbered_work(client, tenant, db):
    """A run's sample has no seq_id: the cut keeps the rows' order (sorting by seq_id raised a
    TypeError comparing None with a number, a 500 on every claim of the base model)."""
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    # A pending forward_backward and no step boundary (a sample past one waits for a later claim).
    body = _fwdbwd_body(model_id, 1, [_datum(_tokens(10))])
    assert (
        client.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF).status_code == 200
    )
    run_id = db.get(TinkerModel, model_id).run_id
    spec = SamplingSpec(prompt=[1, 2, 3], num_samples=2, max_tokens=4, temperature=1.0, top_k=-1, top_p=1.0)
    item = ManualWorkItem(request_id=new_id("req"), run_id=run_id, seq_id=0, kind="sample", sampling=spec)
    db.add(
        TinkerFuture(
            id=item.request_id,
            tenant_id=tenant.id,
            kind="sample",
            model_id=model_id,
            seq_id=None,
            run_id=run_id,
            status="pending",
            request=item.model_dump(mode="json"),
            tokens=work.work_tokens(item),
        )
    )
    db.commit()
    kinds = sorted(i["kind"] for i in _claim(client, pool_id))
    assert kinds == ["forward_backward", "sample"]


def test_one_datum_longer_than_a_round_passes_alone(client, tenant, db):
    """The SDK sends a datum larger than its chunk alone and cannot split it: it is bounded by the
    pool's max_seq_len instead."""
    register(client, max_seq_len=2048)
    model_id, headers = _model(client, tenant)
    alone = _fwdbwd_body(model_id, 1, [_datum(_tokens(1500))])
    assert (
        client.post("/api/v1/forward_backward", content=alone, headers=headers | PROTOBUF).status_code == 200
    )
    two = _fwdbwd_body(model_id, 2, [_datum(_tokens(1500)), _datum(_tokens(10))])
    r = client.post("/api/v1/forward_backward", content=two, headers=headers | PROTOBUF)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["details"]["kind"] == "tokens_per_request"


def test_base_model_samples_have_a_rounds_tokens_of_their_own(client, tenant, other_tenant, db):
    """Each sample costs num_samples × (prompt + max_tokens) = 303 tokens: three fit a round of
    1,024, beside a training request that fills the training work's round (one budget shared would
    starve one or the other; without a budget the claim took all four)."""
    pool_id = register(client)
    busy, busy_headers = _model(client, tenant)
    _queue(client, busy, busy_headers, sizes=[1000])
    sampler = _base_sampler(client, other_tenant)
    for _ in range(4):
        body = _sample_body(sampler, [5, 6, 7], sampling_params={"max_tokens": 300})
        r = client.post("/api/v1/asample", json=body, headers=_headers(other_tenant))
        assert r.status_code == 200, r.text

    def kinds(items: list[dict]) -> list[str]:
        return sorted(i["kind"] for i in items)

    assert kinds(_claim(client, pool_id)) == ["forward_backward", "optim_step", "sample", "sample", "sample"]
    assert kinds(_claim(client, pool_id)) == ["sample"]


def _asample(client: TestClient, tenant, sampler: str, *, num_samples: int, max_tokens: int) -> str:
    body = _sample_body(
        sampler, [5, 6, 7], num_samples=num_samples, sampling_params={"max_tokens": max_tokens}
    )
    r = client.post("/api/v1/asample", json=body, headers=_headers(tenant))
    assert r.status_code == 200, r.text
    request_id: str = r.json()["request_id"]
    return request_id


def test_a_tenant_with_an_older_queue_of_full_base_samples_does_not_keep_a_later_one_waiting(
    client, tenant, other_tenant
):
    """Each of busy's samples costs 1,003 tokens (a round's): dealt by age alone, busy's queue
    came first in every round and quiet's one sample waited for all of it."""
    pool_id = register(client)
    busy, quiet = _base_sampler(client, tenant), _base_sampler(client, other_tenant)
    busy_ids = [_asample(client, tenant, busy, num_samples=1, max_tokens=1000) for _ in range(3)]
    quiet_id = _asample(client, other_tenant, quiet, num_samples=1, max_tokens=1000)

    def claimed() -> list[str]:
        return [i["request_id"] for i in _claim(client, pool_id)]

    assert claimed() == [busy_ids[0]]  # neither served yet: the one waiting longest
    assert claimed() == [quiet_id]  # by age: busy's second
    assert claimed() == [busy_ids[1]]
    assert claimed() == [busy_ids[2]]


def test_a_claim_full_of_run_work_keeps_items_for_base_samples(client, tenant, other_tenant):
    """64 small passes queued: the claim's items went to the run work first, and a base sample got
    none, round after round, until it failed unclaimed."""
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    _queue(client, model_id, headers, sizes=[10] * 8)
    sample_id = _asample(
        client, other_tenant, _base_sampler(client, other_tenant), num_samples=1, max_tokens=4
    )
    r = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 4}, headers=WORKER_HEADERS
    )
    assert r.status_code == 200, r.text
    items = r.json()["items"]
    assert [i["kind"] for i in items] == ["forward_backward"] * 3 + ["sample"]
    assert items[-1]["request_id"] == sample_id


def test_a_sample_larger_than_a_round_is_refused_and_nothing_is_stored(client, other_tenant, db):
    register(client)
    sampler = _base_sampler(client, other_tenant)
    body = _sample_body(sampler, [5, 6, 7], num_samples=2, sampling_params={"max_tokens": 600})
    r = client.post("/api/v1/asample", json=body, headers=_headers(other_tenant))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert f"1206 tokens in one request; at most {ROUND}" in error["message"]
    assert error["details"] == {"kind": "tokens_per_request", "tokens": 1206, "limit": ROUND}
    db.expire_all()
    assert db.scalar(select(func.count()).select_from(TinkerFuture).where(TinkerFuture.kind == "sample")) == 0


def test_the_claim_reads_only_the_kept_requests_and_in_one_query(client, tenant, db):
    """The deal cuts by the token count stored with each request (`TinkerFuture.tokens`): the
    requests it keeps are read in one query, the one it stops at is not read at all (before, one
    deferred load per dealt row, on every poll), and they are marked running in one statement."""
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    _queue(client, model_id, headers, sizes=[300, 300, 300, 300])  # three fit a round of 1,024
    selected: list[str] = []
    updates: list[tuple[str, bool]] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001, ARG001
        head = re.split(r"\sFROM\s", statement.upper(), maxsplit=1)[0]  # the select list
        if head.lstrip().startswith("SELECT") and "TINKER_FUTURES.REQUEST" in head:
            selected.append(statement)
        if statement.upper().lstrip().startswith("UPDATE TINKER_FUTURES"):
            updates.append((statement, executemany))

    engine = db.get_bind()
    event.listen(engine, "before_cursor_execute", record)
    try:
        items = work.claim(db, pool_id=pool_id, max_items=64, max_tokens=ROUND)
    finally:
        event.remove(engine, "before_cursor_execute", record)
        db.rollback()
    assert [item.seq_id for item in items] == [1, 2, 3]
    assert [len(item.data[0].tokens) for item in items] == [300, 300, 300]
    assert len(selected) == 1, selected
    # ... and marked running by one UPDATE (one per future before, sent as an executemany).
    assert [many for _, many in updates] == [False], updates


def test_a_request_written_without_its_token_count_is_counted_from_its_data(client, tenant, db):
    """A process still running the code from before migration 0012 inserts futures without `tokens`
    (its default, 0): the cut counts their data instead of taking them as free (both 600-token
    requests in one round of 1,024 otherwise)."""
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    _queue(client, model_id, headers, sizes=[600, 600])
    db.execute(update(TinkerFuture).where(TinkerFuture.model_id == model_id).values(tokens=0))
    db.commit()
    assert [i["seq_id"] for i in _claim(client, pool_id)] == [1]
