"""The OpenAPI documents as a product: rules every operation must follow, today's and any added later.

A new route fails here if it has no auth dependency, returns an error the document does not describe
with the `Error` body, inlines a body schema, or raises an error code app/errors.py does not list.
"""

import ast
import re
from pathlib import Path
from typing import Any

import pytest
from openapi_spec_validator import validate

from app.config import Settings
from app.errors import all_codes
from app.main import create_app
from app.openapi import ERROR_REF, POOL_OPENAPI_URL, build_documents

UNAUTHENTICATED = {("get", "/healthz"), ("get", "/readyz")}
METHODS = ("get", "put", "post", "delete", "patch")
APP_DIR = Path(__file__).resolve().parents[2] / "app"


def _documents() -> tuple[dict[str, Any], dict[str, Any]]:
    return build_documents(create_app(Settings(database_url="sqlite:///:memory:")))


PUBLIC, POOL = _documents()
DOCS = {"public": PUBLIC, "pool": POOL}


def _operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(m, path, op) for path, item in doc["paths"].items() for m, op in item.items() if m in METHODS]


ALL_OPERATIONS = [(name, m, p, op) for name, doc in DOCS.items() for m, p, op in _operations(doc)]
IDS = [f"{name}:{m.upper()} {p}" for name, m, p, _ in ALL_OPERATIONS]


@pytest.mark.parametrize("name", DOCS)
def test_documents_pass_the_openapi_spec_validator(name):
    validate(DOCS[name])


def test_the_app_serves_both_documents(client):
    assert client.get("/openapi.json").json() == PUBLIC
    assert client.get(POOL_OPENAPI_URL).json() == POOL


@pytest.mark.parametrize(("doc", "method", "path", "op"), ALL_OPERATIONS, ids=IDS)
def test_every_operation_has_a_security_requirement(doc, method, path, op):
    if (method, path) in UNAUTHENTICATED:
        assert "security" not in op
        return
    assert op.get("security"), "no auth dependency (TenantDep, AdminDep, WorkerDep) on this route"
    schemes = {name for req in op["security"] for name in req}
    assert schemes <= set(DOCS[doc]["components"]["securitySchemes"])
    assert DOCS[doc]["components"]["securitySchemes"][next(iter(schemes))] == {
        "type": "http",
        "scheme": "bearer",
        "description": DOCS[doc]["components"]["securitySchemes"][next(iter(schemes))]["description"],
    }
    # Authenticated: a missing or wrong key is a documented 401.
    assert "401" in op["responses"]


def test_the_documents_split_tenant_and_admin_from_pool():
    public_schemes = {n for _, _, op in _operations(PUBLIC) for req in op.get("security", []) for n in req}
    pool_schemes = {n for _, _, op in _operations(POOL) for req in op.get("security", []) for n in req}
    assert public_schemes == {"TenantKey", "AdminKey", "MetricsToken"}
    assert pool_schemes == {"WorkerToken"}
    assert not [p for p in PUBLIC["paths"] if p.startswith("/v1/pool/")]
    assert set(PUBLIC["components"]["securitySchemes"]) == {"TenantKey", "AdminKey", "MetricsToken"}
    assert set(POOL["components"]["securitySchemes"]) == {"WorkerToken"}


@pytest.mark.parametrize(("doc", "method", "path", "op"), ALL_OPERATIONS, ids=IDS)
def test_every_error_response_is_the_error_schema(doc, method, path, op):
    for status, response in op["responses"].items():
        if int(status) >= 400:
            assert response["content"] == {"application/json": {"schema": {"$ref": ERROR_REF}}}, status
            assert response["description"]
    if op.get("parameters") or op.get("requestBody"):
        assert "422" in op["responses"]
    if op.get("requestBody"):
        assert {"400", "413"} <= set(op["responses"])  # unparsable, too large
    if any(p["name"] == "run_id" for p in op.get("parameters", [])) and not path.startswith("/v1/pool/"):
        assert "404" in op["responses"]  # another tenant's run, or none


@pytest.mark.parametrize(("doc", "method", "path", "op"), ALL_OPERATIONS, ids=IDS)
def test_no_inline_body_schemas(doc, method, path, op):
    bodies = [("request", op.get("requestBody", {}))] + list(op["responses"].items())
    for where, holder in bodies:
        for media, content in holder.get("content", {}).items():
            schema = content.get("schema")
            assert schema is not None, f"{where} {media}: no schema"
            if "$ref" in schema:
                continue
            # Bytes (adapters) and text bodies (TOML) are strings, not objects to name.
            assert schema.get("type") == "string", f"{where} {media}: inline schema {schema}"


@pytest.mark.parametrize(("doc", "method", "path", "op"), ALL_OPERATIONS, ids=IDS)
def test_string_path_parameters_have_a_pattern_or_an_enum(doc, method, path, op):
    for param in op.get("parameters", []):
        if param["in"] == "path" and param["schema"].get("type") == "string":
            assert "pattern" in param["schema"] or "enum" in param["schema"], param["name"]


@pytest.mark.parametrize("name", DOCS)
def test_component_names_make_good_class_names(name):
    schemas = DOCS[name]["components"]["schemas"]
    assert not {"HTTPValidationError", "ValidationError"} & set(schemas)
    for component in schemas:
        assert re.fullmatch(r"[A-Z][A-Za-z0-9]*", component), component


def test_error_code_enum_lists_every_code_the_app_raises():
    enum = PUBLIC["components"]["schemas"]["ErrorCode"]["enum"]
    assert enum == all_codes() == POOL["components"]["schemas"]["ErrorCode"]["enum"]
    used = _codes_in_source()
    assert used - set(enum) == set(), "add these codes to their class's `codes` in app/errors.py"


def _codes_in_source() -> set[str]:
    """Literal codes in app/: `code="..."` keyword arguments, `code = "..."` class attributes and the
    first argument of error_body(...)."""
    found: set[str] = set()
    for path in APP_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "code":
                        found |= _strings(kw.value)
                func = node.func
                if isinstance(func, ast.Name) and func.id == "error_body" and node.args:
                    found |= _strings(node.args[0])
            elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["code"]:
                found |= _strings(node.value)
    return found


def _strings(node: ast.expr) -> set[str]:
    """The string constants an expression can evaluate to (`"a" if x else "b"` gives both)."""
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_adapter_download_is_typed_binary_with_etags():
    op = PUBLIC["paths"]["/v1/runs/{run_id}/adapters/{step}"]["get"]
    ok = op["responses"]["200"]
    assert ok["content"] == {"application/gzip": {"schema": {"type": "string", "format": "binary"}}}
    assert {"ETag", "X-Adapter-Step"} <= set(ok["headers"])
    assert "ETag" in op["responses"]["304"]["headers"]
    params = {p["name"]: p for p in op["parameters"]}
    assert params["If-None-Match"]["in"] == "header"
    assert params["step"]["schema"]["pattern"] == "^(latest|[0-9]{1,9})$"
    upload = POOL["paths"]["/v1/pool/runs/{run_id}/adapters/{step}"]["put"]
    assert set(upload["requestBody"]["content"]) == {"application/x-tar"}


def test_cursors_are_opaque_everywhere():
    for _, path, op in _operations(PUBLIC):
        for param in op.get("parameters", []):
            if param["name"] == "cursor":
                assert param["schema"]["anyOf"][0] == {
                    "type": "string",
                    "maxLength": 512,
                    "pattern": "^[A-Za-z0-9_-]+$",
                }, path


@pytest.mark.parametrize(("doc", "method", "path", "op"), ALL_OPERATIONS, ids=IDS)
def test_every_operation_has_one_tag_and_an_operation_id(doc, method, path, op):
    # Generated clients group operations by their first tag (`api.runs`, `api.metrics`, ...).
    assert len(op.get("tags", [])) == 1
    assert re.fullmatch(r"[a-z][A-Za-z0-9]*", op["operationId"])
