"""The worker's one settings model: every option settable by LORALOOM_* and by flag, the flag wins,
`loraloom worker` offers every option, and LORALOOM_MODEL_CACHE is honoured (a worker started in a
directory it cannot write to builds nothing there)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from loraloom.cli import cli
from trainer_core.models import builtin
from trainer_core.settings import WorkerSettings
from trainer_core.worker import WorkerArgs, parse_args, parse_settings

# field: (environment variable, value from the environment, value from a flag, expected from the flag)
CASES: dict[str, tuple[str, str, str, object]] = {
    "url": ("LORALOOM_URL", "http://env:1", "http://flag:2", "http://flag:2"),
    "worker_token": ("LORALOOM_WORKER_TOKEN", "env-token", "flag-token", "flag-token"),
    "worker_token_file": ("LORALOOM_WORKER_TOKEN_FILE", "/env/tok", "/flag/tok", Path("/flag/tok")),
    "runs_dir": ("LORALOOM_RUNS_DIR", "/env/runs", "/flag/runs", Path("/flag/runs")),
    "heartbeat_file": ("LORALOOM_HEARTBEAT_FILE", "/env/hb", "/flag/hb", Path("/flag/hb")),
    "base_model": ("LORALOOM_BASE_MODEL", "org/env-model", "org/flag-model", "org/flag-model"),
    "model_cache_dir": ("LORALOOM_MODEL_CACHE", "/env/models", "/flag/models", Path("/flag/models")),
    "device": ("LORALOOM_DEVICE", "cuda", "cpu", "cpu"),
    "dtype": ("LORALOOM_DTYPE", "bf16", "fp32", "fp32"),
    "attention": ("LORALOOM_ATTENTION", "eager", "sdpa", "sdpa"),
    "gradient_checkpointing": ("LORALOOM_GRADIENT_CHECKPOINTING", "true", "false", False),
    "slots": ("LORALOOM_MAX_CONCURRENT_RUNS", "7", "3", 3),
    "max_rank": ("LORALOOM_MAX_RANK", "32", "8", 8),
    "target_modules": ("LORALOOM_TARGET_MODULES", "q_proj,v_proj", "up_proj", ("up_proj",)),
    "seq_len": ("LORALOOM_SEQ_LEN", "2048", "512", 512),
    "checkpoint_dir": ("LORALOOM_CHECKPOINT_DIR", "/env/ckpt", "/flag/ckpt", Path("/flag/ckpt")),
    "data_dir": ("LORALOOM_DATA_DIR", "/env/data", "/flag/data", Path("/flag/data")),
    "sampler_url": (
        "LORALOOM_SAMPLER_URL",
        "http://env-vllm:8000",
        "http://flag-vllm:8000",
        "http://flag-vllm:8000",
    ),
    "sampler_deadline": ("LORALOOM_SAMPLER_DEADLINE", "1800", "900.5", 900.5),
    "sampler_max_response_bytes": ("LORALOOM_SAMPLER_MAX_RESPONSE_BYTES", "1048576", "2048", 2048),
    "sampler_concurrency": ("LORALOOM_SAMPLER_CONCURRENCY", "32", "2", 2),
    "pack_timeout": ("LORALOOM_PACK_TIMEOUT", "5", "0.3", 0.3),
    "poll_interval": ("LORALOOM_POLL_INTERVAL", "1", "0.05", 0.05),
    "max_claim": ("LORALOOM_MAX_CLAIM", "8", "16", 16),
    "exit_when_idle": ("LORALOOM_EXIT_WHEN_IDLE", "9", "1.5", 1.5),
    "nproc_per_node": ("LORALOOM_WORKER_RANKS", "4", "2", 2),
    "master_port": ("LORALOOM_MASTER_PORT", "29000", "29001", 29001),
}


def _value(settings: WorkerSettings, name: str) -> object:
    value = getattr(settings, name)
    return settings.token if name == "worker_token" else value


def test_every_setting_has_a_case() -> None:
    assert set(CASES) == set(WorkerSettings.model_fields)


@pytest.mark.parametrize("name", sorted(CASES))
def test_env_sets_it_and_the_flag_wins(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    var, env_value, flag_value, expected = CASES[name]
    for other in os.environ:
        if other.startswith("LORALOOM_"):
            monkeypatch.delenv(other)
    monkeypatch.setenv(var, env_value)
    from_env = parse_settings([])
    assert _value(from_env, name) != _value(WorkerSettings.model_construct(), name)  # the env took effect
    flag = "--" + name.replace("_", "-")
    assert _value(parse_settings([flag, flag_value]), name) == expected


def test_the_cli_offers_every_setting_and_its_flag_wins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    command = typer.main.get_command(cli).commands["worker"]  # type: ignore[attr-defined]
    options = {opt for p in command.params for opt in p.opts}
    for name in CASES:
        flag = {"worker_token": "--token", "worker_token_file": "--token-file"}.get(
            name, "--" + name.replace("_", "-")
        )
        assert flag in options, flag

    monkeypatch.chdir(tmp_path)
    env = {var: value for var, value, _, _ in CASES.values()}
    flags = [
        "--slots",
        "3",
        "--pack-timeout",
        "0.3",
        "--model-cache-dir",
        "cache",
        "--target-modules",
        "up_proj",
    ]
    result = CliRunner().invoke(cli, ["worker", "--dry-run", *flags], env=env)
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert (shown["slots"], shown["pack_timeout"], shown["target_modules"]) == (3, 0.3, ["up_proj"])
    assert shown["max_rank"] == 32 and shown["url"] == "http://env:1"  # not given as flags: the env's
    # Relative paths are resolved against the caller's directory, once, before any child starts.
    assert shown["model_cache_dir"] == str(tmp_path / "cache")
    assert "worker_token" not in shown


def test_relative_paths_become_absolute_for_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LORALOOM_MODEL_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    args = parse_args(["--runs-dir", "runs", "--data-dir", "data"])
    assert isinstance(args, WorkerArgs)
    assert args.runs_dir == tmp_path / "runs"
    assert args.model_cache_dir == tmp_path / ".loraloom" / "models"
    assert args.checkpoint_home == tmp_path / "runs"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs a directory nobody can write (/sys)")
def test_a_worker_in_a_read_only_directory_uses_loraloom_model_cache(tmp_path: Path) -> None:
    # A "built" loraloom-tiny in the cache the environment names (untrained: only loading matters).
    cache = tmp_path / "models"
    model = builtin.LlamaForCausalLM(builtin.tiny_llama_config())
    path = builtin.cached_path(cache)
    model.save_pretrained(path)
    (path / "BUILT").write_text(json.dumps({"name": builtin.NAME, "version": builtin.VERSION}))
    runs = tmp_path / "runs"
    runs.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORALOOM_")}
    env |= {"LORALOOM_MODEL_CACHE": str(cache), "LORALOOM_EXIT_WHEN_IDLE": "0", "OMP_NUM_THREADS": "1"}
    loraloom = Path(sys.executable).with_name("loraloom")
    done = subprocess.run(
        [loraloom, "worker", "--runs-dir", str(runs), "--poll-interval", "0.05"],
        cwd="/sys",  # not writable, not even by root
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "base model loraloom-tiny loaded" in done.stderr
    assert "Read-only" not in done.stderr and "not permitted" not in done.stderr


@pytest.mark.parametrize(
    ("env", "argv", "named"),
    [
        ({"LORALOOM_MAX_CONCURRENT_RUNS": "abc"}, [], "LORALOOM_MAX_CONCURRENT_RUNS: "),  # not LORALOOM_SLOTS
        ({"LORALOOM_SLOTS": "abc"}, [], "LORALOOM_SLOTS: "),
        ({"LORALOOM_SEQ_LEN": "2"}, [], "LORALOOM_SEQ_LEN: "),
        ({"LORALOOM_SEQ_LEN": "2"}, ["--seq-len", "4"], "--seq-len: "),  # the flag won, and is named
    ],
)
def test_the_torchrun_entry_names_a_bad_setting_as_it_was_given(
    env: dict[str, str], argv: list[str], named: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`python -m trainer_core.worker` (what torchrun runs) printed pydantic's traceback, naming an
    aliased setting by its first variable whichever was set."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        parse_settings(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("trainer_core.worker: error: invalid worker settings: " + named), err
    assert "Traceback" not in err
