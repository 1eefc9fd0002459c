"""trainer_core test settings: one CPU thread each (the CI machine is small and shared)."""

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads when it loads)

torch.set_num_threads(1)

import pytest  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str | None]:
    """No LORALOOM_* of the caller's, in this process and for CliRunner (None unsets)."""
    for name in os.environ:
        if name.startswith("LORALOOM_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return {name: None for name in os.environ if name.startswith("LORALOOM_")}


_TIE_WEIGHTS = PreTrainedModel.tie_weights


@pytest.fixture(autouse=True)
def transformers_globals_kept() -> Iterator[None]:
    """Errors the test that leaves transformers' loading patches in place (`tie_weights` a no-op, a
    default dtype other than fp32: trainer_core.models.construction), not a later test of the same
    worker that trips on them; and puts them back for the tests after it."""
    yield
    leaked = []
    if PreTrainedModel.tie_weights is not _TIE_WEIGHTS:
        PreTrainedModel.tie_weights = _TIE_WEIGHTS  # type: ignore[method-assign]
        leaked.append("PreTrainedModel.tie_weights is not transformers' own (models stop tying)")
    if torch.get_default_dtype() != torch.float32:
        leaked.append(f"torch's default dtype is {torch.get_default_dtype()}")
        torch.set_default_dtype(torch.float32)
    if leaked:
        pytest.fail("this test left process-wide state changed: " + "; ".join(leaked))
