"""The tenants' bulk routes (rollout batches, JSON and msgpack; adapter uploads) check the caller's
Bearer key before the body is read (app/request_guard.py, `_tenant_refusal`): an anonymous or
wrong-key body was read whole before its 401, and counted against the process's body budget
(`max_buffered_body_bytes`) meanwhile, so a few stalled anonymous bodies made every tenant's
upload a 503. A valid key still works the first time (not cached: looked up, left for the route to
cache, so the batch route's fast path answers the same requests as before) and afterwards.

Raw sockets (the helpers of tests/app/test_front_limits.py) show a refusal sent before the rest of
the body: the client sends a head declaring a large body and a few bytes of it, and reads the
answer without sending more."""

import io
import json
import select
import socket
import tarfile
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import msgspec
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from safetensors.torch import save
from sqlalchemy.exc import OperationalError

from app import request_guard
from app.config import Settings
from app.key_cache import ApiKeyCache, key_cache
from app.main import create_app
from app.serving import uvicorn_options
from tests.app.api import ADMIN_HEADERS, MSGPACK, POOL_SPEC, LiveServer, new_tenant, register, sample
from tests.app.factories import Seeded, batch_count, rollout_files, seed_run
from tests.app.test_front_limits import (
    _budget_used,
    _closed,
    _connect,
    _head,
    _key_lookups,
    _read_response,
    _wait_until,
)
from tests.common import ADMIN_KEY

MIB = 1024 * 1024
DECLARED = 32 * MIB
"""What an anonymous client declares it sends (under `max_body_bytes`); it sends a few KiB only."""

PRECHECKED = 64 << 10
"""The guard's `_PRECHECKED_BODY_BYTES`: a body declared larger has an uncached key looked up first;
the valid bodies below are larger."""

TAR = "application/x-tar"
ROUTES = [
    pytest.param("/v1/runs/{run}/batches", "application/json", id="batches-json"),
    pytest.param("/v1/runs/{run}/batches", MSGPACK, id="batches-msgpack"),
    pytest.param("/v1/adapters", TAR, id="adapters"),
]


@pytest.fixture
def live(settings: Settings) -> Iterator[tuple[FastAPI, LiveServer]]:
    # A long body deadline: a server that waited for the unsent body would not answer in time.
    app = create_app(settings.model_copy(update={"body_timeout_seconds": 30.0}))
    with LiveServer(app, **uvicorn_options()) as server:
        yield app, server


def _send_partly(
    server: LiveServer, path: str, headers: dict[str, str], *, chunked: bool = False
) -> socket.socket:
    """A socket that sent the head of a DECLARED-byte POST to `path` and its first 4 KiB only."""
    sock = _connect(server)
    first = b"\0" * 4096
    if chunked:  # no Content-Length: the size is not known before the body is read
        lines = [f"POST {path} HTTP/1.1", "Host: x", "Transfer-Encoding: chunked"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + b"%x\r\n" % len(first) + first + b"\r\n")
    else:
        sock.sendall(_head("POST", path, headers, DECLARED) + first)
    return sock


def _refused_unread(
    server: LiveServer, path: str, headers: dict[str, str], *, chunked: bool = False
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """The answer to a body sent in part: it must come without the rest, and close the connection."""
    sock = _send_partly(server, path, headers, chunked=chunked)
    try:
        status, response_headers, body = _read_response(sock)  # times out (10 s) if it waited
        assert _closed(sock)
    finally:
        sock.close()
    return status, response_headers, json.loads(body)


def _wrong_credentials(server: LiveServer) -> dict[str, dict[str, str]]:
    """Every kind of caller the tenants' routes refuse, by name: their headers."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        revoked = new_tenant(http)
        r = http.delete(f"/v1/tenants/{revoked.id}/keys/{revoked.key_id}", headers=ADMIN_HEADERS)
        assert r.status_code == 204, r.text
    return {
        "anonymous": {},
        "malformed": {"Authorization": "Basic dXNlcjpwYXNz"},
        "empty bearer": {"Authorization": "Bearer "},
        "made-up key": {"Authorization": "Bearer llk_" + "m" * 43},
        "admin key": {"Authorization": f"Bearer {ADMIN_KEY}"},  # not a tenant key: the route's 401
        "revoked key": revoked.headers,
    }


@pytest.mark.parametrize(("route", "content_type"), ROUTES)
def test_anonymous_and_wrong_key_bodies_are_refused_unread(live, route: str, content_type: str) -> None:
    app, server = live
    seeded = seed_run(app.state.settings)
    path = route.format(run=seeded.run_id)
    for name, credential in _wrong_credentials(server).items():
        for chunked in (False, True):
            headers = credential | {"Content-Type": content_type}
            status, response_headers, body = _refused_unread(server, path, headers, chunked=chunked)
            assert status == 401, (name, chunked, body)
            error = body["error"]
            assert error["code"] == "unauthorized" and set(error) == {"code", "message", "details"}
            assert response_headers["connection"] == "close"
            assert _budget_used(app) <= 0, name  # nothing of it buffered, nothing left counted
    assert batch_count(app.state.settings) == 0 and rollout_files(app.state.settings) == []


def test_a_made_up_key_is_looked_up_once_within_the_miss_cache(live) -> None:
    app, server = live
    lookups = _key_lookups(app)
    headers = {"Authorization": "Bearer llk_" + "z" * 43, "Content-Type": MSGPACK}
    for _ in range(3):
        status, _, body = _refused_unread(server, "/v1/runs/run_000000000000/batches", headers)
        assert (status, body["error"]["message"]) == (401, "invalid or revoked API key")
    assert len(lookups) == 1


# ----------------------------------------------------------------------------- valid keys


def _big_batch(seed: int = 0) -> dict[str, Any]:
    """A valid batch whose body (JSON or msgpack) is larger than the size below which the guard
    does not look a key up first."""
    return {
        "examples": [sample(completion_len=500, seed=seed * 16 + i) for i in range(16)],
        "temperature": 1.0,
        "step": 0,
    }


def _encoded(body: dict[str, Any], msgpack: bool) -> bytes:
    return msgspec.msgpack.encode(body) if msgpack else msgspec.json.encode(body)


def _post_big(client: Any, seeded: Seeded, seed: int, msgpack: bool) -> httpx.Response:
    content = _encoded(_big_batch(seed), msgpack)
    assert len(content) > PRECHECKED
    content_type = MSGPACK if msgpack else "application/json"
    return client.post(
        f"/v1/runs/{seeded.run_id}/batches",
        content=content,
        headers=seeded.headers | {"Content-Type": content_type},
    )


def test_a_valid_key_posts_large_batches_the_first_time_and_after(settings: Settings, fast_calls) -> None:
    assert request_guard._PRECHECKED_BODY_BYTES == PRECHECKED
    app = create_app(settings)
    app.state.api_key_cache = ApiKeyCache(60.0)
    seeded = seed_run(settings)
    lookups = _key_lookups(app)
    with TestClient(app) as client:
        for seed, msgpack in enumerate((False, True)):
            key_cache(app.state, 60.0).clear()  # the key not cached: the guard looks it up first
            before = len(lookups)
            r = _post_big(client, seeded, 2 * seed, msgpack)
            assert r.status_code == 201, r.text
            assert len(lookups) == before + 1  # the guard's, which caches it: the route's is spared
            # The guard cached the key: the first request took the fast path too.
            assert fast_calls == [seeded.run_id] * (2 * seed + 1)
            r = _post_big(client, seeded, 2 * seed + 1, msgpack)  # cached: the fast path, no lookup
            assert r.status_code == 201, r.text
            assert fast_calls == [seeded.run_id] * (2 * seed + 2)
            assert len(lookups) == before + 1
    assert batch_count(settings) == 4 and len(rollout_files(settings)) == 4


def _big_adapter() -> bytes:
    """An adapter of the pool registered by `_register_wide_pool` (a tar over the size below which
    the guard does not look a key up first)."""
    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj"]}
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(16, 512),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(512, 16),
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (
            ("adapter_config.json", json.dumps(config).encode()),
            ("adapter_model.safetensors", save(tensors)),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    body = buf.getvalue()
    assert len(body) > PRECHECKED
    return body


def _register_wide_pool(client: TestClient) -> None:
    register(client, module_shapes={m: [512, 512] for m in POOL_SPEC["target_modules"]}, num_layers=2)


def test_a_valid_key_uploads_large_adapters_the_first_time_and_after(settings: Settings) -> None:
    app = create_app(settings)
    app.state.api_key_cache = ApiKeyCache(60.0)  # the default 2 s could expire within a slow request
    lookups = _key_lookups(app)
    with TestClient(app) as client:
        _register_wide_pool(client)
        tenant = new_tenant(client)
        headers = tenant.headers | {"Content-Type": TAR}
        key_cache(app.state, 60.0).clear()
        before = len(lookups)
        r = client.post("/v1/adapters", params={"name": "first"}, content=_big_adapter(), headers=headers)
        assert r.status_code == 201, r.text
        assert len(lookups) == before + 1  # the guard's, which caches the key for the route
        r = client.post("/v1/adapters", params={"name": "after"}, content=_big_adapter(), headers=headers)
        assert r.status_code == 201, r.text
        names = {a["name"] for a in client.get("/v1/adapters", headers=tenant.headers).json()["items"]}
        assert names == {"first", "after"}


def test_a_failed_lookup_in_the_guard_leaves_the_answer_to_the_route(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's lookup failing is not an answer of its own: the request goes on to the route,
    which looks the key up and answers as it always did (a 201 here; a 401 for a wrong key)."""

    def unavailable(*_args: Any) -> Any:
        raise OperationalError("SELECT api_keys", {}, Exception("the database went away"))

    monkeypatch.setattr(request_guard, "select", unavailable)  # the guard's query only
    app = create_app(settings)
    seeded = seed_run(settings)
    with TestClient(app) as client:
        assert _post_big(client, seeded, 0, msgpack=True).status_code == 201
        wrong = Seeded(seeded.tenant_id, "llk_" + "w" * 43, seeded.run_id)
        r = _post_big(client, wrong, 1, msgpack=False)
        assert (r.status_code, r.json()["error"]["message"]) == (401, "invalid or revoked API key")
    assert batch_count(settings) == 1


# ----------------------------------------------------------------------------- the body budget


def _arrived(sock: socket.socket, app: FastAPI) -> bool:
    """Whether a body sent in part reached the server: answered, or (without the check) being read."""
    return bool(select.select([sock], [], [], 0)[0]) or _budget_used(app) > 0


def test_stalled_anonymous_bodies_do_not_take_another_tenants_place(settings: Settings) -> None:
    """A budget of 64 KiB: before, the first anonymous body's 48 KiB were held (for its 30 s body
    deadline), and a tenant's batch that did not fit beside them was a 503."""
    app = create_app(
        settings.model_copy(update={"max_buffered_body_bytes": 64 << 10, "body_timeout_seconds": 30.0})
    )
    seeded = seed_run(settings)
    with LiveServer(app, **uvicorn_options()) as server:
        stalled: list[socket.socket] = []
        try:
            for i, credential in enumerate(({}, {"Authorization": "Bearer llk_" + "s" * 43}) * 2):
                path = "/v1/adapters" if i % 2 else f"/v1/runs/{seeded.run_id}/batches"
                sock = _connect(server)
                stalled.append(sock)
                sock.sendall(
                    _head("POST", path, credential | {"Content-Type": MSGPACK}, MIB) + b"\0" * (48 << 10)
                )
                _wait_until(partial(_arrived, sock, app), "the body arrives")
            with httpx.Client(base_url=server.url, timeout=30) as http:
                r = _post_big(http, seeded, 0, msgpack=True)  # 88 KiB: alone, taken whole
                assert r.status_code == 201, r.text
                assert _post_big(http, seeded, 1, msgpack=True).status_code == 201
            for sock in stalled:
                status, _, body = _read_response(sock)
                assert status == 401, body
        finally:
            for sock in stalled:
                sock.close()
        _wait_until(lambda: _budget_used(app) == 0, "every body gave its place back")
    assert batch_count(settings) == 2
