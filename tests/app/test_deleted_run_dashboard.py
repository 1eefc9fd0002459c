"""The dashboard shows no metrics of a deleted run, as the API answers them with a 404
(tests/app/test_htk_deleted_run_metrics.py): the run page still charted the rewards and losses of a
deleted run (their rows stay until the run is purged) and gave its latest reward, and the runs list
filtered on `deleted` gave each one's latest reward. Now the page shows the run as deleted, its curves
and adapters "Deleted with the run", its chart series empty; the list gives no reward for a deleted
run. Driven as tests/app/test_ui.py drives the dashboard (a TestClient, no browser). Both databases."""

import html
import json
import re
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.app.api import WORKER_HEADERS, TenantHandle, create_run, rewarded_batch
from tests.app.test_ui import sign_in

PAGE = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}  # a browser's navigation


def _run_data(page: str) -> dict[str, Any]:
    """The run page's JSON block: the series run.js charts."""
    block = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page, re.S)
    assert block is not None, page
    data: dict[str, Any] = json.loads(html.unescape(block.group(1)))
    return data


def _latest_reward(page: str) -> str:
    cell = re.search(r'<dd id="latest-reward">(.*?)</dd>', page)
    assert cell is not None, page
    return cell.group(1)


def _listed_reward(page: str, run_id: str) -> str:
    """The "Latest reward" cell of the run's row of the runs list."""
    row = re.search(rf'<tr data-run-id="{run_id}">(.*?)</tr>', page, re.S)
    assert row is not None, page
    cells = re.findall(r"<td>(.*?)</td>", row.group(1), re.S)
    return str(cells[-2])  # before "Created"


@pytest.fixture
def charted(client: TestClient, tenant: TenantHandle) -> str:
    """A run sent rewards for rollout steps 0 and 1 and a trainer report (with a loss) for step 1; its id."""
    run_id: str = create_run(client, tenant, max_steps=10)["id"]
    rewards_per_step: list[tuple[int, list[float | None]]] = [(0, [0.25, 0.75]), (1, [1.0, 2.0])]
    for step, rewards in rewards_per_step:
        body = rewarded_batch(rewards, step=step)
        r = client.post(f"/v1/runs/{run_id}/batches", json=body, headers=tenant.headers)
        assert r.status_code == 201, r.text
    report = {"step": 1, "total_tokens": 10, "total_samples": 2, "metrics": {"loss": 0.5}}
    r = client.post(f"/v1/pool/runs/{run_id}/steps", json=report, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    return run_id


def test_a_deleted_runs_page_charts_none_of_its_metrics(
    app: FastAPI, client: TestClient, tenant: TenantHandle, charted: str
) -> None:
    with TestClient(app) as ui:
        sign_in(ui, tenant.key)
        before = ui.get(f"/ui/runs/{charted}", headers=PAGE)
        assert before.status_code == 200, before.text
        data = _run_data(before.text)
        assert data["reward"] == [[0, 0.5], [1, 1.5]] and data["loss"] == [[1, 0.5]]
        assert _latest_reward(before.text) == "1.500"
        assert 'class="charts"' in before.text and "curves-deleted" not in before.text

        assert client.delete(f"/v1/runs/{charted}", headers=tenant.headers).status_code == 200
        assert client.get(f"/v1/runs/{charted}/metrics", headers=tenant.headers).status_code == 404

        after = ui.get(f"/ui/runs/{charted}", headers=PAGE)
        assert after.status_code == 200, after.text  # the run is still shown, as the API shows it: deleted
        assert 'id="status" class="status status-deleted">deleted<' in after.text
        data = _run_data(after.text)
        assert data["status"] == "deleted" and data["reward"] == [] and data["loss"] == []
        assert _latest_reward(after.text) == "–"
        # Said, not left blank: the charts (still in the page, for run.js) are hidden.
        assert (
            '<p id="curves-deleted">Deleted with the run: its metrics are no longer shown.</p>' in after.text
        )
        assert '<div id="charts" hidden>' in after.text and 'class="charts"' not in after.text
        assert '<p id="adapters-deleted">Deleted with the run.</p>' in after.text
        assert "None yet." not in after.text


def test_the_runs_list_gives_no_reward_of_a_deleted_run(
    app: FastAPI, client: TestClient, tenant: TenantHandle, charted: str
) -> None:
    other: str = create_run(client, tenant, name="kept")["id"]
    r = client.post(f"/v1/runs/{other}/batches", json=rewarded_batch([0.5], step=0), headers=tenant.headers)
    assert r.status_code == 201, r.text
    with TestClient(app) as ui:
        sign_in(ui, tenant.key)
        assert _listed_reward(ui.get("/ui/runs", headers=PAGE).text, charted) == "1.500"

        assert client.delete(f"/v1/runs/{charted}", headers=tenant.headers).status_code == 200
        listed = ui.get("/ui/runs", params={"status": "deleted"}, headers=PAGE)
        assert listed.status_code == 200, listed.text
        assert _listed_reward(listed.text, charted) == "–"
        # A run that is not deleted keeps its reward.
        assert _listed_reward(ui.get("/ui/runs", headers=PAGE).text, other) == "0.500"
