"""Static checks of the Docker deployment (no Docker engine runs here).

The compose files against the compose-spec JSON schema (check-jsonschema's built-in copy), the
Dockerfile with hadolint, and the wiring a reviewer would check by eye: migrations before the
server, healthchecks and restart policies, loopback ports, secrets only from the env file, the
README's commands against the variables compose requires, and which image gets torch.
"""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
ENV_EXAMPLE = ROOT / ".env.example"
TORCH_PIN = "2.13.0"
TORCH_STACK = {"torch", "transformers", "peft", "safetensors"}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|(^|_)KEY$")
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}
INTERPOLATION = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def _tool(name: str) -> str:
    """A console script of the test environment (the dev extra installs it), or a clear failure."""
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]' (make install)")
    return found


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _services(path: Path = COMPOSE) -> dict[str, Any]:
    return _load(path)["services"]


def _merged_gpu_worker() -> dict[str, Any]:
    """The worker as `docker compose -f docker-compose.yml -f docker-compose.gpu.yml` sees it:
    mappings merge key by key, volumes merge by their target path (compose's merge rules)."""
    base, gpu = _services()["worker"], _services(COMPOSE_GPU)["worker"]
    merged = {**base, **gpu, "build": {**base["build"], **gpu.get("build", {})}}
    merged["build"]["args"] = {**base["build"].get("args", {}), **gpu.get("build", {}).get("args", {})}
    volumes = {v.split(":")[1]: v for v in base.get("volumes", [])}
    volumes.update({v.split(":")[1]: v for v in gpu.get("volumes", [])})
    merged["volumes"] = list(volumes.values())
    return merged


def _with_defaults(value: str) -> str:
    """`value` as compose interpolates it when no variable is set (required ones become <NAME>)."""

    def replace(m: re.Match[str]) -> str:
        return m["arg"] if m["op"] in ("-", ":-") else f"<{m['name']}>"

    return INTERPOLATION.sub(replace, value)


def _interpolations(*paths: Path) -> list[re.Match[str]]:
    return [m for path in paths for m in INTERPOLATION.finditer(path.read_text())]


def _required_variables(*paths: Path) -> set[str]:
    """Variables compose cannot do without: no default given."""
    return {m["name"] for m in _interpolations(*paths) if m["op"] not in ("-", ":-")}


def _env_assignments(path: Path) -> dict[str, str]:
    """NAME=value lines of an env file (comments and commented-out settings skipped)."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"^\w+=", line))
    return {name: value for name, value in pairs}


# --- the compose stack ----------------------------------------------------------------------


def test_compose_stack_wires_postgres_api_and_worker():
    services = _services()
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


def test_the_api_migrates_before_it_serves():
    command = " ".join(_services()["api"]["command"])
    assert command.index("loraloom db upgrade") < command.index("loraloom serve")
    assert "&&" in command  # a failed migration never starts the server


@pytest.mark.parametrize("service", ["postgres", "api", "worker"])
def test_every_service_has_a_healthcheck_with_a_start_period_and_restarts(service):
    spec = _services()[service]
    health = spec["healthcheck"]
    assert health["test"][0] in ("CMD", "CMD-SHELL") and len(health["test"]) > 1
    assert "start_period" in health and "interval" in health and "retries" in health
    assert spec["restart"] in ("always", "unless-stopped", "on-failure")


def test_the_worker_healthcheck_reads_the_heartbeat_file_the_worker_is_given():
    worker = _services()["worker"]
    assert "LORALOOM_HEARTBEAT_FILE" in worker["environment"]
    assert "LORALOOM_HEARTBEAT_FILE" in " ".join(worker["healthcheck"]["test"])


def test_published_ports_bind_to_loopback_by_default():
    published = [(name, port) for name, spec in _services().items() for port in spec.get("ports", [])]
    assert [name for name, _ in published] == ["api"]  # Postgres is reached over the compose network only
    for _, port in published:
        host_ip = _with_defaults(port).rsplit(":", 2)[0]
        assert host_ip == "127.0.0.1", port


def test_model_cache_and_data_live_on_named_volumes():
    compose = _load(COMPOSE)
    worker = compose["services"]["worker"]
    env = worker["environment"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in worker["volumes"]}
    assert mounts[env["LORALOOM_MODEL_CACHE"]] == "models"
    assert mounts[env["LORALOOM_DATA_DIR"]] == "data"
    assert env["HF_HOME"].startswith(env["LORALOOM_MODEL_CACHE"] + "/")  # hub downloads land there too
    assert {"pgdata", "data", "models"} <= set(compose["volumes"])


def test_the_gpu_variant_asks_for_gpus_shared_memory_and_keeps_the_model_cache():
    worker = _merged_gpu_worker()
    assert worker["gpus"] == "all"
    assert "shm_size" in worker or worker.get("ipc") == "host"
    assert "models:/models" in worker["volumes"] and "data:/data" in worker["volumes"]
    assert worker["build"]["target"] == "worker"
    assert _with_defaults(worker["build"]["args"]["TORCH_VARIANT"]).startswith("cu")
    # Its own image tag: building the GPU worker never overwrites the CPU one.
    assert worker["image"] != _services()["worker"]["image"]


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
def test_compose_file_matches_the_compose_spec_schema(path):
    result = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_schema_check_rejects_a_broken_file(tmp_path):
    """The check above can fail: an unknown depends_on condition and a typo'd key are errors.
    (The schema leaves `restart` a free string: the healthcheck test above checks its value.)"""
    broken = _load(COMPOSE)
    broken["services"]["api"]["depends_on"]["postgres"]["condition"] = "service_happy"
    broken["services"]["worker"]["helthcheck"] = broken["services"]["worker"].pop("healthcheck")
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "service_happy" in result.stdout and "helthcheck" in result.stdout, result.stdout


# --- secrets and the env file ---------------------------------------------------------------


def test_no_secret_is_written_in_the_compose_files():
    for path in (COMPOSE, COMPOSE_GPU):
        for name, spec in _services(path).items():
            for key, value in (spec.get("environment") or {}).items():
                if SECRET_NAME.search(key):
                    assert re.fullmatch(r"\$\{\w+:\?[^}]*\}", str(value)), f"{name}.{key} = {value!r}"
                # A password inside a URL comes from a variable too.
                for password in re.findall(r"://[^:/@\s]+:([^@\s]+)@", str(value)):
                    assert re.fullmatch(r"\$\{\w+:\?[^}]*\}", password), f"{name}.{key}"


def test_every_variable_compose_requires_is_in_the_env_example():
    required = _required_variables(COMPOSE, COMPOSE_GPU)
    assert {"POSTGRES_PASSWORD", "LORALOOM_ADMIN_KEY", "LORALOOM_WORKER_TOKEN"} <= required
    assert required <= set(_env_assignments(ENV_EXAMPLE)), required - set(_env_assignments(ENV_EXAMPLE))
    # The optional ones are documented there too (commented out, with their defaults).
    text = ENV_EXAMPLE.read_text()
    optional = {m["name"] for m in _interpolations(COMPOSE, COMPOSE_GPU)} - required
    assert all(name in text for name in optional), sorted(n for n in optional if n not in text)


def test_the_env_example_commits_no_secret_value():
    for name, value in _env_assignments(ENV_EXAMPLE).items():
        if SECRET_NAME.search(name):
            assert value == "", f"{name} has a value in .env.example"


def test_the_env_file_is_ignored_by_git_and_docker_but_its_example_is_not():
    def git_ignores(name: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT).returncode == 0

    assert git_ignores(".env") and git_ignores(".env.production")
    assert not git_ignores(".env.example")
    assert ".env" in (ROOT / ".dockerignore").read_text().splitlines()


# --- the README's commands ------------------------------------------------------------------


def _readme_docker_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Docker\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_the_readme_commands_fill_every_required_variable(tmp_path):
    """Run the README's set-up lines (everything before `docker`) on a copy of the example."""
    commands = _readme_docker_commands()
    assert commands[0] == "cp .env.example .env"
    setup = [c for c in commands if not c.startswith("docker ")]
    shutil.copy(ENV_EXAMPLE, tmp_path / ".env.example")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(setup)], cwd=tmp_path, env=env, check=True)
    values = _env_assignments(tmp_path / ".env")
    required = _required_variables(COMPOSE, COMPOSE_GPU)
    assert all(values.get(name) for name in required), {n: values.get(n) for n in required}
    assert len({values[name] for name in required}) == len(required)  # a fresh secret each


def test_the_readme_compose_commands_name_existing_files():
    compose_lines = [c for c in _readme_docker_commands() if c.startswith("docker compose")]
    assert any(" up " in c and "-f" not in c for c in compose_lines)  # the CPU stack, plain
    for line in compose_lines:
        for name in re.findall(r"-f (\S+)", line):
            assert (ROOT / name).is_file(), line


# --- the Dockerfile -------------------------------------------------------------------------


def _dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, as (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, args = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            current = args.split()[-1] if " as " in args.lower() else args
            stages[current] = []
        stages[current].append((instruction.upper(), " ".join(args.split())))
    return stages


def _runs(stage: str) -> list[str]:
    return [args for instruction, args in _dockerfile_stages()[stage] if instruction == "RUN"]


def test_dockerfile_has_an_api_and_a_worker_target():
    stages = _dockerfile_stages()
    assert {"api", "worker"} <= set(stages)
    # Both are built from the same wheel: the package is installed, not run from a source tree.
    for target in ("api", "worker"):
        assert any("pip install" in run and "/wheels/loraloom-" in run for run in _runs(target)), target
        assert not any("-e " in run or "--editable" in run for run in _runs(target)), target
    assert any("pip wheel" in run and run.endswith(" .") for run in _runs("build"))


def test_dockerfile_installs_pinned_torch_before_the_package():
    """In the worker stage: torch==2.13.0 first, from PyTorch's index for the variant (CPU by default)."""
    instructions = _dockerfile_stages()["worker"]
    args = dict(a.split("=", 1) for i, a in instructions if i == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == TORCH_PIN and args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_INDEX_URL"].endswith("/${TORCH_VARIANT}")
    runs = _runs("worker")
    torch_run = next(i for i, run in enumerate(runs) if "torch==${TORCH_VERSION}" in run)
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_run]
    package_run = next(i for i, run in enumerate(runs) if "[worker]" in run)
    assert torch_run < package_run


def test_the_api_image_installs_no_torch():
    runs = " ".join(_runs("api") + _runs("base"))
    assert "torch" not in runs and "[worker]" not in runs and "[all]" not in runs


@pytest.mark.parametrize("target", ["api", "worker"])
def test_dockerfile_targets_run_as_an_unprivileged_user_with_no_secret(target):
    instructions = _dockerfile_stages()[target]
    users = [args for instruction, args in instructions if instruction == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    for instruction, args in _dockerfile_stages()[target] + _dockerfile_stages()["base"]:
        if instruction in ("ENV", "ARG"):
            names = re.findall(r"(\w+)=", args) or [args.split()[0]]
            assert not any(SECRET_NAME.search(n) for n in names), f"{instruction} {args}"


def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path):
    """The check above can fail: an unpinned base image and a root user are findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nUSER root\nRUN pip install requests\n")
    result = subprocess.run([_tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3002" in result.stdout, result.stdout


# --- the dependency split the images rely on ------------------------------------------------


def _project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_core_dependencies_have_no_torch_stack_and_no_plotting():
    names = {Requirement(r).name for r in _project()["dependencies"]}
    assert not names & (TORCH_STACK | {"matplotlib"}), names
    assert {"fastapi", "sqlalchemy", "alembic", "typer", "httpx"} <= names


def test_the_worker_extra_accepts_the_pinned_torch():
    extras = _project()["optional-dependencies"]
    worker = {Requirement(r).name: Requirement(r) for r in extras["worker"]}
    assert set(worker) == TORCH_STACK
    assert Version(TORCH_PIN) in worker["torch"].specifier
    assert {Requirement(r).name for r in extras["plot"]} == {"matplotlib"}
    all_extras = Requirement(extras["all"][0])
    assert all_extras.name == "loraloom" and all_extras.extras == {"worker", "plot", "tensorboard"}
