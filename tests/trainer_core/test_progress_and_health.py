"""Long work says what it is doing, and the pool tells a container healthcheck it is alive."""

import logging
from pathlib import Path

import pytest

from contracts.pool_api import PoolRegister
from trainer_core.http_source import HttpRunSource
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.models import builtin

POOL = PoolRegister(
    base_model="loraloom-tiny",
    vocab_size=100,
    max_rank=8,
    target_modules=["q_proj"],
    slots=1,
    world_size=1,
    max_seq_len=32,
)


def test_the_built_in_model_build_reports_its_progress(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(builtin, "PROGRESS_EVERY_S", 0.0)  # a line per step instead of every 5 s
    with caplog.at_level(logging.INFO, logger="loraloom.models"):
        builtin.build(clean_steps=3, noisy_steps=1)
    lines = [r.getMessage() for r in caplog.records if "warm-up step" in r.getMessage()]
    assert lines and lines[0].startswith("building loraloom-tiny: warm-up step 1/4 (25%)")
    assert "left" in lines[-1]


def test_the_heartbeat_file_is_touched_once_registered(tmp_path: Path) -> None:
    beat = tmp_path / "health" / "heartbeat"
    source = HttpRunSource(MemoryPoolClient([[]], {}), heartbeat_file=beat)
    source.open(POOL)
    try:
        assert beat.is_file()  # registered: healthy from now on (then after every accepted heartbeat)
    finally:
        source.close()
