"""A Tinker session's tags: bounded in count and length (a 422 at the tag's place, `["body", "tags",
"3"]`, nothing stored), their characters not checked. The service keeps no tag, and the official SDK
sends `TINKER_TAGS` split on commas as written: `"a, b,"` is `["a", " b", ""]`, which the run names'
rule (contracts/names.py) would refuse, failing every client created with it. Both databases."""

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.config import Settings
from app.tinker.models import TinkerSession
from app.tinker.schemas import MAX_TAG_CHARS, MAX_TAGS
from contracts.names import label_problem
from tests.app.api import TenantHandle
from tests.app.factories import committed
from tests.app.tinker_calls import tinker_headers


def _sessions(settings: Settings, tenant_id: str) -> int:
    with committed(settings) as session:
        return int(
            session.scalar(
                select(func.count()).select_from(TinkerSession).where(TinkerSession.tenant_id == tenant_id)
            )
            or 0
        )


def _create(client: TestClient, tenant: TenantHandle, tags: list[str]) -> Any:
    body = {"tags": tags, "sdk_version": "test"}
    return client.post("/api/v1/create_session", json=body, headers=tinker_headers(tenant))


def test_tags_as_the_sdk_splits_them_are_taken(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    before = _sessions(settings, tenant.id)
    r = _create(client, tenant, ["a", " b", "", "gsm8k\u202e"])
    assert r.status_code == 200, r.text
    assert _sessions(settings, tenant.id) == before + 1


def test_the_tags_count_and_length_are_bounded(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    before = _sessions(settings, tenant.id)
    tags = [f"t{i}" for i in range(MAX_TAGS)]
    r = _create(client, tenant, [*tags, "one more"])
    assert r.status_code == 422, r.text
    assert [(d["loc"], d["type"]) for d in r.json()["error"]["details"]] == [(["body", "tags"], "too_long")]
    r = _create(client, tenant, ["ok", "t" * (MAX_TAG_CHARS + 1)])
    assert r.status_code == 422, r.text
    assert [(d["loc"], d["type"]) for d in r.json()["error"]["details"]] == [
        (["body", "tags", "1"], "string_too_long")
    ]
    assert _sessions(settings, tenant.id) == before
    assert _create(client, tenant, tags).status_code == 200


def test_the_rule_of_names_for_a_label_of_another_length() -> None:
    assert label_problem("t" * MAX_TAG_CHARS, max_chars=MAX_TAG_CHARS, kind="tag") is None
    too_long = label_problem("t" * (MAX_TAG_CHARS + 1), max_chars=MAX_TAG_CHARS, kind="tag")
    assert too_long is not None and too_long.type == "string_too_long"
    refused = label_problem("a\u202eb", max_chars=MAX_TAG_CHARS, kind="tag")
    assert refused is not None and refused.type == "tag_character"
    assert (
        refused.message
        == "must not contain U+202E RIGHT-TO-LEFT OVERRIDE (a bidirectional text control, character 2)"
    )
