"""The worker pool's side of the service API (only the master rank talks to the service).

Retries follow the SDK's policy (contracts.http); an error answer raises ServiceError.
Never logs the token.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from contracts.http import RetryPolicy, send_with_retries
from trainer_core.export import adapter_tar_bytes

log = logging.getLogger("loraloom.worker")


class ServiceError(RuntimeError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class PoolRegistration:
    pool_id: str
    heartbeat_interval_s: float
    lease_seconds: float


class PoolServiceClient:
    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0, max_attempts: int = 6) -> None:
        self._http = httpx.Client(
            base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )
        self._retry = RetryPolicy(max_attempts=max_attempts, backoff_base_s=0.2, backoff_max_s=5.0)
        self.pool_id: str | None = None

    def close(self) -> None:
        self._http.close()

    # -- transport -------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        # The SDK's retry rules (backoff with jitter; connection errors, 429 with Retry-After and
        # 5xx are retried, every other 4xx is an answer): one implementation for both clients.
        response = send_with_retries(
            lambda: self._http.request(method, path, **kwargs), self._retry, f"{method} {path}"
        )
        if response.status_code >= 400:
            raise _service_error(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    # -- pool ------------------------------------------------------------------------------------

    def register(self, **capabilities: Any) -> PoolRegistration:
        body = self._json("POST", "/v1/pool/register", json=capabilities)
        self.pool_id = body["pool_id"]
        return PoolRegistration(
            body["pool_id"], float(body["heartbeat_interval_s"]), float(body["lease_seconds"])
        )

    def heartbeat(self) -> None:
        self._json("POST", "/v1/pool/heartbeat", json={"pool_id": self.pool_id})

    def state(self) -> list[dict[str, Any]]:
        return self._json("GET", "/v1/pool/state", params={"pool_id": self.pool_id})["runs"]

    def claim(self, max_batches: int) -> list[dict[str, Any]]:
        body = self._json(
            "POST", "/v1/pool/batches/claim", json={"pool_id": self.pool_id, "max_batches": max_batches}
        )
        return body["batches"]

    def ack(self, acks: list[tuple[int, int]]) -> None:
        if acks:
            payload = [{"batch_id": b, "trained_step": s} for b, s in acks]
            self._json("POST", "/v1/pool/batches/ack", json={"pool_id": self.pool_id, "acks": payload})

    def restart_run(
        self, run_id: str, *, checkpoint_step: int, total_samples: int, total_tokens: int
    ) -> list[int]:
        body = self._json(
            "POST",
            f"/v1/pool/runs/{run_id}/restart",
            json={
                "pool_id": self.pool_id,
                "checkpoint_step": checkpoint_step,
                "total_samples": total_samples,
                "total_tokens": total_tokens,
            },
        )
        return list(body["returned"])

    def upload_adapter(self, run_id: str, step: int, adapter_dir: Path) -> None:
        self._request(
            "PUT",
            f"/v1/pool/runs/{run_id}/adapters/{step}",
            content=adapter_tar_bytes(adapter_dir),
            headers={"Content-Type": "application/x-tar"},
        )

    def report_step(
        self, run_id: str, *, step: int, total_tokens: int, total_samples: int, metrics: dict
    ) -> dict:
        return self._json(
            "POST",
            f"/v1/pool/runs/{run_id}/steps",
            json={
                "step": step,
                "total_tokens": total_tokens,
                "total_samples": total_samples,
                "metrics": metrics,
            },
        )

    def report_checkpoint(self, run_id: str, *, step: int, total_samples: int) -> None:
        self._json(
            "POST", f"/v1/pool/runs/{run_id}/checkpoints", json={"step": step, "total_samples": total_samples}
        )

    def evict(self, run_id: str, reason: str) -> None:
        try:
            self._json("POST", f"/v1/pool/runs/{run_id}/evict", json={"reason": reason})
        except ServiceError as exc:
            if exc.status != 409:  # already evicted/completed: nothing left to do
                raise


def _service_error(response: httpx.Response) -> ServiceError:
    try:
        err = response.json()["error"]
        return ServiceError(response.status_code, err.get("code", "error"), err.get("message", ""))
    except Exception:
        return ServiceError(response.status_code, "error", response.text[:200])
