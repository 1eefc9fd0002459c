"""The ids the CLI puts into URL paths are checked before any request, and an answer of the wrong
shape is a clear error.

Before: `runs delete ../tenants/ten_...` sent `DELETE /v1/tenants/ten_...` and deleted the tenant
(without the --yes that `tenants delete` asks for), then failed on the 204 with `AttributeError`;
`runs show ../tenants` printed `KeyError: 'progress'` for the tenants list it got."""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from loraloom.cli import cli
from loraloom.commands.answers import HINT
from tests.common import ADMIN_KEY

runner = CliRunner()
NOWHERE = "http://127.0.0.1:9"
"""Nothing listens there: a command that sent its request would fail with "cannot reach" (exit 6)."""
RUN, TENANT, KEY = "run_0123456789ab", "ten_0123456789ab", "key_0123456789ab"
ENV = {"LORALOOM_URL": NOWHERE, "LORALOOM_ADMIN_KEY": ADMIN_KEY, "LORALOOM_API_KEY": "llk_some-key"}

# (arguments, the argument the error names, the words of the error)
BAD_IDS = [
    (["runs", "delete", f"../tenants/{TENANT}"], "run_id", "not a run id: '../tenants/ten_0123456789ab'"),
    (["runs", "show", "../tenants"], "run_id", "not a run id"),
    (["runs", "show", "run_%ff"], "run_id", "not a run id"),
    (["runs", "show", "RUN_0123456789AB"], "run_id", "not a run id"),
    (["runs", "evict", "run_1", "--reason", "x"], "run_id", "not a run id"),
    (["runs", "watch", "run_0123456789ab/.."], "run_id", "not a run id"),
    (["metrics", "run_0123456789ab?x=1"], "run_id", "not a run id"),
    (["adapters", "list", "../../v1/tenants"], "run_id", "not a run id"),
    (["adapters", "download", "run_x"], "run_id", "not a run id"),
    (["adapters", "download", RUN, "--step", "../../../tenants"], "--step", "not a step: '../../../tenants'"),
    (["adapters", "download", RUN, "--step", "-1"], "--step", "not a step"),
    (["adapters", "download", RUN, "--step", "²"], "--step", "not a step"),
    (["tenants", "delete", "../runs", "--yes"], "tenant_id", "not a tenant id: '../runs'"),
    (["tenants", "delete", "ten_0123456789ab/keys"], "tenant_id", "not a tenant id"),  # before the prompt
    (["keys", "list", "ten_%2e%2e"], "tenant_id", "not a tenant id"),
    (["keys", "create", "x"], "tenant_id", "not a tenant id"),
    (["keys", "revoke", "..", KEY], "tenant_id", "not a tenant id"),
    (["keys", "revoke", TENANT, "../../../runs/run_0123456789ab"], "key_id", "not a key id"),
]


@pytest.mark.parametrize(("args", "argument", "words"), BAD_IDS, ids=[" ".join(a) for a, _, _ in BAD_IDS])
def test_a_bad_id_is_a_usage_error_before_any_request(args: list[str], argument: str, words: str) -> None:
    result = runner.invoke(cli, args, env=ENV)
    assert result.exit_code == 2, result.output  # 6 ("cannot reach") had the request been sent
    error, hint = result.stderr.splitlines()
    assert error.startswith(f"error: Invalid value for '{argument}': ") and words in error
    command = args[:1] if args[0] == "metrics" else args[:2]
    assert hint.startswith("hint: try '") and hint.endswith(f" {' '.join(command)} --help'")
    as_json = runner.invoke(cli, [*args, "--json"], env=ENV)
    assert as_json.exit_code == 2 and as_json.stdout == ""
    body = json.loads(as_json.stderr)["error"]
    assert body["code"] == "usage" and words in body["message"]


def test_a_good_id_goes_through() -> None:
    """The check passes the ids the service issues: the request is sent (and finds no service)."""
    for args in (["runs", "show", RUN], ["keys", "revoke", TENANT, KEY], ["adapters", "list", RUN]):
        result = runner.invoke(cli, args, env=ENV)
        assert result.exit_code == 6 and "cannot reach" in result.output, result.output
    result = runner.invoke(cli, ["adapters", "download", RUN, "--step", "12"], env=ENV)
    assert result.exit_code == 6, result.output


def _params(command: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(command path, parameter) of every command under `command` (typer's own copy of click's
    classes: no isinstance on click's)."""
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _params(sub, f"{path} {name}")
    else:
        for param in command.params:
            yield path, param


def test_every_id_a_command_takes_is_checked() -> None:
    """A command added later with a `*_id` argument or a step gets the check too (ids.py)."""
    taken = [(path, p) for path, p in _params(typer.main.get_command(cli), "loraloom") if p.name]
    ids = [(path, p.name) for path, p in taken if p.name.endswith("_id") or p.name == "step"]
    unchecked = [(path, p.name) for path, p in taken if (path, p.name) in ids and p.callback is None]
    assert ("loraloom runs delete", "run_id") in ids and ("loraloom keys revoke", "key_id") in ids
    assert unchecked == []


# --- against the service -----------------------------------------------------------------


def test_runs_delete_cannot_reach_a_tenant(live_server: Any) -> None:
    env = {"LORALOOM_URL": live_server.url, "LORALOOM_ADMIN_KEY": ADMIN_KEY}
    victim = json.loads(runner.invoke(cli, ["tenants", "create", "victim", "--json"], env=env).stdout)
    for args in (["runs", "delete", f"../tenants/{victim['id']}"], ["runs", "show", "../tenants"]):
        result = runner.invoke(cli, [*args, "--key", ADMIN_KEY], env=env)
        assert result.exit_code == 2 and "not a run id" in result.stderr, result.output
    listed = json.loads(runner.invoke(cli, ["tenants", "list", "--json"], env=env).stdout)
    assert [t["id"] for t in listed["items"]] == [victim["id"]]


def test_tenants_delete_and_keys_revoke_print_json(live_server: Any) -> None:
    """The README: `--json` prints the response. These two answer 204, so it says what was done."""
    env = {"LORALOOM_URL": live_server.url, "LORALOOM_ADMIN_KEY": ADMIN_KEY}

    def ok(*args: str) -> Any:
        result = runner.invoke(cli, [*args, "--json"], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    tenant = ok("tenants", "create", "acme")["id"]
    key = ok("keys", "create", tenant)["id"]
    assert ok("keys", "revoke", tenant, key) == {"id": key, "tenant_id": tenant, "revoked": True}
    assert ok("keys", "list", tenant)["items"][0]["revoked_at"] is not None
    assert ok("tenants", "delete", tenant, "--yes") == {"id": tenant, "deleted": True}
    assert ok("tenants", "list")["items"] == []
    gone = runner.invoke(cli, ["tenants", "delete", tenant, "--yes", "--json"], env=env)
    assert gone.exit_code == 3 and json.loads(gone.stderr)["error"]["code"] == "not_found"


# --- answers of the wrong shape ----------------------------------------------------------


class _Answer(BaseHTTPRequestHandler):
    """Whatever the test set in `server.answer`, to every request: (status, content type, body)."""

    def _reply(self) -> None:
        status, content_type, body = self.server.answer  # type: ignore[attr-defined]
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _reply

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def odd_server() -> Iterator[ThreadingHTTPServer]:
    """A real HTTP server that is not the loraloom service (or not of this version)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join()
    server.server_close()


JSON = "application/json"
ODD_ANSWERS = [
    (["runs", "show", RUN], (200, JSON, b'{"items": []}'), f"GET /v1/runs/{RUN}: no 'progress' field"),
    (["runs", "delete", RUN], (204, None, b""), f"DELETE /v1/runs/{RUN}: no content (HTTP 204)"),
    (["runs", "list"], (200, "text/html", b"<html>hello</html>"), "GET /v1/runs: not JSON (text/html)"),
    (["tenants", "list"], (200, JSON, b"[1, 2]"), "GET /v1/tenants: JSON, but not an object"),
    (["runs", "watch", RUN], (200, JSON, b'{"id": "x"}'), f"GET /v1/runs/{RUN}: no 'config' field"),
    (
        ["metrics", RUN],
        (200, JSON, b'{"next_since_step": null}'),
        f"GET /v1/runs/{RUN}/metrics: no 'items' field",
    ),
    (["pools", "list"], (200, JSON, b'{"pools": []}'), "GET /v1/admin/pools: no 'items' field"),
]


@pytest.mark.parametrize(
    ("args", "answer", "words"), ODD_ANSWERS, ids=[" ".join(a[:2]) for a, _, _ in ODD_ANSWERS]
)
def test_an_answer_of_another_shape_is_a_clear_error(
    odd_server: ThreadingHTTPServer, args: list[str], answer: tuple[int, str | None, bytes], words: str
) -> None:
    odd_server.answer = answer  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{odd_server.server_address[1]}"
    result = runner.invoke(cli, args, env={**ENV, "LORALOOM_URL": url})
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [f"error: unexpected answer to {words}", f"hint: {HINT}"]
