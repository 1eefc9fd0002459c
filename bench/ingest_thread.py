"""The worker thread's part of a batch submission, in-process: CPU per batch of the hot route's
thread-pool function (app/batches/lean_route._submit_in_thread: run read, decode + checks + sha256,
payload write with its fsyncs, the reserve-and-insert and stats statements, the commits), without
HTTP, the event loop or the front layer.

    .venv/bin/python -m bench.ingest_thread                        # Postgres, 230 batches × 3 rounds
    .venv/bin/python -m bench.ingest_thread --data-dir-in /dev/shm # payloads on tmpfs: no fsync cost
    PYTHONPATH=/work/main .venv/bin/python bench/ingest_thread.py  # the same against another checkout

`thread_time` of the calling thread around each call (the kernel's part of the fsyncs included, the
waits for Postgres not), summed over the round and divided by its batches; the median of the rounds
is the figure. The same binary (msgpack) batches as bench/ingest.py, 64 samples × ~600 tokens.
"""

import argparse
import random
import shutil
import statistics
import tempfile
import time
import types
from pathlib import Path

from app import migrate
from app.batches.lean_route import _Lean, _submit_in_thread
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.runs.models import Run
from bench.ingest import _binary, create_database, drop_database, make_batches, seed
from bench.options import add_pg_admin_url


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=230, help="batches per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--distinct", type=int, default=20, help="distinct batch bodies (cycled)")
    p.add_argument(
        "--data-dir-in",
        default=None,
        help="where the payload files go (e.g. /dev/shm: fsyncs then cost nothing, which leaves the "
        "database work as most of what varies); default: the system's temporary directory",
    )
    add_pg_admin_url(p)
    args = p.parse_args(argv)
    shape = argparse.Namespace(samples=64, prompt_len=200, completion_len=400, seq_len=2048)
    bodies = [_binary(b) for b in make_batches(shape, args.distinct, random.Random(0))]

    workdir = Path(tempfile.mkdtemp(prefix="loraloom-bench-thread-", dir=args.data_dir_in))
    url = create_database(args.pg_admin_url)
    engine = None
    try:
        migrate.upgrade(url)
        _secret, (run_id,) = seed(url, seq_len=shape.seq_len, runs=1)
        engine = make_engine(url)
        with make_session_factory(engine)() as session:
            tenant_id = session.get_one(Run, run_id).tenant_id
        settings = Settings(
            database_url=url,
            data_dir=workdir / "data",
            admin_key="bench-admin",
            worker_token="bench-worker",
            run_max_pending_batches=1_000_000,
            run_max_pending_bytes=1 << 50,
        )
        state = types.SimpleNamespace(settings=settings, session_factory=make_session_factory(engine))
        request = types.SimpleNamespace(app=types.SimpleNamespace(state=state))
        n = 0

        def submit() -> float:
            nonlocal n
            n += 1
            lean = _Lean(tenant_id, run_id, True, f"k{n}")
            t0 = time.thread_time()
            result = _submit_in_thread(request, lean, bodies[n % len(bodies)])  # type: ignore[arg-type]
            spent = time.thread_time() - t0
            assert result.created
            return spent

        for _ in range(20):  # warm-up: pool, prepared statements, caches
            submit()
        per_round = []
        for r in range(args.rounds):
            spent = sum(submit() for _ in range(args.batches))
            per_round.append(spent / args.batches * 1000)
            print(f"round {r + 1}: {per_round[-1]:.2f} ms CPU per batch (worker thread)")
        print(
            f"median {statistics.median(per_round):.2f} ms (rounds: {', '.join(f'{x:.2f}' for x in per_round)})"
        )
    finally:
        if engine is not None:
            engine.dispose()
        drop_database(args.pg_admin_url, url)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
