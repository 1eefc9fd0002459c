"""`--sampler-concurrency` answers of up to `--sampler-max-response-bytes` each are held at once, so
the two multiplied are bounded (16 GiB). The bound is the pair's: the error names both, with their
values and where each came from (flag, variable or default). It named
`--sampler-max-response-bytes` alone before, also when the user had set only
LORALOOM_SAMPLER_CONCURRENCY and left the answer size at its default. Both entries refuse such a
config with a usage error (2) before anything starts."""

from typing import Any

import pytest
from typer.testing import CliRunner

from loraloom.cli import cli
from loraloom.commands import worker as worker_command
from trainer_core.settings import MAX_SAMPLER_ROUND_BYTES, WorkerSettings
from trainer_core.worker import parse_settings

runner = CliRunner()
DEFAULT_EACH = 256 * 1024**2
BOUND = f"over the bound of {MAX_SAMPLER_ROUND_BYTES} (16 GiB): lower one of the two"


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The settings `loraloom worker` started a pool with (none started: it is only recorded)."""
    pools: list[Any] = []

    def launch(settings: Any) -> int:
        pools.append(settings)
        return 0

    monkeypatch.setattr(worker_command, "_launch", launch)
    return pools


def worker(*flags: str, env: dict[str, str | None], **variables: str) -> Any:
    return runner.invoke(cli, ["worker", "--runs-dir", "runs", *flags], env={**env, **variables})


CASES = [
    # (flags, variables, what the error names)
    (
        [],
        {"LORALOOM_SAMPLER_CONCURRENCY": "1024"},
        "LORALOOM_SAMPLER_CONCURRENCY=1024 (environment) × "
        f"--sampler-max-response-bytes {DEFAULT_EACH} (default) = {1024 * DEFAULT_EACH} bytes",
    ),
    (
        ["--sampler-concurrency", "1024"],
        {},
        f"--sampler-concurrency 1024 (flag) × --sampler-max-response-bytes {DEFAULT_EACH} (default)",
    ),
    (
        [],
        {"LORALOOM_SAMPLER_MAX_RESPONSE_BYTES": str(16 * 1024**3)},
        f"--sampler-concurrency 8 (default) × LORALOOM_SAMPLER_MAX_RESPONSE_BYTES={16 * 1024**3} "
        f"(environment) = {8 * 16 * 1024**3} bytes",
    ),
    (
        ["--sampler-max-response-bytes", str(1024**3)],
        {"LORALOOM_SAMPLER_CONCURRENCY": "17"},
        f"LORALOOM_SAMPLER_CONCURRENCY=17 (environment) × --sampler-max-response-bytes {1024**3} (flag)",
    ),
    (  # a flag wins over the variable: the flag's value is the one refused, and named
        ["--sampler-concurrency", "1024"],
        {"LORALOOM_SAMPLER_CONCURRENCY": "1"},
        f"--sampler-concurrency 1024 (flag) × --sampler-max-response-bytes {DEFAULT_EACH} (default)",
    ),
]


@pytest.mark.parametrize(("flags", "variables", "names"), CASES)
def test_the_cli_names_both_settings_and_starts_nothing(
    clean_env, launched: list[Any], flags: list[str], variables: dict[str, str], names: str
) -> None:
    result = worker(*flags, env=clean_env, **variables)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: invalid worker settings: {names}"), result.output
    assert BOUND in result.output and "Traceback" not in result.output
    assert launched == []


def test_at_the_bound_the_pool_starts(clean_env, launched: list[Any]) -> None:
    # The control of the test above: what it patches is what starts the pool.
    result = worker(env=clean_env, LORALOOM_SAMPLER_CONCURRENCY="64")  # 64 × 256 MiB = 16 GiB
    assert result.exit_code == 0, result.output
    assert [(s.sampler_concurrency, s.sampler_max_response_bytes) for s in launched] == [(64, DEFAULT_EACH)]


@pytest.mark.parametrize(("flags", "variables", "names"), CASES)
def test_the_torchrun_entry_names_both_settings(
    clean_env,
    monkeypatch: pytest.MonkeyPatch,
    capsys,
    flags: list[str],
    variables: dict[str, str],
    names: str,
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        parse_settings(["--runs-dir", "runs", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"trainer_core.worker: error: invalid worker settings: {names}" in err, err
    assert BOUND in err


def test_a_bad_value_of_either_is_its_own_error_not_the_bounds(clean_env) -> None:
    # Out of its range, a value is named alone (the product of a refused value means nothing).
    result = worker("--sampler-concurrency", "0", env=clean_env)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: invalid worker settings: --sampler-concurrency: ")
    assert "16 GiB" not in result.output


def test_the_model_refuses_it_naming_both_without_a_cli() -> None:
    # What a caller building the settings itself sees (no flags, no variables to name).
    with pytest.raises(ValueError, match=r"sampler_concurrency 1024 × sampler_max_response_bytes 268435456"):
        WorkerSettings(sampler_concurrency=1024)
