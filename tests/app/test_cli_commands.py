"""The CLI commands that cover the rest of the API, against a live service (uvicorn in a thread): a
run's adapters and metrics, following a run to its end, pools, key listings, tenant deletion, YAML
configs; and the exit codes by kind of failure, table-driven, with --json errors on stderr.

What the trainer would push (step reports, adapters, a pool registration) goes through the pool
routes with the worker token, as the worker pool sends it."""

import io
import json
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from typer.testing import CliRunner

from contracts.wire import TrainingBatch, TrainingSample
from loraloom.cli import cli
from loraloom.commands import observe
from loraloom.commands.worker import check_token
from orchestrator.client import LoraloomClient
from tests.app.api import POOL_SPEC, WORKER_HEADERS
from tests.common import ADMIN_KEY, WORKER_TOKEN
from trainer_core.models.tiny import build_model

runner = CliRunner()


class Service:
    """The live service, a tenant with a key, and the pool's side of the API."""

    def __init__(self, url: str, tmp_path: Path) -> None:
        self.url = url
        self.tmp_path = tmp_path
        self.env = {"LORALOOM_URL": url, "LORALOOM_ADMIN_KEY": ADMIN_KEY, "LORALOOM_API_KEY": ""}
        self.pool = httpx.Client(base_url=url, headers=WORKER_HEADERS, timeout=30)
        self.tenant = self.ok("tenants", "create", "acme", "--quota", "4", "--json", json_out=True)
        self.key = self.ok("keys", "create", self.tenant["id"], "--json", json_out=True)["key"]
        self.env["LORALOOM_API_KEY"] = self.key

    def ok(self, *args: str, json_out: bool = False, env: dict[str, str] | None = None) -> Any:
        result = runner.invoke(cli, list(args), env=env or self.env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout) if json_out else result.stdout

    def create_run(self, name: str, max_steps: int = 2) -> str:
        config = self.tmp_path / f"{name}.yaml"
        config.write_text(f"max_steps: {max_steps}\nlora:\n  rank: 4\n")  # YAML, beside TOML and JSON
        run = self.ok("runs", "create", str(config), "--json", json_out=True)
        assert isinstance(run, dict) and run["name"] == name and run["config"]["max_steps"] == max_steps
        return str(run["id"])

    def report_step(self, run_id: str, step: int) -> None:
        body = {
            "step": step,
            "total_tokens": 10 * step,
            "total_samples": 4 * step,
            "metrics": {"loss": 1.0 / step, "grad_norm": 0.5, "lr": 1e-3, "tokens": 10, "samples": 4},
        }
        r = self.pool.post(f"/v1/pool/runs/{run_id}/steps", json=body)
        assert r.status_code == 200, r.text


@pytest.fixture
def svc(live_server, tmp_path: Path) -> Iterator[Service]:
    s = Service(live_server.url, tmp_path)
    yield s
    s.pool.close()


def _peft_tar(tmp_path: Path) -> bytes:
    model = build_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, max_position_embeddings=64
    )
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    out = tmp_path / "peft"
    peft.save_pretrained(str(out))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(out / name, arcname=name)
    return buf.getvalue()


def test_adapters_list_and_download(svc: Service, tmp_path: Path) -> None:
    run_id = svc.create_run("math", max_steps=5)
    r = svc.pool.put(
        f"/v1/pool/runs/{run_id}/adapters/1",
        content=_peft_tar(tmp_path),
        headers={"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 201, r.text
    listing = svc.ok("adapters", "list", run_id)
    assert "STEP" in listing and "\n1 " in listing and "more:" not in listing
    dest = tmp_path / "got"
    out = svc.ok("adapters", "download", run_id, "--output", str(dest), "--json", json_out=True)
    assert isinstance(out, dict) and out["step"] == 1
    assert sorted(p.name for p in dest.iterdir()) == [
        ".loraloom-adapter.json",  # the SDK's marker: its sha256 and step
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert out["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    # A directory of other files is not replaced by the adapter (nor merged into): exit 2, intact.
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    refused = runner.invoke(cli, ["adapters", "download", run_id, "--output", str(project)], env=svc.env)
    assert refused.exit_code == 2, refused.output
    assert "notes.txt" in refused.output and "new or empty directory" in refused.output
    assert sorted(p.name for p in project.iterdir()) == ["notes.txt"]


def test_adapters_list_pages_and_says_how_to_go_on(svc: Service, tmp_path: Path) -> None:
    run_id = svc.create_run("paged", max_steps=5)
    tar = _peft_tar(tmp_path)
    for step in (1, 2, 3):
        r = svc.pool.put(
            f"/v1/pool/runs/{run_id}/adapters/{step}",
            content=tar,
            headers={"Content-Type": "application/x-tar"},
        )
        assert r.status_code == 201, r.text
    first = str(svc.ok("adapters", "list", run_id, "--limit", "2", "--newest-first"))
    assert [line.split()[0] for line in first.splitlines()[1:3]] == ["3", "2"]
    more = first.splitlines()[-1].split()
    assert more[:2] == ["more:", "--cursor"] and more[3:] == ["--limit", "2", "--newest-first"]
    rest = str(svc.ok("adapters", "list", run_id, "--cursor", more[2], *more[3:]))
    assert [line.split()[0] for line in rest.splitlines()[1:]] == ["1"]
    bad = runner.invoke(cli, ["adapters", "list", run_id, "--limit", "0"], env=svc.env)
    assert bad.exit_code != 0 and "limit" in bad.output


def test_metrics_table_json_and_plot(svc: Service, tmp_path: Path) -> None:
    run_id = svc.create_run("curve", max_steps=10)
    assert str(svc.ok("metrics", run_id)).strip() == f"{run_id}: no step reported yet"  # not a bare header
    for step in (1, 2, 3):
        svc.report_step(run_id, step)
    table = str(svc.ok("metrics", run_id))
    assert table.splitlines()[0].split()[:3] == ["STEP", "LOSS", "GRAD_NORM"]
    assert len(table.splitlines()) == 4
    items = svc.ok("metrics", run_id, "--json", json_out=True)
    assert isinstance(items, dict) and [i["step"] for i in items["items"]] == [1, 2, 3]
    png = tmp_path / "plot" / "loss.png"
    svc.ok("metrics", run_id, "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metrics_show_and_plot_the_mean_reward(svc: Service, tmp_path: Path) -> None:
    """The service reports a step's rewards as an aggregate (a dict): a column of its mean, and a
    curve (the plot crashed on the dict)."""
    run_id = svc.create_run("rewarded", max_steps=10)
    sample: dict[str, Any] = {"prompt_ids": [1, 2], "prompt_mask": [False, False], "completion_ids": [3, 4]}
    sample |= {"completion_mask": [True, True], "completion_logprobs": [-0.5, -0.5], "advantage": 0.0}
    batch = TrainingBatch(examples=[TrainingSample(**sample, reward=r) for r in (0.25, 0.75)], step=0)
    with LoraloomClient(svc.url, svc.key) as client:
        client.submit_batch(run_id, batch)
    svc.report_step(run_id, 1)
    header, *rows = str(svc.ok("metrics", run_id)).splitlines()
    assert header.split()[:4] == ["STEP", "ROLLOUT", "REWARD", "LOSS"]
    assert ["-", "0", "0.5"] in [r.split()[:3] for r in rows]  # no pool acknowledged it as trained
    png = tmp_path / "rewards.png"
    svc.ok("metrics", run_id, "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class StepsSeen:
    """The steps the watch read in its polls of the run (`loraloom.commands.observe.api` wrapped), so
    that the trainer reports a step once the watch has seen what it is to see, by condition."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, run_id: str) -> None:
        self.steps: list[int] = []
        self.changed = threading.Condition()
        real = observe.api

        def watched(method: str, path: str, **kwargs: Any) -> Any:
            answer = real(method, path, **kwargs)
            if (method, path) == ("GET", f"/v1/runs/{run_id}"):
                with self.changed:
                    self.steps.append(answer["progress"]["step"])
                    self.changed.notify_all()
            return answer

        monkeypatch.setattr(observe, "api", watched)

    def wait(self, step: int, times: int = 1) -> None:
        """Until the watch has read `step` `times` times (or it never will: the assertions say why)."""
        with self.changed:
            self.changed.wait_for(lambda: self.steps.count(step) >= times, timeout=30)


def test_runs_watch_follows_a_run_to_its_end(svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = svc.create_run("watched", max_steps=2)
    seen = StepsSeen(monkeypatch, run_id)

    def trainer() -> None:  # the pool reports each step once the watch has seen the one before
        seen.wait(0, times=2)  # two polls of step 0: one line for both
        svc.report_step(run_id, 1)
        seen.wait(1)
        svc.report_step(run_id, 2)

    thread = threading.Thread(target=trainer)
    thread.start()
    result = runner.invoke(cli, ["runs", "watch", run_id, "--interval", "0.05"], env=svc.env)
    thread.join()
    assert result.exit_code == 0, result.output
    assert f"{run_id} completed" in result.output
    # Not a terminal: a line per change of step or status, not a bar frame per poll (the watch
    # polled step 0 at least twice before the trainer reported step 1).
    assert seen.steps.count(0) >= 2 and seen.steps.count(1) >= 1, seen.steps
    lines = result.output.splitlines()
    assert lines.count("watched: step 0/2 active") == 1, result.output
    assert [line for line in lines if line.startswith("watched: step 1/2 ")] == [
        "watched: step 1/2 active loss=1 grad_norm=0.5"
    ], result.output
    assert "watched: step 2/2 completed loss=0.5 grad_norm=0.5" in lines, result.output

    # A run that ends any other way: exit code 8, with the reason.
    evicted = svc.create_run("evicted", max_steps=2)
    svc.ok("runs", "evict", evicted, "--reason", "plateau")
    result = runner.invoke(cli, ["runs", "watch", evicted], env=svc.env)
    assert result.exit_code == 8 and "evicted: plateau" in result.output


def test_pools_keys_and_tenant_deletion(svc: Service) -> None:
    r = svc.pool.post("/v1/pool/register", json=POOL_SPEC)
    assert r.status_code == 201, r.text
    pools = str(svc.ok("pools", "list"))
    assert r.json()["pool_id"] in pools and POOL_SPEC["base_model"] in pools and "alive" in pools

    tenant_id = svc.tenant["id"]
    second = svc.ok("keys", "create", tenant_id, "--json", json_out=True)
    svc.ok("keys", "revoke", tenant_id, second["id"])
    keys = svc.ok("keys", "list", tenant_id, "--json", json_out=True)["items"]
    assert [k["revoked_at"] is None for k in keys] == [True, False]
    assert all("key" not in k for k in keys)  # never the secrets
    assert svc.key[:12] in str(svc.ok("keys", "list", tenant_id))

    run_id = svc.create_run("doomed")
    svc.ok("tenants", "delete", tenant_id, "--yes")
    assert "acme" not in str(svc.ok("tenants", "list"))
    gone = runner.invoke(cli, ["runs", "show", run_id], env=svc.env)
    assert gone.exit_code == 5  # its keys went with it


# (arguments, exit code, words of the message); {run} is a completed run, {tenant} the tenant's id.
EXIT_CODES = [
    (["runs", "show"], 2, "Missing argument"),
    (["runs", "create", "{bad_config}"], 2, "greater than or equal to 1"),
    (["runs", "create", "{broken_yaml}"], 2, "not valid YAML"),
    (["runs", "create", "{not_utf8}"], 2, "not UTF-8"),
    (["metrics", "{run}", "--plot", "out.txt"], 2, "not an image file name"),
    (["tenants", "delete", "ten_000000000000"], 2, "pass --yes"),  # no terminal to ask on
    (["runs", "show", "run_000000000000"], 3, "not_found"),
    (["keys", "list", "ten_000000000000"], 3, "not_found"),
    (["adapters", "download", "{run}", "--step", "7"], 3, "not_found"),
    (["runs", "evict", "{run}", "--reason", "late"], 4, "only queued or active runs"),
    (["tenants", "create", "acme"], 4, "already exists"),
    (["runs", "list", "--key", "llk_wrong"], 5, "unauthorized"),
    (["pools", "list", "--key", "wrong"], 5, "unauthorized"),
    (["runs", "list", "--url", "http://127.0.0.1:9"], 6, "cannot reach"),
    (["runs", "list", "--url", "127.0.0.1:9"], 2, "not an http:// or https:// URL"),  # no scheme: usage
    # Copied from the routes: every command got a 404 (exit 3), as if the run did not exist.
    (["runs", "list", "--url", "{url}/v1"], 2, "give the base URL without /v1, e.g. '{url}'"),
    (["tenants", "list", "--url", "{url}/v1/"], 2, "give the base URL without /v1, e.g. '{url}'"),
    # The worker: a wrong token is refused before any rank starts (no model is loaded), and a
    # mistyped local model path is a missing directory, not an invalid hub id.
    (["worker", "--token", "wrong"], 5, "refused the worker token (HTTP 401: invalid worker token)"),
    (["worker", "--runs-dir", "runs", "--base-model", "./no/such-model"], 3, "does not exist"),
    (["worker", "--token", "x", "--url", "http://127.0.0.1:9"], 6, "cannot reach"),
    # A URL with a path is no service (the ranks used to die on a 404 after loading the model): /v1 is
    # named as the API commands name it; a token file given as a flag wins over LORALOOM_WORKER_TOKEN,
    # and one that cannot be read is named.
    (["worker", "--token", "x", "--url", "{url}/v1"], 2, "give the base URL without /v1"),
    (["worker", "--token", "x", "--url", "{url}/proxy"], 2, "no loraloom service"),
    # /api/v1 is the Tinker SDK's surface: refused up front, by the API commands too; a 401 at /api
    # (which a proxy may serve the service at) names it rather than blaming the key.
    (["worker", "--token", "x", "--url", "{url}/api/v1"], 2, "the Tinker SDK's API"),
    (["runs", "list", "--url", "{url}/api/v1"], 2, "the Tinker SDK's API"),
    (["runs", "list", "--url", "{url}/api"], 5, "where the Tinker SDK's API lives"),
    (["worker", "--token-file", "/no/such/token"], 2, "/no/such/token"),
    (["worker", "--token-file", "{empty_file}"], 2, "is empty"),
]


@pytest.mark.parametrize(
    ("args", "code", "words"), EXIT_CODES, ids=[" ".join(a[:2]) + f"-{c}" for a, c, _ in EXIT_CODES]
)
def test_exit_codes_by_kind(svc: Service, args: list[str], code: int, words: str) -> None:
    completed = svc.create_run("done", max_steps=1)
    svc.report_step(completed, 1)
    bad = svc.tmp_path / "bad.yaml"
    bad.write_text("lora:\n  rank: 0\n")
    broken = svc.tmp_path / "broken.yaml"
    broken.write_text("lora: [rank\n")
    not_utf8 = svc.tmp_path / "latin1.toml"
    not_utf8.write_bytes(b"name = '\xe9t\xe9'\n")
    empty = svc.tmp_path / "empty-token"
    empty.write_text("\n")
    values = {
        "run": completed,
        "bad_config": str(bad),
        "broken_yaml": str(broken),
        "url": svc.url,
        "empty_file": str(empty),
        "not_utf8": str(not_utf8),
    }
    argv = [a.format(**values) for a in args]
    words = words.format(**values)
    # A token in the environment: a --token-file flag must win over it.
    result = runner.invoke(cli, argv, env={**svc.env, "LORALOOM_WORKER_TOKEN": "from-env"})
    assert result.exit_code == code, result.output
    assert words in result.output
    assert "Traceback" not in result.output
    if args[0] == "worker":
        return  # the worker has no --json
    # One line and a hint at most; with --json the error is JSON on stderr, stdout stays empty.
    assert len(result.stderr.strip().splitlines()) <= 3 or "body.config" in result.stderr
    as_json = runner.invoke(cli, [*argv, "--json"], env=svc.env)
    assert as_json.exit_code == code and as_json.stdout == ""
    error = json.loads(as_json.stderr)["error"]
    assert error["exit_code"] == code and words in json.dumps(error)


def test_the_token_check_passes_the_services_own_token(svc: Service) -> None:
    """The check's pool route answers 404 for its made-up pool: that is the token accepted (a check
    that took every 404 for a wrong URL stopped every worker before it started)."""
    check_token(svc.url, WORKER_TOKEN)
    check_token(svc.url + "/", WORKER_TOKEN)


def test_debug_shows_the_traceback(svc: Service) -> None:
    result = runner.invoke(cli, ["--debug", "runs", "show", "run_000000000000"], env=svc.env)
    assert result.exit_code != 0 and result.exception is not None  # raised, not reported


def test_watching_a_deleted_run_that_trained_ends_as_deleted(svc: Service) -> None:
    """A deleted run's metrics are a 404: the watch asked for them before it looked at the status,
    and failed with that 404 (exit 3) instead of ending as deleted (8)."""
    run_id = svc.create_run("gone", max_steps=5)
    svc.report_step(run_id, 1)
    assert runner.invoke(cli, ["runs", "delete", run_id], env=svc.env).exit_code == 0
    result = runner.invoke(cli, ["runs", "watch", run_id], env=svc.env)
    assert result.exit_code == 8, result.output
    assert f"{run_id} deleted" in result.output
    # Deleted between the watch's read of the run and its read of the metrics: no figures, no error.
    from loraloom.commands.observe import _latest_metrics

    assert _latest_metrics(run_id, 1, url=svc.url, key=svc.key) == {}
