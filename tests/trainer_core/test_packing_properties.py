"""Property tests of the Packer and of `pack_ffd` (hypothesis).

Every sample carries its identity in its tokens (prompt tokens ``2·uid``, completion tokens
``2·uid + 1``), so each packed sample can be traced back to the one that went in.
"""

from unittest.mock import patch

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.wire import TrainingBatch, TrainingSample
from trainer_core.packing import MicroBatch, Packer, PackResult, SampleRef, assign_to_ranks, pack_ffd
from trainer_core.packing import bins as bins_module

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
    scan_max_bins=st.sampled_from([0, bins_module.LINEAR_SCAN_MAX_BINS]),
)
def test_pack_ffd_matches_the_textbook_algorithm(seq_len, data, scan_max_bins):
    """Both placements of `pack_ffd` (the tree, and the scan for few bins) are the textbook one."""
    lengths = data.draw(st.lists(st.integers(1, seq_len), max_size=80))
    with patch.object(bins_module, "LINEAR_SCAN_MAX_BINS", scan_max_bins):
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
            assert mb.teacher_logprobs is not None
            assert torch.allclose(mb.teacher_logprobs[seg], torch.tensor([0.0] * p + s.teacher_logprobs))
        elif mb.teacher_logprobs is not None:
            assert not mb.teacher_logprobs[seg].any()
        seen.append(uid)
        start += n
    if mb.is_filler:
        assert mb.num_samples == 0 and not mb.loss_mask.any()


class PackerModel:
    """The Packer under test beside what it should hold: every sample added, by uid, and which are
    still buffered. `add` and `pack` check the Packer against it after every action."""

    def __init__(self, config: dict, batch_sizes: dict[int, int]) -> None:
        self.packer = Packer(**config)
        self.batch_sizes = batch_sizes
        for slot, size in batch_sizes.items():
            self.packer.add_run(slot, batch_size=size)
        self.samples: dict[int, TrainingSample] = {}
        self.uid_of: dict[SampleRef, int] = {}
        self.slot_of: dict[int, int] = {}
        self.expected_buffered: set[int] = set()
        self.consumed: dict[int, int] = dict.fromkeys(batch_sizes, 0)
        self.packed_uids: list[int] = []
        self.next_uid = 1
        self.batch_id = 0

    def add(self, slot: int, shapes: list, skip: int) -> None:
        packer = self.packer
        self.batch_id += 1
        batch_samples = []
        for index, shape in enumerate(shapes):
            s = make_sample(self.next_uid, *shape)
            self.samples[self.next_uid] = s
            self.uid_of[SampleRef(self.batch_id, index)] = self.next_uid
            self.slot_of[self.next_uid] = slot
            if index >= skip:
                self.expected_buffered.add(self.next_uid)
            batch_samples.append(s)
            self.next_uid += 1
        added = packer.add_batch(
            slot, TrainingBatch(examples=batch_samples), batch_id=self.batch_id, skip=skip
        )
        assert added == max(0, len(shapes) - skip)
        assert packer.buffered_tokens() == sum(self.samples[u].num_tokens for u in self.expected_buffered)

    def pack(self) -> bool:
        packer = self.packer
        before = {slot: packer.samples_consumed_this_step(slot) for slot in self.batch_sizes}
        steps_before = {slot: packer.progress(slot).step for slot in self.batch_sizes}
        result = packer.pack(force=True)
        if result is None:
            assert not self.expected_buffered
            return False
        seen = self._check_grid(result.micro_batches)
        self._check_accounting(result, seen, before, steps_before)
        for u in seen:
            self.expected_buffered.remove(u)
        self.packed_uids.extend(seen)
        return True

    def _check_grid(self, grid: list[list[MicroBatch]]) -> list[int]:
        """The rows of one pack; returns the uids of their samples."""
        packer = self.packer
        assert len(grid) == packer.dp_world_size
        assert len({len(rank) for rank in grid}) == 1, "every rank holds the same number of micro-batches"
        assert sum(mb.is_filler for rank in grid for mb in rank) <= packer.dp_world_size - 1
        assert all(len(rank) == 1 for rank in grid), "the row budget: one row per rank per pack"
        seen: list[int] = []
        for rank in grid:
            for mb in rank:
                check_row(mb, packer, self.samples, seen)
        assert len(seen) == len(set(seen))
        real_tokens = sum(self.samples[u].num_tokens for u in seen)
        assert real_tokens <= packer.token_budget
        return seen

    def _check_accounting(
        self, result: PackResult, seen: list[int], before: dict[int, int], steps_before: dict[int, int]
    ) -> None:
        """The consumed refs are exactly the packed samples; step accounting by batch_size."""
        packer, uid_of = self.packer, self.uid_of
        refs = [ref for stats in result.runs.values() for ref in stats.consumed]
        assert sorted(uid_of[r] for r in refs) == sorted(seen)
        for slot, stats in result.runs.items():
            size = self.batch_sizes[slot]
            assert 1 <= stats.samples <= size - before[slot], "never more than the step still needs"
            assert stats.samples == len(stats.consumed)
            assert stats.tokens == sum(self.samples[uid_of[r]].num_tokens for r in stats.consumed)
            assert all(self.slot_of[uid_of[r]] == slot for r in stats.consumed)
            assert stats.step - steps_before[slot] == int(stats.step_completed) <= 1
            self.consumed[slot] += stats.samples
        loss_tokens = sum(int(mb.loss_mask.sum()) for rank in result.micro_batches for mb in rank)
        assert loss_tokens == sum(stats.loss_tokens for stats in result.runs.values())
        for slot in self.batch_sizes:
            progress = packer.progress(slot)
            assert progress.total_samples == self.consumed[slot]
            assert progress.step == self.consumed[slot] // self.batch_sizes[slot]
            assert packer.samples_consumed_this_step(slot) == self.consumed[slot] % self.batch_sizes[slot]


@SETTINGS
@given(scenarios())
def test_packer_invariants(scenario):
    config, batch_sizes, actions = scenario
    model = PackerModel(config, batch_sizes)
    for action in actions:
        if action[0] == "pack":
            model.pack()
        else:
            _, slot, shapes, skip = action
            model.add(slot, shapes, skip)

    # Drain: every buffered sample is packed exactly once, then nothing is left.
    for _ in range(10_000):
        if not model.pack():
            break
    assert not model.expected_buffered
    assert model.packer.buffered_tokens() == 0
    assert len(model.packed_uids) == len(set(model.packed_uids))
