"""The design's import arrows (DESIGN §2), checked rather than hoped for.

    contracts  ◀── app            (never imports torch or trainer_core)
    contracts  ◀── trainer_core   (never imports fastapi, sqlalchemy, app, orchestrator)
    contracts  ◀── orchestrator   (never imports app or trainer_core; its local sampler may import torch)
    loraloom   ──▶ all of them    (nothing imports loraloom)

Two checks: every import statement of every module (function-level imports included), read with
`ast`; and what a fresh interpreter really loads for the two entry points that matter most.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("contracts", "app", "trainer_core", "orchestrator", "loraloom")
WEB = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg")
TORCH = ("torch", "transformers", "peft", "safetensors")

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "contracts": ("app", "trainer_core", "orchestrator", "loraloom", *WEB, *TORCH),
    "app": ("trainer_core", "orchestrator", "loraloom", *TORCH),
    "trainer_core": ("app", "orchestrator", "loraloom", *WEB),
    "orchestrator": ("app", "trainer_core", "loraloom", *WEB),
}


def imported_top_levels(path: Path) -> set[str]:
    """Top-level names of every absolute import in a module (relative imports stay inside its package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def modules_of(part: str) -> list[Path]:
    return sorted((ROOT / part).rglob("*.py"))


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_part_imports_only_what_the_design_allows(part: str) -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules_of(part)
        for name in sorted(imported_top_levels(path) & set(FORBIDDEN[part]))
    ]
    assert not violations, "\n".join(violations)


def test_nothing_imports_the_composition_package() -> None:
    importers = [
        str(path.relative_to(ROOT))
        for part in PARTS
        if part != "loraloom"
        for path in modules_of(part)
        if "loraloom" in imported_top_levels(path)
    ]
    assert not importers, importers


def test_every_part_is_checked() -> None:
    """A new top-level package must be placed in the design (and in FORBIDDEN) before it is used."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == set(PARTS)


def _loaded_by(statement: str) -> set[str]:
    """Top-level names of every module a fresh interpreter has loaded after `statement`."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_worker_loads_no_service_and_no_sdk() -> None:
    loaded = _loaded_by("import trainer_core.worker")
    assert not loaded & {"app", "orchestrator", "loraloom", "fastapi", "sqlalchemy"}, sorted(loaded)


def test_the_service_loads_no_torch_and_no_trainer() -> None:
    loaded = _loaded_by("import app.main")
    assert not loaded & {"torch", "trainer_core", "orchestrator", "loraloom", "transformers"}, sorted(loaded)


def test_the_contracts_load_no_part_and_no_framework() -> None:
    loaded = _loaded_by("import contracts.wire, contracts.pool_api, contracts.http, contracts.run_config")
    assert not loaded & {"torch", "fastapi", "sqlalchemy", "app", "trainer_core", "orchestrator"}, sorted(
        loaded
    )


def test_app_modules_import_each_other_at_module_level_only() -> None:
    """An import of an app module inside a function hides an import cycle between services; the
    design has none (events, capabilities and leases are where shared pieces live instead)."""
    hidden: set[str] = set()
    for path in modules_of("app"):
        for func in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                hidden.update(
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                    for name in names
                    if name == "app" or name.startswith("app.")
                )
    assert not hidden, "\n".join(sorted(hidden))
