"""Property tests of the Packer and of `pack_ffd` (hypothesis).

Every sample carries its identity in its tokens (prompt tokens ``2·uid``, completion tokens
``2·uid + 1``), so each packed sample can be traced back to the one that went in.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.wire import TrainingBatch, TrainingSample
from trainer_core.packing import MicroBatch, Packer, SampleRef, assign_to_ranks, pack_ffd

torch.set_num_threads(1)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def naive_ffd(lengths: list[int], seq_len: int) -> list[list[int]]:
    """The textbook O(n · bins) First-Fit-Decreasing, as the reference."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(seq_len - lengths[i])
    return bins


@SETTINGS
@given(
    seq_len=st.integers(1, 64),
    data=st.data(),
)
def test_pack_ffd_matches_the_textbook_algorithm(seq_len, data):
    lengths = data.draw(st.lists(st.integers(1, seq_len), max_size=80))
    bins = pack_ffd(lengths, seq_len)
    assert bins == naive_ffd(lengths, seq_len)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= seq_len for b in bins)


@SETTINGS
@given(costs=st.lists(st.floats(0, 1e6), max_size=40), n_ranks=st.integers(1, 6))
def test_assign_to_ranks_uses_every_row_once_and_evens_counts(costs, n_ranks):
    grid = assign_to_ranks(costs, n_ranks)
    assert len(grid) == n_ranks
    assert sorted(i for g in grid for i in g) == list(range(len(costs)))
    counts = [len(g) for g in grid]
    assert max(counts) * n_ranks - len(costs) <= n_ranks - 1  # fillers needed


# ---- the Packer, end to end -------------------------------------------------------------------


@st.composite
def scenarios(draw):
    n_slots = draw(st.integers(1, 4))
    seq_len = draw(st.integers(4, 48))
    config = {
        "n_slots": n_slots,
        "seq_len": seq_len,
        "dp_world_size": draw(st.integers(1, 3)),
        "pad_to_multiple_of": draw(st.sampled_from([1, 2, 4, 8])),
    }
    slots = draw(st.lists(st.integers(0, n_slots - 1), min_size=1, max_size=n_slots, unique=True))
    batch_sizes = {slot: draw(st.integers(1, 5)) for slot in slots}
    # A script of actions: ("batch", slot, [(prompt, completion, scalar advantage?, teacher?)], skip)
    # or ("pack",).
    sample_shape = st.integers(1, seq_len).flatmap(
        lambda n: st.tuples(st.integers(0, n), st.just(n), st.booleans(), st.booleans(), st.booleans())
    )
    action = st.one_of(
        st.tuples(
            st.just("batch"),
            st.sampled_from(slots),
            st.lists(sample_shape, min_size=1, max_size=6),
            st.integers(0, 2),
        ),
        st.tuples(st.just("pack")),
    )
    actions = draw(st.lists(action, min_size=1, max_size=12))
    return config, batch_sizes, actions


def make_sample(
    uid: int, prompt: int, total: int, scalar: bool, teacher: bool, masked: bool
) -> TrainingSample:
    completion = total - prompt
    return TrainingSample(
        prompt_ids=[2 * uid] * prompt,
        prompt_mask=[True] * prompt,
        completion_ids=[2 * uid + 1] * completion,
        # Mask every other completion token in some samples (tool output, say).
        completion_mask=[not (masked and j % 2) for j in range(completion)],
        completion_logprobs=[-(uid + j / 100) for j in range(completion)],
        advantage=float(uid) if scalar else [uid + j / 10 for j in range(completion)],
        teacher_logprobs=[uid + 0.5] * completion if teacher else None,
    )


def check_row(mb: MicroBatch, packer: Packer, samples: dict[int, TrainingSample], seen: list[int]) -> None:
    """Invariants of one row; appends the uids of its samples to ``seen``."""
    length = mb.num_tokens
    for name in (
        "input_ids",
        "position_ids",
        "loss_mask",
        "advantages",
        "inference_logprobs",
        "temperatures",
    ):
        assert getattr(mb, name).shape == (length,)
    assert 1 <= length <= packer.seq_len
    assert sum(mb.seq_lens) == length
    assert int(mb.slot_token_counts.sum()) == length
    assert mb.slot_token_counts.shape == (packer.n_slots,)
    slots = mb.token_slots.tolist()
    assert slots == sorted(slots), "tokens must be in ascending slot order"
    assert torch.equal(torch.bincount(mb.token_slots, minlength=packer.n_slots), mb.slot_token_counts)
    # Padding only to the next multiple (or seq_len).
    real = sum(mb.seq_lens[: mb.num_samples])
    if not mb.is_filler:
        m = packer.pad_to_multiple_of
        assert length == min(-(-real // m) * m, packer.seq_len)

    start = 0
    for k, n in enumerate(mb.seq_lens):
        seg = slice(start, start + n)
        assert mb.position_ids[seg].tolist() == list(range(n)), "positions restart per sample"
        if k >= mb.num_samples:  # the padding pseudo-sequence
            assert (mb.sample_ids[seg] == -1).all() and not mb.loss_mask[seg].any()
            assert (mb.temperatures[seg] == 1.0).all()
            start += n
            continue
        assert (mb.sample_ids[seg] == k).all()
        ids = mb.input_ids[seg].tolist()
        uid = ids[0] // 2
        s = samples[uid]
        assert ids == s.prompt_ids + s.completion_ids, "a sample is packed whole and in order"
        p, c = len(s.prompt_ids), len(s.completion_ids)
        expected_loss = [False] * p + list(s.completion_mask)
        expected_loss[0] = False  # no in-sample predecessor
        assert mb.loss_mask[seg].tolist() == expected_loss
        assert torch.allclose(mb.inference_logprobs[seg], torch.tensor([0.0] * p + s.completion_logprobs))
        adv = s.advantage if isinstance(s.advantage, list) else [s.advantage] * c
        assert torch.allclose(mb.advantages[seg], torch.tensor([0.0] * p + adv))
        if s.teacher_logprobs is not None:
            assert torch.allclose(mb.teacher_logprobs[seg], torch.tensor([0.0] * p + s.teacher_logprobs))
        elif mb.teacher_logprobs is not None:
            assert not mb.teacher_logprobs[seg].any()
        seen.append(uid)
        start += n
    if mb.is_filler:
        assert mb.num_samples == 0 and not mb.loss_mask.any()


@SETTINGS
@given(scenarios())
def test_packer_invariants(scenario):
    config, batch_sizes, actions = scenario
    packer = Packer(**config)
    for slot, size in batch_sizes.items():
        packer.add_run(slot, batch_size=size)

    samples: dict[int, TrainingSample] = {}
    uid_of: dict[SampleRef, int] = {}
    slot_of: dict[int, int] = {}
    expected_buffered: set[int] = set()
    consumed: dict[int, int] = dict.fromkeys(batch_sizes, 0)
    packed_uids: list[int] = []
    next_uid = 1
    batch_id = 0

    def do_pack() -> bool:
        before = {slot: packer.samples_consumed_this_step(slot) for slot in batch_sizes}
        steps_before = {slot: packer.progress(slot).step for slot in batch_sizes}
        result = packer.pack(force=True)
        if result is None:
            assert not expected_buffered
            return False
        grid = result.micro_batches
        assert len(grid) == packer.dp_world_size
        assert len({len(rank) for rank in grid}) == 1, "every rank holds the same number of micro-batches"
        assert sum(mb.is_filler for rank in grid for mb in rank) <= packer.dp_world_size - 1
        assert all(len(rank) == 1 for rank in grid), "the row budget: one row per rank per pack"
        seen: list[int] = []
        for rank in grid:
            for mb in rank:
                check_row(mb, packer, samples, seen)
        assert len(seen) == len(set(seen))
        real_tokens = sum(samples[u].num_tokens for u in seen)
        assert real_tokens <= packer.token_budget

        # The consumed refs are exactly the packed samples; step accounting by batch_size.
        refs = [ref for stats in result.runs.values() for ref in stats.consumed]
        assert sorted(uid_of[r] for r in refs) == sorted(seen)
        for slot, stats in result.runs.items():
            size = batch_sizes[slot]
            assert 1 <= stats.samples <= size - before[slot], "never more than the step still needs"
            assert stats.samples == len(stats.consumed)
            assert stats.tokens == sum(samples[uid_of[r]].num_tokens for r in stats.consumed)
            assert all(slot_of[uid_of[r]] == slot for r in stats.consumed)
            assert stats.step - steps_before[slot] == int(stats.step_completed) <= 1
            consumed[slot] += stats.samples
        loss_tokens = sum(int(mb.loss_mask.sum()) for rank in grid for mb in rank)
        assert loss_tokens == sum(stats.loss_tokens for stats in result.runs.values())
        for slot in batch_sizes:
            progress = packer.progress(slot)
            assert progress.total_samples == consumed[slot]
            assert progress.step == consumed[slot] // batch_sizes[slot]
            assert packer.samples_consumed_this_step(slot) == consumed[slot] % batch_sizes[slot]
        for u in seen:
            expected_buffered.remove(u)
        packed_uids.extend(seen)
        return True

    for action in actions:
        if action[0] == "pack":
            do_pack()
            continue
        _, slot, shapes, skip = action
        batch_id += 1
        batch_samples = []
        for index, shape in enumerate(shapes):
            s = make_sample(next_uid, *shape)
            samples[next_uid] = s
            uid_of[SampleRef(batch_id, index)] = next_uid
            slot_of[next_uid] = slot
            if index >= skip:
                expected_buffered.add(next_uid)
            batch_samples.append(s)
            next_uid += 1
        added = packer.add_batch(slot, TrainingBatch(examples=batch_samples), batch_id=batch_id, skip=skip)
        assert added == max(0, len(shapes) - skip)
        assert packer.buffered_tokens() == sum(samples[u].num_tokens for u in expected_buffered)

    # Drain: every buffered sample is packed exactly once, then nothing is left.
    for _ in range(10_000):
        if not do_pack():
            break
    assert not expected_buffered
    assert packer.buffered_tokens() == 0
    assert len(packed_uids) == len(set(packed_uids))
