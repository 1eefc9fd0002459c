"""A run's config.metadata is bounded when the run is created: 16 KiB as canonical JSON, 1,000 values,
8 levels (and 64 keys, RunConfig's own rule). A hostile tenant's 1 MiB metadata made every listing of
its runs 200 MiB, and a 1 MB array of 510,000 zeros cost 2.6 s of CPU per create under the service-wide
admission lock. Runs stored before the bounds stay readable: the bounds apply to input only."""

import json
from typing import Any

import pytest
from sqlalchemy import select

from app.events.models import Event
from app.runs import schemas
from app.runs.models import Run
from app.runs.schemas import MAX_CREATE_BODY_VALUES, MAX_TOML_BODY_BYTES
from contracts.run_config import (
    METADATA_MAX_BYTES,
    METADATA_MAX_DEPTH,
    METADATA_MAX_VALUES,
    Excess,
    RunConfig,
    metadata_excess,
    shape_excess,
)
from tests.app.api import new_tenant
from tests.app.factories import make_run, make_tenant, row_counts

JSON = {"Content-Type": "application/json"}
TOML = {"Content-Type": "application/toml"}


def _nested(levels: int) -> Any:
    """A value of `levels` arrays (the innermost holds 1)."""
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def _string_of_bytes(size: int) -> dict[str, Any]:
    """Metadata exactly `size` bytes as canonical JSON: {"k":"xx..."} is 8 bytes plus the string."""
    return {"k": "x" * (size - 8)}


AT_THE_BOUNDS = {
    "bytes": _string_of_bytes(METADATA_MAX_BYTES),
    "values": {"a": [0] * (METADATA_MAX_VALUES - 1)},  # the array and its items
    "depth": {"d": _nested(METADATA_MAX_DEPTH - 1)},  # the metadata table is the first level
}
OVER_THE_BOUNDS = {
    "bytes": (
        _string_of_bytes(METADATA_MAX_BYTES + 1),
        "too_large",
        METADATA_MAX_BYTES,
        METADATA_MAX_BYTES + 1,
    ),
    "values": (
        {"a": [0] * METADATA_MAX_VALUES},
        "too_many_values",
        METADATA_MAX_VALUES,
        METADATA_MAX_VALUES + 1,
    ),
    "values-as-empty-arrays": (
        {"a": [[] for _ in range(METADATA_MAX_VALUES)]},
        "too_many_values",
        METADATA_MAX_VALUES,
        METADATA_MAX_VALUES + 1,
    ),
    "depth": ({"d": _nested(METADATA_MAX_DEPTH)}, "too_deep", METADATA_MAX_DEPTH, METADATA_MAX_DEPTH + 1),
}


def _nothing_stored(settings, db) -> None:
    assert row_counts(settings, Run) == (0,)
    assert db.scalars(select(Event.action).where(Event.action.like("run.%"))).all() == []
    db.rollback()  # no read transaction left open (SQLite)
    runs_dir = settings.runs_dir
    assert not runs_dir.exists() or not [p for p in runs_dir.iterdir() if p.name.startswith("run_")]


def _refusal(r, *, loc: list[str], kind: str, limit: int) -> dict[str, Any]:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == "validation_error"
    [detail] = error["details"]
    assert detail["loc"] == loc
    assert detail["type"] == kind
    assert detail["limit"] == limit
    assert str(limit) in error["message"] and str(detail["actual"]) in error["message"]
    return detail


# --------------------------------------------------------------------------- the bounds, over HTTP


@pytest.mark.parametrize("bound", OVER_THE_BOUNDS)
def test_metadata_over_a_bound_is_a_422_naming_it_and_nothing_is_stored(client, settings, db, bound):
    metadata, kind, limit, actual = OVER_THE_BOUNDS[bound]
    tenant = new_tenant(client)
    r = client.post("/v1/runs", json={"name": "x", "config": {"metadata": metadata}}, headers=tenant.headers)
    detail = _refusal(r, loc=["body", "config", "metadata"], kind=kind, limit=limit)
    assert detail["actual"] == actual
    assert "config.metadata" in r.json()["error"]["message"]
    _nothing_stored(settings, db)


@pytest.mark.parametrize("bound", AT_THE_BOUNDS)
def test_metadata_exactly_at_a_bound_is_created_and_kept_whole(client, bound):
    tenant = new_tenant(client)
    metadata = AT_THE_BOUNDS[bound]
    r = client.post("/v1/runs", json={"name": "x", "config": {"metadata": metadata}}, headers=tenant.headers)
    assert r.status_code == 201, r.text
    assert r.json()["config"]["metadata"] == metadata
    shown = client.get(f"/v1/runs/{r.json()['id']}", headers=tenant.headers).json()
    assert shown["config"]["metadata"] == metadata


def test_toml_metadata_nested_by_dotted_headers_is_bounded(client, settings, db):
    """`[config.metadata.a.b...]` nests a table per dot (no bracket for the byte scan to count)."""
    tenant = new_tenant(client)
    for levels, status in ((METADATA_MAX_DEPTH - 1, 201), (METADATA_MAX_DEPTH, 422)):
        header = ".".join(["config", "metadata", *["a"] * levels])
        r = client.post(
            "/v1/runs", content=f'name = "x"\n[{header}]\nb = 1\n', headers={**tenant.headers, **TOML}
        )
        assert r.status_code == status, r.text
    _refusal(r, loc=["body", "config", "metadata"], kind="too_deep", limit=METADATA_MAX_DEPTH)
    assert "nested too deeply" in r.json()["error"]["message"]
    assert row_counts(settings, Run) == (1,)


def test_the_probe_body_is_refused_before_any_walk_of_its_items(client, settings, db, monkeypatch):
    """1 MB of `0,`: the nesting and NUL walks, pydantic, the TOML check, the request hash and the
    projection each took their turn over the 510,000 items (2.6 s of CPU). Now none is reached."""

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("walked the whole body")

    for name in ("nested_deeper", "nul_path"):
        monkeypatch.setattr(schemas, name, never)
    monkeypatch.setattr(schemas.RunCreate, "model_validate", never)
    tenant = new_tenant(client)
    body = '{"name":"many","config":{"metadata":{"a":[' + ",".join(["0"] * 510_000) + "]}}}"
    r = client.post("/v1/runs", content=body, headers={**tenant.headers, **JSON})
    detail = _refusal(
        r, loc=["body", "config", "metadata"], kind="too_many_values", limit=METADATA_MAX_VALUES
    )
    assert detail["actual"] > METADATA_MAX_VALUES
    assert "at least" in detail["msg"]  # the count stopped at the bound
    _nothing_stored(settings, db)


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x", "config": {"lora": {"target_modules": ["q_proj"] * MAX_CREATE_BODY_VALUES}}},
        {"name": "x", "junk": [0] * MAX_CREATE_BODY_VALUES},
        {"name": [0] * MAX_CREATE_BODY_VALUES},
    ],
    ids=["target_modules", "unknown-field", "name"],
)
def test_a_long_array_anywhere_in_the_body_is_refused_as_cheaply(client, settings, db, body):
    """Outside metadata, `lora.target_modules` of 510,000 items once gave 510,001 errors in 6 s."""
    tenant = new_tenant(client)
    r = client.post("/v1/runs", json=body, headers=tenant.headers)
    _refusal(r, loc=["body"], kind="too_many_values", limit=MAX_CREATE_BODY_VALUES)
    _nothing_stored(settings, db)


def test_a_large_toml_body_is_a_413_before_it_is_parsed(client, settings, db, monkeypatch):
    """TOML is parsed in pure Python: a 1 MB array took 0.8 s before any bound could be checked."""

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("parsed")

    tenant = new_tenant(client)
    monkeypatch.setattr(schemas.tomllib, "loads", never)
    body = b'name = "x"\n[config.metadata]\na = "' + b"x" * MAX_TOML_BODY_BYTES + b'"\n'
    r = client.post("/v1/runs", content=body, headers={**tenant.headers, **TOML})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "payload_too_large"
    assert str(MAX_TOML_BODY_BYTES) in r.json()["error"]["message"]
    _nothing_stored(settings, db)


def test_the_document_states_the_bounds(client):
    metadata = client.get("/openapi.json").json()["components"]["schemas"]["RunConfig"]["properties"][
        "metadata"
    ]
    assert metadata["maxProperties"] == 64
    for figure in ("16 KiB", f"{METADATA_MAX_VALUES:,}", f"{METADATA_MAX_DEPTH} levels"):
        assert figure in metadata["description"]


# --------------------------------------------------------------------------- stored runs stay readable


def test_a_run_stored_with_metadata_over_the_bounds_still_lists_and_shows(client, db):
    """Stored before the bounds (64 keys of 16,000 characters, one of them 5,000 values deep in
    arrays): read back without them, by the listing, the run's page and the dashboard alike."""
    tenant, secret = make_tenant(db)
    big = {f"k{i}": "x" * 16_000 for i in range(63)} | {"many": [[0] * 5_000]}
    assert metadata_excess(big) is not None
    run = make_run(db, tenant, status="completed", config=RunConfig(metadata=big))
    db.commit()
    headers = {"Authorization": f"Bearer {secret}"}
    r = client.get("/v1/runs", headers=headers)
    assert r.status_code == 200, r.text
    assert [item["config"]["metadata"] for item in r.json()["items"]] == [big]
    r = client.get(f"/v1/runs/{run.id}", headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["config"]["metadata"] == big
    # ... and leaves the lifecycle as any run does.
    r = client.delete(f"/v1/runs/{run.id}", headers=headers)
    assert r.status_code == 200, r.text


def test_deleting_a_run_drops_its_metadata_and_keeps_the_rest(client, db):
    """Deleted runs stay for the audit trail; their free-form labels did too (create-and-delete loops
    grew the database by every run's metadata, for good)."""
    tenant = new_tenant(client)
    metadata = _string_of_bytes(METADATA_MAX_BYTES)
    r = client.post(
        "/v1/runs",
        json={"name": "x", "config": {"metadata": metadata, "max_steps": 7}},
        headers=tenant.headers,
    )
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    deleted = client.delete(f"/v1/runs/{run_id}", headers=tenant.headers).json()
    assert (deleted["status"], deleted["config"]["metadata"], deleted["config"]["max_steps"]) == (
        "deleted",
        {},
        7,
    )
    listed = client.get("/v1/runs", params={"status": "deleted"}, headers=tenant.headers).json()["items"]
    assert [item["config"]["metadata"] for item in listed] == [{}]
    stored = db.scalars(select(Run.config).where(Run.id == run_id)).one()
    assert stored == {**r.json()["config"], "metadata": {}}


# --------------------------------------------------------------------------- the contract's functions


def test_metadata_excess_reports_the_first_bound_and_its_measure():
    assert metadata_excess({}) is None
    assert metadata_excess(AT_THE_BOUNDS["bytes"]) is None
    assert metadata_excess(_string_of_bytes(METADATA_MAX_BYTES + 1)) == Excess(
        "bytes", METADATA_MAX_BYTES, METADATA_MAX_BYTES + 1
    )
    # Canonical JSON escapes non-ASCII: "é" is 6 bytes (\\u00e9), as the request hash's form has it.
    assert metadata_excess({"k": "é" * 2729}) is None  # 8 + 6 * 2729 = 16382
    assert metadata_excess({"k": "é" * 2730}) == Excess("bytes", METADATA_MAX_BYTES, 16388)
    # TOML's dates are measured as their ISO text.
    assert metadata_excess({"when": __import__("datetime").date(2026, 1, 1)}) is None
    # Too many values is reported before too deep, and the count stops at the bound.
    excess = metadata_excess({"a": [0] * 500_000, "d": _nested(50)})
    assert excess is not None and (excess.bound, excess.at_least) == ("values", True)
    assert excess.measured > 500_000
    assert metadata_excess({"d": _nested(50)}) == Excess("depth", METADATA_MAX_DEPTH, 51)


def test_shape_excess_counts_every_value_and_levels():
    assert shape_excess(1, max_values=0) is None  # a scalar holds no value
    assert shape_excess({"a": {"b": [1, 2]}}, max_values=4, max_depth=3) is None  # {b}, [..], 1, 2
    assert shape_excess({"a": {"b": [1, 2]}}, max_values=3) == Excess("values", 3, 4, at_least=True)
    assert shape_excess({"a": {"b": [1, 2]}}, max_values=9, max_depth=2) == Excess("depth", 2, 3)
    assert shape_excess([[], {}], max_values=9, max_depth=1) == Excess("depth", 1, 2)  # empty ones count


def test_runconfig_itself_reads_metadata_over_the_bounds():
    """The bounds are the create route's: stored configs are read back with RunConfig, by the service,
    the dashboard, the pool and the SDK."""
    big = {"k": "x" * 100_000, "many": list(range(5_000))}
    assert RunConfig.model_validate({"metadata": big}).metadata == big
    assert RunConfig.model_validate_json(json.dumps({"metadata": big})).metadata == big
