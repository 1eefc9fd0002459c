"""Worker-facing batch routes: claim (leases, fairness, SKIP LOCKED), ack, lease expiry,
dead pools, restart-from-checkpoint (exactly-once, DESIGN §4.3)."""

import threading
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from sqlalchemy import select

from app.batches import leases, pool_router
from app.batches.models import Batch
from app.db import utcnow
from app.events.models import Event
from app.runs.models import Run
from contracts.arrays import ArrayBatch, to_lists
from contracts.pool_api import ClaimStruct, claimed_batches
from contracts.run_config import RunConfig
from contracts.wire import TrainingBatch
from tests.app.api import WORKER_HEADERS, ack, as_plain, batch_body, claim, post_batch, restart
from tests.app.factories import add_pool, batch_states, committed, seed_run


def test_pool_routes_refuse_tenant_keys(settings, client):
    seeded = seed_run(settings)
    for path, body in (
        ("/v1/pool/batches/claim", {"pool_id": "p", "max_batches": 1}),
        ("/v1/pool/batches/ack", {"pool_id": "p", "acks": [{"batch_id": 1, "trained_step": 1}]}),
        (
            f"/v1/pool/runs/{seeded.run_id}/restart",
            {"pool_id": "p", "checkpoint_step": 0, "total_samples": 0, "total_tokens": 0},
        ),
    ):
        assert (
            client.post(path, json=body, headers=seeded.headers).status_code == 403
        )  # a valid tenant key: known, wrong route
        assert client.post(path, json=body).status_code == 401


def test_claim_and_ack(settings, client):
    pool_id = add_pool(settings)
    seeded = seed_run(settings)
    bodies = [batch_body(2, seed=i, step=0) for i in range(3)]
    ids = [post_batch(client, seeded, b).json()["id"] for b in bodies]

    first = claim(client, pool_id, max_batches=2)
    assert [b["id"] for b in first["batches"]] == ids[:2]
    got = first["batches"][0]
    assert got["run_id"] == seeded.run_id and got["slot"] == 0
    assert [b["sample_offset"] for b in first["batches"]] == [0, 2]
    assert got["num_samples"] == 2 and got["rollout_step"] == 0
    assert got["payload"] == as_plain(bodies[0])
    assert set(got) == {"id", "run_id", "slot", "sample_offset", "num_samples", "rollout_step", "payload"}
    assert first["lease_expires_at"]

    second = claim(client, pool_id)
    assert [b["id"] for b in second["batches"]] == ids[2:]
    assert claim(client, pool_id)["batches"] == []

    resp = ack(client, pool_id, [(ids[0], 1), (ids[1], 1)])
    assert resp.status_code == 200 and resp.json() == {"acked": 2}
    # A retried ack is a no-op, not an error.
    assert ack(client, pool_id, [(ids[0], 1)]).json() == {"acked": 1}
    assert batch_states(settings) == {
        ids[0]: ("trained", pool_id, 1),
        ids[1]: ("trained", pool_id, 1),
        ids[2]: ("claimed", pool_id, None),
    }
    listed = client.get(f"/v1/runs/{seeded.run_id}/batches", headers=seeded.headers).json()["items"]
    assert [(b["state"], b["trained_step"]) for b in listed] == [
        ("trained", 1),
        ("trained", 1),
        ("claimed", None),
    ]


def test_claim_msgpack_response(settings, client):
    pool_id = add_pool(settings)
    seeded = seed_run(settings)
    body = batch_body(2)
    post_batch(client, seeded, body)
    resp = client.post(
        "/v1/pool/batches/claim",
        json={"pool_id": pool_id, "max_batches": 4},
        headers=WORKER_HEADERS | {"Accept": "application/msgpack"},
    )
    assert resp.headers["content-type"] == "application/msgpack"
    # The stored binary payload, spliced in as stored.
    payload = msgspec.msgpack.decode(resp.content)["batches"][0]["payload"]
    assert msgspec.to_builtins(to_lists(msgspec.convert(payload, ArrayBatch))) == as_plain(body)


@pytest.mark.parametrize("accept", ["application/json", "application/msgpack"])
def test_claim_decodes_as_the_pools_structs(settings, client, accept):
    """The pool decodes claims with contracts.pool_api.ClaimStruct: both encodings must fit it."""
    pool_id = add_pool(settings)
    seeded = seed_run(settings)
    body = batch_body(2, seed=3)
    batch_id = post_batch(client, seeded, body).json()["id"]
    resp = client.post(
        "/v1/pool/batches/claim",
        json={"pool_id": pool_id, "max_batches": 4},
        headers=WORKER_HEADERS | {"Accept": accept},
    )
    assert resp.status_code == 200, resp.text
    decode = msgspec.msgpack.decode if accept == "application/msgpack" else msgspec.json.decode
    claimed = decode(resp.content, type=ClaimStruct)
    msgpack = accept == "application/msgpack"
    assert datetime.fromisoformat(claimed.lease_expires_at) > datetime.now(UTC)
    [item] = claimed_batches(claimed, msgpack=msgpack)
    # msgpack: the binary form numpy reads in place; JSON: the list form.
    assert isinstance(item.payload, ArrayBatch if msgpack else TrainingBatch)
    assert (item.id, item.run_id, item.slot, item.sample_offset, item.num_samples) == (
        batch_id,
        seeded.run_id,
        0,
        0,
        2,
    )
    payload = to_lists(item.payload) if isinstance(item.payload, ArrayBatch) else item.payload
    assert msgspec.to_builtins(payload) == as_plain(body)


def test_unregistered_pool_cannot_claim(settings, client):
    seeded = seed_run(settings)
    post_batch(client, seeded, batch_body(1))
    resp = client.post(
        "/v1/pool/batches/claim", json={"pool_id": "pool_x", "max_batches": 4}, headers=WORKER_HEADERS
    )
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "pool_not_found"
    assert {state for state, _, _ in batch_states(settings).values()} == {"pending"}


def test_ack_rejections_name_the_batch_and_change_nothing(settings, client):
    pool_a, pool_b = add_pool(settings), add_pool(settings, base_model="other")
    seeded = seed_run(settings)
    ids = [post_batch(client, seeded, batch_body(1, seed=i)).json()["id"] for i in range(3)]
    claim(client, pool_a, max_batches=2)

    cases = [
        ([(ids[0], 1), (999_999, 1)], 999_999, "no such batch"),
        ([(ids[0], 1), (ids[2], 1)], ids[2], "not held"),  # pending, never claimed
    ]
    for acks, culprit, problem in cases:
        resp = ack(client, pool_a, acks)
        assert resp.status_code == 409
        error = resp.json()["error"]
        assert error["code"] == "ack_rejected" and str(culprit) in error["message"]
        assert [d["batch_id"] for d in error["details"]] == [culprit]
        assert problem in error["details"][0]["problem"]
    # Another pool cannot ack pool A's batches.
    resp = ack(client, pool_b, [(ids[0], 1)])
    assert resp.status_code == 409 and resp.json()["error"]["details"][0]["batch_id"] == ids[0]
    assert ack(client, pool_a, [(ids[0], 1), (ids[0], 2)]).status_code == 409
    assert [s[0] for s in batch_states(settings).values()] == ["claimed", "claimed", "pending"]

    assert ack(client, pool_a, [(ids[0], 3)]).status_code == 200
    resp = ack(client, pool_a, [(ids[0], 4)])  # already acked with another step
    assert resp.status_code == 409 and "already acked" in resp.json()["error"]["details"][0]["problem"]
    # A pool id that never registered cannot ack (nor claim): 404, nothing changed.
    before = batch_states(settings)
    resp = ack(client, "pool_000000000000", [(ids[1], 1)])
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "pool_not_found"
    resp = client.post(
        "/v1/pool/batches/claim",
        json={"pool_id": "pool_000000000000", "max_batches": 1},
        headers=WORKER_HEADERS,
    )
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "pool_not_found"
    assert batch_states(settings) == before


def test_claim_is_fair_and_in_order(settings, client):
    pool_id = add_pool(settings)
    flood = seed_run(settings)
    quiet = seed_run(settings)
    flood_ids = [post_batch(client, flood, batch_body(1, seed=i)).json()["id"] for i in range(6)]
    quiet_id = post_batch(client, quiet, batch_body(1)).json()["id"]

    got = claim(client, pool_id, max_batches=2)["batches"]
    assert [b["id"] for b in got] == [flood_ids[0], quiet_id]
    assert {b["run_id"]: b["slot"] for b in got} == {flood.run_id: 0, quiet.run_id: 1}
    assert [b["id"] for b in claim(client, pool_id, max_batches=10)["batches"]] == flood_ids[1:]


def test_claim_only_active_runs_of_the_pool_base_model(settings, client):
    pool_id = add_pool(settings, base_model="loraloom-tiny")
    other_pool = add_pool(settings, base_model="big-model")
    mine = seed_run(settings)
    other_model = seed_run(settings, config=RunConfig(base_model="big-model"))
    stopped = seed_run(settings)
    post_batch(client, mine, batch_body(1))
    other_id = post_batch(client, other_model, batch_body(1)).json()["id"]
    post_batch(client, stopped, batch_body(1))
    with committed(settings) as session:
        run = session.get(Run, stopped.run_id)
        run.status, run.slot, run.eviction_reason, run.evicted_by = "evicted", None, "bye", "user"

    assert [b["run_id"] for b in claim(client, pool_id)["batches"]] == [mine.run_id]
    assert [b["id"] for b in claim(client, other_pool)["batches"]] == [other_id]


@pytest.mark.parametrize(("status", "code"), [("dead", "pool_dead"), ("stopped", "pool_stopped")])
def test_dead_pool_cannot_claim(settings, client, status, code):
    pool_id = add_pool(settings, status=status)
    resp = client.post(
        "/v1/pool/batches/claim", json={"pool_id": pool_id, "max_batches": 1}, headers=WORKER_HEADERS
    )
    assert resp.status_code == 409 and resp.json()["error"]["code"] == code


class _RouteClock:
    """The pool routes' clock, moved forward by hand: a lease runs out when the test says so, not
    when a real-time window closes (the background sweeper, on the real clock, never sees it expire)."""

    def __init__(self) -> None:
        self.ahead = timedelta(0)

    def __call__(self) -> datetime:
        return utcnow() + self.ahead


def test_lease_expiry_returns_batches_to_pending(settings, client, monkeypatch):
    clock = _RouteClock()
    monkeypatch.setattr(pool_router, "utcnow", clock)
    pool_a, pool_b = add_pool(settings), add_pool(settings, base_model="loraloom-tiny")
    seeded = seed_run(settings)
    ids = [post_batch(client, seeded, batch_body(1, seed=i)).json()["id"] for i in range(2)]
    assert [b["id"] for b in claim(client, pool_a)["batches"]] == ids
    assert claim(client, pool_b)["batches"] == []  # leased
    clock.ahead = timedelta(seconds=settings.lease_seconds + 1)
    # The claim expires leases itself before it looks.
    assert [b["id"] for b in claim(client, pool_b)["batches"]] == ids
    # Pool A lost its lease: its late ack is refused, so nothing is counted twice.
    resp = ack(client, pool_a, [(ids[0], 1)])
    assert resp.status_code == 409 and resp.json()["error"]["details"][0]["batch_id"] == ids[0]
    assert ack(client, pool_b, [(ids[0], 1)]).status_code == 200


def test_lease_service_functions(settings, client):
    pool_a, pool_b = add_pool(settings), add_pool(settings)
    seeded = seed_run(settings)
    ids = [post_batch(client, seeded, batch_body(1, seed=i)).json()["id"] for i in range(3)]
    claim(client, pool_a, max_batches=2)
    claim(client, pool_b, max_batches=1)
    now = utcnow()
    with committed(settings) as session:
        assert leases.expire_leases(session, now=now) == 0
        assert leases.extend_leases(session, pool_id=pool_a, now=now + timedelta(hours=1)) == 2
        # B's lease (120 s) is over in two hours; A's was pushed to 1 h + 120 s.
        assert leases.expire_leases(session, now=now + timedelta(hours=1)) == 1
    assert batch_states(settings) == {
        ids[0]: ("claimed", pool_a, None),
        ids[1]: ("claimed", pool_a, None),
        ids[2]: ("pending", None, None),
    }
    with committed(settings) as session:
        assert leases.return_pool_batches(session, pool_id=pool_a) == 2
        assert leases.return_pool_batches(session, pool_id=pool_a) == 0
    assert {s[0] for s in batch_states(settings).values()} == {"pending"}
    # Returned batches are claimed again in id order.
    assert [b["id"] for b in claim(client, pool_b)["batches"]] == ids


@pytest.mark.postgres_only
def test_concurrent_claimers_never_share_a_batch(settings, client):
    pool_id = add_pool(settings)
    runs = [seed_run(settings) for _ in range(3)]
    all_ids = {post_batch(client, runs[i % 3], batch_body(1, seed=i)).json()["id"] for i in range(45)}

    n = 4
    barrier = threading.Barrier(n)
    got: list[list[int]] = [[] for _ in range(n)]

    def claimer(i: int) -> None:
        barrier.wait()
        empty_in_a_row = 0
        while empty_in_a_row < 3:
            batches = claim(client, pool_id, max_batches=3)["batches"]
            got[i] += [b["id"] for b in batches]
            empty_in_a_row = 0 if batches else empty_in_a_row + 1

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [b for ids in got for b in ids]
    assert len(flat) == len(set(flat)), "a batch was claimed twice"
    assert set(flat) == all_ids
    assert {s[0] for s in batch_states(settings).values()} == {"claimed"}


def test_restart_returns_exactly_the_batches_after_the_checkpoint(settings, client):
    pool_id = add_pool(settings)
    seeded = seed_run(settings)
    other = seed_run(settings)
    ids = [post_batch(client, seeded, batch_body(2, seed=i)).json()["id"] for i in range(6)]
    other_ids = [post_batch(client, other, batch_body(2, seed=i)).json()["id"] for i in range(2)]
    assert len(claim(client, pool_id, max_batches=20)["batches"]) == 8
    # Steps of 4 samples: batches 0,1 → step 1; 2,3 → step 2; 4 → step 3 (5 still in flight).
    assert (
        ack(client, pool_id, [(ids[0], 1), (ids[1], 1), (ids[2], 2), (ids[3], 2), (ids[4], 3)]).status_code
        == 200
    )
    assert ack(client, pool_id, [(other_ids[0], 1), (other_ids[1], 5)]).status_code == 200
    with committed(settings) as session:
        run = session.get(Run, seeded.run_id)
        run.step, run.total_samples, run.total_tokens = 3, 12, 999

    resp = restart(client, seeded.run_id, pool_id, checkpoint_step=1, total_samples=4, total_tokens=100)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"returned": [ids[2], ids[3], ids[4], ids[5]]}

    after = batch_states(settings)
    assert after[ids[0]] == ("trained", pool_id, 1) and after[ids[1]] == ("trained", pool_id, 1)
    assert all(after[i] == ("pending", None, None) for i in ids[2:])
    # Another run is untouched.
    assert after[other_ids[0]] == ("trained", pool_id, 1) and after[other_ids[1]] == ("trained", pool_id, 5)
    with committed(settings) as session:
        run = session.get(Run, seeded.run_id)
        assert (run.step, run.total_samples, run.total_tokens) == (1, 4, 100)
        event = session.scalar(
            select(Event).where(Event.run_id == seeded.run_id, Event.action == "run.restart_from_checkpoint")
        )
        assert event is not None and event.details["returned_batches"] == ids[2:]

    # Re-claimed in order; sample_offsets let the pool skip samples below the checkpoint's total.
    again = claim(client, pool_id)["batches"]
    assert [b["id"] for b in again] == ids[2:]
    assert [b["sample_offset"] for b in again] == [4, 6, 8, 10]

    # Restarting at the newest checkpoint returns only what is claimed.
    resp = restart(client, seeded.run_id, pool_id, checkpoint_step=1, total_samples=4, total_tokens=100)
    assert resp.json() == {"returned": ids[2:]}
    assert restart(client, seeded.run_id, pool_id, 1, 4, 100).json() == {"returned": []}


def test_restart_errors(settings, client):
    seeded = seed_run(settings, status="completed")
    assert restart(client, "run_000000000000", "p", 0, 0, 0).status_code == 404
    assert restart(client, "not-a-run", "p", 0, 0, 0).status_code == 404
    resp = restart(client, seeded.run_id, "p", 0, 0, 0)
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "run_not_active"
    assert restart(client, seeded.run_id, "p", -1, 0, 0).status_code == 422


def test_unreadable_payload_holds_back_only_its_run(settings, client):
    pool_id = add_pool(settings)
    broken = seed_run(settings)
    healthy = seed_run(settings)
    broken_ids = [post_batch(client, broken, batch_body(1, seed=i)).json()["id"] for i in range(3)]
    healthy_id = post_batch(client, healthy, batch_body(1)).json()["id"]
    with committed(settings) as session:
        row = session.get(Batch, broken_ids[1])
        (settings.data_dir / row.payload_path).write_bytes(b"corrupted")

    got = [b["id"] for b in claim(client, pool_id)["batches"]]
    # The broken run's first batch is fine; its later ones wait behind the corrupt one (in-order training).
    assert sorted(got) == sorted([broken_ids[0], healthy_id])
    assert (
        batch_states(settings)[broken_ids[1]][0] == "pending"
        and batch_states(settings)[broken_ids[2]][0] == "pending"
    )
