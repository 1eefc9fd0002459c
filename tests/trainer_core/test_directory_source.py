"""DirectoryRunSource's batches and results on a temporary directory (the run discovery is in test_runs.py)."""

import logging
from pathlib import Path

import msgspec
import pytest
import tomli_w
import torch
from safetensors.torch import load_file, save_file

from contracts.arrays import encode as encode_arrays
from contracts.arrays import to_arrays
from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, EVICTED_FILE, STABLE_MARKER
from contracts.pool_api import PoolRegister
from contracts.progress import Progress
from contracts.wire import TrainingBatch, TrainingSample, msgpack_encoder
from trainer_core.directory_source import DirectoryRunSource, write_rollout_step

RUN_A = "run_aaaaaaaaaaaa"
RUN_B = "run_bbbbbbbbbbbb"
POOL = PoolRegister(
    base_model="loraloom-tiny",
    vocab_size=100,
    max_rank=8,
    target_modules=["q_proj"],
    slots=2,
    world_size=1,
    max_seq_len=32,
)


def batch(n: int, *, tag: int = 1, completion_ids: list[int] | None = None) -> TrainingBatch:
    """`n` samples; `tag` marks them (their prompt is [tag] * 2)."""
    ids = completion_ids or [5, 6, 7]
    sample = TrainingSample(
        prompt_ids=[tag, tag],
        prompt_mask=[False, False],
        completion_ids=ids,
        completion_mask=[True] * len(ids),
        completion_logprobs=[-1.0] * len(ids),
        advantage=1.0,
    )
    return TrainingBatch(examples=[sample] * n)


def make_source(root: Path, *run_ids: str) -> DirectoryRunSource:
    for run_id in run_ids:
        (root / run_id / "control").mkdir(parents=True)
        (root / run_id / "control" / "orch.toml").write_text(tomli_w.dumps({"batch_size": 2}))
    source = DirectoryRunSource(root)
    source.open(POOL)
    return source


def tags(claimed: list) -> list[tuple[str, int, int, int]]:
    """(run, rollout step, sample offset, tag) of each claimed batch."""
    return [
        (c.run_id[-1], c.rollout_step, c.sample_offset, c.payload.examples[0].prompt_ids[0]) for c in claimed
    ]


def test_stable_steps_in_order_files_by_name_and_runs_in_turn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    source = make_source(tmp_path, RUN_A, RUN_B)
    write_rollout_step(tmp_path / RUN_A, 0, [batch(2, tag=1), batch(3, tag=2)])
    write_rollout_step(tmp_path / RUN_A, 1, [batch(1, tag=3)])
    write_rollout_step(tmp_path / RUN_B, 5, [batch(2, tag=4)])
    unfinished = tmp_path / RUN_B / "rollouts" / "step_6"
    unfinished.mkdir()
    (unfinished / "batch_000000.msgpack").write_bytes(
        msgpack_encoder.encode(batch(2, tag=9))
    )  # no STABLE yet

    assert source.claim(10) == []  # nothing is handed out for a run the pool has not started
    source.restart_run(RUN_A, Progress())
    source.restart_run(RUN_B, Progress())
    first = source.claim(3)
    assert tags(first) == [("a", 0, 0, 1), ("b", 5, 0, 4), ("a", 0, 2, 2)]
    assert tags(source.claim(10)) == [("a", 1, 5, 3)]
    assert source.claim(10) == []
    assert len({c.id for c in first}) == 3 and all(c.num_samples == len(c.payload.examples) for c in first)

    (unfinished / STABLE_MARKER).write_text("6\n")
    assert tags(source.claim(10)) == [("b", 6, 2, 9)]

    source.release_run(RUN_A)
    write_rollout_step(tmp_path / RUN_A, 2, [batch(1)])
    assert source.claim(10) == []
    assert caplog.text == ""  # steps read in order are not "late"


def test_a_restart_hands_out_the_batches_after_the_checkpoint_again(tmp_path: Path) -> None:
    source = make_source(tmp_path, RUN_A)
    for step, tag in enumerate((1, 2, 3)):
        write_rollout_step(tmp_path / RUN_A, step, [batch(2, tag=tag)])
    source.restart_run(RUN_A, Progress())
    assert [c.sample_offset for c in source.claim(10)] == [0, 2, 4]

    # Checkpointed after 3 samples: the first batch was trained, the second straddles the checkpoint.
    source.restart_run(RUN_A, Progress(step=1, total_tokens=15, total_samples=3))
    assert tags(source.claim(10)) == [("a", 1, 2, 2), ("a", 2, 4, 3)]


def test_a_step_that_turns_stable_late_is_not_trained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = make_source(tmp_path, RUN_A)
    write_rollout_step(tmp_path / RUN_A, 2, [batch(1, tag=2)])
    source.restart_run(RUN_A, Progress())
    assert tags(source.claim(10)) == [("a", 2, 0, 2)]
    write_rollout_step(tmp_path / RUN_A, 1, [batch(1, tag=1)])
    with caplog.at_level(logging.WARNING):
        assert source.claim(10) == []
    assert "rollout steps [1] turned stable after step 2 was read" in caplog.text
    with pytest.raises(FileExistsError, match="already complete"):
        write_rollout_step(tmp_path / RUN_A, 1, [batch(1)])


def test_a_batch_that_cannot_be_trained_evicts_its_run_naming_the_file(tmp_path: Path) -> None:
    source = make_source(tmp_path, RUN_A, RUN_B)
    write_rollout_step(tmp_path / RUN_A, 0, [batch(1), batch(1, completion_ids=[5, 100, 7])])
    step_b = tmp_path / RUN_B / "rollouts" / "step_0"
    step_b.mkdir(parents=True)
    (step_b / "batch_x.msgpack").write_bytes(b"\x93not a batch")
    (step_b / STABLE_MARKER).write_text("0\n")
    source.restart_run(RUN_A, Progress())
    source.restart_run(RUN_B, Progress())

    assert tags(source.claim(10)) == [("a", 0, 0, 1)]  # the good batch before the bad one
    reason_a = (tmp_path / RUN_A / "control" / EVICTED_FILE).read_text()
    assert reason_a.startswith(
        "rollouts/step_0/batch_000001.msgpack cannot be trained: sample 0: completion_ids:"
    )
    assert "token id 100 at position 1 of completion_ids is outside the vocabulary [0, 100)" in reason_a
    reason_b = (tmp_path / RUN_B / "control" / EVICTED_FILE).read_text()
    assert reason_b.startswith("rollouts/step_0/batch_x.msgpack is not a msgpack TrainingBatch:")
    assert [r.run_id for r in source.list_runs()] == []  # both stopped
    assert source.claim(10) == []


def test_adapters_are_published_to_broadcast_with_a_stable_marker(tmp_path: Path) -> None:
    source = make_source(tmp_path, RUN_A)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / ADAPTER_CONFIG).write_text('{"r": 4}')
    save_file({"w": torch.tensor([1.0])}, adapter / ADAPTER_WEIGHTS)

    source.publish_adapter(RUN_A, 3, adapter)
    step_dir = tmp_path / RUN_A / "broadcast" / "step_3"
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS, STABLE_MARKER]
    )
    assert (step_dir / STABLE_MARKER).read_text() == "3\n"

    save_file({"w": torch.tensor([2.0])}, adapter / ADAPTER_WEIGHTS)
    source.publish_adapter(RUN_A, 3, adapter)  # a step trained again after a restart: replaced whole
    assert float(load_file(step_dir / ADAPTER_WEIGHTS)["w"][0]) == 2.0
    assert [p.name for p in (tmp_path / RUN_A / "broadcast").iterdir()] == ["step_3"]

    source.publish_adapter("run_cccccccccccc", 1, adapter)  # a deleted run: no ghost directory
    assert not (tmp_path / "run_cccccccccccc").exists()


def test_list_runs_reports_the_newest_checkpoint_as_progress(tmp_path: Path) -> None:
    source = make_source(tmp_path, RUN_A)
    assert source.list_runs()[0].progress == Progress()
    ckpt = tmp_path / RUN_A / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (ckpt / "progress.json").write_text(
        '{"step": 2, "progress": {"step": 2, "total_tokens": 40, "total_samples": 4}}'
    )
    assert source.list_runs()[0].progress == Progress()  # not stable yet
    (ckpt / STABLE_MARKER).write_text("2\n")
    assert source.list_runs()[0].progress == Progress(step=2, total_tokens=40, total_samples=4)


def test_decodes_what_the_service_stores(tmp_path: Path) -> None:
    """The files are the service's stored payload format: msgpack of a TrainingBatch."""
    source = make_source(tmp_path, RUN_A)
    step_dir = write_rollout_step(tmp_path / RUN_A, 0, [batch(2, tag=7)])
    (path,) = step_dir.glob("*.msgpack")
    assert msgspec.msgpack.decode(path.read_bytes(), type=TrainingBatch) == batch(2, tag=7)
    source.restart_run(RUN_A, Progress())
    assert source.claim(1)[0].payload == batch(2, tag=7)


def test_decodes_the_binary_form_the_service_stores_now(tmp_path: Path) -> None:
    """The service stores the binary form (contracts/arrays.py); a run directory holding such a file
    (e.g. a service's data directory) trains from it too."""
    source = make_source(tmp_path, RUN_A)
    step_dir = write_rollout_step(tmp_path / RUN_A, 0, [batch(2, tag=7)])
    (path,) = step_dir.glob("*.msgpack")
    path.write_bytes(encode_arrays(to_arrays(batch(2, tag=7))))
    source.restart_run(RUN_A, Progress())
    assert source.claim(1)[0].payload == batch(2, tag=7)
