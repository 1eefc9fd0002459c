"""One run's huge batch must not stop every other run's training (a probe: alice's 4096-sample batch of
3.9M tokens kept the pool's buffer above its claim cap for its whole length, and bob's 8-sample batch
stayed pending at the service for 11 minutes and counting).

The master's plan is driven step by step, without training: the real PoolTrainer's claim and pack
logic, fed from memory (`MemoryPoolClient`, which honours `run_ids` as the service does; the service's
side is tests/app/test_claim_run_filter.py). Then the packer alone: once bob's samples are buffered,
its round-robin gives them a turn while alice's buffer is still far from drained.
"""

import json
from pathlib import Path

import httpx
import msgspec
import pytest

from contracts.http import ApiError
from contracts.pool_api import ClaimedBatchStruct
from contracts.progress import Progress
from contracts.run_config import RunConfig
from contracts.wire import TrainingBatch
from tests.e2e.helpers import run_config, synthetic_batch
from tests.trainer_core.memory_pool import memory_trainer
from tests.trainer_core.test_directory_source import RUN_A, RUN_B, batch, make_source, tags
from trainer_core.directory_source import write_rollout_step
from trainer_core.http_source import HttpRunSource
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.packing import Packer
from trainer_core.service_client import PoolServiceClient
from trainer_core.worker import CLAIM_AHEAD_PACKS, PoolTrainer

ALICE, BOB = "run_000000000000", "run_000000000001"
FLOOD_SAMPLES = 400
"""Alice's batch: ~4000 tokens, ~15 times the claim cap of the test pool (4 packs of 64 tokens)."""


class ClaimLog(MemoryPoolClient):
    """Records every claim as (max_batches, run_ids)."""

    def __init__(self, payloads: list[list[dict]], config: dict) -> None:
        super().__init__(payloads, config)
        self.claims: list[tuple[int, list[str] | None]] = []

    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
        self.claims.append((max_batches, None if run_ids is None else list(run_ids)))
        return super().claim(max_batches, run_ids)


def _config() -> dict:
    return RunConfig.model_validate(run_config(max_steps=1000, batch_size=4)).model_dump(mode="json")


def _client(client_type: type[ClaimLog] = ClaimLog) -> ClaimLog:
    """Alice: three huge batches; bob: three small ones, queued behind all of alice's (the pool's first
    claim, of one batch, takes alice's first)."""
    alice = [synthetic_batch(s, n_samples=FLOOD_SAMPLES) for s in (1, 2, 3)]
    bob = [synthetic_batch(s, n_samples=4) for s in (11, 12, 13)]
    client = client_type([alice, bob], _config())
    client.pending.sort(key=lambda b: (b.run_id, b.id))
    return client


def _admitted(trainer: PoolTrainer) -> dict[str, int]:
    trainer._sync_slots()
    return {run.run_id: slot for slot, run in trainer.slots.items()}


def test_a_run_with_nothing_buffered_is_claimed_for_while_the_flood_fills_the_buffer(tmp_path: Path) -> None:
    client = _client()
    trainer = memory_trainer(client, tmp_path, max_claim=1)
    try:
        slots = _admitted(trainer)
        m = trainer.master
        assert m is not None and set(slots) == {ALICE, BOB}
        cap = CLAIM_AHEAD_PACKS * m.packer.token_budget

        assert trainer._plan(m).kind == "train"  # claims alice's first batch, packs a bit of it
        assert client.claims == [(1, None)]
        flood = m.packer.buffered_tokens(slots[ALICE])
        assert flood > 10 * cap

        bob_packed = []
        for _ in range(6):
            plan = trainer._plan(m)
            assert plan.kind == "train"
            bob_packed.append(m.packer.progress(slots[BOB]).total_samples)
            assert m.packer.buffered_tokens(slots[ALICE]) > cap  # still far over the cap
        # Bob's batches were claimed alone, one per plan (he had less than a pack buffered), and his
        # samples went into the very next packs, beside alice's: all 12 within the six plans.
        assert client.claims[1:4] == [(1, [BOB])] * 3
        assert bob_packed[0] > 0 and bob_packed[-1] == 12
        # Alice's further batches stayed queued: her buffer is over the cap, and she is not short.
        assert [b.run_id for b in client.pending] == [ALICE, ALICE]
        assert all(run_ids == [BOB] for _, run_ids in client.claims[1:])
        # The buffer never grew beyond the flood's first batch (what one claim under the cap brought).
        assert m.packer.buffered_tokens() < flood
    finally:
        trainer.close()


class OlderService(ClaimLog):
    """A service older than `ClaimIn.run_ids`: its claim body forbids the field (a 422)."""

    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
        self.claims.append((max_batches, None if run_ids is None else list(run_ids)))
        if run_ids is not None:
            raise ApiError(
                "1 invalid field(s)",
                status=422,
                code="validation_error",
                details=[
                    {
                        "loc": ["body", "run_ids"],
                        "msg": "Extra inputs are not permitted",
                        "type": "extra_forbidden",
                    }
                ],
            )
        return MemoryPoolClient.claim(self, max_batches)


def test_against_an_older_service_the_pool_claims_as_before_and_asks_once(tmp_path: Path) -> None:
    client = _client(OlderService)
    trainer = memory_trainer(client, tmp_path, max_claim=1)
    try:
        _admitted(trainer)
        m = trainer.master
        assert m is not None
        for _ in range(4):
            assert trainer._plan(m).kind == "train"  # no error: the refusal is the older service's
        # The first claim under the cap, one filtered claim refused, then none while over the cap
        # (the pool before the filter): the fallback is remembered, not asked again every plan.
        assert client.claims == [(1, None), (1, [BOB])]
        assert [b.run_id for b in client.pending] == [ALICE, ALICE, BOB, BOB, BOB]
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("details", "status"),
    [
        # A newer service refusing the ids themselves: a bug of the pool, not an older service.
        ([{"loc": ["body", "run_ids", "0"], "msg": "bad", "type": "string_pattern_mismatch"}], 422),
        ([{"loc": ["body", "max_batches"], "msg": "bad", "type": "extra_forbidden"}], 422),
        (None, 409),
    ],
)
def test_other_claim_errors_are_not_taken_for_an_older_service(details: object, status: int) -> None:
    class Refusing:
        def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
            raise ApiError("no", status=status, code="x", details=details)

    source = HttpRunSource(Refusing())  # type: ignore[arg-type]  # only claim is called
    for _ in range(2):
        with pytest.raises(ApiError):
            source.claim(1, run_ids=[BOB])


def test_the_http_client_falls_back_on_an_older_services_422() -> None:
    """Over HTTP: the body without the filter is the one an older service knows (no `run_ids: null`),
    and its refusal of the field, as its error handler writes it, turns the filter off."""
    bodies: list[dict] = []

    def older_service(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        extra = sorted(set(body) - {"pool_id", "max_batches"})
        if extra:  # ClaimIn before run_ids: extra="forbid"; app/main.py's uniform 422 body
            details = [
                {"loc": ["body", k], "msg": "Extra inputs are not permitted", "type": "extra_forbidden"}
                for k in extra
            ]
            error = {
                "code": "validation_error",
                "message": f"{len(details)} invalid field(s)",
                "details": details,
            }
            return httpx.Response(422, json={"error": error})
        empty = {"lease_expires_at": "2026-01-01T00:00:00Z", "batches": []}
        return httpx.Response(200, content=msgspec.msgpack.encode(empty))

    client = PoolServiceClient("http://service", "token")
    client._http = httpx.Client(base_url="http://service", transport=httpx.MockTransport(older_service))
    client.pool_id = "pool_1"
    source = HttpRunSource(client)
    try:
        assert source.claim(4) == []
        assert source.claim(1, run_ids=[BOB]) == []  # refused: nothing, as the older pool claimed
        assert source.claim(1, run_ids=[BOB]) == []  # remembered: not asked again
        assert source.claim(4) == []
    finally:
        source.close()
    assert bodies == [
        {"pool_id": "pool_1", "max_batches": 4},
        {"pool_id": "pool_1", "max_batches": 1, "run_ids": [BOB]},
        {"pool_id": "pool_1", "max_batches": 4},
    ]


def test_run_directories_honour_the_filter(tmp_path: Path) -> None:
    source = make_source(tmp_path, RUN_A, RUN_B)
    write_rollout_step(tmp_path / RUN_A, 0, [batch(2, tag=1), batch(2, tag=2)])
    write_rollout_step(tmp_path / RUN_B, 0, [batch(2, tag=3)])
    source.restart_run(RUN_A, Progress())
    source.restart_run(RUN_B, Progress())
    assert tags(source.claim(10, run_ids=[RUN_B])) == [("b", 0, 0, 3)]
    assert source.claim(10, run_ids=[RUN_B]) == []
    assert tags(source.claim(10)) == [("a", 0, 0, 1), ("a", 0, 2, 2)]  # A's were left for later


# --------------------------------------------------------------------------- the packer alone


def _samples(n: int, length: int) -> TrainingBatch:
    prompt = [1] * (length // 2)
    completion = [2] * (length - len(prompt))
    sample = {
        "prompt_ids": prompt,
        "prompt_mask": [False] * len(prompt),
        "completion_ids": completion,
        "completion_mask": [True] * len(completion),
        "completion_logprobs": [-1.0] * len(completion),
        "advantage": 1.0,
    }
    return msgspec.convert({"examples": [sample] * n, "temperature": 1.0, "step": 0}, TrainingBatch)


@pytest.mark.parametrize(
    ("alice_len", "bob_within"),
    [
        (10, 1),  # short samples: bob shares the very next pack
        (60, 2),  # a sample nearly fills the row: alice's head sample may take the next pack first
    ],
)
@pytest.mark.parametrize(("alice_slot", "bob_slot"), [(0, 1), (1, 0)])
def test_the_packer_gives_a_newcomer_its_turn_beside_a_huge_buffer(
    alice_len: int, bob_within: int, alice_slot: int, bob_slot: int
) -> None:
    packer = Packer(n_slots=2, seq_len=64, dp_world_size=1, timeout_s=0.0)
    packer.add_run(alice_slot, batch_size=4096)
    packer.add_run(bob_slot, batch_size=8)
    packer.add_batch(alice_slot, _samples(4096, alice_len), batch_id=1)
    assert packer.pack() is not None  # alice alone
    packer.add_batch(bob_slot, _samples(8, 8), batch_id=2)
    got = []
    for _ in range(bob_within):
        result = packer.pack()
        assert result is not None
        got.append(result.runs[bob_slot].samples if bob_slot in result.runs else 0)
    assert got[-1] > 0 and sum(got) >= 1
    assert packer.buffered_samples(alice_slot) > 4000  # alice's buffer is still there


def test_the_filter_is_asked_for_again_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service upgraded under a registered pool is found: the refusal is remembered for
    CLAIM_FILTER_RETRY_S, then the filter is tried again (it was off until the pool registered anew)."""
    from trainer_core import http_source

    now = [1000.0]
    monkeypatch.setattr(http_source.time, "monotonic", lambda: now[0])
    client = _client(OlderService)
    source = HttpRunSource(client)
    assert source.claim(1, run_ids=[BOB]) == []
    now[0] += http_source.CLAIM_FILTER_RETRY_S - 1
    assert source.claim(1, run_ids=[BOB]) == []
    assert client.claims == [(1, [BOB])]  # remembered
    now[0] += 2
    assert source.claim(1, run_ids=[BOB]) == []  # refused again (this service is still the older one)
    assert client.claims == [(1, [BOB]), (1, [BOB])]  # asked again
