"""Calls through the service's HTTP API, as tenants, the admin and a pool make them, and the
bodies they send. Works with the in-process TestClient and with a real HTTP client alike
(`Client`). Direct database work lives in tests/app/factories.py.
"""

import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from contracts.arrays import decode_stored, to_arrays, to_lists
from contracts.wire import batch_json_decoder
from tests.app.factories import Seeded
from tests.common import ADMIN_KEY, WORKER_TOKEN

ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
WORKER_HEADERS = {"Authorization": f"Bearer {WORKER_TOKEN}"}
MSGPACK = "application/msgpack"

Client = TestClient | httpx.Client
"""The in-process app or a real server."""
Response = Any
"""What a `Client` call returns: httpx's Response, or the TestClient's (starlette builds its TestClient
on its own copy of httpx); both answer to the same API."""

# --------------------------------------------------------------------------- tenants and runs


@dataclass(frozen=True)
class TenantHandle:
    id: str
    name: str
    key: str
    key_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def new_tenant(client: Client, *, quota: int = 2, name: str | None = None) -> TenantHandle:
    """A tenant and one API key, through the admin API."""
    name = name or f"t-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/tenants", json={"name": name, "max_concurrent_runs": quota}, headers=ADMIN_HEADERS)
    assert r.status_code == 201, r.text
    tenant_id = r.json()["id"]
    r = client.post(f"/v1/tenants/{tenant_id}/keys", headers=ADMIN_HEADERS)
    assert r.status_code == 201, r.text
    return TenantHandle(id=tenant_id, name=name, key=r.json()["key"], key_id=r.json()["id"])


def create_run(
    client: Client,
    tenant: TenantHandle,
    *,
    name: str = "r",
    expect: int = 201,
    **config: Any,
) -> dict[str, Any]:
    r = client.post("/v1/runs", json={"name": name, "config": config}, headers=tenant.headers)
    assert r.status_code == expect, r.text
    body: dict[str, Any] = r.json()
    return body


# --------------------------------------------------------------------------- rollout batches


def sample(
    prompt_len: int = 4, completion_len: int = 3, *, seed: int = 0, **overrides: Any
) -> dict[str, Any]:
    """A valid TrainingSample as a plain dict (so tests can break it freely)."""
    out: dict[str, Any] = {
        "prompt_ids": [(seed * 7 + i) % 50 + 1 for i in range(prompt_len)],
        "prompt_mask": [False] * prompt_len,
        "completion_ids": [(seed * 11 + i) % 50 + 2 for i in range(completion_len)],
        "completion_mask": [True] * completion_len,
        "completion_logprobs": [-0.5 - 0.01 * i for i in range(completion_len)],
        "advantage": 0.25 + seed,
    }
    out.update(overrides)
    return out


def batch_body(n: int = 3, *, step: int = 0, seed: int = 0, **overrides: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "examples": [sample(seed=seed + i) for i in range(n)],
        "temperature": 1.0,
        "step": step,
    }
    out.update(overrides)
    return out


def rewarded_batch(
    rewards: list[float | None], *, step: int, metrics: list[dict[str, float] | None] | None = None
) -> dict[str, Any]:
    """A batch of one sample per reward (None: a sample without one), with optional per-sample metrics."""
    examples = []
    for i, reward in enumerate(rewards):
        extra: dict[str, Any] = {} if reward is None else {"reward": reward}
        if metrics is not None and metrics[i] is not None:
            extra["metrics"] = metrics[i]
        examples.append(sample(seed=i, **extra))
    return batch_body(0, step=step) | {"examples": examples}


def as_plain(body: dict[str, Any]) -> dict[str, Any]:
    """What a body decodes to (defaults filled in, ints in float fields as floats, per-token floats
    rounded to float32 as the binary form stores them)."""
    batch = to_lists(to_arrays(batch_json_decoder.decode(msgspec.json.encode(body))))
    plain: dict[str, Any] = msgspec.to_builtins(batch)
    return plain


def stored_plain(data: bytes) -> dict[str, Any]:
    """A stored payload (or a msgpack claim's payload) as `as_plain` writes a body."""
    plain: dict[str, Any] = msgspec.to_builtins(to_lists(decode_stored(data)))
    return plain


def post_batch(
    client: Client,
    seeded: Seeded,
    body: dict[str, Any],
    *,
    msgpack: bool = False,
    key: str | None = None,
) -> Response:
    headers = dict(seeded.headers)
    if key is not None:
        headers["Idempotency-Key"] = key
    if msgpack:
        headers["Content-Type"] = MSGPACK
        return client.post(
            f"/v1/runs/{seeded.run_id}/batches", content=msgspec.msgpack.encode(body), headers=headers
        )
    return client.post(f"/v1/runs/{seeded.run_id}/batches", json=body, headers=headers)


# --------------------------------------------------------------------------- the pool's side

POOL_SPEC: dict[str, Any] = {
    "base_model": "loraloom-tiny",
    "vocab_size": 256,
    "max_rank": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "slots": 2,
    "world_size": 2,
    "max_seq_len": 1024,
}


def register(client: Client, **overrides: Any) -> str:
    """Register a pool (POOL_SPEC with `overrides`); returns its id."""
    r = client.post("/v1/pool/register", json=POOL_SPEC | overrides, headers=WORKER_HEADERS)
    assert r.status_code == 201, r.text
    pool_id: str = r.json()["pool_id"]
    return pool_id


def claim(client: Client, pool_id: str, max_batches: int = 16) -> dict[str, Any]:
    resp = client.post(
        "/v1/pool/batches/claim",
        json={"pool_id": pool_id, "max_batches": max_batches},
        headers=WORKER_HEADERS,
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def ack(client: Client, pool_id: str, acks: list[tuple[int, int]]) -> Response:
    return client.post(
        "/v1/pool/batches/ack",
        json={"pool_id": pool_id, "acks": [{"batch_id": b, "trained_step": s} for b, s in acks]},
        headers=WORKER_HEADERS,
    )


def restart(
    client: Client,
    run_id: str,
    pool_id: str,
    checkpoint_step: int,
    total_samples: int,
    total_tokens: int,
) -> Response:
    return client.post(
        f"/v1/pool/runs/{run_id}/restart",
        json={
            "pool_id": pool_id,
            "checkpoint_step": checkpoint_step,
            "total_samples": total_samples,
            "total_tokens": total_tokens,
        },
        headers=WORKER_HEADERS,
    )


# --------------------------------------------------------------------------- a real server


class LiveServer:
    """The app under real uvicorn on 127.0.0.1 (a free port), in a thread."""

    def __init__(self, app: FastAPI, **options: Any) -> None:
        """`options`: more uvicorn.Config arguments (e.g. app.serving.uvicorn_options())."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()
