"""The physical floor of ingestion through a service on this machine: what raw HTTP, one Postgres
statement and the payload's fsyncs cost with nothing else, as a bound for bench/ingest.py.

    .venv/bin/python -m bench.ingest_floor --batches 100 --rounds 2 --clients 1,4

The same clients, batches and binary bodies as bench/ingest.py's `msgpack` format, POSTed to a
minimal ASGI app (`create_floor_app`, no framework, no middleware) served by uvicorn with the
service's options (app/serving.py: the httptools protocol, no proxy-headers layer). Per request it
only reads the body, hashes it (sha256), writes it atomically (temp, fsync, rename, fsync of the
directory, in the loop's default thread pool, as the service must not block its loop on a disk) and
runs ONE prepared INSERT … RETURNING on an autocommit psycopg AsyncConnection (one per client: no
pool, no ORM, no thread hop for the database). No authentication, no validation, no run row, no
rollout stats, no events: everything the service does beyond this is what it adds to the floor.

Prints the same table as bench/ingest.py ("service" is the floor app).
"""

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from bench.ingest import (
    Result,
    create_database,
    drop_database,
    make_batches,
    measure_rounds,
    parse_args,
    post_all,
    stop_service,
    table,
)
from contracts.durable import atomic_write_bytes
from loraloom.launch import start_service_process

_INSERT = (
    "INSERT INTO floor_batches (run_id, idempotency_key, sha256, payload_path, payload_bytes) "
    "VALUES (%s, %s, %s, %s, %s) RETURNING id, created_at"
)
_SCHEMA = """
CREATE TABLE floor_batches (
    id bigserial PRIMARY KEY, run_id text NOT NULL, idempotency_key text, sha256 text NOT NULL,
    payload_path text NOT NULL, payload_bytes integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(), UNIQUE (run_id, idempotency_key))
"""
_DB_ENV, _DIR_ENV = "FLOOR_DATABASE_URL", "FLOOR_DATA_DIR"
_CONNECTIONS = 8


def create_floor_app() -> Any:
    """The floor app (a uvicorn factory; settings from FLOOR_DATABASE_URL and FLOOR_DATA_DIR)."""
    url = os.environ[_DB_ENV].replace("postgresql+psycopg://", "postgresql://")
    data_dir = Path(os.environ[_DIR_ENV])
    idle: asyncio.Queue[psycopg.AsyncConnection[Any]] | None = None

    async def connections() -> asyncio.Queue[psycopg.AsyncConnection[Any]]:
        nonlocal idle
        if idle is None:
            idle = asyncio.Queue()
            for _ in range(_CONNECTIONS):
                conn = await psycopg.AsyncConnection.connect(url, autocommit=True, prepare_threshold=0)
                idle.put_nowait(conn)
        return idle

    async def reply(send: Any, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":  # /healthz, /readyz
            await reply(send, 200, b'{"status":"ok"}')
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        digest = hashlib.sha256(body).hexdigest()
        run_id = scope["path"].split("/")[3]
        key = dict(scope["headers"]).get(b"idempotency-key", b"").decode() or None
        relative = f"{run_id}/{digest}.msgpack"
        await asyncio.get_running_loop().run_in_executor(None, atomic_write_bytes, data_dir / relative, body)
        pool = await connections()
        conn = await pool.get()
        try:
            cursor = await conn.execute(_INSERT, (run_id, key, digest, relative, len(body)), prepare=True)
            row = await cursor.fetchone()
        finally:
            pool.put_nowait(conn)
        assert row is not None
        out = {"id": row[0], "run_id": run_id, "created_at": row[1].isoformat(), "state": "pending"}
        await reply(send, 201, json.dumps(out).encode())

    return app


def _start(database_url: str, data_dir: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = os.environ | {_DB_ENV: database_url, _DIR_ENV: str(data_dir)}
    # As the service is started (its protocol and limits; a port bound before the child starts).
    return start_service_process(
        env=env, log_path=log_path, factory="bench.ingest_floor:create_floor_app", timeout_s=30
    )


def main(argv: list[str] | None = None) -> None:
    args: argparse.Namespace = parse_args(argv)
    rng = random.Random(args.seed)
    clients_list = [int(c) for c in args.clients.split(",") if c]
    batches = make_batches(args, args.batches, rng)
    warm = make_batches(args, args.warmup, rng) if args.warmup else []
    workdir = Path(tempfile.mkdtemp(prefix="loraloom-bench-floor-"))
    database_url = create_database(args.pg_admin_url)
    proc: subprocess.Popen[bytes] | None = None
    raw = Result("raw files", "msgpack", 1, 0, 0, 0, 0, 0.0, [])
    floors = [Result("service", "msgpack", c, 0, 0, 0, 0, 0.0, []) for c in clients_list]
    try:
        with psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
            conn.execute(_SCHEMA)
        raw_dir = workdir / "raw"
        raw_dir.mkdir()
        proc, url = _start(database_url, workdir / "data", workdir / "floor.log")
        for c in clients_list:
            post_all(url, "-", f"run_warm{c}", warm, fmt="msgpack", clients=c)
        targets = [(result, "-", f"run_{result.clients}") for result in floors]
        measure_rounds(batches, args.rounds, raw_dir, raw, targets, url=url, pid=proc.pid)
    finally:
        if proc is not None:
            stop_service(proc)
        drop_database(args.pg_admin_url, database_url)
        shutil.rmtree(workdir, ignore_errors=True)
    print(table([raw, *floors]).replace("| service |", "| floor app |"))


if __name__ == "__main__":
    main()
