"""`loraloom worker` refuses what it can tell is wrong before torchrun starts: one `error:` line and
a hint, the exit code of its kind, no traceback. Each of these used to launch torchrun and end in a
traceback from inside a rank (or, for a bad variable, named another variable than the one set).
`--dry-run` says where the worker token comes from, never the token. What only a rank can find out
(target modules the model lacks, a model transformers cannot load) is one line from the master rank
and exit code 2 (the slow tests at the end start torchrun on a tiny saved model). No service."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraloom.cli import cli
from tests.e2e.helpers import TORCHRUN_PICKS_THE_PORT
from trainer_core.models.tiny import build_model

runner = CliRunner()

SECRET = "s3cret-worker-token"


Env = dict[str, str | None]
"""An environment for CliRunner: None unsets a variable."""


def _refused(args: list[str], env: Env, code: int) -> str:
    result = runner.invoke(cli, ["worker", *args], env=env)
    assert result.exit_code == code, result.output
    assert result.output.startswith("error: ") and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 2, result.output  # the error and its hint
    return result.output


@pytest.fixture
def quiet_env(tmp_path: Path) -> Env:
    """No LORALOOM_* of the caller's; a pool started anyway would stop at once (an empty runs dir)."""
    (tmp_path / "runs").mkdir()
    env: Env = {k: None for k in os.environ if k.startswith("LORALOOM_")}
    return {**env, "LORALOOM_RUNS_DIR": str(tmp_path / "runs"), "LORALOOM_EXIT_WHEN_IDLE": "0"}


def test_a_directory_without_config_json_is_named_with_what_it_lacks(tmp_path, quiet_env):
    empty = tmp_path / "my-model"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    out = _refused(["--base-model", str(empty)], quiet_env, 2)
    assert str(empty) in out and "no config.json" in out and "save_pretrained" in out


def test_a_taken_master_port_is_refused_before_torchrun(quiet_env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _refused(["--nproc-per-node", "2", "--master-port", str(port)], quiet_env, 6)
    assert f"127.0.0.1:{port}: the port is in use" in out and "choose another --master-port" in out


def test_a_bad_setting_names_the_variable_or_flag_the_user_gave(quiet_env):
    out = _refused([], {**quiet_env, "LORALOOM_MAX_CONCURRENT_RUNS": "abc"}, 2)
    # pydantic reports the field by its first variable, LORALOOM_SLOTS, which was not set.
    assert "LORALOOM_MAX_CONCURRENT_RUNS: Input should be a valid integer" in out
    assert "LORALOOM_SLOTS" not in out
    assert "LORALOOM_SLOTS: " in _refused(["--dry-run"], {**quiet_env, "LORALOOM_SLOTS": "x"}, 2)
    # A flag is named as a flag, even with the variable set too; an empty module list is refused.
    out = _refused(["--slots", "0"], {**quiet_env, "LORALOOM_MAX_CONCURRENT_RUNS": "2"}, 2)
    assert "--slots: Input should be greater than or equal to 1" in out
    out = _refused([], {**quiet_env, "LORALOOM_TARGET_MODULES": ","}, 2)
    assert "LORALOOM_TARGET_MODULES: " in out and "at least 1 item" in out


def test_dry_run_says_where_the_token_comes_from_never_the_token(tmp_path, quiet_env):
    service = {**quiet_env, "LORALOOM_RUNS_DIR": None}
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = [
        ([], {"LORALOOM_WORKER_TOKEN": SECRET}, "from LORALOOM_WORKER_TOKEN"),
        (["--token", SECRET], {"LORALOOM_WORKER_TOKEN": "other"}, "from --token"),
        (
            [],
            {"LORALOOM_WORKER_TOKEN_FILE": str(token_file)},
            f"from LORALOOM_WORKER_TOKEN_FILE {token_file}",
        ),
        # The flag wins over the variable, as every flag does.
        (
            ["--token-file", str(token_file)],
            {"LORALOOM_WORKER_TOKEN": "x"},
            f"from --token-file {token_file}",
        ),
        (["--token-file", str(empty)], {}, f"none: --token-file {empty} is empty"),
        (["--token-file", str(tmp_path / "no")], {}, "none: cannot read --token-file"),
        ([], {}, "none: pass --token or --token-file, or set LORALOOM_WORKER_TOKEN"),
    ]
    for args, env, source in cases:
        result = runner.invoke(cli, ["worker", "--dry-run", *args], env={**service, **env})
        assert result.exit_code == 0, result.output
        shown = json.loads(result.stdout)
        assert shown["token"].startswith(source), (args, env, shown["token"])
        # Given as a flag, the token is on the command line anyway; it is never printed back.
        assert SECRET not in result.stdout
    without = runner.invoke(cli, ["worker", "--dry-run"], env=quiet_env)
    assert json.loads(without.stdout)["token"] == "none (not needed with --runs-dir)"


def _loraloom_worker(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The console script in a process of its own: huggingface_hub reads HF_HUB_OFFLINE and its
    cache directory once, when imported."""
    loraloom = Path(sys.executable).with_name("loraloom")
    full = {k: v for k, v in os.environ.items() if not k.startswith(("LORALOOM_", "HF_"))} | env
    return subprocess.run(
        [str(loraloom), "worker", *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=120
    )


def test_offline_a_hub_id_that_is_not_cached_is_refused_before_torchrun(tmp_path):
    (tmp_path / "runs").mkdir()
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "LORALOOM_EXIT_WHEN_IDLE": "0"}
    done = _loraloom_worker(["--runs-dir", "runs", "--base-model", "some-org/not-cached"], env, tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("error: base model some-org/not-cached is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE" in done.stderr and "Traceback" not in done.stderr
    assert "starting" not in done.stderr  # no rank was started
    assert len(done.stderr.strip().splitlines()) == 2, done.stderr


def test_a_hub_id_that_is_no_hub_id_is_a_usage_error(tmp_path):
    done = _loraloom_worker(["--runs-dir", str(tmp_path), "--base-model", "not a model"], {}, tmp_path)
    assert done.returncode == 2, done.stderr
    assert "neither a local directory nor a valid hub id" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture
def cached_hub_model(tmp_path: Path) -> Path:
    """`org/tiny` in a Hugging Face cache laid out as the hub client leaves it (refs/main → snapshot)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    build_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1).save_pretrained(
        repo / "snapshots" / "abc123"
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return tmp_path / "hub"


@pytest.mark.slow
def test_offline_a_cached_hub_id_passes_the_check_and_loads(tmp_path, cached_hub_model):
    """The check looks in the same cache transformers loads from: a cached model is not refused."""
    (tmp_path / "runs").mkdir()
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cached_hub_model),
        "LORALOOM_EXIT_WHEN_IDLE": "0",
        "OMP_NUM_THREADS": "1",
    }
    done = _loraloom_worker(["--runs-dir", "runs", "--base-model", "org/tiny"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "base model org/tiny loaded" in done.stderr


@pytest.fixture
def saved_model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-llama"
    build_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1).save_pretrained(
        path
    )
    return path


@pytest.mark.slow
def test_target_modules_the_model_lacks_are_one_line_naming_those_it_has(tmp_path, saved_model):
    """Known only once the model has loaded, in the ranks: the master logs one line naming the option
    and the model's linear layers, every rank exits 2, and so does the CLI; torchrun adds no
    traceback (its ChildFailedError) and no summary per rank."""
    (tmp_path / "runs").mkdir()
    args = ["--runs-dir", "runs", "--base-model", str(saved_model), "--target-modules", "q_proj,qkv"]
    args += ["--nproc-per-node", "2"]
    env = {"OMP_NUM_THREADS": "1", "LORALOOM_EXIT_WHEN_IDLE": "0", **TORCHRUN_PICKS_THE_PORT}
    done = _loraloom_worker(args, env, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "ERROR cannot start the worker pool" in line]
    assert len(errors) == 1, done.stderr[-3000:]
    assert (
        f"--target-modules (LORALOOM_TARGET_MODULES): the base model {saved_model} has no linear layer "
        "named qkv; its linear layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, "
        "v_proj"
    ) in errors[0]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_model_directory_transformers_cannot_load_is_one_line_from_the_rank(tmp_path, ranks: int):
    """config.json is there (the CLI's check passes) but names no model type: transformers' reason,
    on one line with what --base-model takes, and exit 2. With two ranks the second, waiting for the
    master's cache, stops with it (it died in that wait with a gloo traceback, and the pool then
    exited 1 or 2 by which rank torchrun saw end first)."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "bogus").mkdir()
    (tmp_path / "bogus" / "config.json").write_text("{}")
    args = ["--runs-dir", "runs", "--base-model", "./bogus"]
    if ranks > 1:
        args += ["--nproc-per-node", str(ranks)]
    env = {"OMP_NUM_THREADS": "1", "LORALOOM_EXIT_WHEN_IDLE": "0", **TORCHRUN_PICKS_THE_PORT}
    done = _loraloom_worker(args, env, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "ERROR cannot start the worker pool" in line]
    assert len(errors) == 1, done.stderr[-3000:]
    assert f"cannot start the worker pool: base model {tmp_path / 'bogus'}: Unrecognized model" in errors[0]
    assert "Check --base-model (LORALOOM_BASE_MODEL: a local model directory" in done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr[-3000:]
