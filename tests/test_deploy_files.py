"""Static checks of the compose stack and the Dockerfile (no Docker engine runs here)."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_stack_wires_postgres_api_and_worker():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert set(services) == {"postgres", "api", "worker"}
    api, worker = services["api"], services["worker"]
    assert api["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "loraloom db upgrade" in " ".join(api["command"])  # migrations before serving
    assert api["environment"]["LORALOOM_DATABASE_URL"].startswith("postgresql+psycopg://")
    # The pool speaks HTTP to the API only: no database URL, the worker token, the shared data volume.
    assert "LORALOOM_DATABASE_URL" not in worker["environment"]
    assert "LORALOOM_WORKER_TOKEN" in worker["environment"]
    assert "loraloom worker --url http://api:8000" in " ".join(worker["command"])
    assert worker["depends_on"]["api"]["condition"] == "service_healthy"
    assert "data:/data" in worker["volumes"] and "data:/data" in api["volumes"]


def test_dockerfile_installs_pinned_torch_before_the_package():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    torch_line = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    package_line = next(i for i, line in enumerate(lines) if line.startswith("RUN pip install ."))
    assert torch_line < package_line
    assert any(line.startswith("USER ") and "root" not in line for line in lines)
