"""trainer_core test settings: one CPU thread each (the CI machine is small and shared)."""

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads when it loads)

torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str | None]:
    """No LORALOOM_* of the caller's, in this process and for CliRunner (None unsets)."""
    for name in os.environ:
        if name.startswith("LORALOOM_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return {name: None for name in os.environ if name.startswith("LORALOOM_")}
