"""CPU of an idle service: `loraloom serve` on a fresh Postgres database with no request at all, so
what it burns is its background work (the sweeper). Alternates configurations in one run (same
minutes, same load), each a fresh process, and prints CPU milliseconds per second of each window.

    .venv/bin/python -m bench.service_idle                      # the defaults against the
                                                                # housekeeping at every sweep
    .venv/bin/python -m bench.service_idle --seconds 30 --rounds 3

The process's CPU is read from /proc (bench/ingest.py `tree_cpu_seconds`) after the service has
answered /healthz and `--settle` seconds have passed (its first sweep runs the housekeeping, with
the reconcile pass's first share, whatever the cadence), then again `--seconds` later.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from app import migrate
from bench.ingest import create_database, drop_database, start_service, stop_service, tree_cpu_seconds
from bench.options import add_pg_admin_url

CONFIGS: dict[str, dict[str, str]] = {
    "defaults": {},
    # The cadence before the housekeeping was split off: every job at every sweep.
    "housekeeping every sweep": {"LORALOOM_HOUSEKEEPING_INTERVAL_SECONDS": "2"},
}


def idle_cpu_ms_per_s(url: str, env: dict[str, str], *, settle: float, seconds: float) -> float:
    workdir = Path(tempfile.mkdtemp(prefix="loraloom-bench-idle-"))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # start_service passes the environment on
    try:
        proc, _url = start_service(url, workdir / "data", workdir / "service.log", workers=1)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        time.sleep(settle)
        before, _ = tree_cpu_seconds(proc.pid)
        time.sleep(seconds)
        after, _ = tree_cpu_seconds(proc.pid)
        return (after - before) * 1e3 / seconds
    finally:
        stop_service(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="measured window per process")
    p.add_argument("--settle", type=float, default=5.0, help="seconds after start-up before the window")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the configurations")
    add_pg_admin_url(p)
    args = p.parse_args(argv)
    url = create_database(args.pg_admin_url)
    figures: dict[str, list[float]] = {name: [] for name in CONFIGS}
    try:
        migrate.upgrade(url)
        for round_ in range(1, args.rounds + 1):
            for name, env in CONFIGS.items():
                ms = idle_cpu_ms_per_s(url, env, settle=args.settle, seconds=args.seconds)
                figures[name].append(ms)
                print(f"round {round_}, {name}: {ms:.1f} ms CPU per second", flush=True)
    finally:
        drop_database(args.pg_admin_url, url)
    for name, values in figures.items():
        print(f"{name}: median {statistics.median(values):.1f} ms CPU per second ({len(values)} windows)")


if __name__ == "__main__":
    main()
