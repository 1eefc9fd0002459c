"""What a pool can train: the one capability check.

Pure (no session, no service): admission calls it before it gives a run a slot, and the pools
service calls it when a pool registers or polls its state, so neither imports the other.
"""

from typing import Any

from pydantic import ValidationError

from app.pools.models import Pool
from contracts.run_config import RunConfig


def capability_problems(config: RunConfig, pool: Pool) -> list[str]:
    """Every reason `pool` cannot train a run with `config` (empty: it can)."""
    problems: list[str] = []
    if config.base_model != pool.base_model:
        problems.append(f"base_model {config.base_model!r} is not the pool's {pool.base_model!r}")
    if config.lora.rank > pool.max_rank:
        problems.append(f"lora.rank {config.lora.rank} exceeds the pool's max_rank {pool.max_rank}")
    unsupported = sorted(set(config.lora.target_modules) - set(pool.target_modules))
    if unsupported:
        problems.append(
            f"lora.target_modules {unsupported} are not adapted by the pool "
            f"(it adapts {sorted(pool.target_modules)})"
        )
    if config.seq_len > pool.max_seq_len:
        problems.append(f"seq_len {config.seq_len} exceeds the pool's max_seq_len {pool.max_seq_len}")
    return problems


def stored_config_problems(config: dict[str, Any], pool: Pool) -> list[str]:
    """`capability_problems` for a config as stored on a run (JSON)."""
    try:
        parsed = RunConfig.model_validate(config)
    except ValidationError as exc:  # stored configs were validated at creation; this is a guard
        return [f"config is invalid: {exc.error_count()} error(s)"]
    return capability_problems(parsed, pool)


def untrainable_reason(config: dict[str, Any], pool: Pool) -> str | None:
    """Why `pool` cannot train a run with this stored config, worded as the run's failure reason
    (control/config_validation_error.txt); None if it can."""
    problems = stored_config_problems(config, pool)
    if not problems:
        return None
    return f"pool {pool.id} for base model {pool.base_model!r} cannot train this run: " + "; ".join(problems)
