"""`loraloom demo`: the whole system on one machine, on the embedded default.

SQLite under ./.loraloom/demo, the service as a subprocess, a one-rank CPU worker pool,
the built-in `loraloom-tiny` base model. Two tenants, four runs:

- alice / `arith-grpo`: one agent learning single-digit sums (GRPO);
- alice / `arith-rloo`: the same env with RLOO advantages;
- bob / `duo-solver` and bob / `duo-checker`: a two-agent system in `lora` mode: one
  LoRA per agent on the shared base, each agent's samples trained only into its own run,
  all four runs in the same trainer passes.

Prints progress per run, a before/after reward table, writes a reward-curve PNG and the
final adapters to the output directory.
"""

import asyncio
import copy
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import typer
from tqdm import tqdm

from orchestrator.client import AsyncLoraloomClient, LoraloomClient
from orchestrator.engine import AgentPolicy, EngineConfig, MultiAgentEngine
from orchestrator.loop import LoopConfig, RolloutLoop, StepReport
from orchestrator.tokenizer import CharTokenizer

ROOT = Path(".loraloom/demo")
MODEL_CACHE = Path(".loraloom/models")


@dataclass
class DemoSystem:
    """One orchestrator: a tenant's engine over one or more runs."""

    tenant: str
    label: str
    engine_config: EngineConfig
    runs: dict[str, str] = field(default_factory=dict)
    """agent → run name"""


def _run_config(*, max_steps: int, batch_size: int, seed: int) -> dict:
    return {
        "base_model": "loraloom-tiny",
        "lora": {"rank": 8, "alpha": 16.0},
        "optim": {"lr": 3e-3, "max_grad_norm": 1.0},
        "scheduler": {"kind": "constant"},
        "batch_size": batch_size,
        "max_steps": max_steps,
        "seq_len": 64,
        "max_async_level": 1,
        "ckpt": {"interval": 10, "keep_last": 1},
        "seed": seed,
    }


def _systems(problems: int, group: int) -> list[DemoSystem]:
    common = {"problems_per_step": problems, "samples_per_problem": group, "val_problems": 0}
    return [
        DemoSystem("alice", "arith-grpo", EngineConfig(env="arithmetic", **common), {"solver": "arith-grpo"}),
        DemoSystem(
            "alice",
            "arith-rloo",
            EngineConfig(env="arithmetic", advantage="rloo", seed=1, **common),
            {"solver": "arith-rloo"},
        ),
        DemoSystem(
            "bob",
            "duo",
            EngineConfig(env="solver_checker", specialization="lora", seed=2, **common),
            {"solver": "duo-solver", "checker": "duo-checker"},
        ),
    ]


def _wait_ready(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the service exited with {process.returncode}; see {ROOT / 'service.log'}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the service did not become ready")


def run_demo(*, steps: int, output_dir: Path, problems: int = 8, group: int = 8, port: int = 8765) -> dict:
    """Run the demo; returns {run: {agent: (reward before, reward after)}}."""
    from app.migrate import upgrade
    from trainer_core.launch import launch_pool
    from trainer_core.models.registry import load_base_model

    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    admin_key, worker_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    db_url = f"sqlite:///{ROOT / 'loraloom.db'}"
    env = {
        **os.environ,
        "LORALOOM_DATABASE_URL": db_url,
        "LORALOOM_DATA_DIR": str(ROOT / "data"),
        "LORALOOM_ADMIN_KEY": admin_key,
        "LORALOOM_WORKER_TOKEN": worker_token,
        "LORALOOM_MAX_CONCURRENT_RUNS": "4",
        "OMP_NUM_THREADS": "1",
    }
    url = f"http://127.0.0.1:{port}"
    say = typer.echo
    say(f"[demo] database {db_url}; artifacts under {ROOT / 'data'}")
    upgrade(db_url)
    service_log = open(ROOT / "service.log", "wb")  # noqa: SIM115 - closed at the end
    service = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "app.main:create_app",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=service_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    pool = None
    try:
        _wait_ready(url, service)
        say(f"[demo] service up at {url}")
        say("[demo] building/loading the built-in base model loraloom-tiny (cached after the first run)")
        base = load_base_model("loraloom-tiny", cache_dir=MODEL_CACHE)
        pool = launch_pool(
            nproc_per_node=1,
            worker_args=[
                "--url",
                url,
                "--token",
                worker_token,
                "--slots",
                "4",
                "--seq-len",
                "64",
                "--max-rank",
                "8",
                "--checkpoint-dir",
                str(ROOT / "data" / "runs"),
                "--model-cache-dir",
                str(MODEL_CACHE),
                "--pack-timeout",
                "0.3",
                "--poll-interval",
                "0.05",
            ],
            env={"OMP_NUM_THREADS": "1"},
            log_path=ROOT / "worker.log",
        )
        say(f"[demo] worker pool started (1 CPU rank); log: {ROOT / 'worker.log'}")

        keys: dict[str, str] = {}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}) as admin:
            for tenant in ("alice", "bob"):
                t = admin.post("/v1/tenants", json={"name": tenant, "max_concurrent_runs": 3}).json()
                keys[tenant] = admin.post(f"/v1/tenants/{t['id']}/keys").json()["key"]
                say(f"[demo] tenant {tenant} ({t['id']}) with an API key")

        systems = _systems(problems, group)
        tokenizer = CharTokenizer()
        run_ids: dict[str, str] = {}
        loops: list[tuple[DemoSystem, RolloutLoop]] = []
        bars: dict[str, tqdm] = {}
        for i, system in enumerate(systems):
            client = LoraloomClient(url, keys[system.tenant])
            policies = {}
            for agent, run_name in system.runs.items():
                run = client.create_run(
                    run_name, _run_config(max_steps=steps, batch_size=problems * group, seed=i)
                )
                run_ids[run_name] = run.id
                say(f"[demo] {system.tenant} created run {run_name} ({run.id}): {run.status}")
                from orchestrator.samplers.local import LocalSampler

                sampler = LocalSampler(copy.deepcopy(base), eos_token_id=tokenizer.eos_token_id, seed=i)
                policies[agent] = AgentPolicy(run_id=run.id, sampler=sampler, tokenizer=tokenizer)
                bars[run_name] = tqdm(total=steps, desc=f"{run_name:12s}", position=len(bars), leave=True)
            client.close()
            engine = MultiAgentEngine(system.engine_config, policies)
            loop = RolloutLoop(
                AsyncLoraloomClient(url, keys[system.tenant]),
                engine,
                LoopConfig(
                    max_iterations=steps,
                    adapter_dir=ROOT / "adapters" / system.label,
                    poll_interval_s=0.1,
                    heartbeat_interval_s=5.0,
                ),
                on_step=[_progress(system, bars)],
            )
            loops.append((system, loop))

        started = time.monotonic()

        async def _all() -> None:
            await asyncio.gather(*(loop.run() for _, loop in loops))

        asyncio.run(_all())
        for bar in bars.values():
            bar.close()
        say(f"[demo] {steps} steps of every run in {time.monotonic() - started:.0f} s")
        results = _report(loops, output_dir, say)
        _download_adapters(url, keys, systems, run_ids, output_dir, say)
        (output_dir / "results.json").write_text(json.dumps(results, indent=2))
        return results
    finally:
        if pool is not None and pool.poll() is None:
            pool.terminate()
            try:
                pool.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pool.kill()
        service.terminate()
        service.wait(timeout=20)
        service_log.close()


def _progress(system: DemoSystem, bars: dict[str, tqdm]):
    def update(report: StepReport) -> None:
        for agent, run_name in system.runs.items():
            bar = bars[run_name]
            bar.update(1)
            reward = report.mean_reward.get(agent)
            if reward is not None:
                bar.set_postfix(reward=f"{reward:.2f}")

    return update


def _window_mean(values: list[float], *, first: bool, k: int = 3) -> float:
    window = values[:k] if first else values[-k:]
    return sum(window) / max(len(window), 1)


def _report(loops, output_dir: Path, say) -> dict:
    results: dict[str, dict[str, list[float]]] = {}
    say("")
    say(
        f"{'system':12s} {'agent':8s} {'run':12s} {'reward before':>14s} {'reward after':>13s} {'change':>8s}"
    )
    for system, loop in loops:
        for agent, run_name in system.runs.items():
            history = loop.reward_history.get(agent, [])
            before, after = _window_mean(history, first=True), _window_mean(history, first=False)
            results[run_name] = {"agent": agent, "before": before, "after": after, "curve": history}
            say(
                f"{system.label:12s} {agent:8s} {run_name:12s} {before:14.3f} {after:13.3f} {after - before:+8.3f}"
            )
    _plot(results, output_dir / "reward_curves.png")
    say(f"\n[demo] reward curves: {output_dir / 'reward_curves.png'}")
    return results


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run_name, r in results.items():
        ax.plot(range(1, len(r["curve"]) + 1), r["curve"], label=f"{run_name} ({r['agent']})")
    ax.set_xlabel("rollout step")
    ax.set_ylabel("mean reward")
    ax.set_title("loraloom demo: four runs trained together on one tiny base model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _download_adapters(url, keys, systems, run_ids, output_dir: Path, say) -> None:
    for system in systems:
        with LoraloomClient(url, keys[system.tenant]) as client:
            for run_name in system.runs.values():
                path = client.download_adapter(
                    run_ids[run_name], "latest", output_dir / "adapters" / run_name
                )
                say(f"[demo] final adapter of {run_name}: {path}")
