"""A setting with two variables (the pool's slots: LORALOOM_SLOTS or LORALOOM_MAX_CONCURRENT_RUNS)
set to different values is a start-up error naming both variables and their values, at both entry
points (`loraloom worker`, and `python -m trainer_core.worker`, what torchrun runs). Before, the
first of pydantic's AliasChoices set (LORALOOM_SLOTS) won without a word. The same value in both is
fine, and a flag wins over both (it settles the question: no error)."""

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from loraloom.cli import cli
from trainer_core.settings import WorkerSettings
from trainer_core.worker import parse_settings

runner = CliRunner()

DISAGREE = {"LORALOOM_SLOTS": "2", "LORALOOM_MAX_CONCURRENT_RUNS": "5"}


def _dry_run(env: dict[str, str | None], *flags: str) -> tuple[int, str]:
    result = runner.invoke(cli, ["worker", "--runs-dir", "runs", "--dry-run", *flags], env=env)
    return result.exit_code, result.output


def test_the_cli_refuses_the_two_slot_variables_disagreeing(clean_env) -> None:
    code, out = _dry_run({**clean_env, **DISAGREE})
    assert code == 2, out
    first = out.splitlines()[0]
    assert first.startswith("error: invalid worker settings: "), out
    assert "LORALOOM_SLOTS='2'" in first and "LORALOOM_MAX_CONCURRENT_RUNS='5'" in first, out
    assert "--slots" in first and "Traceback" not in out


def test_the_torchrun_entry_refuses_them_too(clean_env, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for name, value in DISAGREE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        parse_settings([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("trainer_core.worker: error: invalid worker settings: "), err
    assert "LORALOOM_SLOTS='2'" in err and "LORALOOM_MAX_CONCURRENT_RUNS='5'" in err, err


def test_the_settings_model_itself_refuses_them(clean_env, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DISAGREE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match="LORALOOM_MAX_CONCURRENT_RUNS='5'"):
        WorkerSettings()


@pytest.mark.parametrize(
    ("slots", "max_concurrent_runs"), [("6", "6"), ("6", "06"), (" 6", "6")], ids=["same", "zero", "space"]
)
def test_the_same_value_in_both_is_fine(clean_env, slots: str, max_concurrent_runs: str) -> None:
    env = {**clean_env, "LORALOOM_SLOTS": slots, "LORALOOM_MAX_CONCURRENT_RUNS": max_concurrent_runs}
    code, out = _dry_run(env)
    assert code == 0, out
    assert '"slots": 6' in out


@pytest.mark.parametrize("variable", ["LORALOOM_SLOTS", "LORALOOM_MAX_CONCURRENT_RUNS"])
def test_either_variable_alone_sets_the_slots(clean_env, variable: str) -> None:
    code, out = _dry_run({**clean_env, variable: "7"})
    assert code == 0, out
    assert '"slots": 7' in out


def test_the_flag_wins_over_both(clean_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--slots` (there is no --max-concurrent-runs flag) wins over every variable, as every flag
    does: given, the variables' disagreement does not matter."""
    code, out = _dry_run({**clean_env, **DISAGREE}, "--slots", "3")
    assert code == 0, out
    assert '"slots": 3' in out
    for name, value in DISAGREE.items():
        monkeypatch.setenv(name, value)
    assert parse_settings(["--slots", "3"]).slots == 3
    # And with one variable set: the flag's value, not the variable's.
    code, out = _dry_run({**clean_env, "LORALOOM_MAX_CONCURRENT_RUNS": "9"}, "--slots", "3")
    assert code == 0 and '"slots": 3' in out, out


def test_a_lower_case_variable_counts_as_pydantic_settings_reads_it(clean_env) -> None:
    code, out = _dry_run({**clean_env, "loraloom_slots": "2", "LORALOOM_MAX_CONCURRENT_RUNS": "5"})
    assert code == 2, out
    assert "loraloom_slots='2'" in out and "LORALOOM_MAX_CONCURRENT_RUNS='5'" in out, out


@pytest.mark.parametrize(
    ("env", "flag"),
    [
        ({"LORALOOM_MODEL_CACHE": "/a/models", "LORALOOM_MODEL_CACHE_DIR": "/b/models"}, "--model-cache-dir"),
        ({"LORALOOM_NPROC_PER_NODE": "1", "LORALOOM_WORKER_RANKS": "2"}, "--nproc-per-node"),
    ],
)
def test_the_other_settings_with_two_variables_are_refused_alike(
    clean_env, env: dict[str, str], flag: str
) -> None:
    code, out = _dry_run({**clean_env, **env})
    assert code == 2, out
    for name, value in env.items():
        assert f"{name}='{value}'" in out, out
    assert flag in out


def test_a_rank_count_flag_settles_its_variables_in_the_ranks_too(
    clean_env, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The launcher takes `--nproc-per-node` over its two disagreeing variables; the ranks, which
    inherit its environment, read the settings from the flags it passes them: the same flag must be
    among them (every rank exited 2 naming the variables the user had already overridden)."""
    from loraloom.commands.worker import build_settings
    from trainer_core.worker import parse_args

    monkeypatch.setenv("LORALOOM_NPROC_PER_NODE", "1")
    monkeypatch.setenv("LORALOOM_WORKER_RANKS", "2")
    settings = build_settings({"nproc_per_node": 2, "runs_dir": str(tmp_path / "runs")})
    assert settings.nproc_per_node == 2
    parse_args(settings.flags())  # a rank's start: no SystemExit
