"""A run whose `init_from` weights cannot be loaded fails with a reason the tenant reads
(GET /v1/runs/{id}): it names what is missing, never the pool's file paths (the reason quoted the
checkpoint's absolute path, the service's data directory with it)."""

from pathlib import Path

import pytest

from contracts.http import NotFound, RetryExhausted
from contracts.pool_api import InitFrom
from contracts.run_config import LoraSettings, RunConfig
from trainer_core.dist import World
from trainer_core.init_from import _reason, load_initial_weights
from trainer_core.lora import MultiLoRA, apply_multi_lora
from trainer_core.models.tiny import build_model

TARGETS = ("q_proj", "v_proj")
CONFIG = RunConfig(lora=LoraSettings(rank=4, alpha=8.0, target_modules=TARGETS))


class _Source:
    """The master's answers about the new run: where it starts from and, for an adapter, its files
    (written by `files`, which may raise as the service's download does)."""

    def __init__(self, spec: InitFrom, files: dict[str, bytes] | Exception | None = None) -> None:
        self.spec, self.files = spec, files

    def init_from(self, run_id: str) -> InitFrom | None:
        return self.spec

    def fetch_init_adapter(self, run_id: str, dest: Path) -> bool:
        if isinstance(self.files, Exception):
            raise self.files
        for name, data in (self.files or {}).items():
            (dest / name).write_bytes(data)
        return True


@pytest.fixture(scope="module")
def lora() -> MultiLoRA:
    return apply_multi_lora(build_model("llama", seed=0), list(TARGETS), n_slots=2, max_rank=8)


def _error(lora: MultiLoRA, source: _Source, checkpoint_home: Path) -> str:
    loaded = load_initial_weights(
        lora=lora,
        slot=0,
        run_id="run_00000000000b",
        config=CONFIG,
        checkpoint_home=checkpoint_home,
        source=source,  # type: ignore[arg-type]  # only the two calls the master makes
        world=World(),
    )
    assert loaded.error is not None
    return loaded.error


def test_a_missing_checkpoint_is_named_without_the_pools_path(lora, tmp_path):
    home = tmp_path / "data" / "runs"
    (home / "run_00000000000a" / "checkpoints" / "step_4").mkdir(parents=True)  # no STABLE marker
    spec = InitFrom(run_id="run_00000000000a", checkpoint=4)
    error = _error(lora, _Source(spec), home)
    assert (
        error
        == "checkpoint 4 of run run_00000000000a: FileNotFoundError: step_4 is not a stable checkpoint (no STABLE marker)"
    )
    assert str(tmp_path) not in error and "/" not in error


def test_an_adapter_that_does_not_load_is_named_without_the_temporary_path(lora, tmp_path):
    # The download gave no files: the import reads the config file from a temporary directory.
    error = _error(lora, _Source(InitFrom(run_id="run_00000000000a", step=3), files={}), tmp_path)
    assert error.startswith("FileNotFoundError: [Errno 2] No such file or directory: 'adapter_config.json'")
    assert "/" not in error


def test_the_services_refusal_is_kept_as_it_was_said(lora, tmp_path):
    refusal = NotFound("the files of run run_00000000000a's adapter 3 are missing", code="not_found")
    error = _error(lora, _Source(InitFrom(run_id="run_00000000000a", step=3), files=refusal), tmp_path)
    assert error == f"NotFound: {refusal}"


def test_a_route_in_the_reason_is_kept_whole(lora, tmp_path):
    # Only the pool's directories are cut: an API route is what the tenant needs to read.
    gave_up = RetryExhausted(
        "GET /v1/pool/runs/run_00000000000a/init_adapter: gave up after 5 attempts: 503 busy",
        attempts=5,
        last_error=OSError("503 busy"),
    )
    error = _error(lora, _Source(InitFrom(run_id="run_00000000000a", step=3), files=gave_up), tmp_path)
    assert error == f"RetryExhausted: {gave_up}"


def test_only_paths_under_the_pools_roots_are_cut() -> None:
    root = (Path("/tmp"),)
    # A root inside a longer path is no root of the pool's.
    assert _reason(OSError("cannot read /var/tmp/x/a.safetensors"), root) == (
        "OSError: cannot read /var/tmp/x/a.safetensors"
    )
    assert (
        _reason(OSError("No such file: '/tmp/run_a-init-x1/a.json'"), root)
        == "OSError: No such file: 'a.json'"
    )
