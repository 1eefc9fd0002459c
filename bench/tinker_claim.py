"""The pools' Tinker claim with a day of retained futures: with and without its partial index.

    python -m bench.tinker_claim                       # Postgres at 127.0.0.1 (a scratch database)
    python -m bench.tinker_claim --runs 20 --done 5000 --repeats 50

Every pool polls `app.tinker.work.claim` every poll interval (0.2 s by default). Done futures stay in
tinker_futures for the retention period (their results answer retried requests), so the table grows
with everything trained that day while the claimable rows (pending work, replayable done work) stay a
handful. A scratch database, migrated to head, gets --runs active runs with --done completed futures
each (requests cleared, as after their step's checkpoint) and 2 pending ones; the claim's query
(`claim_query`, as the pool's claim runs it, locks included) is timed over --repeats calls and
explained, first with the partial index `ix_tinker_futures_claimable`, then after dropping it.
"""

import argparse
import statistics
import time

from sqlalchemy import Connection, Engine, create_engine, text

from app import migrate
from app.tinker.work import claim_query
from bench.ingest import create_database, drop_database
from bench.options import add_pg_admin_url

INDEX = "ix_tinker_futures_claimable"


def seed_retained_futures(
    conn: Connection, *, runs: int, done_per_run: int, base_model: str = "base"
) -> None:
    """A tenant, `runs` active runs of `base_model` (each a Tinker model's), each with `done_per_run`
    completed futures whose requests were cleared (forward_backward / optim_step alternately) and 2
    pending ones."""
    conn.execute(
        text("INSERT INTO tenants (id, name, max_concurrent_runs, created_at) VALUES ('t', 't', 4, now())")
    )
    conn.execute(
        text(
            "INSERT INTO runs (id, tenant_id, name, config, base_model, status, step, total_tokens, "
            "total_samples, submitted_samples, created_at, updated_at) "
            "SELECT 'run' || r, 't', 'run' || r, '{}', :base, 'active', 0, 0, 0, 0, now(), now() "
            "FROM generate_series(1, :runs) r"
        ),
        {"runs": runs, "base": base_model},
    )
    conn.execute(
        text(
            "INSERT INTO tinker_futures (id, tenant_id, kind, model_id, seq_id, run_id, status, request, "
            "created_at) "
            "SELECT 'f' || r || '_' || s, 't', "
            "CASE WHEN s % 2 = 0 THEN 'forward_backward' ELSE 'optim_step' END, 'model' || r, s, 'run' || r, "
            "CASE WHEN s > :done THEN 'pending' ELSE 'complete' END, "
            'CASE WHEN s > :done THEN \'{"kind": "optim_step"}\'::json ELSE NULL END, now() '
            "FROM generate_series(1, :runs) r, generate_series(1, :done + 2) s"
        ),
        {"runs": runs, "done": done_per_run},
    )
    # Each run is a Tinker model's, served at a different time (the claim's deal order reads it).
    conn.execute(
        text(
            "INSERT INTO tinker_sessions (id, tenant_id, sdk_version, created_at, last_heartbeat_at) "
            "VALUES ('s', 't', 'bench', now(), now())"
        )
    )
    conn.execute(
        text(
            "INSERT INTO tinker_models (id, tenant_id, session_id, model_seq_id, run_id, created_at, "
            "last_request_at, served_at) "
            "SELECT 'model' || r, 't', 's', r, 'run' || r, now(), now(), now() - r * interval '1 second' "
            "FROM generate_series(1, :runs) r"
        ),
        {"runs": runs},
    )
    conn.execute(text("ANALYZE tinker_futures"))
    conn.execute(text("ANALYZE tinker_models"))
    conn.execute(text("ANALYZE runs"))


def measure(engine: Engine, repeats: int) -> tuple[float, str]:
    """Median ms of the claim query (in a transaction, rolled back: the locks are taken), and its plan."""
    query = claim_query("pool-1", "base")  # LIMIT 64, the parameter's default
    times = []
    with engine.connect() as conn:
        for _ in range(repeats):
            start = time.perf_counter()
            with conn.begin():
                conn.execute(query).all()
                conn.rollback()
            times.append((time.perf_counter() - start) * 1e3)
        sql = query.compile(engine, compile_kwargs={"literal_binds": True})
        lines = list(conn.execute(text(f"EXPLAIN ANALYZE {sql}")).scalars())
    return statistics.median(times), "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--done", type=int, default=5000, help="completed futures per run")
    p.add_argument("--repeats", type=int, default=30)
    add_pg_admin_url(p)
    args = p.parse_args()
    url = create_database(args.pg_admin_url)
    try:
        migrate.upgrade(url)
        engine = create_engine(url)
        with engine.begin() as conn:
            seed_retained_futures(conn, runs=args.runs, done_per_run=args.done)
        print(
            f"{args.runs} active runs x ({args.done} done + 2 pending) futures = "
            f"{args.runs * (args.done + 2):,} rows; median of {args.repeats} claims"
        )
        results = {}
        for label in ("with the partial index", "without it"):
            if label == "without it":
                with engine.begin() as conn:
                    conn.execute(text(f"DROP INDEX {INDEX}"))
                    conn.execute(text("ANALYZE tinker_futures"))
            results[label] = measure(engine, args.repeats)
        print("| index | claim ms (median) | plan's read of tinker_futures | execution |")
        print("|---|---:|---|---:|")
        for label, (ms, plan) in results.items():
            scan = next(
                line.strip() for line in plan.splitlines() if "tinker_futures" in line and "Scan" in line
            )
            execution = next(line for line in plan.splitlines() if line.startswith("Execution Time"))
            print(
                f"| {label} | {ms:.2f} | {scan.split('(')[0].strip(' ->')} | {execution.split(':')[1].strip()} |"
            )
        engine.dispose()
    finally:
        drop_database(args.pg_admin_url, url)


if __name__ == "__main__":
    main()
