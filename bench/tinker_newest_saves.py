"""The reads of a Tinker checkpoint path, with one name saved --saves times (a tenant saving under one
name at every step): what every sample, resolve, load_weights, weights_info and delete checks, and the
checkpoint listings.

    python -m bench.tinker_newest_saves                   # Postgres at 127.0.0.1 (a scratch database)
    python -m bench.tinker_newest_saves --saves 50000 --repeats 30 --sqlite

Completed saves are never purged, so a name saved at every step leaves a row per step. A scratch
database, migrated to head, gets a tenant and a model (made through the app's HTTP API in-process)
with a sampler checkpoint and a training state saved under one name each, then --saves older saves
of each name inserted directly, marked superseded (as `app.tinker.work.record_results` marks them),
and ANALYZE. Each call below is timed in its own transaction, rolled back (the delete too, then a
VACUUM on Postgres: no call reads the dead rows of the one before); the median of --repeats calls
after one untimed warm-up.
"""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from app import migrate
from app.config import Settings
from app.main import create_app
from app.tinker import checkpoints, sampling, service, work
from bench.ingest import create_database, drop_database
from bench.options import add_pg_admin_url
from tests.app.api import new_tenant, register
from tests.app.tinker_calls import answer_work, new_model, tinker_headers
from tests.common import ADMIN_KEY, WORKER_TOKEN

COLUMNS = "tenant_id, kind, model_id, run_id, status, lost_leases, tokens, request_bytes, result, created_at"


def seed(url: str, data_dir: Path, saves: int) -> tuple[str, str, str]:
    """(tenant id, model id, sampling session id): the model's sampler checkpoint `s` and training
    state `w`, each saved once through the API and `saves` times before it (inserted)."""
    settings = Settings(database_url=url, data_dir=data_dir, admin_key=ADMIN_KEY, worker_token=WORKER_TOKEN)
    with TestClient(create_app(settings)) as client:
        tenant = new_tenant(client)
        pool_id = register(client)
        model_id = new_model(client, tenant)
        for seq_id, kind, name in ((1, "save_weights_for_sampler", "s"), (2, "save_weights", "w")):
            body = {"model_id": model_id, "seq_id": seq_id, "path": name}
            r = client.post(f"/api/v1/{kind}", json=body, headers=tinker_headers(tenant))
            assert r.status_code == 200, r.text
        answer_work(client, pool_id)
        r = client.post(
            "/api/v1/create_sampling_session",
            json={"model_path": checkpoint(model_id, "s")},
            headers=tinker_headers(tenant),
        )
        assert r.status_code == 200, r.text
        sampler_id = str(r.json()["sampling_session_id"])
    engine = create_engine(url)
    postgres = engine.dialect.name == "postgresql"
    # Older saves: lower seq ids, earlier completions (negative seq ids leave the API's own free).
    earlier = (
        "f.completed_at - g * interval '1 second'"
        if postgres
        else "datetime(f.completed_at, '-' || g || ' seconds')"
    )
    with engine.begin() as conn:
        conn.execute(
            text(
                "WITH RECURSIVE series(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM series WHERE g < :n) "
                f"INSERT INTO tinker_futures (id, seq_id, completed_at, superseded_at, {COLUMNS}) "
                f"SELECT f.id || '-' || g, -(f.seq_id * 1000000 + g), {earlier}, CURRENT_TIMESTAMP, {COLUMNS} "
                "FROM tinker_futures f, series WHERE f.kind LIKE 'save_weights%'"
            ),
            {"n": saves},
        )
        conn.execute(text("ANALYZE" + (" tinker_futures" if postgres else "")))
    engine.dispose()
    return tenant.id, model_id, sampler_id


def checkpoint(model_id: str, name: str, segment: str = "sampler_weights") -> str:
    return f"tinker://{model_id}/{segment}/{name}"


def median_ms(engine: Engine, call: Callable[[Session], Any], repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        with Session(engine) as session:
            start = time.perf_counter()
            call(session)
            session.flush()
            elapsed = time.perf_counter() - start
            session.rollback()
        if engine.dialect.name == "postgresql":
            # A rolled-back delete leaves its row versions dead: the next call would read them too.
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("VACUUM tinker_futures"))
        if i:  # the first warms the caches
            times.append(elapsed * 1e3)
    return statistics.median(times)


def calls(tenant_id: str, model_id: str, sampler_id: str) -> dict[str, Callable[[Session], Any]]:
    s, w = checkpoint(model_id, "s"), checkpoint(model_id, "w", "weights")
    t = {"tenant_id": tenant_id}
    return {
        "resolve (GET /api/v1/loraloom/resolve, create_sampling_session)": lambda db: (
            work.resolve_sampler_path(db, **t, path=s)
        ),
        "a sample's sampling-session check (get_sampling_session)": lambda db: sampling.get_sampling_session(
            db, **t, sampler_id=sampler_id
        ),
        "weights_info": lambda db: checkpoints.weights_info(db, **t, path=w),
        "load_weights' source check (training state)": lambda db: checkpoints.live_saves(
            db, **t, path=w, kind="save_weights"
        ),
        "GET /training_runs/{id}/checkpoints": lambda db: checkpoints.model_checkpoints(
            db, **t, model_id=model_id
        ),
        "GET /checkpoints (limit 100)": lambda db: checkpoints.user_checkpoints(db, **t, limit=100, offset=0),
        "GET /training_runs/{id} (its latest checkpoints)": lambda db: checkpoints.with_latest_checkpoints(
            db, **t, run_out=service.training_run_out(*service.get_listed_model(db, **t, model_id=model_id))
        ),
        "delete_checkpoint (sampler, rolled back)": lambda db: checkpoints.delete_checkpoint(
            db, **t, model_id=model_id, checkpoint_id="sampler_weights/s"
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=50_000, help="older saves of each name")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--sqlite", action="store_true", help="a scratch SQLite file instead of Postgres")
    add_pg_admin_url(p)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        # A scratch database, as bench.ingest makes and drops one.
        url = f"sqlite:///{scratch}/bench.db" if args.sqlite else create_database(args.pg_admin_url)
        try:
            migrate.upgrade(url)
            ids = seed(url, Path(scratch) / "data", args.saves)
            engine = create_engine(url)
            print(
                f"{engine.dialect.name}: {args.saves:,} superseded saves of each name; median of {args.repeats}"
            )
            print("| call | ms (median) |")
            print("|---|---:|")
            for label, call in calls(*ids).items():
                print(f"| {label} | {median_ms(engine, call, args.repeats):.2f} |")
            engine.dispose()
        finally:
            if not args.sqlite:
                drop_database(args.pg_admin_url, url)


if __name__ == "__main__":
    main()
