"""The built-in model's cache (`.loraloom/models`) under builds that start together: the demo and a
pool, two pytest-xdist workers. Each builds it; all end up loading the one complete directory, and
none leaves its temporary behind (the loser of the rename race left its own `.tmp` directory). The
temporaries of builds that died while saving go at the next load, once they are old enough not to
be a live build's."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from contracts.durable import OLD_SUFFIX, beside
from contracts.tokenizer_files import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from trainer_core.models import builtin

COMPLETE = {builtin.BUILT_FILE, "config.json", "model.safetensors", TOKENIZER_FILE, TOKENIZER_CONFIG_FILE}
"""What a complete build's directory holds (generation_config.json too, where transformers writes it)."""


def untrained() -> builtin.LlamaForCausalLM:
    """The built model's shape without its warm-up (which takes ~20 s): only the caching is tested."""
    torch.manual_seed(0)
    return builtin.LlamaForCausalLM(builtin.tiny_llama_config())


def assert_one_complete_model(cache: Path) -> None:
    path = builtin.cached_path(cache)
    assert os.listdir(cache) == [path.name]  # no temporary beside it
    assert set(os.listdir(path)) >= COMPLETE, os.listdir(path)
    assert json.loads((path / builtin.BUILT_FILE).read_text()) == {
        "name": builtin.NAME,
        "version": builtin.VERSION,
    }


def test_builds_racing_end_with_one_complete_model_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window forced open: neither build goes on to save until both found no cache and built.
    # Whichever renames first wins; the other's rename fails on the complete directory.
    both_built = threading.Barrier(2, timeout=120)  # a timeout only so that a bug fails, not hangs

    def build() -> builtin.LlamaForCausalLM:
        model = untrained()
        both_built.wait()
        return model

    monkeypatch.setattr(builtin, "build", build)
    loaded: list[object] = []
    failed: list[BaseException] = []

    def load() -> None:
        try:
            loaded.append(builtin.load(tmp_path))
        except BaseException as exc:  # the thread's failure must fail the test
            failed.append(exc)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failed, failed
    assert len(loaded) == 2
    assert_one_complete_model(tmp_path)
    # Both loaded the same weights, the cached ones.
    cached = builtin.LlamaForCausalLM.from_pretrained(builtin.cached_path(tmp_path))
    for model in loaded:
        assert isinstance(model, builtin.LlamaForCausalLM)
        for (name, mine), theirs in zip(
            model.state_dict().items(), cached.state_dict().values(), strict=True
        ):
            assert torch.equal(mine, theirs), name


def test_the_loser_keeps_the_winners_model_and_removes_its_temporary(tmp_path: Path) -> None:
    path = builtin.cached_path(tmp_path)
    builtin._publish(untrained(), path)  # the winner's
    weights = path / "model.safetensors"
    before = weights.stat()
    builtin._publish(untrained(), path)  # the loser's: its rename fails on the complete directory
    assert_one_complete_model(tmp_path)
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # left as it was


def test_a_failed_save_leaves_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(builtin, "save_char_tokenizer", full_disk)
    with pytest.raises(OSError, match="No space left"):
        builtin._publish(untrained(), builtin.cached_path(tmp_path))
    assert os.listdir(tmp_path) == []


def test_an_incomplete_directory_in_the_way_is_replaced(tmp_path: Path) -> None:
    # Not a build's (a build moves in complete): a hand's, or a crash's of an older version.
    path = builtin.cached_path(tmp_path)
    path.mkdir()
    (path / "config.json").write_text("{}")
    builtin._publish(untrained(), path)
    assert_one_complete_model(tmp_path)
    assert not any(name.endswith(OLD_SUFFIX) for name in os.listdir(tmp_path))


def test_dead_builds_temporaries_go_a_live_ones_and_others_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = builtin.cached_path(tmp_path)
    builtin._publish(untrained(), path)
    dead = beside(path)  # a build killed while saving
    legacy = tmp_path / f".{path.name}.4242.tmp"  # the loser's of a race, before this fix
    other = tmp_path / f".{builtin.NAME}-v{builtin.VERSION - 1}.4242.tmp"  # an older version's: not ours
    for leftover in (dead, legacy, other):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"half")

    builtin.load(tmp_path)  # all just written: a live build's, for all the load knows
    assert {dead, legacy, other} <= set(tmp_path.iterdir())

    # Old enough: `untouched` reads ctimes too, which a test cannot set back, so the cutoff moves.
    monkeypatch.setattr(builtin, "STALE_TEMPORARY_S", -60.0)
    builtin.load(tmp_path)
    assert set(tmp_path.iterdir()) == {path, other}
    assert set(os.listdir(path)) >= COMPLETE
