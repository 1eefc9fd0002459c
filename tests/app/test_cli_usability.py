"""The CLI as a user meets it: click's usage errors in the CLI's own one-line form (the installed
`loraloom` command, from another directory), a --url that names the Tinker surface, and a
`metrics` table whose rows put each trainer step beside the batches it trained (a live service, the
pool's side driven through its routes as the worker pool drives them)."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from loraloom.cli import cli
from orchestrator import LoraloomClient
from orchestrator.errors import Unauthorized
from tests.app.api import WORKER_HEADERS, ack, claim, create_run, new_tenant, register, rewarded_batch

runner = CliRunner()
LORALOOM = Path(sys.executable).parent / "loraloom"
"""The console script `make install` put beside this interpreter."""


def loraloom(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    if not LORALOOM.exists():
        pytest.skip(f"no installed loraloom command at {LORALOOM} (make install)")
    env = {"PATH": "/usr/bin:/bin", "LORALOOM_URL": "http://127.0.0.1:9"}  # no service: none is needed
    return subprocess.run(
        [str(LORALOOM), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


# (arguments, the error's message, the command whose --help the hint names)
USAGE_ERRORS = [
    (["runs", "create", "--foo"], "No such option: --foo", "loraloom runs create"),
    (["runs", "show"], "Missing argument 'run_id'.", "loraloom runs show"),
    (["runs", "list", "--limit", "many"], "'many' is not a valid int", "loraloom runs list"),
    (["runs", "list", "--status"], "Option '--status' requires an argument.", "loraloom runs list"),
    (["serve", "--port", "70000"], "70000 is not in the range", "loraloom serve"),
    (["--frobnicate"], "No such option: --frobnicate", "loraloom"),
    (["runz", "list"], "No such command 'runz'.", "loraloom"),
]


@pytest.mark.parametrize(
    ("args", "message", "command"), USAGE_ERRORS, ids=[" ".join(a) for a, _, _ in USAGE_ERRORS]
)
def test_usage_errors_are_one_line_with_a_hint(
    tmp_path: Path, args: list[str], message: str, command: str
) -> None:
    """Typer printed these as a boxed panel under the usage line; the README promises `error: ...` /
    `hint: ...` and exit code 2 for every usage error."""
    result = loraloom(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    error, hint = result.stderr.splitlines()
    assert error.startswith("error: ") and message in error
    assert hint == f"hint: try '{command} --help'"


def test_usage_errors_are_json_with_json(tmp_path: Path) -> None:
    result = loraloom("runs", "show", "--json", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    error = json.loads(result.stderr)["error"]
    assert error["exit_code"] == 2 and error["code"] == "usage"
    assert "Missing argument" in error["message"] and error["hint"] == "try 'loraloom runs show --help'"


def test_help_is_unchanged(tmp_path: Path) -> None:
    """--help, and a group without its command, still print the help (exit codes 0 and 2 as before)."""
    shown = loraloom("runs", "create", "--help", cwd=tmp_path)
    assert (
        shown.returncode == 0
        and "Usage: loraloom runs create" in shown.stdout
        and "--idempotency-key" in shown.stdout
    )
    bare = loraloom("runs", cwd=tmp_path)
    assert bare.returncode == 2 and "Usage: loraloom runs" in bare.stdout + bare.stderr
    assert "error:" not in bare.stderr


# --- a --url that names the Tinker surface -----------------------------------------------


@pytest.fixture
def tenant_env(live_server: Any) -> Iterator[dict[str, str]]:
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        tenant = new_tenant(http)
    yield {"LORALOOM_URL": live_server.url, "LORALOOM_API_KEY": tenant.key}


def test_a_url_ending_with_api_v1_is_refused_up_front(tenant_env: dict[str, str]) -> None:
    """/api/v1/... is the Tinker SDK's surface: it wants X-API-Key, so every command got a 401 that
    blamed the key (exit 5); it was refused as a /v1 URL, suggesting .../api instead."""
    url = tenant_env["LORALOOM_URL"]
    result = runner.invoke(cli, ["runs", "list", "--url", url + "/api/v1"], env=tenant_env)
    assert result.exit_code == 2, result.output
    assert "the Tinker SDK's API" in result.stderr and f"e.g. '{url}'" in result.stderr
    assert "401" not in result.stderr


@pytest.mark.parametrize("suffix", ["/api", "/api/"])
def test_a_401_at_a_url_ending_with_api_names_the_tinker_surface(
    tenant_env: dict[str, str], suffix: str
) -> None:
    """A URL ending in /api is not refused (a reverse proxy may serve the service there), but its 401
    says where the request went instead of "check --key", in the CLI and in the SDK."""
    url = tenant_env["LORALOOM_URL"]
    result = runner.invoke(cli, ["runs", "list", "--url", url + suffix], env=tenant_env)
    assert result.exit_code == 5, result.output
    error, hint = result.stderr.splitlines()
    assert error.startswith("error: HTTP 401")
    assert "where the Tinker SDK's API lives" in hint and f"e.g. '{url}'" in hint
    client = LoraloomClient(url + suffix, tenant_env["LORALOOM_API_KEY"])
    with client, pytest.raises(Unauthorized, match="where the Tinker SDK's API lives") as info:
        client.list_runs()
    assert f"e.g. '{url}'" in str(info.value)


# --- metrics: each trainer step beside the batches it trained ------------------------------


class PoolSide:
    """What the worker pool sends for one run: claims, step reports, acknowledgements."""

    def __init__(self, http: httpx.Client, run_id: str) -> None:
        self.http = http
        self.run_id = run_id
        self.pool_id = register(http)

    def train_step(self, step: int, *, step_time_s: float) -> None:
        """Claim what is pending, report `step` done and acknowledge the claimed batches in it."""
        claimed = [b["id"] for b in claim(self.http, self.pool_id)["batches"]]
        metrics = {"loss": 1.0 / step, "grad_norm": 0.5, "lr": 1e-3, "tokens": 10, "samples": 2}
        body = {"step": step, "total_tokens": 10 * step, "total_samples": 2 * step}
        r = self.http.post(
            f"/v1/pool/runs/{self.run_id}/steps",
            json=body | {"metrics": metrics | {"step_time_s": step_time_s}},
            headers=WORKER_HEADERS,
        )
        assert r.status_code == 200, r.text
        assert ack(self.http, self.pool_id, [(b, step) for b in claimed]).status_code == 200


@pytest.fixture
def rl_run(live_server: Any) -> Iterator[tuple[dict[str, str], httpx.Client, str]]:
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        tenant = new_tenant(http)
        run = create_run(http, tenant, name="rl", batch_size=2, max_steps=10, lora={"rank": 4})
        env = {"LORALOOM_URL": live_server.url, "LORALOOM_API_KEY": tenant.key}
        yield env, http, run["id"]


def submit(http: httpx.Client, env: dict[str, str], run_id: str, rewards: list[float], *, step: int) -> None:
    r = http.post(
        f"/v1/runs/{run_id}/batches",
        json=rewarded_batch(list(rewards), step=step),
        headers={"Authorization": f"Bearer {env['LORALOOM_API_KEY']}"},
    )
    assert r.status_code == 201, r.text


def metrics_table(env: dict[str, str], run_id: str) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """The table's header, its rows by STEP (`-` for rollouts not trained yet) and the notes below it."""
    result = runner.invoke(cli, ["metrics", run_id], env=env)
    assert result.exit_code == 0, result.output
    header, *lines = result.stdout.splitlines()
    rows = [line for line in lines if line[:1].isdigit() or line.startswith("- ")]
    notes = [line for line in lines if line not in rows]
    columns = header.split()
    return columns, {line.split()[0]: line.split() for line in rows}, notes


def test_metrics_put_each_step_beside_the_reward_of_the_batch_it_trained(rl_run: Any) -> None:
    """The orchestrator samples rollout step s with adapter s; trainer step s + 1 trains it. The table
    showed rollout step N's reward beside trainer step N, whose loss came from rollout step N - 1.
    The service's items say which rollout steps each step trained; the table and --json show them."""
    env, http, run_id = rl_run
    pool = PoolSide(http, run_id)
    submit(http, env, run_id, [0.25, 0.75], step=0)
    pool.train_step(1, step_time_s=1.5)
    submit(http, env, run_id, [1.0, 1.0], step=1)
    pool.train_step(2, step_time_s=0.5)
    submit(http, env, run_id, [0.0, 0.0], step=2)  # sampled with adapter 2, not trained yet

    columns, rows, notes = metrics_table(env, run_id)
    assert columns[:4] == ["STEP", "ROLLOUT", "REWARD", "LOSS"] and columns[-1] == "STEP_TIME_S"
    assert rows["1"][:4] == ["1", "0", "0.5", "1"]
    assert rows["2"][:4] == ["2", "1", "1", "0.5"]
    assert rows["-"][:3] == ["-", "2", "0"]
    # The pool times a step from its first pack now (trainer_core/slots.py): no step's time is marked.
    assert rows["1"][-1] == "1.5" and rows["2"][-1] == "0.5"
    assert any("ROLLOUT" in n for n in notes) and not any(n.startswith("*") for n in notes)

    result = runner.invoke(cli, ["metrics", run_id, "--json"], env=env)
    assert result.exit_code == 0, result.output
    items = {i["step"]: i for i in json.loads(result.stdout)["items"]}
    assert [
        (i["trained_rollout_steps"], (i["trained_reward"] or {}).get("mean")) for i in items.values()
    ] == [
        (None, None),  # rollout step 0: no trainer step 0
        ([0], 0.5),
        ([1], 1.0),
    ]
    assert [items[s]["reward"]["mean"] for s in (0, 1, 2)] == [0.5, 1.0, 0.0]  # keyed by rollout step


def test_metrics_follow_the_pool_when_batches_trail_their_adapter(rl_run: Any) -> None:
    """An orchestrator running ahead (max_async_level 2) samples its second batch with adapter 0 too:
    trainer step 2 trained rollout step 0, not 1. The offset comes from the pool's acknowledgements."""
    env, http, run_id = rl_run
    pool = PoolSide(http, run_id)
    submit(http, env, run_id, [0.0, 1.0], step=0)
    pool.train_step(1, step_time_s=3.0)
    submit(http, env, run_id, [0.0, 1.0], step=0)
    pool.train_step(2, step_time_s=0.5)

    _, rows, _ = metrics_table(env, run_id)
    assert rows["1"][:3] == ["1", "0", "0.5"] and rows["2"][:3] == ["2", "0", "0.5"]
    assert "-" not in rows  # nothing left untrained


def test_metrics_without_rewards_are_the_trainer_table(rl_run: Any) -> None:
    """No rewards sent (e.g. SFT): no ROLLOUT or REWARD column, no note about them."""
    env, http, run_id = rl_run
    pool = PoolSide(http, run_id)
    r = http.post(
        f"/v1/runs/{run_id}/batches",
        json=rewarded_batch([None, None], step=0),
        headers={"Authorization": f"Bearer {env['LORALOOM_API_KEY']}"},
    )
    assert r.status_code == 201, r.text
    pool.train_step(1, step_time_s=2.0)
    columns, rows, notes = metrics_table(env, run_id)
    assert columns[:2] == ["STEP", "LOSS"] and "REWARD" not in columns and "ROLLOUT" not in columns
    assert rows["1"][-1] == "2" and not any("ROLLOUT" in n for n in notes)


def test_metrics_and_watch_read_past_the_first_page(live_server: Any) -> None:
    """The service pages metrics by step (200 at most): the table stopped at step 200, and `runs watch`
    showed step 200's loss for every later step."""
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        tenant = new_tenant(http)
        run_id = create_run(http, tenant, name="long", max_steps=205, lora={"rank": 4})["id"]
        for step in range(1, 206):
            body = {
                "step": step,
                "total_tokens": step,
                "total_samples": step,
                "metrics": {"loss": 1.0 / step},
            }
            r = http.post(f"/v1/pool/runs/{run_id}/steps", json=body, headers=WORKER_HEADERS)
            assert r.status_code == 200, r.text
    env = {"LORALOOM_URL": live_server.url, "LORALOOM_API_KEY": tenant.key}

    items = json.loads(runner.invoke(cli, ["metrics", run_id, "--json"], env=env).stdout)["items"]
    assert [i["step"] for i in items] == list(range(1, 206))
    _, rows, _ = metrics_table(env, run_id)
    assert rows["205"][:2] == ["205", f"{1 / 205:.4g}"]
    watched = runner.invoke(cli, ["runs", "watch", run_id, "--json"], env=env)
    assert watched.exit_code == 0, watched.output  # completed at step 205
    assert json.loads(watched.stdout.splitlines()[0])["metrics"]["loss"] == f"{1 / 205:.4g}"


def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    """`loraloom runs watch ... | head -1`: once the reader has gone, writing raises BrokenPipeError,
    which the CLI reported as `error: BrokenPipeError: ...`. It now ends as click ends `--help` piped
    the same way: exit 1, nothing on stderr."""
    if not LORALOOM.exists():
        pytest.skip(f"no installed loraloom command at {LORALOOM} (make install)")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before the command wrote: its first write fails
    try:
        result = subprocess.run(
            [str(LORALOOM), "worker", "--dry-run"],
            cwd=tmp_path,
            env={"PATH": "/usr/bin:/bin"},
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert result.stderr == ""


def _nested_metadata(levels: int = 5, width: int = 150, key_length: int = 80) -> dict[str, Any]:
    """Within the metadata bounds (~3.8 KB as JSON, 900 values), but ~66 KB re-written as TOML: each
    leaf table's header repeats the whole dotted path of long keys."""
    tree: dict[str, Any] = {f"leaf{i:03d}": {"v": i} for i in range(width)}
    for level in range(levels):
        tree = {f"k{level}" * (key_length // 2): tree}
    return tree


def test_runs_create_sends_json_whatever_the_files_format(tenant_env: dict[str, str], tmp_path: Path) -> None:
    """The CLI re-wrote a TOML file as TOML, whose repeated dotted headers took a config within the
    metadata bounds past the 64 KiB TOML body bound (a 413; review); and a YAML date could not be
    sent as JSON at all (a TypeError). Both go as JSON now, dates as the service writes them."""
    import tomli_w

    metadata = _nested_metadata()
    nested = tmp_path / "nested.toml"
    nested.write_text(tomli_w.dumps({"name": "nested", "config": {"metadata": metadata}}))
    assert nested.stat().st_size > 64 * 1024
    dated = tmp_path / "dated.yaml"
    dated.write_text("name: dated\nconfig:\n  metadata:\n    day: 2026-11-27\n    at: 2026-11-27T10:00:00Z\n")
    with httpx.Client(
        base_url=tenant_env["LORALOOM_URL"],
        headers={"Authorization": f"Bearer {tenant_env['LORALOOM_API_KEY']}"},
        timeout=30,
    ) as http:
        for path, expected in (
            (nested, metadata),
            (dated, {"day": "2026-11-27", "at": "2026-11-27T10:00:00Z"}),
        ):
            result = runner.invoke(cli, ["runs", "create", str(path), "--json"], env=tenant_env)
            assert result.exit_code == 0, result.output
            run_id = json.loads(result.stdout)["id"]
            assert http.get(f"/v1/runs/{run_id}").json()["config"]["metadata"] == expected
