"""GET /v1/runs/{run_id}/adapters pages by step (app/pagination.py's id cursor, as the batches list
does): every adapter exactly once across pages, past the default page of 200 when the run keeps
every adapter (LORALOOM_RUN_ADAPTERS_KEPT=0); adapters published or pruned between pages neither
shift nor repeat the others; `newest_first=true&limit=1` is the newest adapter; a request with no
paging parameter at all is the whole list on one page, as before paging (what older SDKs read);
a cursor names its list and order, so one of the other order or of the batches list is the uniform
422, as is a bad limit; another tenant's run is the 404 of a missing one, whatever the query."""

import base64
import json
import random
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from safetensors.torch import save
from sqlalchemy import delete

from app.adapters import router as adapters_router
from app.adapters.models import Adapter
from app.config import Settings
from app.pagination import MAX_LIMIT
from app.ui.router import RUN_PAGE_ADAPTERS
from tests.app.api import WORKER_HEADERS, Client, TenantHandle, batch_body, create_run, post_batch
from tests.app.factories import committed, seed_run
from tests.app.test_adapters import FILES, tar_bytes
from tests.app.test_ui import sign_in

MANY = MAX_LIMIT + 5
"""More adapters than the default (and largest) page."""


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The suite's settings, keeping every adapter: the listing is as long as the run's history."""
    return settings.model_copy(update={"run_adapters_kept": 0})


def add_adapters(settings: Settings, run_id: str, steps: list[int]) -> None:
    """Adapter rows as the trainer leaves them (the listing reads rows only), added in a shuffled
    order with publication times unrelated to the steps: the pages follow the step alone."""
    shuffled = random.Random(7).sample(steps, len(steps))
    start = datetime(2026, 1, 1, tzinfo=UTC)
    with committed(settings) as session:
        for i, step in enumerate(shuffled):
            session.add(
                Adapter(
                    run_id=run_id,
                    step=step,
                    path=f"x/{step}",
                    size_bytes=step + 1,
                    sha256=f"{step:064x}",
                    created_at=start + timedelta(seconds=i),
                )
            )


def pages(client: TestClient, tenant: TenantHandle, run_id: str, **params: Any) -> Iterator[dict[str, Any]]:
    """Every page of the run's adapters, following `next_cursor`."""
    cursor = None
    while True:
        query = params | ({"cursor": cursor} if cursor else {})
        r = client.get(f"/v1/runs/{run_id}/adapters", params=query, headers=tenant.headers)
        assert r.status_code == 200, r.text
        page = r.json()
        yield page
        if page["next_cursor"] is None:
            return
        cursor = page["next_cursor"]


def walk(client: TestClient, tenant: TenantHandle, run_id: str, **params: Any) -> list[list[int]]:
    return [[a["step"] for a in page["items"]] for page in pages(client, tenant, run_id, **params)]


STEPS = [3 * i + 1 for i in range(MANY)]  # not 0..n-1: nothing can pass for an offset


@pytest.mark.parametrize(
    ("params", "sizes"),
    [
        ({"newest_first": "false"}, [MAX_LIMIT, MANY - MAX_LIMIT]),  # a paging parameter, no limit
        ({"limit": 7}, [7] * (MANY // 7) + [MANY % 7]),
        ({"limit": MAX_LIMIT}, [MAX_LIMIT, MANY - MAX_LIMIT]),
    ],
    ids=["default-limit", "limit-7", "limit-max"],
)
def test_pages_walk_every_adapter_once_by_step(
    client: TestClient, tenant: TenantHandle, settings: Settings, params: dict[str, Any], sizes: list[int]
) -> None:
    run_id = create_run(client, tenant)["id"]
    add_adapters(settings, run_id, STEPS)
    walked = walk(client, tenant, run_id, **params)
    assert [len(p) for p in walked] == sizes
    assert [s for page in walked for s in page] == STEPS  # each once, ascending

    newest_first = walk(client, tenant, run_id, **(params | {"newest_first": "true"}))
    assert [len(p) for p in newest_first] == sizes
    assert [s for page in newest_first for s in page] == STEPS[::-1]


def test_an_item_is_the_adapter_and_the_cursor_is_opaque(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    run_id = create_run(client, tenant)["id"]
    add_adapters(settings, run_id, [4, 9])
    page = client.get(f"/v1/runs/{run_id}/adapters?limit=1", headers=tenant.headers).json()
    [item] = page["items"]
    assert item == {
        "step": 4,
        "size_bytes": 5,
        "sha256": f"{4:064x}",
        "created_at": item["created_at"],
    }
    assert not page["next_cursor"].isdigit()  # opaque, as the runs and batches cursors
    last = client.get(
        f"/v1/runs/{run_id}/adapters", params={"cursor": page["next_cursor"]}, headers=tenant.headers
    ).json()
    assert ([a["step"] for a in last["items"]], last["next_cursor"]) == ([9], None)


def test_no_paging_parameter_is_the_whole_list_as_before_paging(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    """What an SDK from before paging sends and reads whole, taking the highest step as the newest:
    past the largest page it still sees every adapter, the newest included. Any one paging
    parameter gives pages of 200."""
    run_id = create_run(client, tenant)["id"]
    add_adapters(settings, run_id, STEPS)
    url = f"/v1/runs/{run_id}/adapters"
    whole = client.get(url, headers=tenant.headers).json()
    assert [a["step"] for a in whole["items"]] == STEPS and len(STEPS) > MAX_LIMIT
    assert whole["next_cursor"] is None
    assert max(a["step"] for a in whole["items"]) == STEPS[-1]  # what an old SDK's latest_adapter took

    first = client.get(url, params={"limit": MAX_LIMIT}, headers=tenant.headers).json()
    assert [a["step"] for a in first["items"]] == STEPS[:MAX_LIMIT] and first["next_cursor"]
    for params, steps in (
        ({"newest_first": "false"}, STEPS[:MAX_LIMIT]),
        ({"newest_first": "true"}, STEPS[::-1][:MAX_LIMIT]),
        (
            {"cursor": client.get(url, params={"limit": 1}, headers=tenant.headers).json()["next_cursor"]},
            STEPS[1 : MAX_LIMIT + 1],
        ),
    ):
        page = client.get(url, params=params, headers=tenant.headers).json()
        assert [a["step"] for a in page["items"]] == steps, params
        assert page["next_cursor"] is not None


def test_a_cursor_of_the_other_order_is_a_422(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    """An oldest-first cursor read as a newest-first one would answer the steps below it, which
    that walk has already passed (and the other way round): the cursor says its order."""
    run_id = create_run(client, tenant)["id"]
    add_adapters(settings, run_id, [1, 2, 3, 4])
    url = f"/v1/runs/{run_id}/adapters"
    oldest_first = client.get(url, params={"limit": 2}, headers=tenant.headers).json()["next_cursor"]
    newest_first = client.get(
        url, params={"limit": 2, "newest_first": "true"}, headers=tenant.headers
    ).json()["next_cursor"]
    assert oldest_first and newest_first
    for params in (
        {"cursor": oldest_first, "newest_first": "true"},
        {"cursor": oldest_first, "newest_first": "true", "limit": 2},
        {"cursor": newest_first},
        {"cursor": newest_first, "newest_first": "false", "limit": 2},
    ):
        r = client.get(url, params=params, headers=tenant.headers)
        assert_uniform_422(r, "query.cursor")
        assert "other order" in r.json()["error"]["details"][0]["msg"]
    # Each with its own order goes on.
    for params, steps in (
        ({"cursor": oldest_first, "newest_first": "false"}, [3, 4]),
        ({"cursor": newest_first, "newest_first": "true"}, [2, 1]),
    ):
        page = client.get(url, params=params, headers=tenant.headers).json()
        assert [a["step"] for a in page["items"]] == steps


def test_a_batches_cursor_is_a_422_and_the_batches_list_refuses_an_adapters_one(
    client: TestClient, settings: Settings
) -> None:
    """Both lists page by an integer key: without its list's name in it a batches cursor (a batch
    id) would be read as a step."""
    seeded = seed_run(settings)
    for i in range(2):
        assert post_batch(client, seeded, batch_body(1, seed=i)).status_code == 201
    add_adapters(settings, seeded.run_id, [1, 2, 3])
    batches_url = f"/v1/runs/{seeded.run_id}/batches"
    adapters_url = f"/v1/runs/{seeded.run_id}/adapters"
    batches_cursor = client.get(batches_url, params={"limit": 1}, headers=seeded.headers).json()[
        "next_cursor"
    ]
    adapters_cursor = client.get(adapters_url, params={"limit": 1}, headers=seeded.headers).json()[
        "next_cursor"
    ]
    assert batches_cursor and adapters_cursor
    for params in ({"cursor": batches_cursor}, {"cursor": batches_cursor, "newest_first": "true"}):
        r = client.get(adapters_url, params=params, headers=seeded.headers)
        assert_uniform_422(r, "query.cursor")
    assert_uniform_422(
        client.get(batches_url, params={"cursor": adapters_cursor}, headers=seeded.headers), "query.cursor"
    )
    # Each list takes its own.
    assert (
        client.get(batches_url, params={"cursor": batches_cursor}, headers=seeded.headers).status_code == 200
    )
    page = client.get(adapters_url, params={"cursor": adapters_cursor}, headers=seeded.headers).json()
    assert [a["step"] for a in page["items"]] == [2, 3]


def test_publishing_and_pruning_between_pages_shift_nothing(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    """Keyset, not offset: after the first page a step on it is pruned and a newer one published;
    the walk goes on with the next step, and ends with the new one."""
    run_id = create_run(client, tenant)["id"]
    add_adapters(settings, run_id, [1, 2, 3, 4, 5, 6])
    walker = pages(client, tenant, run_id, limit=3)
    assert [a["step"] for a in next(walker)["items"]] == [1, 2, 3]
    with committed(settings) as session:
        session.execute(delete(Adapter).where(Adapter.run_id == run_id, Adapter.step.in_([1, 2])))
    add_adapters(settings, run_id, [7])
    assert [[a["step"] for a in page["items"]] for page in walker] == [[4, 5, 6], [7]]


def test_newest_first_with_limit_1_is_the_newest_adapter(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    run_id = create_run(client, tenant)["id"]
    newest = f"/v1/runs/{run_id}/adapters?newest_first=true&limit=1"
    assert client.get(newest, headers=tenant.headers).json() == {"items": [], "next_cursor": None}
    add_adapters(settings, run_id, STEPS)
    page = client.get(newest, headers=tenant.headers).json()
    assert [a["step"] for a in page["items"]] == [STEPS[-1]]
    assert page["next_cursor"] is not None
    # What the tar.gz route sends for `latest` is that step.
    publish_adapter(client, run_id, STEPS[-1] + 1)
    page = client.get(newest, headers=tenant.headers).json()
    assert [a["step"] for a in page["items"]] == [STEPS[-1] + 1]
    download = client.get(f"/v1/runs/{run_id}/adapters/latest", headers=tenant.headers)
    assert download.status_code == 200, download.text
    assert download.headers["x-adapter-step"] == str(STEPS[-1] + 1)
    assert download.headers["etag"] == f'"{page["items"][0]["sha256"]}"'


def publish_adapter(client: Client, run_id: str, step: int) -> None:
    """A real adapter through the pool's route (its rows and files, as the trainer publishes)."""
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{q_proj}.lora_A.weight": torch.ones(4, 32), f"{q_proj}.lora_B.weight": torch.ones(32, 4)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    r = client.put(
        f"/v1/pool/runs/{run_id}/adapters/{step}",
        content=tar_bytes({FILES[0]: json.dumps(config).encode(), FILES[1]: save(tensors)}),
        headers=WORKER_HEADERS | {"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 201, r.text


def _b64(value: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


BAD_QUERIES = [
    ("limit=0", "query.limit"),
    ("limit=201", "query.limit"),
    ("limit=-1", "query.limit"),
    ("limit=ten", "query.limit"),
    ("cursor=%25%25", "query.cursor"),  # not base64url
    ("cursor=" + "A" * 513, "query.cursor"),
    ("cursor=bm90LWpzb24", "query.cursor"),  # "not-json"
    ("cursor=" + _b64(["2026-01-01T00:00:00+00:00", "run_x"]), "query.cursor"),  # a runs cursor
    ("cursor=" + _b64(["id", 3]), "query.cursor"),  # a batches cursor
    ("cursor=" + _b64(["adapters_newest_first", 3]), "query.cursor"),  # the other order's
    ("cursor=" + _b64(["adapters_oldest_first", 3]) + "&newest_first=true", "query.cursor"),
    ("cursor=" + _b64(["adapters_oldest_first", 2**31]), "query.cursor"),  # past the 32-bit step column
    ("cursor=" + _b64(["adapters_oldest_first", -1]), "query.cursor"),
    ("cursor=" + _b64(["adapters_oldest_first", True]), "query.cursor"),
    ("cursor=" + _b64(["adapters_oldest_first", "3"]), "query.cursor"),
    ("newest_first=maybe", "query.newest_first"),
]


@pytest.mark.parametrize(("query", "field"), BAD_QUERIES, ids=[q[:40] for q, _ in BAD_QUERIES])
def test_a_bad_limit_or_cursor_is_the_uniform_422(
    client: TestClient, tenant: TenantHandle, settings: Settings, query: str, field: str
) -> None:
    run_id = create_run(client, tenant)["id"]
    add_adapters(settings, run_id, [1, 2])
    assert_uniform_422(client.get(f"/v1/runs/{run_id}/adapters?{query}", headers=tenant.headers), field)


def assert_uniform_422(r: Any, field: str) -> None:
    assert r.status_code == 422, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == "validation_error"
    assert [".".join(d["loc"]) for d in body["error"]["details"]] == [field]
    assert all(set(d) == {"loc", "msg", "type"} for d in body["error"]["details"])


def test_another_tenants_run_is_a_404_whatever_the_query(
    client: TestClient, tenant: TenantHandle, other_tenant: TenantHandle, settings: Settings
) -> None:
    run_id = create_run(client, tenant)["id"]
    add_adapters(settings, run_id, [1, 2, 3])
    mine = client.get(f"/v1/runs/{run_id}/adapters?limit=1", headers=tenant.headers).json()
    for query in (
        "",
        "?newest_first=true&limit=1",
        f"?cursor={mine['next_cursor']}",
        "?limit=0",
        "?cursor=%25",
    ):
        theirs = client.get(f"/v1/runs/{run_id}/adapters{query}", headers=other_tenant.headers)
        missing = client.get(f"/v1/runs/run_000000000000/adapters{query}", headers=other_tenant.headers)
        assert theirs.status_code == missing.status_code == 404, (query, theirs.text)
        assert theirs.json()["error"]["code"] == missing.json()["error"]["code"] == "not_found"
        assert theirs.json()["error"]["message"] == f"run {run_id} not found"


def test_the_dashboards_run_page_shows_the_newest_and_says_where_the_rest_are(
    app: FastAPI, client: TestClient, settings: Settings, tenant: TenantHandle
) -> None:
    """The run page reads one page, newest first, not the run's whole history."""
    few, many = create_run(client, tenant)["id"], create_run(client, tenant)["id"]
    add_adapters(settings, few, [1, 2])
    add_adapters(settings, many, STEPS)
    with TestClient(app) as ui:
        sign_in(ui, tenant.key)
        page = ui.get(f"/ui/runs/{many}")
        assert page.status_code == 200
        shown = [int(s) for s in re.findall(rf'href="/ui/runs/{many}/adapters/(\d+)"', page.text)]
        assert shown == sorted(STEPS, reverse=True)[:RUN_PAGE_ADAPTERS]
        assert 'id="older-adapters"' in page.text and f"loraloom adapters list {many}" in page.text
        page = ui.get(f"/ui/runs/{few}")
        assert re.findall(rf'href="/ui/runs/{few}/adapters/(\d+)"', page.text) == ["2", "1"]
        assert 'id="older-adapters"' not in page.text


def test_the_unpaged_form_is_the_newest_at_most(
    client: TestClient, tenant: TenantHandle, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run keeping every step would answer its whole history to each unpaged call (megabytes, and
    a tenant could tie the service up with them): the unpaged form is its newest UNPAGED_MOST,
    oldest first, so an old client's highest step is still the newest."""
    monkeypatch.setattr(adapters_router, "UNPAGED_MOST", 50)
    run_id = create_run(client, tenant)["id"]
    add_adapters(settings, run_id, STEPS)
    whole = client.get(f"/v1/runs/{run_id}/adapters", headers=tenant.headers).json()
    assert [a["step"] for a in whole["items"]] == STEPS[-50:] and whole["next_cursor"] is None
