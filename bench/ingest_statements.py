"""CPU per execution of the ingestion hot path's three Postgres statements, through SQLAlchemy's
`Connection.execute` and through app/db.py `pg_execute` (the psycopg connection directly), alternating
on the same connection in one process.

    .venv/bin/python -m bench.ingest_statements        # 6 rounds × 400 executions per way and statement

`thread_time` around each execution (waiting for Postgres is not CPU); the writing statements are rolled
back after each execution (outside the timing). Prints the median and best round per way.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from app import migrate
from app.batches.ingest_run import _LOAD
from app.batches.one_statement import _STATEMENT
from app.db import make_engine, make_session_factory, pg_execute
from app.rollouts.service import _WRITE_STATS_AND_EVENT_PG
from app.runs.models import Run
from bench.ingest import create_database, drop_database, seed
from bench.options import add_pg_admin_url


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--executions", type=int, default=400, help="per round, way and statement")
    p.add_argument("--rounds", type=int, default=6)
    add_pg_admin_url(p)
    args = p.parse_args(argv)
    url = create_database(args.pg_admin_url)
    try:
        migrate.upgrade(url)
        _secret, (run_id,) = seed(url, seq_len=2048, runs=1)
        engine = make_engine(url)
        with make_session_factory(engine)() as session:
            tenant_id = session.get_one(Run, run_id).tenant_id
        count = 0

        def load() -> dict[str, Any]:
            return {"run_id": run_id, "tenant_id": tenant_id}

        def reserve() -> dict[str, Any]:
            nonlocal count
            count += 1
            return {
                "run_id": run_id,
                "idempotency_key": f"k{count}",
                "request_hash": "0" * 64,
                "rollout_step": 0,
                "num_samples": 64,
                "num_tokens": 40_000,
                "payload_path": f"p{count}",
                "payload_bytes": 400_000,
                "payload_sha256": "0" * 64,
                "state": "pending",
                "created_at": datetime.now(UTC),
                "reward_count": 64,
                "reward_mean": 0.5,
                "reward_m2": 4.0,
                "reward_min": 0.0,
                "reward_max": 1.0,
                "pending": "pending",
                "active": "active",
                "max_async_level": 1000,
                "max_pending_batches": 10**6,
                "max_pending_bytes": 1 << 50,
            }

        def stats() -> dict[str, Any]:
            return {
                "run_id": run_id,
                "rollout_step": 0,
                "samples": 64,
                "reward_count": 0,
                "reward_mean": 0.0,
                "reward_m2": 0.0,
                "reward_min": None,
                "reward_max": None,
                "metrics": "{}",
                "updated_at": datetime.now(UTC),
                "action": "batch.received",
                "actor": "orchestrator",
                "tenant_id": tenant_id,
                "details": json.dumps({"batch_id": 1}),
            }

        cases: list[tuple[str, Any, Callable[[], dict[str, Any]], bool]] = [
            ("run read (autocommit)", _LOAD, load, True),
            ("reserve + insert", _STATEMENT, reserve, False),
            ("stats + event", _WRITE_STATS_AND_EVENT_PG, stats, False),
        ]
        for name, statement, params, autocommit in cases:
            spent: dict[str, list[float]] = {"sqlalchemy": [], "direct": []}
            for r in range(args.rounds):
                for way in ("sqlalchemy", "direct") if r % 2 else ("direct", "sqlalchemy"):
                    with engine.connect() as plain:
                        conn = plain.execution_options(isolation_level="AUTOCOMMIT") if autocommit else plain
                        total = 0.0
                        for i in range(args.executions + 5):  # 5 unmeasured: psycopg prepares on use 5
                            values = params()
                            t0 = time.thread_time()
                            if way == "sqlalchemy":
                                result = conn.execute(statement, values)
                                if result.returns_rows:
                                    result.fetchall()
                            else:
                                pg_execute(conn, statement, values)
                            if i >= 5:
                                total += time.thread_time() - t0
                            if not autocommit:
                                conn.rollback()
                    spent[way].append(total / args.executions * 1e6)
            print(
                f"{name}: SQLAlchemy {statistics.median(spent['sqlalchemy']):.0f} µs "
                f"(best {min(spent['sqlalchemy']):.0f}), directly {statistics.median(spent['direct']):.0f} µs "
                f"(best {min(spent['direct']):.0f}) of CPU per execution"
            )
        engine.dispose()
    finally:
        drop_database(args.pg_admin_url, url)


if __name__ == "__main__":
    main()
