"""The worker pool and the demo name every module of their extras that is missing, not torch alone.

Following the README's order (torch first, then `pip install loraloom`) and forgetting `[worker]`
gave torch without transformers: `loraloom worker` printed a rank's `ModuleNotFoundError`
traceback, and `loraloom demo` said "run again with --debug"."""

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import loraloom.demo
from loraloom.cli import cli
from loraloom.commands.errors import PLOT_EXTRA, WORKER_EXTRA

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def test_the_modules_looked_for_are_the_extras_in_pyproject() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:  # the distributions' names are their modules' here
        return {re.split(r"[^A-Za-z0-9_.-]", requirement, maxsplit=1)[0] for requirement in extras[extra]}

    assert names("worker") == set(WORKER_EXTRA)
    assert names("plot") == set(PLOT_EXTRA)


@pytest.fixture
def hide(monkeypatch: pytest.MonkeyPatch) -> Any:
    """hide(*modules): `find_spec` finds none of them, as if they were not installed."""
    real = importlib.util.find_spec

    def hide(*modules: str) -> None:
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a)
        )

    return hide


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    def started(**_: Any) -> None:
        raise AssertionError("the demo started without the modules it needs")

    monkeypatch.setattr(loraloom.demo, "run_demo", started)
    # Past the check, the worker would reach for this service: exit 6, not 2.
    return {
        "LORALOOM_WORKER_TOKEN": "t",
        "LORALOOM_MODEL_CACHE": str(tmp_path),
        "LORALOOM_URL": "http://127.0.0.1:9",
    }


WORKER = ["worker", "--url", "http://127.0.0.1:9"]
DEMO = ["demo", "--steps", "2"]
# (command, modules hidden, the error's words, the hint)
CASES = [
    (
        WORKER,
        ["transformers"],
        "needs transformers, which is not installed (the worker extra)",
        "pip install 'loraloom[worker]'",
    ),
    (
        WORKER,
        ["peft", "safetensors"],
        "needs peft, safetensors, which are not installed (the worker extra)",
        "pip install 'loraloom[worker]'",
    ),
    (
        DEMO,
        ["transformers"],
        "needs transformers, which is not installed (the worker extra)",
        "pip install 'loraloom[worker]'",
    ),
    (
        DEMO,
        ["matplotlib"],
        "needs matplotlib, which is not installed (the plot extra)",
        "pip install 'loraloom[plot]'",
    ),
    (
        DEMO,
        ["peft", "matplotlib"],
        "needs peft, matplotlib, which are not installed (the worker and plot extras)",
        "pip install 'loraloom[worker,plot]'",
    ),
    # torch too: installed first, of the build the machine wants.
    (
        WORKER,
        ["torch", "peft"],
        "needs torch, peft, which are not installed",
        "pip install torch==2.13.0 (or a CUDA build), then pip install 'loraloom[worker]'",
    ),
]


@pytest.mark.parametrize(
    ("args", "hidden", "words", "hint"), CASES, ids=[f"{a[0]}-{'+'.join(h)}" for a, h, _, _ in CASES]
)
def test_each_missing_module_is_named_with_its_extra(
    hide: Any, env: dict[str, str], args: list[str], hidden: list[str], words: str, hint: str
) -> None:
    hide(*hidden)
    result = runner.invoke(cli, args, env=env)
    assert result.exit_code == 2, result.output
    error, shown_hint = result.stderr.splitlines()
    assert error.startswith("error: ") and words in error
    assert shown_hint == f"hint: {hint}"


def test_with_every_module_the_worker_goes_on(env: dict[str, str]) -> None:
    """The check passes an install with the extra: the worker goes on to the service (none here)."""
    result = runner.invoke(cli, WORKER, env=env)
    assert result.exit_code == 6 and "cannot reach" in result.output, result.output


def test_in_a_process_without_transformers(tmp_path: Path) -> None:
    """The same in a process of its own where importing transformers fails, as after `pip install
    torch loraloom`: the worker's one line, not a rank's ModuleNotFoundError."""
    code = "import sys; sys.modules['transformers'] = None; from loraloom.cli import main; main()"
    env = {"PATH": "/usr/bin:/bin", "LORALOOM_WORKER_TOKEN": "t", "LORALOOM_MODEL_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code, "worker", "--url", "http://127.0.0.1:9"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: the worker pool needs transformers, which is not installed (the worker extra)",
        "hint: pip install 'loraloom[worker]'",
    ]
