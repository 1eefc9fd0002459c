"""What a pool can train: the one capability check.

Pure (no session, no service): admission calls it before it gives a run a slot, and the pools
service calls it when a pool registers or polls its state, so neither imports the other.
"""

from typing import Any

from pydantic import ValidationError

from app.pools.models import Pool
from contracts.run_config import RunConfig


def capability_field_problems(config: RunConfig, pool: Pool) -> list[dict[str, Any]]:
    """Every reason `pool` cannot train a run with `config`, as 422 details naming the field of
    the create body and the pool's limit (empty: it can)."""
    problems: list[dict[str, Any]] = []

    def add(field: str, msg: str, limit: Any) -> None:
        loc = ["body", "config", *field.split(".")]
        problems.append({"loc": loc, "msg": msg, "type": "pool_limit", "limit": limit, "pool_id": pool.id})

    if config.base_model != pool.base_model:
        add(
            "base_model",
            f"base_model {config.base_model!r} is not the pool's {pool.base_model!r}",
            pool.base_model,
        )
    if config.lora.rank > pool.max_rank:
        add(
            "lora.rank",
            f"lora.rank {config.lora.rank} exceeds the pool's max_rank {pool.max_rank}",
            pool.max_rank,
        )
    unsupported = sorted(set(config.lora.target_modules) - set(pool.target_modules))
    if unsupported:
        add(
            "lora.target_modules",
            f"lora.target_modules {unsupported} are not adapted by the pool "
            f"(it adapts {sorted(pool.target_modules)})",
            sorted(pool.target_modules),
        )
    if config.seq_len > pool.max_seq_len:
        add(
            "seq_len",
            f"seq_len {config.seq_len} exceeds the pool's max_seq_len {pool.max_seq_len}",
            pool.max_seq_len,
        )
    return problems


def capability_problems(config: RunConfig, pool: Pool) -> list[str]:
    """Every reason `pool` cannot train a run with `config` (empty: it can)."""
    return [p["msg"] for p in capability_field_problems(config, pool)]


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
