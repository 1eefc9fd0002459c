"""`init_from.step` and `init_from.checkpoint` are integers a step column holds (0..INT32_MAX) or
"latest": anything else is a 422 that names the field, and nothing is stored.

A probe found a step past the range a 500 on SQLite (OverflowError binding it), a 422 naming no field
on Postgres ("a value is out of the range the service stores", loc ["body"]); `"step": true` made a
run from step 1, and `"checkpoint": -1` was a 404. Both databases."""

from typing import Any

import pytest

from app.runs.models import Run
from contracts.pool_api import INT32_MAX
from tests.app.api import create_run
from tests.app.factories import row_counts

BAD: list[tuple[Any, str]] = [
    (99999999999999999999999, "less_than_equal"),
    (INT32_MAX + 1, "less_than_equal"),
    (-1, "greater_than_equal"),
    (True, "int_type"),
    (False, "int_type"),
    (1.0, "int_type"),
    ("4", "int_type"),
    ([4], "int_type"),
]


@pytest.mark.parametrize("field", ["step", "checkpoint"])
@pytest.mark.parametrize(("value", "kind"), BAD, ids=[repr(v)[:12] for v, _ in BAD])
def test_a_step_out_of_the_stored_range_is_a_422_naming_it(
    client, tenant, settings, field: str, value: Any, kind: str
) -> None:
    source = create_run(client, tenant, name="source")
    body = {"name": "s", "init_from": {"run_id": source["id"], field: value}, "config": {}}
    r = client.post("/v1/runs", json=body, headers=tenant.headers)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error"
    [detail] = error["details"]
    assert (detail["loc"], detail["type"]) == (["body", "init_from", field], kind), detail
    assert row_counts(settings, Run) == (1,)


@pytest.mark.parametrize("field", ["step", "checkpoint"])
@pytest.mark.parametrize("value", [0, INT32_MAX])
def test_a_step_at_the_ends_of_the_range_is_looked_up(client, tenant, field: str, value: int) -> None:
    """In range: the source has no adapter or checkpoint of that step, a 404 as before."""
    source = create_run(client, tenant, name="source")
    body = {"name": "s", "init_from": {"run_id": source["id"], field: value}, "config": {}}
    r = client.post("/v1/runs", json=body, headers=tenant.headers)
    assert r.status_code == 404, r.text
    assert str(value) in r.json()["error"]["message"]


def test_a_toml_step_out_of_range_is_named_too(client, tenant) -> None:
    source = create_run(client, tenant, name="source")
    body = f'name = "s"\n[init_from]\nrun_id = "{source["id"]}"\nstep = {INT32_MAX + 1}\n'
    r = client.post("/v1/runs", content=body, headers=tenant.headers | {"Content-Type": "application/toml"})
    assert r.status_code == 422, r.text
    assert [d["loc"] for d in r.json()["error"]["details"]] == [["body", "init_from", "step"]]
