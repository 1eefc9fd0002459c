"""The full Packer path of two versions of the Packer in ONE process, rounds alternating.

On a shared machine the CPU time of the same code swings by a third between runs minutes apart, so
comparing two separate ``bench/packing.py`` runs resolves only large changes. Here the baseline's
``trainer_core/packing`` (from ``--baseline``, a source tree such as ``git worktree add /tmp/base
main`` or ``git archive``) is loaded beside this tree's as a renamed package, both pack the same
stream of stored batches (the pool's path: decode, ``add_batch``, ``pack`` until drained, as in
``bench/packing.py``), rounds alternate, and the minimum and median of each are reported. Output and
accounting of the two are not compared here (tests/trainer_core/test_packing_reference.py does that).

Run: ``.venv/bin/python -m bench.packing_ab --baseline /tmp/base [--distributions lognormal truncated]``
"""

from __future__ import annotations

import argparse
import gc
import importlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from bench.packing import DISTRIBUTIONS, make_pool
from contracts.arrays import ArrayBatch, ArraySample, decode_stored, to_arrays
from contracts.arrays import encode as encode_arrays
from contracts.wire import TrainingBatch
from trainer_core.packing import Packer

BASELINE_PACKAGE = "baseline_packing"


def load_baseline(source: Path, into: Path) -> Any:
    """The baseline's ``trainer_core/packing`` as the package ``baseline_packing``; returns its Packer."""
    package = into / BASELINE_PACKAGE
    shutil.copytree(source / "trainer_core" / "packing", package)
    for path in package.glob("*.py"):
        path.write_text(path.read_text().replace("trainer_core.packing", BASELINE_PACKAGE))
    sys.path.insert(0, str(into))
    return importlib.import_module(BASELINE_PACKAGE).Packer


def drain(
    packer_class: Any, pool: list[ArraySample], draws: np.ndarray, args: argparse.Namespace
) -> tuple[float, float]:
    """(decode + add_batch, pack) CPU seconds per 100k samples for one pass over the stream."""
    packer = packer_class(
        n_slots=args.runs, seq_len=args.seq_len, dp_world_size=args.dp, pad_to_multiple_of=128
    )
    for slot in range(args.runs):
        packer.add_run(slot, batch_size=args.batch_size)
    add = pack = 0.0
    next_batch = 0
    while True:
        for slot in range(args.runs):
            while next_batch < len(draws) and packer.buffered_samples(slot) < 2 * args.batch_size:
                data = encode_arrays(ArrayBatch(examples=[pool[i] for i in draws[next_batch]]))  # untimed
                start = time.process_time()
                packer.add_batch(slot, decode_stored(data), batch_id=next_batch)
                add += time.process_time() - start
                next_batch += 1
        start = time.process_time()
        result = packer.pack(force=True)
        pack += time.process_time() - start
        if result is None:
            break
    per_100k = 100_000 / draws.size
    return add * per_100k, pack * per_100k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="source tree of the other version")
    parser.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=["lognormal"])
    parser.add_argument("--samples", type=int, default=32_768, help="per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"baseline": load_baseline(args.baseline.resolve(), Path(tmp)), "this tree": Packer}
        print(
            f"| distribution | version | decode + add_batch, min / median | pack, min / median "
            f"| total, min / median (CPU s per 100k samples, {args.rounds} rounds) |"
        )
        print("|---|---|---:|---:|---:|")
        for dist in args.distributions:
            rng = np.random.default_rng(args.seed)
            pool = to_arrays(TrainingBatch(examples=make_pool(dist, args.seq_len, 5000, rng))).examples
            gc.collect()  # the list form is garbage now; keep collections in the timed part cheap
            draws = rng.integers(0, len(pool), (args.samples // args.batch_size, args.batch_size))
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in versions}
            for _ in range(args.rounds):
                for name, packer_class in versions.items():
                    times[name].append(drain(packer_class, pool, draws, args))
            for name, rounds in times.items():
                adds, packs = [a for a, _ in rounds], [p for _, p in rounds]
                totals = [a + p for a, p in rounds]
                print(
                    f"| {dist} | {name} | {min(adds):.2f} / {median(adds):.2f} s "
                    f"| {min(packs):.2f} / {median(packs):.2f} s | {min(totals):.2f} / {median(totals):.2f} s |"
                )


if __name__ == "__main__":
    main()
