"""The external sampler's bounds are the operator's (`--sampler-deadline`,
`--sampler-max-response-bytes`, `--sampler-concurrency`): a generation on a large model may need more than the 600 s
`ExternalSampler` defaults to, and the pool built it with its defaults whatever was set. Out-of-range
values are refused by both entries, naming what the user set; the values given reach the
`ExternalSampler` the ranks build, through the flags `loraloom worker` hands them. And `--dry-run`
shows the checkpoint directory the pool writes to, not the unset field's `null`."""

import json
from dataclasses import fields
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraloom.cli import cli
from loraloom.commands.worker import build_settings
from trainer_core.external_sampler import ExternalSampler
from trainer_core.settings import WorkerSettings
from trainer_core.worker import WorkerArgs, external_sampler, parse_args, parse_settings

runner = CliRunner()


def _default(name: str) -> object:
    return next(f.default for f in fields(ExternalSampler) if f.name == name)


def test_the_defaults_are_the_samplers() -> None:
    settings = WorkerSettings.model_construct()
    assert settings.sampler_deadline == _default("deadline_s") == 600.0
    assert settings.sampler_max_response_bytes == _default("max_response_bytes") == 256 * 1024**2
    assert settings.sampler_concurrency == _default("concurrency") == 8
    args = WorkerArgs()
    assert (args.sampler_deadline_s, args.sampler_max_response_bytes) == (600.0, 256 * 1024**2)
    assert args.sampler_concurrency == 8


def test_the_values_given_reach_the_sampler_the_ranks_build(clean_env, tmp_path: Path) -> None:
    # As `loraloom worker` does: settings from its flags, handed to every rank as flags.
    settings = build_settings(
        {
            "runs_dir": tmp_path / "runs",
            "sampler_url": "http://vllm:8000",
            "sampler_deadline": 1800.0,
            "sampler_max_response_bytes": 1024**3,
            "sampler_concurrency": 16,
        }
    )
    sampler = external_sampler(parse_args(settings.flags()))
    assert isinstance(sampler, ExternalSampler)
    assert (sampler.deadline_s, sampler.max_response_bytes, sampler.concurrency) == (1800.0, 1024**3, 16)
    assert (sampler.url, sampler.checkpoint_dir) == ("http://vllm:8000", tmp_path / "runs")


def test_the_variables_reach_the_sampler(clean_env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORALOOM_SAMPLER_DEADLINE", "3600")
    monkeypatch.setenv("LORALOOM_SAMPLER_MAX_RESPONSE_BYTES", "4096")
    monkeypatch.setenv("LORALOOM_SAMPLER_CONCURRENCY", "1")
    sampler = external_sampler(parse_args(["--runs-dir", "runs", "--sampler-url", "http://vllm:8000"]))
    assert sampler is not None
    assert (sampler.deadline_s, sampler.max_response_bytes, sampler.concurrency) == (3600.0, 4096, 1)


def test_no_sampler_url_no_sampler(clean_env) -> None:
    assert external_sampler(parse_args(["--runs-dir", "runs", "--sampler-deadline", "5"])) is None


BAD = [
    ("--sampler-deadline", "0", "greater than 0"),
    ("--sampler-deadline", "-5", "greater than 0"),
    ("--sampler-deadline", "86401", "less than or equal to 86400"),
    ("--sampler-deadline", "inf", "less than or equal to 86400"),
    ("--sampler-max-response-bytes", "1023", "greater than or equal to 1024"),
    ("--sampler-max-response-bytes", str(16 * 1024**3 + 1), "less than or equal to 17179869184"),
    ("--sampler-concurrency", "0", "greater than or equal to 1"),
    ("--sampler-concurrency", "-2", "greater than or equal to 1"),
    ("--sampler-concurrency", "1025", "less than or equal to 1024"),
]
NOT_NUMBERS = [
    ("--sampler-deadline", "soon", "float"),
    ("--sampler-max-response-bytes", "1.5", "int"),
    ("--sampler-concurrency", "many", "int"),
]


@pytest.mark.parametrize(("flag", "value", "says"), BAD)
def test_the_cli_refuses_a_bad_bound_naming_the_flag(clean_env, flag: str, value: str, says: str) -> None:
    result = runner.invoke(cli, ["worker", "--runs-dir", "runs", "--dry-run", flag, value], env=clean_env)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: invalid worker settings: {flag}: "), result.output
    assert says in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("flag", "value", "kind"), NOT_NUMBERS)
def test_the_cli_refuses_a_bound_that_is_no_number(clean_env, flag: str, value: str, kind: str) -> None:
    result = runner.invoke(cli, ["worker", "--runs-dir", "runs", "--dry-run", flag, value], env=clean_env)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: Invalid value for '{flag}': '{value}' is not a valid {kind}")


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        *BAD,
        ("--sampler-deadline", "soon", "valid number"),
        ("--sampler-max-response-bytes", "1.5", "valid integer"),
        ("--sampler-concurrency", "many", "valid integer"),
    ],
)
def test_the_torchrun_entry_refuses_a_bad_bound_naming_the_variable(
    clean_env, monkeypatch: pytest.MonkeyPatch, capsys, flag: str, value: str, says: str
) -> None:
    variable = "LORALOOM_" + flag.removeprefix("--").replace("-", "_").upper()
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        parse_settings([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid worker settings: {variable}: " in err and says in err, err


def test_dry_run_shows_the_bounds_and_the_checkpoint_directory(clean_env, tmp_path: Path) -> None:
    def shown(*args: str, **env: str) -> dict[str, object]:
        result = runner.invoke(cli, ["worker", "--dry-run", *args], env={**clean_env, **env})
        assert result.exit_code == 0, result.output
        out: dict[str, object] = json.loads(result.stdout)
        return out

    default = shown()
    assert default["checkpoint_dir"] == str(tmp_path / ".loraloom" / "data" / "runs")  # was null
    assert (default["sampler_deadline"], default["sampler_max_response_bytes"]) == (600.0, 256 * 1024**2)
    assert default["sampler_concurrency"] == 8
    assert shown("--data-dir", "data")["checkpoint_dir"] == str(tmp_path / "data" / "runs")
    assert shown(LORALOOM_CHECKPOINT_DIR="/ckpt")["checkpoint_dir"] == "/ckpt"
    # With --runs-dir the checkpoints go into the run directories themselves, whatever else is set.
    assert shown("--runs-dir", "runs", "--checkpoint-dir", "/ckpt")["checkpoint_dir"] == str(
        tmp_path / "runs"
    )
    given = shown(
        "--sampler-deadline",
        "1200",
        "--sampler-concurrency",
        "2",
        LORALOOM_SAMPLER_MAX_RESPONSE_BYTES="65536",
    )
    assert (given["sampler_deadline"], given["sampler_max_response_bytes"]) == (1200.0, 65536)
    assert given["sampler_concurrency"] == 2


def test_answers_read_at_once_are_bounded_over_the_round(clean_env) -> None:
    """Each of `--sampler-concurrency` requests may hold `--sampler-max-response-bytes` in memory at
    once: their product is what the 16 GiB bound is about."""
    args = ["worker", "--runs-dir", "runs", "--dry-run", "--sampler-concurrency", "1024"]
    refused = runner.invoke(
        cli, [*args, "--sampler-max-response-bytes", str(16 * 1024**2 + 1)], env=clean_env
    )
    assert refused.exit_code == 2, refused.output
    assert refused.output.startswith(
        "error: invalid worker settings: --sampler-concurrency 1024 (flag) × "
        f"--sampler-max-response-bytes {16 * 1024**2 + 1} (flag) = "
    )
    assert "16 GiB" in refused.output
    accepted = runner.invoke(cli, [*args, "--sampler-max-response-bytes", str(16 * 1024**2)], env=clean_env)
    assert accepted.exit_code == 0, accepted.output
