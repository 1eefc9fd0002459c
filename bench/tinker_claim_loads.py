"""A pool's whole poll for Tinker work (the body of `POST /v1/pool/manual/claim`:
`app.tinker.pool_router.claim_manual_work`) with real requests queued: the queries, the token cut
and the reading of the requests it takes, base-model samples' turn included.

    python -m bench.tinker_claim_loads                 # Postgres at 127.0.0.1 (a scratch database)
    python -m bench.tinker_claim_loads --runs 16 --requests 4 --datums 8 --tokens 512
    python -m bench.tinker_claim_loads --runs 0 --repeats 300   # an idle pool's poll

`bench.tinker_claim` times the claim's query alone; this times what a pool's poll pays for the
claim: a scratch database, migrated to head, gets a live pool, --runs active runs (each a Tinker
model's) with --requests pending forward_backwards of --datums datums × --tokens tokens each, and an
optim_step. Each of --repeats claims runs in a transaction that is rolled back, so every one takes
the same work; the median is printed with the SQL statements one claim sends.

Runs against whichever `app` is importable, so the same file measures an older checkout:
``PYTHONPATH=/path/to/checkout python bench/tinker_claim_loads.py`` (a schema without
`tinker_futures.tokens` is seeded without it).
"""

import argparse
import json
import statistics
import time
from typing import Any

from sqlalchemy import Connection, create_engine, event, inspect, text
from sqlalchemy.orm import Session

from app import migrate
from app.config import Settings
from app.tinker.pool_router import claim_manual_work
from bench.ingest import create_database, drop_database
from bench.options import add_pg_admin_url
from contracts.tinker_work import ManualClaimIn


def _request(run: int, seq_id: int, datums: int, tokens: int) -> dict[str, Any]:
    datum = {
        "tokens": [1 + i % 250 for i in range(tokens)],
        "target_tokens": [2 + i % 250 for i in range(tokens)],
        "weights": [1.0] * tokens,
        "logprobs": None,
        "advantages": None,
    }
    return {
        "request_id": f"f{run}_{seq_id}",
        "run_id": f"run{run}",
        "seq_id": seq_id,
        "kind": "forward_backward",
        "loss_fn": "cross_entropy",
        "loss_fn_config": {},
        "data": [datum] * datums,
    }


def seed(conn: Connection, *, runs: int, requests: int, datums: int, tokens: int) -> None:
    """A tenant with a session, a live pool of base model 'base', `runs` active runs each with a
    model, `requests` pending forward_backwards and a pending optim_step."""
    conn.execute(
        text("INSERT INTO tenants (id, name, max_concurrent_runs, created_at) VALUES ('t', 't', 4, now())")
    )
    conn.execute(
        text(
            "INSERT INTO pools (id, base_model, vocab_size, max_rank, target_modules, slots, world_size, "
            "max_seq_len, status, registered_at, last_heartbeat_at) VALUES ('pool-1', 'base', 256, 64, "
            "'[]', :runs, 1, 8192, 'alive', now(), now())"
        ),
        {"runs": runs},
    )
    conn.execute(
        text(
            "INSERT INTO runs (id, tenant_id, name, config, base_model, status, step, total_tokens, "
            "total_samples, submitted_samples, created_at, updated_at) "
            "SELECT 'run' || r, 't', 'run' || r, '{}', 'base', 'active', 0, 0, 0, 0, now(), now() "
            "FROM generate_series(1, :runs) r"
        ),
        {"runs": runs},
    )
    conn.execute(
        text(
            "INSERT INTO tinker_sessions (id, tenant_id, sdk_version, created_at, last_heartbeat_at) "
            "VALUES ('s', 't', 'bench', now(), now())"
        )
    )
    conn.execute(
        text(
            "INSERT INTO tinker_models (id, tenant_id, session_id, model_seq_id, run_id, created_at, "
            "last_request_at) SELECT 'model' || r, 't', 's', r, 'run' || r, now(), now() "
            "FROM generate_series(1, :runs) r"
        ),
        {"runs": runs},
    )
    counted = "tokens" in {c["name"] for c in inspect(conn).get_columns("tinker_futures")}
    columns = "id, tenant_id, kind, model_id, seq_id, run_id, status, request, created_at"
    values = ":id, 't', :kind, :model, :seq_id, :run, 'pending', :request, now()"
    if counted:
        columns, values = columns + ", tokens", values + ", :tokens"
    rows = []
    for r in range(1, runs + 1):
        for s in range(1, requests + 2):
            step = s == requests + 1
            request = (
                {"request_id": f"f{r}_{s}", "run_id": f"run{r}", "seq_id": s, "kind": "optim_step"}
                if step
                else _request(r, s, datums, tokens)
            )
            rows.append(
                {
                    "id": f"f{r}_{s}",
                    "kind": request["kind"],
                    "model": f"model{r}",
                    "seq_id": s,
                    "run": f"run{r}",
                    "request": json.dumps(request),
                    "tokens": 0 if step else datums * tokens,
                }
            )
    if rows:  # --runs 0: the poll of an idle pool
        conn.execute(text(f"INSERT INTO tinker_futures ({columns}) VALUES ({values})"), rows)
    for table in ("tinker_futures", "tinker_models", "runs", "pools"):
        conn.execute(text(f"ANALYZE {table}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="pending forward_backwards per run")
    p.add_argument("--datums", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="tokens per datum")
    p.add_argument(
        "--max-tokens", type=int, default=262_144, help="the round's budget (the setting's default)"
    )
    p.add_argument("--repeats", type=int, default=30)
    add_pg_admin_url(p)
    args = p.parse_args()
    url = create_database(args.pg_admin_url)
    try:
        migrate.upgrade(url)
        engine = create_engine(url)
        with engine.begin() as conn:
            seed(conn, runs=args.runs, requests=args.requests, datums=args.datums, tokens=args.tokens)
        statements: list[str] = []
        event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        settings = Settings(database_url=url, tinker_max_tokens_per_round=args.max_tokens)
        body = ManualClaimIn(pool_id="pool-1", max_items=64)
        times, taken = [], 0
        for _ in range(args.repeats):
            statements.clear()
            with Session(engine) as session:
                start = time.perf_counter()
                taken = len(claim_manual_work(None, session, settings, body).items)
                times.append((time.perf_counter() - start) * 1e3)
                session.rollback()
        print(
            f"{args.runs} runs x {args.requests} forward_backwards of {args.datums} x {args.tokens} tokens "
            f"(+ an optim_step), round of {args.max_tokens:,} tokens: a poll takes {taken} items in "
            f"{len(statements)} statements; median of {args.repeats}: {statistics.median(times):.1f} ms "
            f"(min {min(times):.1f})"
        )
        engine.dispose()
    finally:
        drop_database(args.pg_admin_url, url)


if __name__ == "__main__":
    main()
