"""SFT, then RL, on a task the built-in model was never taught: reversing two digits.

`loraloom-tiny` was warmed up only on single-digit sums (`3+4=` → `7`) and y/n checks. Here it must
answer `rev47=` with `74` (two digits, `00`..`99`, EOS after them). The base model answers with some
number (the sums it knows), almost never the reversal: RL from the base model has nothing to
sharpen. So:

1. an SFT run (`loss.kind = "cross_entropy"`) trained with the SDK's `SFTLoop` on generated
   (prompt, reversal) examples — deliberately short, so that the adapter samples the right answer
   often but not always;
2. an RL run (`loss.kind = "ppo"`, GRPO advantages from `RolloutLoop` and the engine) created with
   `init_from={"run_id": <the SFT run>, "step": "latest"}`: its samplers start on the SFT adapter,
   and RL sharpens what SFT taught;
3. validation on a fixed set (`VAL_PROBLEMS` problems x `VAL_SAMPLES` samples at temperature 1)
   for the base model, the SFT adapter and the RL adapter: a table, `results.json` and a plot
   (`sft_then_rl.png`: SFT loss per step, RL mean training reward per step, validation levels).

Reward: `score_answer` of the built-in arithmetic env (1 for the exact reversal, partial credit
below 0.5 for digits, a stop token, the right length and digits in the right places).

Everything runs on this machine: SQLite, the service and a one-rank CPU pool
(`loraloom.embedded`, as `loraloom demo`). Defaults take a few minutes on 2 CPU cores; the knobs
(`--sft-steps`, `--rl-steps`, ...) give a shortened variant (tests/e2e/test_sft_then_rl.py).

    python examples/sft_then_rl.py --output-dir out/sft_then_rl
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from typer import echo as say  # flushes: progress shows when stdout is a file

from contracts.tokenizer import CharTokenizer
from loraloom.embedded import embedded_stack
from orchestrator.client import AsyncLoraloomClient, LoraloomClient
from orchestrator.engine import AgentPolicy, EngineConfig, MultiAgentEngine
from orchestrator.envs import Env, Episode, Problem, StepResult, register_env, score_answer
from orchestrator.loop import LoopConfig, RolloutLoop, StepReport
from orchestrator.sft import SFTLoop, SFTStep

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 8
LORA = {"rank": LORA_RANK, "alpha": 16.0, "target_modules": list(LORA_TARGETS)}
VAL_PROBLEMS = 64
VAL_SAMPLES = 8
MODEL_CACHE = Path(os.environ.get("LORALOOM_MODEL_CACHE", ".loraloom/models"))


# ---- the task ---------------------------------------------------------------------------------


def reverse_prompt(digits: str) -> str:
    return f"rev{digits}="


class ReverseEpisode(Episode):
    def __init__(self, digits: str) -> None:
        self.question, self.answer = reverse_prompt(digits), digits[::-1]
        self.response, self.truncated = "", False

    def observation(self, agent: str) -> str:
        return self.question

    def step(self, agent: str, action: str, *, truncated: bool = False) -> StepResult:
        self.response, self.truncated = action, truncated
        return StepResult(done=True)

    def final_rewards(self) -> dict[str, float]:
        return {"solver": score_answer(self.response, self.answer, truncated=self.truncated)}

    def success(self) -> dict[str, bool]:
        return {"solver": self.response == self.answer and not self.truncated}


@register_env("reverse_digits")
class ReverseDigitsEnv(Env):
    agents = ("solver",)

    def sample_problems(self, rng: random.Random, count: int) -> list[Problem]:
        digits = [f"{rng.randint(0, 99):02d}" for _ in range(count)]
        return [Problem(id=d, data=d) for d in digits]

    def new_episode(self, problem: Problem) -> Episode:
        return ReverseEpisode(problem.data)

    def max_completion_tokens(self, agent: str) -> int:
        return 4  # two digits, EOS, one token of slack


def sft_examples(seed: int) -> Any:
    """An endless stream of (prompt, completion) pairs (the SFT run stops at its max_steps)."""
    rng = random.Random(seed)
    while True:
        digits = f"{rng.randint(0, 99):02d}"
        yield reverse_prompt(digits), digits[::-1]


# ---- the runs ---------------------------------------------------------------------------------


def wait_for_adapter(client: LoraloomClient, run_id: str, step: int, timeout_s: float = 120.0) -> int:
    """Wait until run `run_id` has published its adapter of `step` (or a later one); its step."""
    deadline = time.monotonic() + timeout_s
    while True:
        latest = client.latest_adapter(run_id)  # one request, however many steps the run keeps
        if latest is not None and latest.step >= step:
            return latest.step
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id}: no adapter of step {step} after {timeout_s:.0f} s")
        time.sleep(0.2)


def run(
    *,
    sft_steps: int,
    sft_batch: int,
    sft_lr: float,
    rl_steps: int,
    problems: int,
    group: int,
    rl_lr: float,
    output_dir: Path,
    state_dir: Path,
    port: int,
    model_cache: Path = MODEL_CACHE,
    seed: int = 0,
) -> dict[str, Any]:
    import torch

    from orchestrator.samplers.local import LocalSampler
    from trainer_core.models.registry import load_base_model

    # Sampling gains nothing from more threads, and the pool's rank trains beside it.
    torch.set_num_threads(1)
    output_dir = output_dir.expanduser().resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = CharTokenizer()
    started = time.monotonic()
    timings: dict[str, float] = {}
    with embedded_stack(
        state_dir=state_dir,
        model_cache=model_cache,
        port=port,
        slots=2,
        max_rank=LORA_RANK,
        target_modules=LORA_TARGETS,
        pack_len=512,
    ) as stack:
        key = stack.create_tenant("alice")
        base = load_base_model("loraloom-tiny", cache_dir=model_cache)
        engine_config = EngineConfig(
            env="reverse_digits",
            problems_per_step=problems,
            samples_per_problem=group,
            val_problems=VAL_PROBLEMS,
            val_samples_per_problem=VAL_SAMPLES,
            val_temperature=1.0,
            seed=seed,
        )
        # One sampler for validation (base, then each adapter loaded in turn), one for RL rollouts.
        val_sampler = LocalSampler(copy.deepcopy(base), eos_token_id=tokenizer.eos_token_id, seed=seed + 100)
        val_engine = MultiAgentEngine(
            engine_config,
            {"solver": AgentPolicy(run_id="validation", sampler=val_sampler, tokenizer=tokenizer)},
        )

        def validate() -> dict[str, float]:
            result = asyncio.run(val_engine.validate())
            return {"reward": result.mean_reward["solver"], "success": result.success_rate["solver"]}

        validation = {"base": validate()}
        say(f"[sft_then_rl] base model: validation reward {validation['base']['reward']:.3f}")

        client = LoraloomClient(stack.url, key)
        run_config: dict[str, Any] = {
            "base_model": "loraloom-tiny",
            "lora": LORA,
            "max_async_level": 0,
            "seq_len": 32,
            "seed": seed,
        }

        # 1. SFT.
        t0 = time.monotonic()
        sft = client.create_run(
            "reverse-sft",
            {
                **run_config,
                "loss": {"kind": "cross_entropy"},
                # SFTLoop sends up to 2 batches ahead of the trained step (no sampler to keep fresh).
                "max_async_level": 2,
                "optim": {"lr": sft_lr, "max_grad_norm": 1.0},
                "batch_size": sft_batch,
                "max_steps": sft_steps,
            },
        )

        def on_sft_step(s: SFTStep) -> None:
            if s.step == 1 or s.step % 10 == 0 or s.step == sft_steps:
                say(f"[sft_then_rl] SFT step {s.step}/{sft_steps}: loss {s.loss:.3f}")

        sft_steps_done = SFTLoop(client, sft.id, tokenizer, on_step=on_sft_step).run(sft_examples(seed))
        sft_adapter_step = wait_for_adapter(client, sft.id, sft_steps)
        sft_adapter = client.download_adapter(sft.id, sft_adapter_step, stack.state_dir / "adapters" / "sft")
        timings["sft_s"] = time.monotonic() - t0
        val_sampler.load_adapter_sync(sft_adapter, "sft", sft_adapter_step)
        validation["sft"] = validate()
        say(f"[sft_then_rl] SFT adapter: validation reward {validation['sft']['reward']:.3f}")

        # 2. RL from the SFT adapter.
        t0 = time.monotonic()
        rl = client.create_run(
            "reverse-rl",
            {
                **run_config,
                "loss": {"kind": "ppo", "clip_low": 0.2, "clip_high": 0.28},
                "optim": {"lr": rl_lr, "max_grad_norm": 1.0},
                "scheduler": {"kind": "cosine", "min_lr_ratio": 0.1},
                "batch_size": problems * group,
                "max_steps": rl_steps,
            },
            init_from={"run_id": sft.id, "step": "latest"},
        )
        rl_sampler = LocalSampler(copy.deepcopy(base), eos_token_id=tokenizer.eos_token_id, seed=seed + 1)
        # The run's trainer starts on the SFT adapter: so must its sampler (the loop loads the run's
        # own adapters as they appear, from step 1 on).
        rl_sampler.load_adapter_sync(sft_adapter, "sft", 0)
        engine = MultiAgentEngine(
            engine_config, {"solver": AgentPolicy(run_id=rl.id, sampler=rl_sampler, tokenizer=tokenizer)}
        )
        rl_rewards: list[float] = []

        def on_rl_step(report: StepReport) -> None:
            reward = report.mean_reward.get("solver", float("nan"))
            rl_rewards.append(reward)
            if len(rl_rewards) == 1 or len(rl_rewards) % 5 == 0:
                say(f"[sft_then_rl] RL step {len(rl_rewards)}/{rl_steps}: mean training reward {reward:.3f}")

        loop = RolloutLoop(
            AsyncLoraloomClient(stack.url, key),
            engine,
            LoopConfig(
                max_iterations=rl_steps,
                adapter_dir=stack.state_dir / "adapters" / "rl",
                poll_interval_s=0.1,
                heartbeat_interval_s=5.0,
            ),
            on_step=[on_rl_step],
        )
        asyncio.run(loop.run())
        rl_adapter_step = wait_for_adapter(client, rl.id, rl_steps)
        rl_adapter = client.download_adapter(rl.id, rl_adapter_step, output_dir / "adapters" / "rl")
        timings["rl_s"] = time.monotonic() - t0
        val_sampler.load_adapter_sync(rl_adapter, "rl", rl_adapter_step)
        validation["rl"] = validate()
        client.download_adapter(sft.id, sft_adapter_step, output_dir / "adapters" / "sft")
        client.close()
    timings["total_s"] = time.monotonic() - started

    results = {
        "task": "reverse two digits: rev47= -> 74",
        "validation": validation,
        "sft_loss": [s.loss for s in sft_steps_done],
        "rl_reward": rl_rewards,
        "settings": {
            "sft_steps": sft_steps,
            "sft_batch": sft_batch,
            "sft_lr": sft_lr,
            "rl_steps": rl_steps,
            "problems": problems,
            "group": group,
            "rl_lr": rl_lr,
            "val": f"{VAL_PROBLEMS} problems x {VAL_SAMPLES} samples, temperature 1",
        },
        "seconds": {k: round(v, 1) for k, v in timings.items()},
    }
    (output_dir / "results.json").write_text(json.dumps(results, indent=2))
    _print_table(validation)
    _plot(results, output_dir / "sft_then_rl.png")
    say(f"[sft_then_rl] times: {results['seconds']}; plot: {output_dir / 'sft_then_rl.png'}")
    return results


def _print_table(validation: dict[str, dict[str, float]]) -> None:
    say("")
    say(f"{'model':12s} {'val reward':>11s} {'exact':>7s}")
    for name, label in (("base", "base"), ("sft", "SFT adapter"), ("rl", "RL adapter")):
        v = validation[name]
        say(f"{label:12s} {v['reward']:11.3f} {v['success']:7.2f}")
    say(f"(validation: {VAL_PROBLEMS} fixed problems x {VAL_SAMPLES} samples at temperature 1)")


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_sft, ax_rl) = plt.subplots(1, 2, figsize=(10, 4))
    losses = results["sft_loss"]
    ax_sft.plot(range(1, len(losses) + 1), losses)
    ax_sft.set_xlabel("SFT step")
    ax_sft.set_ylabel("cross-entropy (nats/token)")
    ax_sft.set_title("1. SFT (cross_entropy)")
    rewards = results["rl_reward"]
    ax_rl.plot(range(1, len(rewards) + 1), rewards, label="RL training reward")
    for name, style in (("base", ":"), ("sft", "--"), ("rl", "-.")):
        reward = results["validation"][name]["reward"]
        ax_rl.axhline(reward, linestyle=style, color="gray", label=f"validation, {name}: {reward:.3f}")
    ax_rl.set_xlabel("RL step")
    ax_rl.set_ylabel("mean reward")
    ax_rl.set_title("2. RL (ppo, GRPO) from the SFT adapter")
    ax_rl.legend(loc="center right", fontsize=8)
    for ax in (ax_sft, ax_rl):
        ax.grid(alpha=0.3)
    fig.suptitle(results["task"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--sft-batch", type=int, default=64)
    parser.add_argument("--sft-lr", type=float, default=5e-3)
    parser.add_argument("--rl-steps", type=int, default=120)
    parser.add_argument("--problems", type=int, default=16, help="RL problems per step")
    parser.add_argument("--group", type=int, default=8, help="RL samples per problem (GRPO group)")
    parser.add_argument("--rl-lr", type=float, default=5e-4)
    parser.add_argument("--output-dir", type=Path, default=Path("out/sft_then_rl"))
    parser.add_argument("--state-dir", type=Path, default=Path(".loraloom/sft_then_rl"))
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    run(
        sft_steps=args.sft_steps,
        sft_batch=args.sft_batch,
        sft_lr=args.sft_lr,
        rl_steps=args.rl_steps,
        problems=args.problems,
        group=args.group,
        rl_lr=args.rl_lr,
        output_dir=args.output_dir,
        state_dir=args.state_dir,
        port=args.port,  # 0: any free port, held by the service's parent from its pick
        seed=args.seed,
    )


if __name__ == "__main__":
    main()
