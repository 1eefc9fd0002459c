"""Nothing acknowledged is lost (DESIGN §4.4): kill -9 the service in the middle of a stream of
ingestions, start it again, and every batch that got a 2xx is there, readable and intact, and
nothing half-written is visible."""

import hashlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest
from sqlalchemy import select

from app.batches.models import Batch
from app.runs.models import Run
from contracts.durable import TMP_SUFFIX
from contracts.run_config import RunConfig
from loraloom.launch import start_service_process
from tests.app.api import as_plain, stored_plain
from tests.app.factories import Seeded, committed, seed_run
from tests.common import ADMIN_KEY, WORKER_TOKEN

ROOT = Path(__file__).resolve().parents[2]


class Service:
    """The real service in its own process (uvicorn), so that it can be killed for real."""

    def __init__(self, settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        env = os.environ | {
            "LORALOOM_DATABASE_URL": self.settings.database_url,
            "LORALOOM_DATA_DIR": str(self.settings.data_dir),
            "LORALOOM_ADMIN_KEY": ADMIN_KEY,
            "LORALOOM_WORKER_TOKEN": WORKER_TOKEN,
        }
        # Any free port, held from its pick (a restart gets a new one: the test reads `url` after it).
        self.proc, self.url = start_service_process(env=env, log_path=self.log_path)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def _body(seed: int, n: int = 32, prompt: int = 120, completion: int = 200) -> dict:
    examples = []
    for i in range(n):
        s = seed * 1000 + i
        examples.append(
            {
                "prompt_ids": [(s + j) % 997 + 1 for j in range(prompt)],
                "prompt_mask": [False] * prompt,
                "completion_ids": [(s * 3 + j) % 991 + 1 for j in range(completion)],
                "completion_mask": [True] * completion,
                "completion_logprobs": [-((s + j) % 17) / 7.0 for j in range(completion)],
                "advantage": (s % 5) - 2.0,
            }
        )
    return {"examples": examples, "temperature": 0.9, "step": 0, "env": f"env-{seed}"}


@dataclass
class Stream:
    acked: dict[str, tuple[dict, dict]] = field(default_factory=dict)
    """Idempotency key → (body sent, BatchOut) for every 2xx."""
    unknown: dict[str, dict] = field(default_factory=dict)
    """Key → body of requests cut off by the kill (outcome unknown to the client)."""
    lock: threading.Lock = field(default_factory=threading.Lock)


def _stream(url: str, seeded: Seeded, writer: int, stream: Stream, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, headers=seeded.headers, timeout=30) as client:
        seq = 0
        while not stop.is_set():
            key = f"w{writer}-{seq}"
            body = _body(writer * 10_000 + seq)
            as_msgpack = seq % 2 == 1
            try:
                if as_msgpack:
                    resp = client.post(
                        f"/v1/runs/{seeded.run_id}/batches",
                        content=msgspec.msgpack.encode(body),
                        headers={"Idempotency-Key": key, "Content-Type": "application/msgpack"},
                    )
                else:
                    resp = client.post(
                        f"/v1/runs/{seeded.run_id}/batches", json=body, headers={"Idempotency-Key": key}
                    )
            except httpx.HTTPError:
                with stream.lock:
                    stream.unknown[key] = body
                return  # the service is gone
            if resp.status_code >= 500:
                with stream.lock:
                    stream.unknown[key] = body
                return
            assert resp.status_code == 201, resp.text
            with stream.lock:
                stream.acked[key] = (body, resp.json())
            seq += 1


@pytest.mark.slow
@pytest.mark.postgres_only
def test_kill_9_during_ingestion_loses_nothing_acknowledged(settings, tmp_path):
    seeded = seed_run(settings, config=RunConfig(seq_len=1024))
    service = Service(settings, tmp_path / "service.log")
    service.start()
    stream, stop = Stream(), threading.Event()
    writers = [
        threading.Thread(target=_stream, args=(service.url, seeded, w, stream, stop), daemon=True)
        for w in range(3)
    ]
    try:
        for t in writers:
            t.start()
        deadline = time.monotonic() + 60
        while len(stream.acked) < 24 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(stream.acked) >= 24, f"too slow: {len(stream.acked)} batches acknowledged"
        service.kill()  # mid-stream: three requests are in flight
        for t in writers:
            t.join(timeout=60)
        stop.set()

        acked_at_kill = dict(stream.acked)
        service.start()

        # 1. Every acknowledged batch is there: row, file, digest, content.
        with committed(settings) as session:
            rows = {b.idempotency_key: b for b in session.scalars(select(Batch).order_by(Batch.id))}
            for key, (body, out) in acked_at_kill.items():
                row = rows.get(key)
                assert row is not None, f"acknowledged batch {key} lost"
                assert row.id == out["id"]
                data = (settings.data_dir / row.payload_path).read_bytes()
                assert hashlib.sha256(data).hexdigest() == row.payload_sha256
                assert stored_plain(data) == as_plain(body)
            # 2. Nothing half-written is visible: every row's file is complete; no temporaries remain.
            for row in rows.values():
                assert not row.payload_path.endswith(TMP_SUFFIX)
                data = (settings.data_dir / row.payload_path).read_bytes()
                assert hashlib.sha256(data).hexdigest() == row.payload_sha256
                assert len(data) == row.payload_bytes
        assert not list(settings.runs_dir.rglob(f"*{TMP_SUFFIX}"))

        # 3. The cut-off requests, retried with their keys, are stored exactly once.
        with httpx.Client(base_url=service.url, headers=seeded.headers, timeout=30) as client:
            for key, body in stream.unknown.items():
                resp = client.post(
                    f"/v1/runs/{seeded.run_id}/batches", json=body, headers={"Idempotency-Key": key}
                )
                assert resp.status_code in (200, 201), resp.text
            # A replay of an acknowledged one is still a replay.
            key, (body, out) = next(iter(acked_at_kill.items()))
            replay = client.post(
                f"/v1/runs/{seeded.run_id}/batches", json=body, headers={"Idempotency-Key": key}
            )
            assert replay.status_code == 200 and replay.json()["id"] == out["id"]
        with committed(settings) as session:
            rows = session.scalars(select(Batch).order_by(Batch.id)).all()
            keys = [b.idempotency_key for b in rows]
            assert len(keys) == len(set(keys))
            assert set(keys) == set(acked_at_kill) | set(stream.unknown)
            offset = 0
            for row in rows:  # offsets stay contiguous across the crash
                assert row.sample_offset == offset
                offset += row.num_samples
            assert session.get(Run, seeded.run_id).submitted_samples == offset
    finally:
        stop.set()
        service.stop()
