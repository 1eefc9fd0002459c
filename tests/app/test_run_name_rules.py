"""A run's name reads as what it is (contracts.names): no control character (C0, DEL, C1), no
invisible format character (bidirectional overrides and isolates, zero-width characters, a BOM), no
line separator, not only whitespace and no whitespace at either end. Such a name was stored and
shown in run lists, the dashboard and logs, where it said something else (`abc<U+202E>gpj.exe`
shows as `abcexe.jpg`).

Every way a name comes in refuses it the same way: POST /v1/runs as JSON and as TOML (a 422 in the
uniform body naming `body.name` and the character by its code point, never the character itself,
and nothing stored), the SDK's create_run and the CLI's run file and --name (before anything is
sent). Runs stored before the rule keep their names. Both databases."""

import json
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.config import Settings
from app.runs.models import Run
from contracts.names import MAX_RUN_NAME_CHARS, run_name_problem
from loraloom.commands.errors import CliError
from orchestrator.client import LoraloomClient
from tests.app.api import LiveServer, TenantHandle, create_run
from tests.app.factories import committed, make_run, make_tenant

# (name, the code point a refusal names, the detail's type)
REFUSED: list[tuple[str, str, str]] = [
    ("evil\u202egpj.exe", "U+202E", "run_name_character"),  # RIGHT-TO-LEFT OVERRIDE
    ("a\u202ab", "U+202A", "run_name_character"),  # LEFT-TO-RIGHT EMBEDDING
    ("a\u2066b\u2069", "U+2066", "run_name_character"),  # LEFT-TO-RIGHT ISOLATE
    ("a\u2069", "U+2069", "run_name_character"),  # POP DIRECTIONAL ISOLATE
    ("a\u200fb", "U+200F", "run_name_character"),  # RIGHT-TO-LEFT MARK
    ("gsm\u200b8k", "U+200B", "run_name_character"),  # ZERO WIDTH SPACE
    ("\ufeffgsm8k", "U+FEFF", "run_name_character"),  # a byte order mark
    ("soft\u00adhyphen", "U+00AD", "run_name_character"),  # SOFT HYPHEN (Cf)
    ("a\u0085b", "U+0085", "run_name_character"),  # NEXT LINE (C1)
    ("a\u009bb", "U+009B", "run_name_character"),  # CONTROL SEQUENCE INTRODUCER (C1)
    ("a\u0080", "U+0080", "run_name_character"),
    ("a\u009f", "U+009F", "run_name_character"),
    ("a\u001b[31mred", "U+001B", "run_name_character"),  # ESC (C0, refused before too)
    ("tab\there", "U+0009", "run_name_character"),
    ("a\u2028b", "U+2028", "run_name_character"),  # LINE SEPARATOR
    ("   ", "", "run_name_whitespace"),
    ("\u3000", "", "run_name_whitespace"),  # IDEOGRAPHIC SPACE alone
    (" gsm8k", "U+0020", "run_name_whitespace"),
    ("gsm8k ", "U+0020", "run_name_whitespace"),
    ("gsm8k\u00a0", "U+00A0", "run_name_whitespace"),  # NO-BREAK SPACE at the end
]
IDS = [f"{code or 'blank'}-{i}" for i, (_, code, _) in enumerate(REFUSED)]

TAKEN = [
    "gsm8k-r8",
    "a b",
    "ablation (rank 8, lr 3e-4)",
    "日本語 の 実験",
    "naïve café",
    "rocket 🚀",
    "x" * 128,
]


def _run_count(settings: Settings) -> int:
    with committed(settings) as session:
        return int(session.scalar(select(func.count()).select_from(Run)) or 0)


def _assert_refused(r: Any, name: str, code: str, kind: str) -> None:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error", error
    (detail,) = error["details"]
    assert detail["loc"] == ["body", "name"] and detail["type"] == kind, detail
    assert code in detail["msg"], detail
    # The offending character is named, never echoed (nor is the name).
    odd = {c for c in name if not (c.isascii() and c.isprintable())}
    assert not odd & set(r.text), r.text
    assert not odd & set(json.loads(r.text)["error"]["details"][0]["msg"])


@pytest.mark.parametrize(("name", "code", "kind"), REFUSED, ids=IDS)
def test_a_hostile_name_is_a_422_naming_the_field_and_the_character_as_json_and_as_toml(
    client: TestClient, tenant: TenantHandle, settings: Settings, name: str, code: str, kind: str
) -> None:
    before = _run_count(settings)
    r = client.post("/v1/runs", json={"name": name, "config": {}}, headers=tenant.headers)
    _assert_refused(r, name, code, kind)
    toml = tomli_w.dumps({"name": name, "config": {"max_steps": 3}}).encode()
    r = client.post("/v1/runs", content=toml, headers=tenant.headers | {"Content-Type": "application/toml"})
    _assert_refused(r, name, code, kind)
    assert _run_count(settings) == before  # nothing stored


@pytest.mark.parametrize("name", TAKEN)
def test_names_in_any_script_with_inner_spaces_and_emoji_are_taken_as_given(
    client: TestClient, tenant: TenantHandle, name: str
) -> None:
    run = create_run(client, tenant, name=name)
    assert run["name"] == name
    assert client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()["name"] == name


def test_the_rule_refuses_every_c1_control_bidi_control_and_listed_format_character() -> None:
    refused = [
        *range(0x80, 0xA0),
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
        0x200B,
        0x2060,
        0xFEFF,
        0x061C,
    ]
    for code in refused:
        problem = run_name_problem(f"a{chr(code)}b")
        assert problem is not None and f"U+{code:04X}" in problem.message, hex(code)
    assert run_name_problem("x" * MAX_RUN_NAME_CHARS) is None
    assert run_name_problem("x" * (MAX_RUN_NAME_CHARS + 1)) is not None
    assert run_name_problem("") is not None


def test_runs_stored_before_the_rule_keep_their_names(client: TestClient, settings: Settings) -> None:
    """The rule checks what comes in: an existing run named against it is listed, read and deleted
    as before, its name as stored."""
    old_name = " legacy\u202eeman "
    with committed(settings) as session:
        tenant, secret = make_tenant(session)
        run = make_run(session, tenant, status="queued", slot=None)
        run.name = old_name
        run_id = run.id
    headers = {"Authorization": f"Bearer {secret}"}
    listed = client.get("/v1/runs", headers=headers).json()["items"]
    assert [(r["id"], r["name"]) for r in listed] == [(run_id, old_name)]
    assert client.get(f"/v1/runs/{run_id}", headers=headers).json()["name"] == old_name
    r = client.delete(f"/v1/runs/{run_id}", headers=headers)
    assert r.status_code == 200 and r.json()["name"] == old_name, r.text


def test_the_sdk_refuses_such_a_name_before_sending_it(
    live_server: LiveServer, tenant: TenantHandle, settings: Settings
) -> None:
    """A ValueError naming the character, as the service's 422 would (no request spent on it)."""
    with LoraloomClient(live_server.url, tenant.key) as sdk:
        with pytest.raises(ValueError, match=r"run name must not contain U\+202E"):
            sdk.create_run("evil\u202egpj.exe")
        with pytest.raises(ValueError, match="run name must not be only whitespace"):
            sdk.create_run("   ")
        assert sdk.create_run("fine name").name == "fine name"
    assert _run_count(settings) == 1


def test_the_cli_refuses_such_a_name_from_the_file_its_stem_or_name(tmp_path: Path) -> None:
    from loraloom.cli import load_run_file

    in_file = tmp_path / "run.toml"
    in_file.write_text(tomli_w.dumps({"name": "gsm8k\u200b", "config": {"max_steps": 2}}))
    with pytest.raises(CliError, match=r"run\.toml: name must not contain U\+200B"):
        load_run_file(in_file, None)
    with pytest.raises(CliError, match=r"--name must not end with whitespace \(U\+0020 SPACE\)"):
        load_run_file(in_file, "gsm8k ")
    assert load_run_file(in_file, "gsm8k")[0]["name"] == "gsm8k"

    stem = tmp_path / "run\u2067x.json"  # a bare config: the file's stem is the name
    stem.write_text('{"max_steps": 3}')
    with pytest.raises(CliError, match=r"the file's stem \(the name\) must not contain U\+2067"):
        load_run_file(stem, None)


def test_the_api_documents_pattern_agrees_with_the_rule_on_every_bmp_character() -> None:
    """Generated clients and schema checkers validate with RUN_NAME_PATTERN: each character of the
    Basic Multilingual Plane, inside a name and at its ends, is refused by both or by neither."""
    import re

    from contracts.names import RUN_NAME_PATTERN

    pattern = re.compile(RUN_NAME_PATTERN)
    disagree = []
    for code in (c for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF):
        for name in (f"a{chr(code)}b", f"{chr(code)}b", f"a{chr(code)}"):
            if (pattern.fullmatch(name) is not None) != (run_name_problem(name) is None):
                disagree.append(f"U+{code:04X} in {ascii(name)}")
    assert not disagree, disagree[:20]


@pytest.mark.parametrize(
    "name", ["\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "\U0001f469\u200d\U0001f4bb eval"]
)
def test_a_joiner_between_two_visible_characters_is_taken(name: str) -> None:
    """Persian (ZERO WIDTH NON-JOINER) and emoji sequences (ZERO WIDTH JOINER) need them."""
    assert run_name_problem(name) is None


@pytest.mark.parametrize("name", ["\u200dab", "ab\u200c", "a \u200db", "a\u200d b", "a\u200d\u200db"])
def test_a_joiner_at_an_end_beside_a_space_or_another_joiner_is_refused(name: str) -> None:
    problem = run_name_problem(name)
    assert problem is not None and problem.type == "run_name_character", name
