"""FakeService: an in-memory stand-in for the tenant half of the loraloom API
(docs/contracts.md), for testing the SDK's client over real HTTP while the real
service is being written. It keeps the contract's shapes, status codes, error
body and idempotency rules; it is not the service."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError as PydanticValidationError

from contracts.arrays import decode_stored, to_lists
from contracts.run_config import RunConfig
from contracts.wire import TrainingBatch, batch_json_decoder


class FakeError(Exception):
    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        self.status, self.code, self.message, self.details = status, code, message, details


def _now() -> str:
    return datetime.now(UTC).isoformat()


def adapter_tarball(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class FakeService:
    def __init__(self, api_key: str = "test-key") -> None:
        self.api_key = api_key
        self.lock = threading.Lock()
        self.runs: dict[str, dict[str, Any]] = {}
        self.batches: dict[str, list[dict[str, Any]]] = {}
        self.payloads: dict[str | int, TrainingBatch] = {}
        """By batch id (the SDK's `BatchInfo.id` is `str | int`: the real service numbers them)."""
        self.adapters: dict[str, dict[int, bytes]] = {}
        self.metrics: dict[str, list[dict[str, Any]]] = {}
        self.heartbeats: dict[str, int] = {}
        self._idem: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        self.app = self._build()

    # ---- helpers for tests ------------------------------------------------------------------

    def set_progress(self, run_id: str, step: int) -> None:
        with self.lock:
            self.runs[run_id]["progress"]["step"] = step

    def set_status(self, run_id: str, status: str, **fields: Any) -> None:
        """`fields`: other fields of the run to set with it (e.g. `waiting_reason` of a queued run)."""
        with self.lock:
            self.runs[run_id].update(status=status, **fields)

    def evict(self, run_id: str, reason: str, by: str = "trainer") -> None:
        with self.lock:
            run = self.runs[run_id]
            run.update(status="evicted", eviction_reason=reason, evicted_by=by, finished_at=_now())

    def add_adapter(self, run_id: str, step: int, files: dict[str, bytes]) -> str:
        data = adapter_tarball(files)
        with self.lock:
            self.adapters.setdefault(run_id, {})[step] = data
        return hashlib.sha256(data).hexdigest()

    # ---- the app ----------------------------------------------------------------------------

    def _auth(self, request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise FakeError(401, "unauthorized", "missing or invalid API key")

    def _run(self, run_id: str) -> dict[str, Any]:
        run = self.runs.get(run_id)
        if run is None:
            raise FakeError(404, "not_found", f"run {run_id} not found")
        return run

    def _replay(self, scope: str, key: str | None, fingerprint: str) -> dict[str, Any] | None:
        if not key:
            return None
        seen = self._idem.get((scope, key))
        if seen is None:
            return None
        if seen[0] != fingerprint:
            raise FakeError(409, "idempotency_conflict", "Idempotency-Key reused with another body")
        return seen[1]

    def _build(self) -> FastAPI:
        app = FastAPI()
        app.exception_handler(FakeError)(_fake_error)
        self._add_run_routes(app)
        self._add_batch_routes(app)
        self._add_adapter_routes(app)
        return app

    def _add_run_routes(self, app: FastAPI) -> None:
        app.add_api_route("/v1/runs", self.create_run, methods=["POST"])
        app.add_api_route("/v1/runs", self.list_runs, methods=["GET"])
        app.add_api_route("/v1/runs/{run_id}", self.get_run, methods=["GET"])
        app.add_api_route("/v1/runs/{run_id}/evict", self.evict_run, methods=["POST"])
        app.add_api_route("/v1/runs/{run_id}", self.delete_run, methods=["DELETE"])
        app.add_api_route("/v1/runs/{run_id}/heartbeat", self.heartbeat, methods=["POST"])

    def _add_batch_routes(self, app: FastAPI) -> None:
        app.add_api_route("/v1/runs/{run_id}/batches", self.submit_batch, methods=["POST"])
        app.add_api_route("/v1/runs/{run_id}/batches", self.list_batches, methods=["GET"])

    def _add_adapter_routes(self, app: FastAPI) -> None:
        app.add_api_route("/v1/runs/{run_id}/adapters", self.list_adapters, methods=["GET"])
        app.add_api_route("/v1/runs/{run_id}/adapters/{step}", self.get_adapter, methods=["GET"])
        app.add_api_route("/v1/runs/{run_id}/metrics", self.get_metrics, methods=["GET"])

    # ---- runs ---------------------------------------------------------------------------------

    def _new_run(self, name: str, config: RunConfig) -> dict[str, Any]:
        return {
            "id": "run_" + uuid.uuid4().hex[:12],
            "tenant_id": "ten_1",
            "name": name,
            "status": "active",
            "slot": len(self.runs),
            "base_model": config.base_model,
            "config": config.model_dump(mode="json"),
            "progress": {"step": 0, "total_tokens": 0, "total_samples": 0},
            "eviction_reason": None,
            "evicted_by": None,
            "failure_reason": None,
            "created_at": _now(),
            "updated_at": _now(),
            "started_at": _now(),
            "finished_at": None,
            "last_heartbeat_at": None,
        }

    async def create_run(self, request: Request) -> JSONResponse:
        self._auth(request)
        raw = await request.body()
        body = json.loads(raw)
        try:
            config = RunConfig.model_validate(body.get("config") or {})
        except PydanticValidationError as exc:
            details = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
            raise FakeError(422, "validation_error", "invalid run config", details) from None
        key = request.headers.get("idempotency-key")
        fingerprint = hashlib.sha256(raw).hexdigest()
        with self.lock:
            replay = self._replay("runs", key, fingerprint)
            if replay is not None:
                return JSONResponse(self.runs[replay["id"]], status_code=200)
            run = self._new_run(body["name"], config)
            self.runs[run["id"]] = run
            self.batches[run["id"]] = []
            if key:
                self._idem[("runs", key)] = (fingerprint, {"id": run["id"]})
        return JSONResponse(run, status_code=201)

    async def list_runs(
        self, request: Request, status: str | None = None, limit: int = 50, cursor: str | None = None
    ) -> dict[str, Any]:
        self._auth(request)
        runs = [r for r in self.runs.values() if status is None or r["status"] == status]
        return _page(runs, limit=limit, cursor=cursor)

    async def get_run(self, request: Request, run_id: str) -> dict[str, Any]:
        self._auth(request)
        return self._run(run_id)

    async def evict_run(self, request: Request, run_id: str) -> dict[str, Any]:
        self._auth(request)
        body = await request.json()
        with self.lock:
            run = self._run(run_id)
            if run["status"] not in ("queued", "active"):
                raise FakeError(409, "conflict", f"run {run_id} is {run['status']}")
            by = "orchestrator" if body.get("by") == "orchestrator" else "user"
            run.update(status="evicted", eviction_reason=body["reason"], evicted_by=by, finished_at=_now())
            return run

    async def delete_run(self, request: Request, run_id: str) -> dict[str, Any]:
        self._auth(request)
        with self.lock:
            run = self._run(run_id)
            run["status"] = "deleted"
            return run

    async def heartbeat(self, request: Request, run_id: str) -> dict[str, Any]:
        self._auth(request)
        with self.lock:
            run = self._run(run_id)
            run["last_heartbeat_at"] = _now()
            self.heartbeats[run_id] = self.heartbeats.get(run_id, 0) + 1
            return {"run_id": run_id, "status": run["status"], "last_heartbeat_at": run["last_heartbeat_at"]}

    # ---- batches ------------------------------------------------------------------------------

    @staticmethod
    def _check_accepts_batches(run: dict[str, Any]) -> None:
        run_id = run["id"]
        if run["status"] == "evicted":
            raise FakeError(
                409,
                "run_evicted",
                f"run {run_id} was evicted: {run['eviction_reason']}",
                {"reason": run["eviction_reason"], "evicted_by": run["evicted_by"], "run_id": run_id},
            )
        if run["status"] != "active":
            raise FakeError(409, "run_not_active", f"run {run_id} is {run['status']}")

    async def submit_batch(self, request: Request, run_id: str) -> JSONResponse:
        self._auth(request)
        raw = await request.body()
        batch = _decode_batch(raw, request.headers.get("content-type", ""))
        key = request.headers.get("idempotency-key")
        fingerprint = hashlib.sha256(raw).hexdigest()
        with self.lock:
            run = self._run(run_id)
            replay = self._replay(f"batches/{run_id}", key, fingerprint)
            if replay is not None:
                return JSONResponse(replay, status_code=200)
            self._check_accepts_batches(run)
            batch_id = f"bat_{uuid.uuid4().hex[:12]}"
            out = {
                "id": batch_id,
                "run_id": run_id,
                "rollout_step": batch.step,
                "num_samples": len(batch.examples),
                "num_tokens": sum(s.num_tokens for s in batch.examples),
                "state": "pending",
                "trained_step": None,
                "created_at": _now(),
            }
            self.batches[run_id].append(out)
            self.payloads[batch_id] = batch
            if key:
                self._idem[(f"batches/{run_id}", key)] = (fingerprint, out)
        return JSONResponse(out, status_code=201)

    async def list_batches(
        self,
        request: Request,
        run_id: str,
        state: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        self._auth(request)
        self._run(run_id)
        items = [b for b in self.batches[run_id] if state is None or b["state"] == state]
        return _page(items, limit=limit, cursor=cursor)

    # ---- adapters and metrics -----------------------------------------------------------------

    async def list_adapters(
        self,
        request: Request,
        run_id: str,
        limit: int = 200,
        cursor: str | None = None,
        newest_first: bool = False,
    ) -> dict[str, Any]:
        self._auth(request)
        self._run(run_id)
        items = [
            {
                "step": step,
                "size_bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "created_at": _now(),
            }
            for step, data in sorted(self.adapters.get(run_id, {}).items(), reverse=newest_first)
        ]
        return _page(items, limit=limit, cursor=cursor)

    async def get_adapter(self, request: Request, run_id: str, step: str) -> Response:
        self._auth(request)
        self._run(run_id)
        adapters = self.adapters.get(run_id, {})
        if not adapters:
            raise FakeError(404, "not_found", "no adapter yet")
        number = max(adapters) if step == "latest" else int(step)
        if number not in adapters:
            raise FakeError(404, "not_found", f"no adapter for step {number}")
        data = adapters[number]
        etag = f'"{hashlib.sha256(data).hexdigest()}"'
        headers = {"ETag": etag, "X-Adapter-Step": str(number)}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(data, media_type="application/gzip", headers=headers)

    async def get_metrics(self, request: Request, run_id: str) -> dict[str, Any]:
        self._auth(request)
        self._run(run_id)
        return {"items": self.metrics.get(run_id, [])}


async def _fake_error(request: Request, exc: FakeError) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": exc.code, "message": exc.message, "details": exc.details}},
        status_code=exc.status,
    )


def _page(items: list[dict[str, Any]], *, limit: int, cursor: str | None) -> dict[str, Any]:
    """One page of `items`; the cursor is the offset of the next page."""
    start = int(cursor or 0)
    more = start + limit < len(items)
    return {"items": items[start : start + limit], "next_cursor": str(start + limit) if more else None}


def _decode_batch(raw: bytes, content_type: str) -> TrainingBatch:
    msgpack = content_type.startswith("application/msgpack")
    try:
        batch = to_lists(decode_stored(raw)) if msgpack else batch_json_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise FakeError(422, "validation_error", f"bad batch: {exc}") from None
    if not batch.examples:
        raise FakeError(422, "validation_error", "empty batch", {"field": "examples"})
    return batch
