"""Packing benchmark: how well and how fast rollouts are packed.

1. ``pack_ffd`` on N samples at once, per sequence length and length distribution: bins used against the
   lower bound ⌈total tokens ÷ seq_len⌉, packing efficiency (real tokens ÷ packed tokens, padding
   included — rows padded to ``seq_len``, and rows padded to ``--pad-to-multiple-of``), and time.
2. The full Packer path on N samples from ``--runs`` runs streamed in batches of ``--batch-size``:
   the claimed batch's stored bytes decoded into the binary form (``--form binary``, the pool's path:
   one msgpack decode, arrays read in place) or TrainingBatch lists (``--form lists``), ``add_batch``, ``pack`` (round-robin selection, step accounting, FFD,
   row building, rank balancing) until drained; efficiency per pack and over the whole stream.

Length distributions, shaped like RL rollouts (prompt + completion, clipped to seq_len):
- ``lognormal``: completions lognormal, median seq_len/16, σ = 1.0.
- ``heavy-tail``: completions lognormal, median seq_len/32, σ = 1.6 (a few very long).
- ``truncated``: 85% lognormal (median seq_len/8, σ = 0.8), 15% cut at the generation cap (the sample
  fills seq_len exactly), as when max_tokens truncates runaway completions.
Prompts are lognormal, median min(256, seq_len/16), σ = 0.6, within [8, seq_len/4].

Run: ``.venv/bin/python bench/packing.py`` (``--help`` for the knobs). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from contracts.arrays import ArrayBatch, decode_stored, to_arrays
from contracts.arrays import encode as encode_arrays
from contracts.wire import TrainingBatch, TrainingSample
from trainer_core.packing import Packer, pack_ffd

DISTRIBUTIONS = ("lognormal", "heavy-tail", "truncated")


def sample_lengths(
    dist: str, n: int, seq_len: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths (n,), completion lengths (n,)), prompt + completion ≤ seq_len."""
    prompt_median = min(256, seq_len / 16)
    prompts = np.clip(rng.lognormal(math.log(prompt_median), 0.6, n), 8, seq_len // 4).astype(np.int64)
    if dist == "lognormal":
        completions = rng.lognormal(math.log(seq_len / 16), 1.0, n)
    elif dist == "heavy-tail":
        completions = rng.lognormal(math.log(seq_len / 32), 1.6, n)
    elif dist == "truncated":
        completions = rng.lognormal(math.log(seq_len / 8), 0.8, n)
        completions[rng.random(n) < 0.15] = seq_len  # hits the cap
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    completions = np.clip(completions.astype(np.int64), 1, seq_len - prompts)
    return prompts, completions


class Timer:
    """Accumulates CPU time (the process's; stable on a shared machine) and wall time."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0

    def __enter__(self) -> Timer:
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu += time.process_time() - self._cpu
        self.wall += time.perf_counter() - self._wall

    def __str__(self) -> str:
        return f"{self.cpu:.2f} s ({self.wall:.2f} s)"


def best_of(repeats: int, fn: Callable[[], object]) -> Timer:
    """The run with the least CPU time."""
    best: Timer | None = None
    for _ in range(repeats):
        with Timer() as timer:
            fn()
        if best is None or timer.cpu < best.cpu:
            best = timer
    assert best is not None
    return best


def padded(length: int, multiple: int, seq_len: int) -> int:
    return min(-(-length // multiple) * multiple, seq_len)


def ffd_table(args: argparse.Namespace) -> list[str]:
    lines = [
        f"### `pack_ffd` on {args.samples:,} samples at once",
        "",
        "| seq_len | distribution | mean len | p50 | p99 | bins | lower bound | excess bins "
        f"| efficiency (rows padded to seq_len) | efficiency (rows padded to ×{args.pad_to_multiple_of}) "
        "| time, CPU (wall), best of {0} |".format(args.repeats),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for seq_len in args.seq_lens:
        for dist in args.distributions:
            rng = np.random.default_rng(args.seed)
            prompts, completions = sample_lengths(dist, args.samples, seq_len, rng)
            lengths = (prompts + completions).tolist()
            total = sum(lengths)
            bins: list[list[int]] = []

            def run(lengths: list[int] = lengths, seq_len: int = seq_len) -> None:
                nonlocal bins
                bins = pack_ffd(lengths, seq_len)

            elapsed = best_of(args.repeats, run)
            lower = -(-total // seq_len)
            rows = [sum(lengths[i] for i in b) for b in bins]
            eff_full = total / (len(bins) * seq_len)
            eff_mult = total / sum(padded(r, args.pad_to_multiple_of, seq_len) for r in rows)
            arr = np.asarray(lengths)
            lines.append(
                f"| {seq_len} | {dist} | {arr.mean():.0f} | {np.percentile(arr, 50):.0f} "
                f"| {np.percentile(arr, 99):.0f} | {len(bins):,} | {lower:,} | {100 * (len(bins) / lower - 1):.2f}% "
                f"| {100 * eff_full:.2f}% | {100 * eff_mult:.2f}% | {1000 * elapsed.cpu:.0f} ms ({1000 * elapsed.wall:.0f} ms) |"
            )
    return lines


def make_pool(dist: str, seq_len: int, size: int, rng: np.random.Generator) -> list[TrainingSample]:
    """Distinct samples to draw batches from (reused, so memory stays small at 100k samples)."""
    prompts, completions = sample_lengths(dist, size, seq_len, rng)
    pool = []
    for p, c in zip(prompts.tolist(), completions.tolist(), strict=True):
        ids = rng.integers(0, 150_000, p + c).tolist()
        pool.append(
            TrainingSample(
                prompt_ids=ids[:p],
                prompt_mask=[True] * p,
                completion_ids=ids[p:],
                completion_mask=[True] * c,
                completion_logprobs=(-rng.random(c)).tolist(),
                advantage=float(rng.normal()),
            )
        )
    return pool


def packer_table(args: argparse.Namespace) -> list[str]:
    seq_len, dp = args.packer_seq_len, args.dp
    lines = [
        f"### Full Packer path: {args.samples:,} samples, {args.runs} runs × batch_size {args.batch_size}, "
        f"seq_len {seq_len}, dp_world_size {dp}, pad_to_multiple_of {args.pad_to_multiple_of}, "
        f"batches as {'stored binary bytes (decode timed)' if args.form == 'binary' else 'TrainingBatch lists'}",
        "",
        "| distribution | tokens | packs | rows | Σ per-pack lower bound | excess rows "
        "| ⌈tokens ÷ seq_len⌉ | rows over it "
        "| real ÷ packed (rows incl. padding) | real ÷ (packs × dp × seq_len) "
        "| add_batch, CPU (wall) | pack, CPU (wall) | total CPU per 100k samples | pack CPU per 100k samples |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dist in args.distributions:
        rng = np.random.default_rng(args.seed)
        pool = make_pool(dist, seq_len, args.pool, rng)
        pool_size = len(pool)
        binary_pool = to_arrays(TrainingBatch(examples=pool)).examples
        if args.form == "binary":
            # The list form holds ~5 Python objects per token; kept alive it would make every garbage
            # collection in the timed part walk millions of them (a worker holds no such lists).
            pool = []
            gc.collect()
        packer = Packer(
            n_slots=args.runs, seq_len=seq_len, dp_world_size=dp, pad_to_multiple_of=args.pad_to_multiple_of
        )
        for slot in range(args.runs):
            packer.add_run(slot, batch_size=args.batch_size)
        batches_needed = -(-args.samples // args.batch_size)
        draws = rng.integers(0, pool_size, (batches_needed, args.batch_size))
        next_batch = 0
        add_t, pack_t = Timer(), Timer()
        packs = rows = lower = tokens = packed = 0
        while True:
            # Stream: keep every run two batches ahead, as orchestrators posting rollouts would.
            for slot in range(args.runs):
                while next_batch < batches_needed and packer.buffered_samples(slot) < 2 * args.batch_size:
                    if args.form == "binary":
                        # The stored bytes of a claimed batch (made untimed); timed: the one decode
                        # into the binary form (as `claimed_batches` does), then add_batch.
                        data = encode_arrays(ArrayBatch(examples=[binary_pool[i] for i in draws[next_batch]]))
                        with add_t:
                            packer.add_batch(slot, decode_stored(data), batch_id=next_batch)
                    else:
                        batch = TrainingBatch(examples=[pool[i] for i in draws[next_batch]])
                        with add_t:
                            packer.add_batch(slot, batch, batch_id=next_batch)
                    next_batch += 1
            with pack_t:
                result = packer.pack(force=True)
            if result is None:
                break
            real_rows = [mb for rank in result.micro_batches for mb in rank if not mb.is_filler]
            pack_tokens = sum(stats.tokens for stats in result.runs.values())
            packs += 1
            rows += len(real_rows)
            lower += -(-pack_tokens // seq_len)
            tokens += pack_tokens
            packed += sum(mb.num_tokens for mb in real_rows)
        samples = batches_needed * args.batch_size
        per_100k = 100_000 / samples
        overall = -(-tokens // seq_len)  # the bound if the whole stream were packed at once
        lines.append(
            f"| {dist} | {tokens:,} | {packs:,} | {rows:,} | {lower:,} | {100 * (rows / lower - 1):.2f}% "
            f"| {overall:,} | {100 * (rows / overall - 1):.2f}% "
            f"| {100 * tokens / packed:.2f}% | {100 * tokens / (packs * dp * seq_len):.2f}% "
            f"| {add_t} | {pack_t} | {(add_t.cpu + pack_t.cpu) * per_100k:.2f} s | {pack_t.cpu * per_100k:.2f} s |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    parser.add_argument("--pad-to-multiple-of", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="pack_ffd timing: best of this many")
    parser.add_argument("--packer-seq-len", type=int, default=8192)
    parser.add_argument("--dp", type=int, default=8, help="dp_world_size for the Packer path")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--pool", type=int, default=5000, help="distinct samples the Packer path draws from")
    parser.add_argument("--skip-packer", action="store_true")
    parser.add_argument(
        "--form",
        choices=("binary", "lists"),
        default="binary",
        help="how batches reach the Packer: the stored binary bytes of a claim (decoded in the timed part), "
        "or TrainingBatch lists (converted once in add_batch)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    lines = ffd_table(args)
    if not args.skip_packer:
        lines += [""] + packer_table(args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
