"""Trainer tokens/s fed through the service vs. the same trainer fed from memory.

Same process, same model, same runs and batches, one after the other:

- memory: `PoolTrainer` with an in-memory stand-in for its service client (claims hand out
  pre-built payloads, pushes are counted and dropped) — the trainer's own speed;
- service: the real service under uvicorn on Postgres (batches posted over HTTP first),
  `PoolTrainer` with the real HTTP client: claims, acks, adapter uploads, metrics, checkpoints.

Tokens/s = trained tokens ÷ time from the first claim to the last step report.

    .venv/bin/python -m bench.pool_throughput
"""

import argparse
import logging
import random
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.ingest import create_database, drop_database, start_service
from bench.options import add_pg_admin_url
from contracts.pool_api import ClaimedBatchStruct, PoolRegister, RunAfterPush, StepReport
from contracts.run_config import RunConfig
from trainer_core.dist import World
from trainer_core.http_source import HttpRunSource
from trainer_core.memory_client import MemoryPoolClient, Timing
from trainer_core.service_client import PoolServiceClient
from trainer_core.worker import PoolTrainer, WorkerArgs

ADMIN, WORKER = "bench-admin", "bench-worker"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8, help="samples per step (one batch per step)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=384)
    p.add_argument("--seq-len", type=int, default=2048)
    add_pg_admin_url(p)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace, directory: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def make_payloads(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """payloads[run][step]: one TrainingBatch (as JSON) per step."""
    rng = random.Random(0)
    out = []
    for _ in range(args.runs):
        batches: list[dict[str, Any]] = []
        for step in range(args.steps):
            examples = []
            for _ in range(args.batch_size):
                p = [rng.randrange(1, args.vocab) for _ in range(args.prompt_len)]
                c = [rng.randrange(1, args.vocab) for _ in range(args.completion_len)]
                examples.append(
                    {
                        "prompt_ids": p,
                        "prompt_mask": [False] * len(p),
                        "completion_ids": c,
                        "completion_mask": [True] * len(c),
                        "completion_logprobs": [-rng.uniform(8.5, 9.5) for _ in c],
                        "advantage": rng.choice([-1.0, 1.0]),
                    }
                )
            batches.append({"examples": examples, "temperature": 1.0, "step": step})
        out.append(batches)
    return out


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    return RunConfig(
        base_model="bench-model",
        batch_size=args.batch_size,
        max_steps=args.steps,
        seq_len=args.seq_len,
        max_async_level=1000,
        ckpt={"interval": 1000, "keep_last": 1},
    ).model_dump(mode="json")


class TimedClient(PoolServiceClient):
    """The real HTTP client, timing the same two moments and every request the trainer waits on."""

    def __init__(self, url: str, token: str, timing: Timing) -> None:
        super().__init__(url, token)
        self.timing = timing
        self.request_seconds: defaultdict[str, float] = defaultdict(float)
        self.request_counts: Counter[str] = Counter()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        started = time.perf_counter()
        try:
            return super()._request(method, path, **kwargs)
        finally:
            route = "/".join(
                "*" if p.startswith(("run_", "pool_")) or p.isdigit() else p for p in path.split("/")
            )
            self.request_seconds[f"{method} {route}"] += time.perf_counter() - started
            self.request_counts[f"{method} {route}"] += 1

    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
        batches = super().claim(max_batches, run_ids)
        if batches:
            self.timing.first_claim = self.timing.first_claim or time.perf_counter()
        return batches

    def report_step(self, run_id: str, report: StepReport) -> RunAfterPush:
        out = super().report_step(run_id, report)
        self.timing.last_step = time.perf_counter()
        self.timing.tokens += report.metrics.tokens or 0
        return out


def train(args: argparse.Namespace, model_dir: Path, work: Path, client: Any) -> None:
    """`client`: a `PoolServiceClient`, or `MemoryPoolClient`, which has its methods but is not one
    (hence Any: `PoolTrainer` names the HTTP class)."""
    worker_args = WorkerArgs(
        url="unused",
        token="unused",
        base_model=str(model_dir),
        max_rank=16,
        slots=args.runs,
        seq_len=args.seq_len,
        checkpoint_dir=work / "ckpt",
        pack_timeout_s=0.2,
        poll_interval_s=0.02,
        exit_when_idle_s=0.5,
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainer = PoolTrainer(worker_args, world=World(), device=device, source=HttpRunSource(client))
    try:
        trainer.run()
    finally:
        trainer.close()


def via_service(
    args: argparse.Namespace, model_dir: Path, payloads: list[list[dict[str, Any]]], work: Path
) -> tuple[Timing, TimedClient]:
    db = create_database(args.pg_admin_url)
    from app.migrate import upgrade

    upgrade(db)
    proc, url = start_service(db, work / "data", work / "service.log", 1)
    try:
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        tenant = admin.post("/v1/tenants", json={"name": "bench", "max_concurrent_runs": args.runs}).json()
        key = admin.post(f"/v1/tenants/{tenant['id']}/keys").json()["key"]
        user = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        timing = Timing()
        client = TimedClient(url, WORKER, timing)
        # Register first so that runs are admitted to this pool's base model and vocabulary.
        client.register(
            PoolRegister(
                base_model=str(model_dir),
                vocab_size=args.vocab,
                max_rank=16,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                slots=args.runs,
                world_size=1,
                max_seq_len=args.seq_len,
            )
        )
        config = run_config(args) | {"base_model": str(model_dir)}
        for i, batches in enumerate(payloads):
            run = user.post("/v1/runs", json={"name": f"bench-{i}", "config": config}).json()
            for b in batches:
                user.post(f"/v1/runs/{run['id']}/batches", json=b).raise_for_status()
        train(args, model_dir, work, client)
        return timing, client
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        drop_database(args.pg_admin_url, db)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="loraloom-bench-"))
    try:
        model_dir = build_model(args, work / "model")
        payloads = make_payloads(args)
        # memory, service, memory: the two memory passes bracket the service pass, so start-up
        # effects and machine load show up as their spread.
        timings: list[tuple[str, Timing]] = []
        client: TimedClient | None = None
        for label in ("memory (1st)", "service", "memory (2nd)"):
            if label == "service":
                timing, client = via_service(args, model_dir, payloads, work)
                timings.append((label, timing))
            else:
                t = Timing()
                config = run_config(args) | {"base_model": str(model_dir)}  # the pool checks it
                # A directory per pass: the pool checkpoints each run's last step, and the second pass
                # must not resume from the first one's checkpoints.
                train(args, model_dir, work / label.replace(" ", "_"), MemoryPoolClient(payloads, config, t))
                timings.append((label, t))
        assert client is not None  # the service pass ran
        rows: list[tuple[str, int, float, float]] = []
        for name, t in timings:
            if t.first_claim is None or t.last_step is None:
                raise RuntimeError(f"{name}: the trainer claimed no batch or finished no step")
            seconds = t.last_step - t.first_claim
            rows.append((name, t.tokens, seconds, t.tokens / seconds))
        print(
            f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.runs} runs × "
            f"{args.steps} steps × {args.batch_size} samples of {args.prompt_len}+{args.completion_len} tokens\n"
        )
        print("| fed from | tokens | seconds | tokens/s |\n|---|---:|---:|---:|")
        for name, tokens, seconds, tps in rows:
            print(f"| {name} | {tokens} | {seconds:.1f} | {tps:.0f} |")
        memory_tps = (rows[0][3] + rows[2][3]) / 2
        print(f"\nservice ÷ mean(memory): {rows[1][3] / memory_tps:.2f}× (target ≥ 0.9×)")
        # Wall-clock ratios on a shared machine swing with other load; the time the trainer spends
        # blocked in service requests does not, and is the overhead the service adds.
        blocked = sum(client.request_seconds.values()) - client.request_seconds.get(
            "POST /v1/pool/heartbeat", 0.0
        )
        service_seconds = rows[1][2]
        print("\n| request (master rank, blocking) | calls | seconds |\n|---|---:|---:|")
        for route, seconds in sorted(client.request_seconds.items(), key=lambda item: -item[1]):
            print(f"| {route} | {client.request_counts[route]} | {seconds:.2f} |")
        print(
            f"\ntrainer blocked on the service: {blocked:.2f} s of {service_seconds:.1f} s "
            f"({100 * blocked / service_seconds:.1f} %; heartbeats run in a background thread and are excluded) "
            f"→ upper bound on the slowdown: {1 - blocked / service_seconds:.3f}×"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
