"""Rollout-batch ingestion throughput: through the service (real uvicorn, real HTTP, Postgres)
against writing the same batches straight to files (the source documents' filesystem
transport: msgpack → temporary file → fsync → rename), in the same run.

    .venv/bin/python -m bench.ingest                        # defaults below
    .venv/bin/python -m bench.ingest --batches 300 --clients 1,2,4 --samples 64

What is timed:
- raw:      per batch: msgpack-encode, write a temporary file, fsync, rename (one writer, as the
            source documents' master rank does).
- service:  per batch: the client encodes (msgpack: the SDK's binary form, int32/uint8/float32
            arrays as bytes, converted from the lists on the client; msgpack-lists: the list form;
            json) and POSTs with an Idempotency-Key; the service decodes, validates every sample
            (vectorised for the binary form, which it stores as received; lists are converted
            once), writes the payload atomically (temp, fsync, rename, fsync dir), commits the row (Postgres fsyncs
            its WAL) and answers 201. --clients concurrent clients (threads, keep-alive connections).
Client, service and Postgres share this machine's cores. The database is a temporary one
(created and dropped here); data goes to a temporary directory.

Prints a markdown table: samples/s, MB/s on the wire (request bodies), MB/s of payload (the
canonical msgpack bytes, the same bytes the raw path writes), median latency and the ratio to raw;
for the service, its CPU per batch, and of it the kernel's part and the event-loop thread's part
(the rest is its worker threads': the routes' blocking work, the sweeper).
"""

import argparse
import hashlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from app import migrate
from app.auth import hash_key, new_api_key
from app.db import make_engine, make_session_factory
from app.pools.models import Pool
from app.runs.models import Run
from app.tenants.models import ApiKey, Tenant
from bench.options import add_pg_admin_url
from contracts.arrays import encode as encode_arrays
from contracts.arrays import to_arrays
from contracts.ids import new_id
from contracts.run_config import RunConfig
from contracts.wire import TrainingBatch, TrainingSample, json_encoder, msgpack_encoder
from loraloom.launch import start_service_process

ROOT = Path(__file__).resolve().parent.parent


def _binary(batch: TrainingBatch) -> bytes:
    return encode_arrays(to_arrays(batch))


ENCODERS = {
    "msgpack": _binary,  # what the SDK sends: the binary form (contracts/arrays.py), converted client-side
    "msgpack-lists": msgpack_encoder.encode,  # the list form in msgpack (what the SDK sent before)
    "json": json_encoder.encode,
}
VOCAB = 32_000
BASE_MODEL = "bench-model"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=200, help="batches per measured configuration")
    p.add_argument("--samples", type=int, default=64, help="samples per batch")
    p.add_argument("--prompt-len", type=int, default=200, help="mean prompt length (uniform ±50%%)")
    p.add_argument("--completion-len", type=int, default=400, help="mean completion length (long-tailed)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--clients", default="1,4", help="comma-separated client concurrencies")
    p.add_argument("--formats", default="json,msgpack")
    p.add_argument("--warmup", type=int, default=10, help="unmeasured batches before each configuration")
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="the batches are split into this many rounds, each measuring every configuration in turn, "
        "so that load from other processes on the machine affects them alike",
    )
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    add_pg_admin_url(p)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- data


def make_batches(args: argparse.Namespace, count: int, rng: random.Random) -> list[TrainingBatch]:
    """RL-like batches: uniform prompt lengths, long-tailed (log-normal) completion lengths."""
    out = []
    for step in range(count):
        examples = []
        for _ in range(args.samples):
            n_prompt = rng.randint(max(1, args.prompt_len // 2), max(1, args.prompt_len * 3 // 2))
            n_completion = int(rng.lognormvariate(0, 0.6) * args.completion_len / 1.2) + 1
            n_completion = min(n_completion, args.seq_len - n_prompt)
            examples.append(
                TrainingSample(
                    prompt_ids=[rng.randrange(VOCAB) for _ in range(n_prompt)],
                    prompt_mask=[False] * n_prompt,
                    completion_ids=[rng.randrange(VOCAB) for _ in range(n_completion)],
                    completion_mask=[True] * n_completion,
                    completion_logprobs=[-rng.expovariate(3.0) for _ in range(n_completion)],
                    advantage=rng.gauss(0.0, 1.0),
                )
            )
        out.append(TrainingBatch(examples=examples, temperature=1.0, step=0, env="bench"))
        del step
    return out


# --------------------------------------------------------------------------- raw file path


def raw_write(directory: Path, index: int, batch: TrainingBatch) -> int:
    data = msgpack_encoder.encode(batch)
    final = directory / f"batch_{index}.msgpack"
    tmp = directory / f".batch_{index}.msgpack.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return len(data)


# --------------------------------------------------------------------------- service


def create_database(admin_url: str) -> str:
    name = f"loraloom_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


def drop_database(admin_url: str, url: str) -> None:
    name = url.rsplit("/", 1)[1]
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def seed(database_url: str, *, seq_len: int, runs: int) -> tuple[str, list[str]]:
    """A tenant with a key, `runs` active runs, and a pool (so token ids are checked against its vocabulary)."""
    engine = make_engine(database_url)
    with make_session_factory(engine)() as session:
        tenant = Tenant(id=new_id("ten"), name="bench", max_concurrent_runs=runs)
        secret = new_api_key()
        session.add(tenant)
        session.flush()
        session.add(
            ApiKey(id=new_id("key"), tenant_id=tenant.id, key_hash=hash_key(secret), prefix=secret[:8])
        )
        session.add(
            Pool(
                id=new_id("pool"),
                base_model=BASE_MODEL,
                vocab_size=VOCAB,
                max_rank=64,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                slots=runs,
                world_size=1,
                max_seq_len=seq_len,
            )
        )
        config = RunConfig(base_model=BASE_MODEL, seq_len=seq_len, max_async_level=1000)
        run_ids = []
        for slot in range(runs):
            run = Run(
                id=new_id("run"),
                tenant_id=tenant.id,
                name=f"bench-{slot}",
                config=config.model_dump(mode="json"),
                base_model=BASE_MODEL,
                status="active",
                slot=slot,
            )
            session.add(run)
            run_ids.append(run.id)
        session.commit()
    engine.dispose()
    return secret, run_ids


def start_service(
    database_url: str, data_dir: Path, log_path: Path, workers: int
) -> tuple[subprocess.Popen[bytes], str]:
    env = os.environ | {
        "LORALOOM_DATABASE_URL": database_url,
        "LORALOOM_DATA_DIR": str(data_dir),
        "LORALOOM_ADMIN_KEY": "bench-admin",
        "LORALOOM_WORKER_TOKEN": "bench-worker",
    }
    return start_service_process(env=env, log_path=log_path, workers=workers)  # any free port


def stop_service(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (uvicorn's clean shutdown), then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """(user + system, system) CPU seconds of a process and its live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, system, stack = 0.0, 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            system += int(fields[12]) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total, system


def event_loop_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) of a single-process uvicorn server's main thread, which runs its
    event loop (the HTTP layer, the front layer and routes' async parts, the thread hand-offs' loop
    side); the rest of the process's CPU is its worker threads' (the routes' blocking parts, the
    sweeper). None when `pid` has child processes (`--workers` > 1: its main thread supervises)."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        if any((task / "children").read_text().split() for task in Path(f"/proc/{pid}/task").iterdir()):
            return None
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / tick


@dataclass
class Result:
    path: str
    fmt: str
    clients: int
    batches: int
    samples: int
    wire_bytes: int
    payload_bytes: int
    seconds: float
    latencies_ms: list[float]
    server_cpu_s: float = 0.0
    """CPU time of the service's processes (not Postgres, not the clients) while this configuration ran."""
    server_sys_s: float = 0.0
    """The part of it spent in the kernel (socket reads, the payload write and its fsyncs)."""
    server_loop_s: float | None = 0.0
    """The part of it on the event loop's thread (`event_loop_cpu_seconds`); None when not known."""


def post_all(
    url: str, secret: str, run_id: str, batches: list[TrainingBatch], *, fmt: str, clients: int
) -> tuple[float, int, list[float]]:
    """POST every batch with `clients` concurrent clients; returns (seconds, wire bytes, latencies)."""
    next_index = iter(range(len(batches)))
    lock = threading.Lock()
    wire = [0] * clients
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[str] = []
    barrier = threading.Barrier(clients + 1)

    def worker(c: int) -> None:
        headers = {"Authorization": f"Bearer {secret}"}
        headers["Content-Type"] = "application/json" if fmt == "json" else "application/msgpack"
        encode = ENCODERS[fmt]
        with httpx.Client(base_url=url, timeout=60) as client:
            client.get("/healthz")  # open the connection before the clock starts
            barrier.wait()
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                body = encode(batches[i])
                resp = client.post(
                    f"/v1/runs/{run_id}/batches",
                    content=body,
                    headers=headers | {"Idempotency-Key": uuid.uuid4().hex},
                )
                latencies[c].append((time.perf_counter() - t0) * 1000)
                if resp.status_code != 201:
                    errors.append(f"{resp.status_code}: {resp.text[:300]}")
                    return
                wire[c] += len(body)

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"ingestion failed: {errors[0]}")
    return seconds, sum(wire), [x for per in latencies for x in per]


# --------------------------------------------------------------------------- main


def measure_rounds(
    batches: list[TrainingBatch],
    rounds: int,
    raw_dir: Path,
    raw: Result,
    targets: list[tuple[Result, str, str]],
    *,
    url: str,
    pid: int,
) -> None:
    """The batches in `rounds` chunks; per chunk the raw file path (one writer, same disk), then each
    target `(result, api key, run id)` posting the chunk with its format and clients while the
    server's process tree CPU is read around it. Accumulates into `raw` and the targets' results."""
    per_round = -(-len(batches) // rounds)
    for start in range(0, len(batches), per_round):
        chunk = batches[start : start + per_round]
        chunk_samples = sum(len(b.examples) for b in chunk)
        chunk_payload = sum(len(msgpack_encoder.encode(b)) for b in chunk)
        t0 = time.perf_counter()
        for i, b in enumerate(chunk):
            t = time.perf_counter()
            n = raw_write(raw_dir, start + i, b)
            raw.latencies_ms.append((time.perf_counter() - t) * 1000)
            raw.wire_bytes += n
            raw.payload_bytes += n
        raw.seconds += time.perf_counter() - t0
        raw.batches += len(chunk)
        raw.samples += chunk_samples
        for result, secret, run_id in targets:
            cpu0, sys0 = tree_cpu_seconds(pid)
            loop0 = event_loop_cpu_seconds(pid)
            seconds, wire, lat = post_all(url, secret, run_id, chunk, fmt=result.fmt, clients=result.clients)
            cpu1, sys1 = tree_cpu_seconds(pid)
            loop1 = event_loop_cpu_seconds(pid)
            result.server_cpu_s += cpu1 - cpu0
            result.server_sys_s += sys1 - sys0
            if result.server_loop_s is not None and loop0 is not None and loop1 is not None:
                result.server_loop_s += loop1 - loop0
            else:
                result.server_loop_s = None
            result.seconds += seconds
            result.wire_bytes += wire
            result.payload_bytes += chunk_payload
            result.latencies_ms += lat
            result.batches += len(chunk)
            result.samples += chunk_samples
        rates = ", ".join(
            f"{r.fmt}×{r.clients} {r.samples / r.seconds / (raw.samples / raw.seconds):.2f}"
            for r, _, _ in targets
        )
        print(f"round {start // per_round + 1}: × raw so far: {rates}", file=sys.stderr)


def table(results: list[Result]) -> str:
    raw = next(r for r in results if r.path == "raw files")
    raw_rate = raw.samples / raw.seconds
    lines = [
        "| path | format | clients | batches | samples/s | wire MB/s | payload MB/s | p50 ms/batch "
        "| service CPU ms/batch | of which kernel | of which event loop | × raw |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rate = r.samples / r.seconds
        served = r.path == "service"
        cpu = f"{r.server_cpu_s / r.batches * 1000:.1f}" if served else "–"
        kernel = f"{r.server_sys_s / r.batches * 1000:.1f}" if served else "–"
        loop = f"{r.server_loop_s / r.batches * 1000:.1f}" if served and r.server_loop_s is not None else "–"
        lines.append(
            f"| {r.path} | {r.fmt} | {r.clients} | {r.batches} | {rate:,.0f} | {r.wire_bytes / r.seconds / 1e6:,.1f} | "
            f"{r.payload_bytes / r.seconds / 1e6:,.1f} | {statistics.median(r.latencies_ms):.1f} | "
            f"{cpu} | {kernel} | {loop} | {rate / raw_rate:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    clients_list = [int(c) for c in args.clients.split(",") if c]
    formats = [f for f in args.formats.split(",") if f]
    batches = make_batches(args, args.batches, rng)
    warm = make_batches(args, args.warmup, rng) if args.warmup else []
    samples = sum(len(b.examples) for b in batches)
    tokens = sum(len(x.prompt_ids) + len(x.completion_ids) for b in batches for x in b.examples)
    payload = sum(len(msgpack_encoder.encode(b)) for b in batches)
    print(
        f"{len(batches)} batches × {args.samples} samples, {tokens / samples:.0f} tokens/sample on average, "
        f"{payload / len(batches) / 1e6:.2f} MB msgpack / {sum(len(json_encoder.encode(b)) for b in batches) / len(batches) / 1e6:.2f} MB JSON per batch",
        file=sys.stderr,
    )

    workdir = Path(tempfile.mkdtemp(prefix="loraloom-bench-ingest-"))
    database_url = create_database(args.pg_admin_url)
    proc: subprocess.Popen[bytes] | None = None
    configs = [(fmt, c) for fmt in formats for c in clients_list]
    raw = Result("raw files", "msgpack", 1, 0, 0, 0, 0, 0.0, [])
    service_results = [Result("service", fmt, c, 0, 0, 0, 0, 0.0, []) for fmt, c in configs]
    try:
        raw_dir = workdir / "raw" / "rollouts" / "step_0"
        raw_dir.mkdir(parents=True)
        migrate.upgrade(database_url)
        secret, run_ids = seed(database_url, seq_len=args.seq_len, runs=len(configs))
        proc, url = start_service(database_url, workdir / "data", workdir / "service.log", args.workers)
        for i, b in enumerate(warm):
            raw_write(raw_dir, -1 - i, b)
        for (fmt, clients), run_id in zip(configs, run_ids, strict=True):
            if warm:
                post_all(url, secret, run_id, warm, fmt=fmt, clients=clients)

        targets = [(result, secret, run_id) for result, run_id in zip(service_results, run_ids, strict=True)]
        measure_rounds(batches, args.rounds, raw_dir, raw, targets, url=url, pid=proc.pid)
        results: list[Result] = [raw, *service_results]

        # Sanity: the service stored what it acknowledged, and the files are what the rows say.
        engine = make_engine(database_url)
        with engine.connect() as conn:
            count = conn.execute(text("SELECT count(*) FROM batches")).scalar_one()
            path, digest = conn.execute(
                text("SELECT payload_path, payload_sha256 FROM batches LIMIT 1")
            ).one()
        engine.dispose()
        assert count == len(configs) * (len(batches) + len(warm)), count
        assert hashlib.sha256((workdir / "data" / path).read_bytes()).hexdigest() == digest
    finally:
        if proc is not None:
            stop_service(proc)
        drop_database(args.pg_admin_url, database_url)
        shutil.rmtree(workdir, ignore_errors=True)

    print(table(results))


if __name__ == "__main__":
    main()
