"""The OpenAPI documents, finished so that generated clients are typed end to end.

FastAPI's own document is the starting point; `build_documents` post-processes it generically,
so a new route gets all of this without any per-route work beyond `@raises(...)` for its
domain errors:

- security: each operation names the scheme of its auth dependency (TenantKey, AdminKey,
  WorkerToken: the `HTTPBearer`s of app/auth.py);
- errors: every error response an operation can return, each with the one `Error` body whose
  `code` is an enum of every code of app/errors.py's classes. An operation's errors come from
  the `@raises` marks of its handler and of every dependency it resolves (auth: 401/403,
  `OwnedRunDep`: 404), plus 422 when it takes parameters or a body and 413 when it takes a body
  (BodySizeLimit) and 400 (an unparsable body), and 415 when its route class answers a typed JSON
  body of another type with one (`JsonBodyRoute`). FastAPI's default `HTTPValidationError` 422 is replaced;
- named schemas: an inline object schema with a title (hand-written bodies, msgspec's schemas)
  becomes a component, so generated classes get the model's name;
- two documents: the public one (tenant and admin operations) at /openapi.json and the pool's
  (worker-token operations) at /v1/pool/openapi.json, each with only the components it uses.
"""

import copy
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, routing
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from app.auth import WORKER_SCHEME
from app.errors import (
    AppError,
    PayloadTooLarge,
    UnsupportedMediaType,
    ValidationFailed,
    all_codes,
    error_classes,
)
from app.http_semantics import JsonBodyRoute, reads_json_body

POOL_OPENAPI_URL = "/v1/pool/openapi.json"
ERROR_REF = "#/components/schemas/Error"
_SCHEMA_PREFIX = "#/components/schemas/"
# FastAPI's validation-error shapes: the service never returns them (its 422 is an `Error`).
_FASTAPI_422_SCHEMAS = ("HTTPValidationError", "ValidationError")
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


def error_components() -> dict[str, Any]:
    """The uniform error body (app/main.py's error_body), as components."""
    return {
        "ErrorCode": {
            "title": "ErrorCode",
            "type": "string",
            "enum": all_codes(),
            "description": "Machine-readable reason; the HTTP status gives its class.",
        },
        "ErrorInfo": {
            "title": "ErrorInfo",
            "type": "object",
            "properties": {
                "code": {"$ref": _SCHEMA_PREFIX + "ErrorCode"},
                "message": {"type": "string", "description": "For people; do not parse."},
                "details": {
                    "description": "Structured context: for a 422 a list of `{loc, msg, type}` "
                    "(`loc` the path of the field at fault; a batch's problems add `sample`, `field` "
                    "and `problem`); else an object or null."
                },
            },
            "required": ["code", "message", "details"],
        },
        "Error": {
            "title": "Error",
            "type": "object",
            "description": "The body of every error response.",
            "properties": {"error": {"$ref": _SCHEMA_PREFIX + "ErrorInfo"}},
            "required": ["error"],
        },
    }


# --------------------------------------------------------------------------- errors per operation


def _dependency_calls(dependant: Dependant) -> Iterator[Any]:
    for dep in dependant.dependencies:
        if dep.call is not None:
            yield dep.call
        yield from _dependency_calls(dep)


def api_routes(app: FastAPI) -> Iterator[Any]:
    """Every documented API route of `app`, included routers' too, as FastAPI documents it (its
    full path, its dependencies). FastAPI >= 0.130 nests included routers; older ones list them flat."""
    contexts = getattr(routing, "iter_route_contexts", None)
    for route in contexts(app.routes) if contexts is not None else app.routes:
        original = getattr(route, "original_route", route)
        if isinstance(original, routing.APIRoute) and getattr(route, "include_in_schema", False):
            yield route


def route_errors(route: Any, operation: dict[str, Any]) -> list[type[AppError]]:
    """The error classes an operation can answer with (see the module docstring)."""
    found: list[type[AppError]] = list(getattr(route.endpoint, "__raises__", ()))
    for call in _dependency_calls(route.dependant):
        found.extend(getattr(call, "__raises__", ()))
    if operation.get("parameters") or operation.get("requestBody"):
        found.append(ValidationFailed)
    if operation.get("requestBody"):
        # BodySizeLimit's 413, and the 400 of a body FastAPI cannot even parse (`http_error`).
        found += [PayloadTooLarge, AppError]
    if isinstance(getattr(route, "original_route", route), JsonBodyRoute) and reads_json_body(route):
        found.append(UnsupportedMediaType)
    return list(dict.fromkeys(found))


def _codes_at(status: int) -> list[str]:
    return sorted({c for cls in error_classes() if cls.status == status for c in (cls.code, *cls.codes)})


def _error_response(status: int, description: str | None) -> dict[str, Any]:
    codes = ", ".join(f"`{c}`" for c in _codes_at(status))
    text = description or (f"Error; `code` is one of {codes}." if codes else "Error.")
    return {"description": text, "content": {"application/json": {"schema": {"$ref": ERROR_REF}}}}


def _document_errors(operation: dict[str, Any], errors: list[type[AppError]]) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    for cls in errors:
        responses.setdefault(str(cls.status), {})
    for status, response in list(responses.items()):
        if not status.isdigit() or int(status) < 400:
            continue
        description = response.get("description")
        if description in ("Validation Error", "Successful Response"):
            description = None  # FastAPI's default text
        responses[status] = _error_response(int(status), description)
    operation["responses"] = dict(sorted(responses.items()))


# --------------------------------------------------------------------------- named schemas


def _lift_defs(node: Any, defs: dict[str, Any]) -> Any:
    """Hand-written schemas (openapi_extra; msgspec's) carry local `$defs`: move them into `defs`
    and point their `$ref`s at the components."""
    if isinstance(node, list):
        return [_lift_defs(v, defs) for v in node]
    if not isinstance(node, dict):
        return node
    for name, schema in node.get("$defs", {}).items():
        defs.setdefault(name, _lift_defs(schema, defs))
    out = {k: _lift_defs(v, defs) for k, v in node.items() if k != "$defs"}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        out["$ref"] = _SCHEMA_PREFIX + ref.removeprefix("#/$defs/")
    return out


def _same_shape(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("properties") == b.get("properties")


def _hoist(node: Any, components: dict[str, Any]) -> Any:
    """Titled inline object schemas → `$ref`s to components of that name (depth first)."""
    if isinstance(node, list):
        return [_hoist(v, components) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _hoist(v, components) for k, v in node.items()}
    title = node.get("title")
    if not (isinstance(title, str) and node.get("type") == "object" and "properties" in node):
        return node
    existing = components.get(title)
    if existing is None:
        components[title] = node
    elif not _same_shape(existing, node):
        return node  # another schema of that name: leave this one where it is
    ref: dict[str, Any] = {"$ref": _SCHEMA_PREFIX + title}
    if "description" in node and existing is not None and node["description"] != existing.get("description"):
        ref["description"] = node["description"]
    return ref


def _hoist_bodies(doc: dict[str, Any]) -> None:
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    # Operations first: a body's own schema wins its name over a look-alike nested in a component.
    for operation in _operations(doc):
        for holder in [operation.get("requestBody", {}), *operation.get("responses", {}).values()]:
            for media in holder.get("content", {}).values():
                if "schema" in media:
                    media["schema"] = _hoist(media["schema"], components)
    for name in list(components):
        # the component's children, not itself: it is its own definition
        components[name] = {k: _hoist(v, components) for k, v in components[name].items()}


# --------------------------------------------------------------------------- the documents


def _operations(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for item in doc.get("paths", {}).values():
        for method in _METHODS:
            if method in item:
                yield item[method]


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _prune(doc: dict[str, Any]) -> dict[str, Any]:
    """Drop the components (schemas, security schemes) no operation of `doc` uses."""
    schemas: dict[str, Any] = doc["components"].get("schemas", {})
    used: set[str] = set()
    pending = [r.removeprefix(_SCHEMA_PREFIX) for r in _refs(doc["paths"])]
    while pending:
        name = pending.pop()
        if name in used or name not in schemas:
            continue
        used.add(name)
        pending.extend(r.removeprefix(_SCHEMA_PREFIX) for r in _refs(schemas[name]))
    doc["components"]["schemas"] = {k: v for k, v in sorted(schemas.items()) if k in used}
    schemes = {name for op in _operations(doc) for req in op.get("security", []) for name in req}
    all_schemes = doc["components"].get("securitySchemes", {})
    doc["components"]["securitySchemes"] = {k: v for k, v in all_schemes.items() if k in schemes}
    return doc


def _is_pool_operation(operation: dict[str, Any]) -> bool:
    return any(WORKER_SCHEME.scheme_name in req for req in operation.get("security", []))


def _subset(doc: dict[str, Any], *, pool: bool, title: str, description: str) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["info"] = {**out["info"], "title": title, "description": description}
    paths: dict[str, Any] = {}
    for path, item in out["paths"].items():
        kept = {
            m: op
            for m, op in item.items()
            if m not in _METHODS or not op.get("security") or _is_pool_operation(op) == pool
        }
        if any(m in _METHODS for m in kept):
            paths[path] = kept
    out["paths"] = paths
    return _prune(out)


def build_documents(app: FastAPI) -> tuple[dict[str, Any], dict[str, Any]]:
    """(public document, pool document) of `app`."""
    doc = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes, openapi_version="3.1.0"
    )
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in _FASTAPI_422_SCHEMAS:
        components.pop(name, None)
    components.update(error_components())
    for route in api_routes(app):
        item = doc["paths"].get(route.path_format, {})
        for method in route.methods:
            operation = item.get(method.lower())
            if operation is not None:
                _document_errors(operation, route_errors(route, operation))
    defs: dict[str, Any] = {}
    doc["paths"] = _lift_defs(doc["paths"], defs)
    for name, schema in defs.items():
        components.setdefault(name, schema)
    _hoist_bodies(doc)
    public = _subset(
        doc,
        pool=False,
        title=app.title,
        description="Tenant and admin operations. The worker pool's operations are in "
        f"[{POOL_OPENAPI_URL}]({POOL_OPENAPI_URL}).",
    )
    pool = _subset(
        doc,
        pool=True,
        title=f"{app.title} pool API",
        description="The worker pool's operations (worker token).",
    )
    return public, pool


def install_openapi(app: FastAPI) -> None:
    """Serve the finished public document at /openapi.json (and /docs) and the pool's at
    POOL_OPENAPI_URL. Built on first use, once: routes are all added by then."""
    cache: dict[str, dict[str, Any]] = {}

    def documents() -> dict[str, dict[str, Any]]:
        if not cache:
            cache["public"], cache["pool"] = build_documents(app)
        return cache

    def public_openapi() -> dict[str, Any]:
        return documents()["public"]

    app.openapi = public_openapi  # type: ignore[method-assign]

    @app.get(POOL_OPENAPI_URL, include_in_schema=False)
    def pool_openapi() -> JSONResponse:
        return JSONResponse(documents()["pool"])
