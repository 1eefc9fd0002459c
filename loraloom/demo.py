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

Before/after: each system's engine plays a fixed validation set (`VAL_PROBLEMS`
problems x `VAL_SAMPLES` samples at the training temperature, the same problems
before and after) once before the first step, on the base model, and once after the
last step, on each run's final adapter. Mean training rewards of a step are noisier
(different problems every step); they are what the progress bars and the plot show.

Hyperparameters (measured on 2 CPU cores, see README): LoRA rank 8 on every linear
layer of the tiny model (attention and MLP), lr 3e-3 with a cosine decay to 3e-4 over
the run, 16 problems x 8 samples per step, max_async_level 0 (each step samples with
the adapter of the step before: with one step of lag the checker learned less, and the
time per step hardly changes). With attention-only adapters or lr 1e-3, 30 steps
barely move the rewards; at lr 1e-2 the checker locks onto one verdict and never
recovers.
"""

import asyncio
import copy
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the dev dependencies (types-tqdm)

from contracts.layout import step_dir_name
from contracts.tokenizer import CharTokenizer
from orchestrator.client import AsyncLoraloomClient, LoraloomClient
from orchestrator.engine import AgentPolicy, EngineConfig, MultiAgentEngine, Specialization
from orchestrator.loop import LoopConfig, RolloutLoop, StepCallback, StepReport

ROOT = Path(".loraloom/demo")
MODEL_CACHE = Path(os.environ.get("LORALOOM_MODEL_CACHE", ".loraloom/models"))
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 8
LORA_ALPHA = 16.0
LR = 3e-3
SEQ_LEN = 64
"""Longest sample (prompt + completion) of a run; the demo's are under 20 tokens."""
PACK_LEN = 512
"""Tokens per packed micro-batch of the pool: a few dozen samples per forward/backward."""
VAL_PROBLEMS = 64
VAL_SAMPLES = 8


@dataclass
class DemoSystem:
    """One orchestrator: a tenant's engine over one or more runs."""

    tenant: str
    label: str
    engine_config: EngineConfig
    runs: dict[str, str] = field(default_factory=dict)
    """agent → run name"""


SystemLoop = tuple[DemoSystem, RolloutLoop]
Say = Callable[[str], None]


class Scores(TypedDict):
    """One system's validation: per agent."""

    mean_reward: dict[str, float]
    success_rate: dict[str, float]


class RunResult(TypedDict):
    """What the demo reports per run (results.json, the table, the plot)."""

    agent: str
    before: float
    """Validation reward before the first step (base model)."""
    after: float
    """Validation reward on the final adapter."""
    success_before: float
    success_after: float
    train_first3: float
    """Mean training reward of the first 3 steps."""
    train_last3: float
    curve: list[float]
    """Mean training reward per step."""


def _run_config(*, max_steps: int, batch_size: int, seed: int) -> dict[str, Any]:
    return {
        "base_model": "loraloom-tiny",
        "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA, "target_modules": list(LORA_TARGETS)},
        "optim": {"lr": LR, "max_grad_norm": 1.0},
        # Cosine to a tenth: the last steps change the adapters little, so one unlucky batch at
        # the end cannot undo a run (at a constant lr the checker's final step once cost 0.1).
        "scheduler": {"kind": "cosine", "min_lr_ratio": 0.1},
        "batch_size": batch_size,
        "max_steps": max_steps,
        "seq_len": SEQ_LEN,
        "max_async_level": 0,
        "ckpt": {"interval": 10, "keep_last": 1},
        "seed": seed,
    }


def _systems(problems: int, group: int) -> list[DemoSystem]:
    # The arith-grpo system's engine; the other two differ from it only where named.
    base = EngineConfig(
        env="arithmetic",
        problems_per_step=problems,
        samples_per_problem=group,
        val_problems=VAL_PROBLEMS,
        val_samples_per_problem=VAL_SAMPLES,
        val_temperature=1.0,
    )
    return [
        DemoSystem("alice", "arith-grpo", base, {"solver": "arith-grpo"}),
        DemoSystem(
            "alice",
            "arith-rloo",
            dataclasses.replace(base, advantage="rloo", seed=1),
            {"solver": "arith-rloo"},
        ),
        DemoSystem(
            "bob",
            "duo",
            dataclasses.replace(base, env="solver_checker", specialization=Specialization.LORA, seed=2),
            {"solver": "duo-solver", "checker": "duo-checker"},
        ),
    ]


def run_demo(
    *,
    steps: int,
    output_dir: Path,
    problems: int = 16,
    group: int = 8,
    port: int = 8765,
    state_dir: Path = ROOT,
    model_cache: Path = MODEL_CACHE,
) -> dict[str, RunResult]:
    """Run the demo; returns {run name: its `RunResult`}.

    `state_dir` (wiped first) holds the SQLite database, the service's artifacts and the logs;
    `model_cache` the built base model."""
    import torch

    from loraloom.embedded import embedded_stack
    from orchestrator.samplers.local import LocalSampler
    from trainer_core.models.registry import load_base_model

    # Sampling the tiny model gains nothing from more threads, and the pool's rank trains at
    # the same time: one thread here keeps the two from oversubscribing a small machine.
    output_dir, model_cache = output_dir.expanduser().resolve(), model_cache.expanduser().resolve()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    output_dir.mkdir(parents=True, exist_ok=True)
    bars: dict[str, tqdm] = {}
    stack_cm = embedded_stack(
        state_dir=state_dir,
        model_cache=model_cache,
        port=port,
        slots=4,
        max_rank=LORA_RANK,
        target_modules=LORA_TARGETS,
        pack_len=PACK_LEN,
        say=say,
    )
    try:
        with stack_cm as stack, warnings.catch_warnings():
            # PEFT reads transformers' deprecated `is_gradient_checkpointing` when a sampler loads its
            # first adapter (no argument of ours): its FutureWarning landed between the progress bars.
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            url, state_dir = stack.url, stack.state_dir
            say("[demo] building/loading the built-in base model loraloom-tiny (cached after the first run)")
            base = load_base_model("loraloom-tiny", cache_dir=model_cache)
            keys = {tenant: stack.create_tenant(tenant) for tenant in ("alice", "bob")}
            say("[demo] tenants alice and bob, each with an API key")

            systems = _systems(problems, group)
            tokenizer = CharTokenizer()
            run_ids: dict[str, str] = {}
            loops: list[SystemLoop] = []
            sampler_seed = 0
            for i, system in enumerate(systems):
                client = LoraloomClient(url, keys[system.tenant])
                policies: dict[str, AgentPolicy] = {}
                for agent, run_name in system.runs.items():
                    run = client.create_run(
                        run_name, _run_config(max_steps=steps, batch_size=problems * group, seed=i)
                    )
                    run_ids[run_name] = run.id
                    say(f"[demo] {system.tenant} created run {run_name} ({run.id}): {run.status}")
                    # One seed per sampler: two agents sampling from the same random stream would
                    # draw correlated actions (the checker's verdict tied to the solver's luck).
                    sampler = LocalSampler(
                        copy.deepcopy(base), eos_token_id=tokenizer.eos_token_id, seed=sampler_seed
                    )
                    sampler_seed += 1
                    policies[agent] = AgentPolicy(run_id=run.id, sampler=sampler, tokenizer=tokenizer)
                    bars[run_name] = tqdm(total=steps, desc=f"{run_name:12s}", position=len(bars), leave=True)
                client.close()
                engine = MultiAgentEngine(system.engine_config, policies)
                loop = RolloutLoop(
                    AsyncLoraloomClient(url, keys[system.tenant]),
                    engine,
                    LoopConfig(
                        max_iterations=steps,
                        adapter_dir=state_dir / "adapters" / system.label,
                        poll_interval_s=0.1,
                        heartbeat_interval_s=5.0,
                    ),
                    on_step=[_progress(system, bars)],
                )
                loops.append((system, loop))

            started = time.monotonic()
            validation: dict[str, dict[str, Scores]] = {}

            async def _all() -> None:
                say(f"[demo] validation before training ({VAL_PROBLEMS} problems x {VAL_SAMPLES} samples)")
                validation["before"] = await _validate(loops)
                await asyncio.gather(*(loop.run() for _, loop in loops))
                _close(bars)
                say(f"[demo] {steps} steps of every run in {time.monotonic() - started:.0f} s")
                await _load_final_adapters(loops, steps)
                validation["after"] = await _validate(loops)

            asyncio.run(_all())
            results = _report(loops, validation, output_dir, say)
            results_meta = {"steps": steps, "seconds": round(time.monotonic() - started, 1)}
            _download_adapters(url, keys, systems, run_ids, output_dir, say)
            (output_dir / "results.json").write_text(json.dumps({**results_meta, "runs": results}, indent=2))
            return results
    except KeyboardInterrupt:
        # typer exits 130 on it without a word; the stack's clean-up has run by now. The bars
        # first: a live one drew itself over the message (when it was closed, or redrawn).
        _close(bars)
        say("[demo] interrupted: the service and the worker pool are stopped", err=True)
        raise
    finally:
        _close(bars)
        torch.set_num_threads(threads)


def say(text: str, *, err: bool = False) -> None:
    """Print one of the demo's lines whole. The runs' progress bars may be live: tqdm clears them,
    prints the line and draws them again (`typer.echo` wrote it into the middle of a bar's line)."""
    tqdm.write(text, file=sys.stderr if err else sys.stdout)


def _close(bars: Mapping[str, tqdm]) -> None:
    for bar in bars.values():
        bar.close()  # closing a closed bar does nothing


def _progress(system: DemoSystem, bars: dict[str, tqdm]) -> StepCallback:
    def update(report: StepReport) -> None:
        for agent, run_name in system.runs.items():
            bar = bars[run_name]
            bar.update(1)
            reward = report.mean_reward.get(agent)
            if reward is not None:
                bar.set_postfix(reward=f"{reward:.2f}")

    return update


async def _validate(loops: Sequence[SystemLoop]) -> dict[str, Scores]:
    """{system label: its scores} on each engine's fixed validation set."""
    out: dict[str, Scores] = {}
    for system, loop in loops:
        result = await loop.engine.validate()
        out[system.label] = {"mean_reward": result.mean_reward, "success_rate": result.success_rate}
    return out


async def _load_final_adapters(loops: Sequence[SystemLoop], steps: int, timeout_s: float = 120.0) -> None:
    """Load every run's step-`steps` adapter into its samplers (the loop ends before the trainer
    has trained its last batch)."""
    for _, loop in loops:
        for run_id in loop.engine.run_ids:
            # Every submitted batch is one trainer step (no filter: batch = batch_size samples).
            target = min(steps, loop.runs[run_id].rollout_step)
            deadline = time.monotonic() + timeout_s
            while True:
                latest = await loop.client.latest_adapter(run_id)
                newest = latest.step if latest is not None else 0
                if newest >= target:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run {run_id}: no adapter for step {target} after {timeout_s:.0f} s")
                await asyncio.sleep(0.2)
            dest = loop.config.adapter_dir / run_id / step_dir_name(newest)
            download = await loop.client.fetch_adapter(run_id, newest, dest)
            for sampler in loop.engine.samplers_of(run_id):
                await sampler.load_adapter(download.path, f"{run_id}-step-{newest}", newest)


def _window_mean(values: list[float], *, first: bool, k: int = 3) -> float:
    window = values[:k] if first else values[-k:]
    return sum(window) / max(len(window), 1)


def _report(
    loops: Sequence[SystemLoop], validation: Mapping[str, Mapping[str, Scores]], output_dir: Path, say: Say
) -> dict[str, RunResult]:
    """Per run: validation reward (and success rate) before/after, the training curve and
    the mean training reward of its first and last 3 steps."""
    results: dict[str, RunResult] = {}
    say("")
    say(
        f"{'system':10s} {'agent':8s} {'run':12s} {'reward before':>14s} {'reward after':>13s} {'change':>8s}"
        f" {'success before':>15s} {'success after':>14s}"
    )
    for system, loop in loops:
        v0, v1 = validation["before"][system.label], validation["after"][system.label]
        for agent, run_name in system.runs.items():
            history = loop.reward_history.get(agent, [])
            before, after = v0["mean_reward"][agent], v1["mean_reward"][agent]
            s0, s1 = v0["success_rate"][agent], v1["success_rate"][agent]
            results[run_name] = {
                "agent": agent,
                "before": before,
                "after": after,
                "success_before": s0,
                "success_after": s1,
                "train_first3": _window_mean(history, first=True),
                "train_last3": _window_mean(history, first=False),
                "curve": history,
            }
            say(
                f"{system.label:10s} {agent:8s} {run_name:12s} {before:14.3f} {after:13.3f} {after - before:+8.3f}"
                f" {s0:15.2f} {s1:14.2f}"
            )
    say(
        f"(validation: {VAL_PROBLEMS} fixed problems x {VAL_SAMPLES} samples at temperature 1, "
        "before the first step and on the final adapters)"
    )
    _plot(results, output_dir / "reward_curves.png")
    say(f"\n[demo] reward curves: {output_dir / 'reward_curves.png'}")
    return results


def _plot(results: Mapping[str, RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run_name, r in results.items():
        (line,) = ax.plot(range(1, len(r["curve"]) + 1), r["curve"], label=f"{run_name} ({r['agent']})")
        # Validation before the first step (x = 0) and after the last one, as markers.
        ax.plot([0, len(r["curve"]) + 1], [r["before"], r["after"]], "o", color=line.get_color())
    ax.set_xlabel("rollout step (dots: validation before and after)")
    ax.set_ylabel("mean reward")
    ax.set_title("loraloom demo: four runs trained together on one tiny base model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _download_adapters(
    url: str,
    keys: Mapping[str, str],
    systems: Sequence[DemoSystem],
    run_ids: Mapping[str, str],
    output_dir: Path,
    say: Say,
) -> None:
    for system in systems:
        with LoraloomClient(url, keys[system.tenant]) as client:
            for run_name in system.runs.values():
                path = client.download_adapter(
                    run_ids[run_name], "latest", output_dir / "adapters" / run_name
                )
                say(f"[demo] final adapter of {run_name}: {path}")
