"""Every file and directory the pool writes follows the process umask, as a plain `open()` and
`mkdir()` do: under umask 022 a shared model cache or checkpoint directory is readable by its other
users (0644 files, 0755 directories); under 077 it stays private (0600, 0700).

safetensors' `save_file` always left 0600 (it writes a temporary file and renames it), and so did
transformers' `save_pretrained`, which uses it: the built-in model's weights in the cache, exported
adapters, checkpoints, critics, the sampler's weight copies. `tempfile.mkdtemp`'s 0700 made the
exported adapter's and the checkpoint's directories private too (`contracts.durable.follow_umask`)."""

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from contracts.durable import follow_umask, process_umask
from contracts.progress import Progress
from contracts.run_config import LoraSettings, RunConfig
from trainer_core.checkpoint import save_checkpoint
from trainer_core.critic import ValueHeads, save_value_head
from trainer_core.export import export_peft_adapter
from trainer_core.lora import MultiLoRA, apply_multi_lora
from trainer_core.models import builtin
from trainer_core.models.tiny import build_model
from trainer_core.sample_server import save_sampler_weights
from trainer_core.slots import RunSlot

TARGETS = ("q_proj", "v_proj", "down_proj")
CONFIG = RunConfig(lora=LoraSettings(rank=4, alpha=8.0, target_modules=TARGETS))


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=["umask022", "umask077", "umask002"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


@pytest.fixture(scope="module")
def lora() -> MultiLoRA:
    handle = apply_multi_lora(build_model("llama", seed=0), list(TARGETS), n_slots=2, max_rank=4)
    handle.configure_slot(0, rank=4, alpha=8.0, dropout=0.0)
    return handle


def _modes(root: Path) -> dict[str, str]:
    """Each path under `root` (itself included) and its permission bits, in octal."""
    return {
        str(path.relative_to(root.parent)): oct(stat.S_IMODE(path.stat().st_mode))
        for path in [root, *sorted(root.rglob("*"))]
    }


def _expected(root: Path, mask: int) -> dict[str, str]:
    """What `open()` and `mkdir()` under `mask` give: 0o666 / 0o777 less the mask."""
    return {
        str(path.relative_to(root.parent)): oct((0o777 if path.is_dir() else 0o666) & ~mask)
        for path in [root, *sorted(root.rglob("*"))]
    }


def test_the_umask_is_read_as_set(umask: int) -> None:
    assert process_umask() == umask
    assert process_umask() == umask  # and left as it was


def test_follow_umask_gives_a_file_and_a_directory_what_open_and_mkdir_would(
    tmp_path: Path, umask: int
) -> None:
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    (directory / "f").touch(mode=0o600)
    follow_umask(directory)
    follow_umask(directory / "f")
    assert _modes(directory) == _expected(directory, umask)
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert oct(stat.S_IMODE(plain.stat().st_mode)) == _modes(directory)["d/f"]


def test_an_exported_adapter_follows_the_umask(tmp_path: Path, umask: int, lora: MultiLoRA) -> None:
    out = export_peft_adapter(lora, 0, tmp_path / "adapter", base_model_name_or_path="tiny")
    assert len(list(out.iterdir())) == 2
    assert _modes(out) == _expected(out, umask)


def test_a_checkpoint_follows_the_umask(tmp_path: Path, umask: int, lora: MultiLoRA) -> None:
    step = save_checkpoint(
        tmp_path / "checkpoints",
        3,
        adapter=lora.slot_state_dict(0),
        optimizer_state={"step": torch.tensor(3)},
        progress={"step": 3},
        extra={"rng": torch.tensor([1, 2])},
        keep_last=1,
    )
    assert {p.name for p in step.iterdir()} >= {"adapter.safetensors", "optimizer.pt", "STABLE"}
    assert _modes(step) == _expected(step, umask)


def test_a_critic_follows_the_umask(tmp_path: Path, umask: int) -> None:
    path = save_value_head(ValueHeads(2, 8), 1, tmp_path)
    assert oct(stat.S_IMODE(path.stat().st_mode)) == oct(0o666 & ~umask)


def test_the_sampler_weights_follow_the_umask(tmp_path: Path, umask: int, lora: MultiLoRA) -> None:
    save_sampler_weights(tmp_path, RunSlot(0, "run_a", CONFIG, Progress(step=2)), lora)
    root = tmp_path / "run_a"
    assert any(p.suffix == ".safetensors" for p in root.rglob("*"))
    assert _modes(root) == _expected(root, umask)


def test_the_built_in_models_cache_follows_the_umask(
    tmp_path: Path, umask: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache another user of the machine loads from (LORALOOM_MODEL_CACHE): the build's warm-up
    is skipped (an untrained model is saved alike)."""
    monkeypatch.setattr(builtin, "build", lambda: builtin.LlamaForCausalLM(builtin.tiny_llama_config()))
    cache = tmp_path / "models"
    builtin.load(cache)
    path = builtin.cached_path(cache)
    assert (path / "model.safetensors").is_file()
    assert _modes(cache) == _expected(cache, umask)


def test_a_shared_directorys_setgid_and_sticky_bits_stay(tmp_path: Path) -> None:
    """In a setgid directory (files keep its group: the usual shared-group setup) the bit must stay,
    or the files written into the widened directory lose the group they are shared with."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o700 | stat.S_ISGID | stat.S_ISVTX)
    old = os.umask(0o027)
    try:
        follow_umask(shared)
    finally:
        os.umask(old)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o750 | stat.S_ISGID | stat.S_ISVTX


def test_a_name_swapped_for_a_symlink_is_refused_not_followed(tmp_path: Path) -> None:
    """Its target (another file of the pool's user) keeps its mode: the chmod does not follow."""
    private = tmp_path / "private"
    private.write_bytes(b"secret")
    private.chmod(0o600)
    link = tmp_path / "adapter.safetensors"
    link.symlink_to(private)
    with pytest.raises(OSError):
        follow_umask(link)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
