"""Tinker calls through the service's HTTP API, as a test sends them by hand, and a pool's side
answered without a model: the service's intake and bookkeeping are under test, not the trainer
(tests/e2e/test_tinker_*.py run the real pool).

Works with the in-process TestClient and a real HTTP client alike (`tests.app.api.Client`).
"""

import threading
from typing import Any

import httpx
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.runs.models import Run
from app.tinker.models import TinkerFuture, TinkerModel, TinkerSamplingSession
from tests.app.api import WORKER_HEADERS, Client, TenantHandle

BASE_MODEL = "loraloom-tiny"


def tinker_headers(tenant: TenantHandle) -> dict[str, str]:
    return {"X-API-Key": "tml-" + tenant.key}


def new_session(client: Client, tenant: TenantHandle) -> str:
    r = client.post(
        "/api/v1/create_session", json={"tags": [], "sdk_version": "test"}, headers=tinker_headers(tenant)
    )
    assert r.status_code == 200, r.text
    session_id: str = r.json()["session_id"]
    return session_id


def new_model(client: Client, tenant: TenantHandle, *, session_id: str | None = None, seq: int = 0) -> str:
    """A LoRA training model (rank 4, attention only) in a new session or `session_id`; its id."""
    body = {
        "session_id": session_id or new_session(client, tenant),
        "model_seq_id": seq,
        "base_model": BASE_MODEL,
        "lora_config": {"rank": 4, "train_unembed": False, "train_mlp": False},
    }
    r = client.post("/api/v1/create_model", json=body, headers=tinker_headers(tenant))
    assert r.status_code == 200, r.text
    model_id: str = r.json()["model_id"]
    return model_id


def run_of(client: Client, tenant: TenantHandle, model_id: str) -> str:
    """The id of the run behind a model, as the tenant finds it in GET /v1/runs."""
    runs = client.get("/v1/runs", headers=tenant.headers).json()["items"]
    (run_id,) = [r["id"] for r in runs if r["name"] == f"tinker {model_id}"]
    return str(run_id)


def result_for(item: dict[str, Any]) -> dict[str, Any]:
    """A plausible pool result for a claimed work item (the shapes trainer_core.manual reports)."""
    out: dict[str, Any] = {"request_id": item["request_id"]}
    if item.get("replay"):
        return out | {"replayed": True}
    kind = item["kind"]
    if kind in ("forward", "forward_backward"):
        rows = [[-1.0] * len(datum["tokens"]) for datum in item["data"]]
        losses = [[1.0] * len(row) for row in rows]
        return out | {"logprobs": rows, "elementwise_loss": losses, "metrics": {"loss:sum": 1.0}}
    if kind == "optim_step":
        step = {"grad_norm": 0.5, "lr": item["adam"]["learning_rate"], "step": float(item["seq_id"])}
        return out | {"metrics": step}
    if kind == "save_weights_for_sampler":
        return out | {"metrics": {"step": 1.0}}
    if kind == "sample":
        spec = item["sampling"]
        n = min(spec["max_tokens"], 2)
        sequence = {"tokens": [7] * n, "logprobs": [-0.5] * n, "stop_reason": "length"}
        out["sequences"] = [sequence] * spec["num_samples"]
        if spec["prompt_logprobs"]:
            out["prompt_logprobs"] = [None] + [-1.0] * (len(spec["prompt"]) - 1)
    return out


def answer_work(client: Client, pool_id: str) -> list[dict[str, Any]]:
    """Claim the pool's Tinker work and post a result for each item; the items claimed."""
    r = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 64}, headers=WORKER_HEADERS
    )
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    if items:
        results = [result_for(item) for item in items]
        posted = client.post(
            "/v1/pool/manual/results", json={"pool_id": pool_id, "results": results}, headers=WORKER_HEADERS
        )
        assert posted.status_code == 200, posted.text
    return items


class AnsweringPool:
    """`answer_work` in a thread, every `interval` seconds, for a client (the SDK) that waits for its
    futures; stops on exit, and re-raises what failed in the thread."""

    def __init__(self, base_url: str, pool_id: str, *, interval: float = 0.05) -> None:
        self.base_url, self.pool_id, self.interval = base_url, pool_id, interval
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            with httpx.Client(base_url=self.base_url, timeout=30) as client:
                while not self.stop.is_set():
                    if not answer_work(client, self.pool_id):
                        self.stop.wait(self.interval)
        except BaseException as exc:  # reported by __exit__
            self.error = exc

    def __enter__(self) -> "AnsweringPool":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        if self.error is not None:
            raise self.error


def stored(db: Session) -> dict[str, int]:
    """What the Tinker tables and runs hold, counted: futures (by kind), models, runs and sampling
    sessions. Ends its transaction (on SQLite a reader's open transaction holds the writers back)."""
    db.expire_all()
    counts: dict[str, int] = {
        kind: int(n)
        for kind, n in db.execute(select(TinkerFuture.kind, func.count()).group_by(TinkerFuture.kind))
    }
    counts["models"] = int(db.scalar(select(func.count()).select_from(TinkerModel)) or 0)
    counts["runs"] = int(db.scalar(select(func.count()).select_from(Run)) or 0)
    counts["sampling_sessions"] = int(db.scalar(select(func.count()).select_from(TinkerSamplingSession)) or 0)
    db.rollback()
    return counts
