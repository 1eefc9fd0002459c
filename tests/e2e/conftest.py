"""Multi-process fixtures: the service under uvicorn (a real subprocess on a real port,
on the test Postgres database) and helpers to drive it over HTTP."""

import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loraloom.launch import start_service_process
from tests.common import ADMIN_KEY, WORKER_TOKEN


@dataclass
class LiveService:
    url: str
    data_dir: Path
    env: dict[str, str]
    process: subprocess.Popen

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)

    def tenant_client(self, name: str, *, quota: int = 4) -> httpx.Client:
        with self.admin() as admin:
            tenant = admin.post("/v1/tenants", json={"name": name, "max_concurrent_runs": quota})
            tenant.raise_for_status()
            key = admin.post(f"/v1/tenants/{tenant.json()['id']}/keys")
            key.raise_for_status()
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key.json()['key']}"}, timeout=30
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=30)


def start_service(
    *, database_url: str, data_dir: Path, port: int = 0, extra_env: dict | None = None
) -> LiveService:
    """`port` 0: any free port, held from its pick to the service's start (loraloom/launch.py)."""
    env = {
        **os.environ,
        "LORALOOM_DATABASE_URL": database_url,
        "LORALOOM_DATA_DIR": str(data_dir),
        "LORALOOM_ADMIN_KEY": ADMIN_KEY,
        "LORALOOM_WORKER_TOKEN": WORKER_TOKEN,
        **(extra_env or {}),
    }
    process, url = start_service_process(env=env, port=port)
    return LiveService(url=url, data_dir=data_dir, env=env, process=process)


@pytest.fixture
def live_service(database_url, tmp_path) -> Iterator[LiveService]:
    service = start_service(
        database_url=database_url,
        data_dir=tmp_path / "data",
        extra_env={
            "LORALOOM_MAX_CONCURRENT_RUNS": "2",
            "LORALOOM_LEASE_SECONDS": "30",
            # Short enough that a killed pool's leases return within a test's wait, long enough
            # that a loaded 2-core CI machine (a Postgres commit stalling on fsync, a busy
            # process) does not declare a live pool dead: at 5 s one did, once, and the Tinker
            # test that used it waited on a future no pool would ever serve.
            "LORALOOM_POOL_TIMEOUT_SECONDS": "15",
            "LORALOOM_SWEEP_INTERVAL_SECONDS": "0.5",
        },
    )
    yield service
    service.stop()
