"""A round of Tinker `sample` requests served by an external server (trainer_core.external_sampler)
goes to it together, at most `concurrency` at a time, each answer in its own request's result, one
request's failure its own; the whole round ends within one deadline however many requests wait;
and one client, its connections kept alive, serves every round until the pool closes it. Against
the fake vLLM of tests/trainer_core/test_external_sampler.py, whose `hold` pause point makes each
overlap certain (a barrier), not a matter of timing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contracts.progress import Progress
from tests.orchestrator.test_client_bounds import RawServer
from tests.orchestrator.test_sampler_openai_bounds import counted, trickle_completion
from tests.trainer_core.test_external_sampler import BASE, CONFIG, FakeVllm, item, serving_fake_vllm
from tests.trainer_core.test_sampling import tiny_model
from trainer_core.external_sampler import ExternalSampler
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.sample_server import COPY_ID_FILE, PEFT_DIR, sampler_weights_dir, save_sampler_weights
from trainer_core.slots import RunSlot

HOLD_S = 10.0
"""How long a held request waits for the others before the test fails: a guard, never reached."""


@pytest.fixture
def fake_vllm() -> Iterator[tuple[str, FakeVllm]]:
    with serving_fake_vllm() as served:
        yield served


def hold_until_all_arrive(fake: FakeVllm, parties: int) -> threading.Barrier:
    """Each completions request waits until `parties` of them have arrived: served one after another,
    the first would wait alone and the barrier break (its request failing)."""
    barrier = threading.Barrier(parties, timeout=HOLD_S)

    def hold(body: dict[str, Any]) -> None:
        barrier.wait()

    fake.hold = hold
    return barrier


def tokens_of(result: Any) -> list[list[int]]:
    assert result.error is None and result.sequences is not None, result.error
    return [list(s.tokens) for s in result.sequences]


def test_a_rounds_requests_go_together_each_answer_in_its_own_result(tmp_path: Path, fake_vllm) -> None:
    url, fake = fake_vllm
    _, lora = tiny_model(PACKED_ATTENTION)
    save_sampler_weights(tmp_path, RunSlot(0, "run_a", CONFIG, Progress(step=1)), lora, peft_base_model=BASE)
    hold_until_all_arrive(fake, 5)
    sampler = ExternalSampler(url, tmp_path, BASE, concurrency=8)
    # Claim indices out of order; two requests of the same new adapter.
    work = [
        (7, item("r7", None, [10]), None),
        (2, item("r2", 1, [20]), 0),
        (9, item("r9", None, [30], num_samples=1), None),
        (4, item("r4", 1, [40]), 0),
        (0, item("r0", None, [50]), None),
    ]
    try:
        results = sampler.serve(work)
    finally:
        sampler.close()

    assert fake.most_in_flight == 5  # all held at once: none waited for another's answer
    assert sorted(results) == [0, 2, 4, 7, 9]
    for index, request, _ in work:
        prompt_end = request.sampling.prompt[-1] if request.sampling else -1
        assert results[index].request_id == request.request_id
        assert tokens_of(results[index])[0] == [prompt_end + 1, prompt_end + 2, prompt_end + 3]
    assert len(tokens_of(results[9])) == 1 and len(tokens_of(results[7])) == 2
    # The adapter both asked for was loaded once, and both used it.
    assert len(fake.loads) == 1
    name = fake.loads[0]["lora_name"]
    assert sorted(c["prompt"] for c in fake.completions if c["model"] == name) == [[20], [40]]
    assert sampler._loading == {}  # its lock went with the load: none kept per step for the pool's life


def test_no_more_requests_are_in_flight_than_the_concurrency(tmp_path: Path, fake_vllm) -> None:
    """Each request is held until the concurrency's worth are in flight (or the last has arrived):
    the bound is reached in every wave and never passed, on as many connections, kept."""
    url, fake = fake_vllm
    requests, concurrency = 7, 3

    def hold_until_saturated(body: dict[str, Any]) -> None:
        with fake.changed:
            saturated = fake.changed.wait_for(
                lambda: fake.in_flight >= concurrency or fake.arrived == requests, timeout=HOLD_S
            )
        assert saturated

    fake.hold = hold_until_saturated
    sampler = ExternalSampler(url, tmp_path, BASE, concurrency=concurrency)
    try:
        results = sampler.serve([(k, item(f"r{k}", None, [k]), None) for k in range(requests)])
    finally:
        sampler.close()
    assert [tokens_of(results[k])[0][0] for k in range(requests)] == [k + 1 for k in range(requests)]
    assert fake.most_in_flight == concurrency
    assert len(set(fake.peers)) == concurrency  # the client's connections: as many, and reused


def test_one_failing_request_fails_alone_in_a_concurrent_round(tmp_path: Path, fake_vllm) -> None:
    url, fake = fake_vllm
    barrier = threading.Barrier(3, timeout=HOLD_S)

    def hold_then_crash_on_666(body: dict[str, Any]) -> None:
        barrier.wait()  # the three are in flight together
        if body["prompt"] == [666]:
            raise ConnectionAbortedError("the server dies on this one")  # no answer: the socket closes

    fake.hold = hold_then_crash_on_666
    sampler = ExternalSampler(url, tmp_path, BASE)
    work = [
        (0, item("ok-a", None, [1]), None),
        (1, item("bad", None, [666]), None),
        (2, item("ok-b", None, [3]), None),
    ]
    try:
        results = sampler.serve(work)
    finally:
        sampler.close()
    assert results[1].request_id == "bad" and results[1].sequences is None
    assert results[1].error is not None and "did not answer /v1/completions" in results[1].error
    assert tokens_of(results[0])[0] == [2, 3, 4] and tokens_of(results[2])[0] == [4, 5, 6]


def test_one_client_serves_every_round_until_closed(tmp_path: Path, fake_vllm) -> None:
    url, fake = fake_vllm
    barrier = hold_until_all_arrive(fake, 2)
    sampler = ExternalSampler(url, tmp_path, BASE, concurrency=2)
    first = sampler.serve([(0, item("a", None, [1]), None), (1, item("b", None, [2]), None)])
    first_peers = set(fake.peers)
    barrier.reset()
    second = sampler.serve([(0, item("c", None, [3]), None), (1, item("d", None, [4]), None)])
    assert all(r.error is None for r in [*first.values(), *second.values()])
    # Two connections, opened by the first round and kept for the second.
    assert len(first_peers) == 2 and set(fake.peers) == first_peers
    assert fake.open_connections == 2

    sampler.close()
    with fake.changed:
        assert fake.changed.wait_for(lambda: fake.open_connections == 0, timeout=HOLD_S)
    # A round after `close` opens a client of its own.
    fake.hold = None
    third = sampler.serve([(0, item("e", None, [5]), None)])
    sampler.close()
    assert third[0].error is None and fake.peers[-1] not in first_peers


@pytest.mark.timeout(60)  # a guard: a deadline per request would still end, this one much sooner
def test_a_hung_server_costs_a_round_one_deadline_not_one_per_request(tmp_path: Path) -> None:
    """Three requests, two at a time, to a server that never finishes an answer: the two sent fail
    at the round's deadline and the third, still waiting for its turn then, is not sent at all."""
    connections: list[int] = []
    with RawServer(counted(trickle_completion, connections)) as server:
        sampler = ExternalSampler(server.url, tmp_path, BASE, timeout_s=30.0, deadline_s=0.5, concurrency=2)
        try:
            results = sampler.serve([(k, item(f"r{k}", None, [k]), None) for k in range(3)])
        finally:
            sampler.close()
    assert [results[k].request_id for k in range(3)] == ["r0", "r1", "r2"]
    assert all(r.sequences is None for r in results.values())
    errors = [str(r.error) for r in results.values()]
    assert len(connections) == 2
    sent = [e for e in errors if e.startswith(f"the external sampler did not answer POST {server.url}")]
    assert len(sent) == 2 and all("within the deadline of 0.5s of its round" in e for e in sent)
    (waiting,) = [e for e in errors if e not in sent]
    assert waiting.startswith("the external sampler did not get to this request within the deadline of 0.5s")
    assert "its 3 requests go 2 at a time" in waiting and "ExternalSampler.concurrency" in waiting


def test_a_fault_of_ours_fails_the_round_as_itself(tmp_path: Path, fake_vllm) -> None:
    """Not a refusal (here an unreadable copy id): raised as it is, not wrapped in an ExceptionGroup,
    for the pool's catch to fail the round's samples with its message."""
    url, _ = fake_vllm
    _, lora = tiny_model(PACKED_ATTENTION)
    save_sampler_weights(tmp_path, RunSlot(0, "run_a", CONFIG, Progress(step=1)), lora, peft_base_model=BASE)
    (sampler_weights_dir(tmp_path, "run_a", 1) / PEFT_DIR / COPY_ID_FILE).write_bytes(b"\xff\xfe")
    sampler = ExternalSampler(url, tmp_path, BASE)
    try:
        with pytest.raises(UnicodeDecodeError):
            sampler.serve([(0, item("fine", None, [1]), None), (1, item("unreadable", 1, [2]), 0)])
    finally:
        sampler.close()


@pytest.mark.parametrize("concurrency", [0, -3])
def test_a_concurrency_below_one_is_refused(tmp_path: Path, concurrency: int) -> None:
    with pytest.raises(
        ValueError, match=f"ExternalSampler.concurrency must be at least 1, not {concurrency}"
    ):
        ExternalSampler("http://vllm:8000", tmp_path, BASE, concurrency=concurrency)
