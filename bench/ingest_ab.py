"""Rollout-batch ingestion of two versions of the service side by side, rounds alternating.

On these shared 2-core machines the same service measured minutes apart differs by a third (docs/
benchmarks.md), which hides changes of 10-20 %. Here this tree's service and a baseline's (``--baseline``,
a source tree such as ``git worktree add --detach /tmp/base main``) run at once on one scratch database
(one run each), and each round posts the same batches to the baseline, then to this tree (the order
swapped every other round: the second in a round reads higher), with the raw file path of bench/ingest.py
measured in the same round. Each service's CPU (its process tree) and throughput are taken per round;
printed are the medians over rounds and the CPU ratio over pairs of rounds, one in each order.

    .venv/bin/python -m bench.ingest_ab --baseline /tmp/base            # 4 clients, 8 rounds of 60 batches
    .venv/bin/python -m bench.ingest_ab --baseline /tmp/base --clients 1 --rounds 12

Clients post the SDK's binary form, converted from lists per batch as in bench/ingest.py (``--pre-encoded``:
bodies made before the clock starts, so the clients' CPU does not compete with the services').
"""

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from app import migrate
from bench.ingest import (
    ENCODERS,
    create_database,
    drop_database,
    event_loop_cpu_seconds,
    make_batches,
    post_all,
    raw_write,
    seed,
    stop_service,
    tree_cpu_seconds,
)
from bench.options import add_pg_admin_url
from loraloom.launch import start_service_process

ROOT = Path(__file__).resolve().parent.parent


def start(database_url: str, data_dir: Path, log: Path, app_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = os.environ | {
        "LORALOOM_DATABASE_URL": database_url,
        "LORALOOM_DATA_DIR": str(data_dir),
        "LORALOOM_ADMIN_KEY": "bench-admin",
        "LORALOOM_WORKER_TOKEN": "bench-worker",
        "LORALOOM_RUN_MAX_PENDING_BATCHES": "1000000",
        "LORALOOM_RUN_MAX_PENDING_BYTES": str(1 << 50),
    }
    return start_service_process(env=env, log_path=log, app_dir=app_dir)  # any free port


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, required=True, help="the baseline's source tree")
    p.add_argument("--rounds", type=int, default=8, help="an even number: the order alternates")
    p.add_argument("--batches", type=int, default=60, help="batches per service per round")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--pre-encoded", action="store_true", help="bodies encoded before the clock starts")
    add_pg_admin_url(p)
    args = p.parse_args(argv)
    if args.rounds < 2 or args.rounds % 2:
        p.error("--rounds must be an even number of at least 2")
    shape = argparse.Namespace(samples=64, prompt_len=200, completion_len=400, seq_len=2048)
    batches = make_batches(shape, args.batches, random.Random(0))
    warm = make_batches(shape, 10, random.Random(1))
    fmt = "msgpack"
    if args.pre_encoded:
        bodies = {id(b): ENCODERS["msgpack"](b) for b in [*batches, *warm]}
        ENCODERS["pre-encoded"] = lambda b: bodies[id(b)]
        fmt = "pre-encoded"
    samples = sum(len(b.examples) for b in batches)

    workdir = Path(tempfile.mkdtemp(prefix="loraloom-bench-ingest-ab-"))
    url = create_database(args.pg_admin_url)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        migrate.upgrade(url)
        secret, run_ids = seed(url, seq_len=shape.seq_len, runs=2)
        versions = {"baseline": args.baseline.resolve(), "this tree": ROOT}
        services = {}
        for (name, tree), run_id in zip(versions.items(), run_ids, strict=True):
            proc, base_url = start(url, workdir / name.replace(" ", "_"), workdir / f"{name}.log", tree)
            procs.append(proc)
            services[name] = (proc, base_url, run_id)
            post_all(base_url, secret, run_id, warm, fmt=fmt, clients=args.clients)
        raw_dir = workdir / "raw"
        raw_dir.mkdir()
        per_round: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in services}
        for r in range(args.rounds):
            t0 = time.perf_counter()
            for i, b in enumerate(batches):
                raw_write(raw_dir, r * len(batches) + i, b)
            raw_rate = samples / (time.perf_counter() - t0)
            order = list(services) if r % 2 == 0 else list(reversed(services))
            line = []
            for name in order:
                proc, base_url, run_id = services[name]
                cpu0, _ = tree_cpu_seconds(proc.pid)
                loop0 = event_loop_cpu_seconds(proc.pid) or 0.0
                seconds, _, _ = post_all(base_url, secret, run_id, batches, fmt=fmt, clients=args.clients)
                cpu1, _ = tree_cpu_seconds(proc.pid)
                loop1 = event_loop_cpu_seconds(proc.pid) or 0.0
                rate = samples / seconds
                cpu_ms, loop_ms = ((cpu1 - cpu0) / len(batches) * 1000, (loop1 - loop0) / len(batches) * 1000)
                per_round[name].append((cpu_ms, rate, rate / raw_rate, loop_ms))
                line.append(
                    f"{name}: {rate:,.0f} samples/s ({rate / raw_rate:.2f}x raw), {cpu_ms:.2f} ms "
                    f"(event loop {loop_ms:.2f})"
                )
            print(f"round {r + 1}: raw {raw_rate:,.0f} samples/s; " + "; ".join(line), file=sys.stderr)
    finally:
        for proc in procs:
            stop_service(proc)
        drop_database(args.pg_admin_url, url)
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"{args.rounds} rounds x {args.batches} batches x 64 samples, {args.clients} clients, {fmt}")
    print(
        "| service | CPU ms per batch, median (min-max) | of which event loop, median | samples/s, median "
        "| x raw, median (min-max) |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, rows in per_round.items():
        cpus, rates, ratios, loops = zip(*rows, strict=True)
        print(
            f"| {name} | {statistics.median(cpus):.2f} ({min(cpus):.2f}-{max(cpus):.2f}) | "
            f"{statistics.median(loops):.2f} | {statistics.median(rates):,.0f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    # Whichever service posts second in a round reads higher (the first one's files and WAL are still
    # being written back), so the versions are compared over pairs of rounds, one in each order.
    base, new = per_round["baseline"], per_round["this tree"]
    pairs = [(new[i][0] + new[i + 1][0]) / (base[i][0] + base[i + 1][0]) for i in range(0, len(base) - 1, 2)]
    total = sum(n[0] for n in new) / sum(b[0] for b in base)
    print(
        f"this tree / baseline, CPU per batch: {total:.2f} over all rounds; per pair of rounds (one in each "
        f"order) median {statistics.median(pairs):.2f} ({', '.join(f'{x:.2f}' for x in pairs)})"
    )


if __name__ == "__main__":
    main()
