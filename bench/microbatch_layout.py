"""What a packed row (`MicroBatch`) costs to hold, to send to another rank, and to expand in the step.

Packs one stream of the Packer path (``bench/packing.py``'s samples: ``--runs`` runs × ``--batch-size``,
``--seq-len``, ``dp_world_size`` ``--dp``) and, over its real rows, reports:

- **stored bytes per token**: the row's tensors as the Packer builds them (the compact contract: int32
  ids, bool loss mask, float32 logprobs per token; per-segment slot/temperature/advantage/prompt length);
- **expanded bytes per token**: the per-token views the model and the loss read (``input_ids``,
  ``position_ids``, ``loss_mask``, ``advantages``, ``inference_logprobs``, ``temperatures``,
  ``token_slots``, ``sample_ids``) — what every row held before the compact contract;
- **pickled bytes per token**: ``pickle.dumps`` of the row (what ``scatter_from_master`` sends), and of a
  dict of the expanded views (the old row's payload);
- **expansion time**: building every per-token view of a fresh copy of the row in torch (CPU, 1 thread)
  — the work the compact contract moves from the Packer into the training step.

Run: ``.venv/bin/python bench/microbatch_layout.py`` (``--help`` for the knobs). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import time

import numpy as np
import torch

from bench.packing import make_pool
from contracts.wire import TrainingBatch
from trainer_core.packing import MicroBatch, Packer

_VIEWS = (
    "input_ids",
    "position_ids",
    "loss_mask",
    "advantages",
    "inference_logprobs",
    "temperatures",
    "token_slots",
    "sample_ids",
)


def _nbytes(mb: MicroBatch) -> int:
    """Bytes of the row's stored tensors."""
    return sum(
        v.numel() * v.element_size()
        for f in dataclasses.fields(mb)
        if isinstance(v := getattr(mb, f.name), torch.Tensor)
    )


def _expand(mb: MicroBatch) -> float:
    """Seconds of CPU to build every per-token view of a fresh copy of ``mb``."""
    fresh = dataclasses.replace(mb)  # no cached views
    start = time.process_time()
    for name in _VIEWS:
        getattr(fresh, name)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--distribution", default="lognormal")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--pool", type=int, default=2000)
    parser.add_argument("--packs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    rng = np.random.default_rng(args.seed)
    pool = make_pool(args.distribution, args.seq_len, args.pool, rng)
    packer = Packer(n_slots=args.runs, seq_len=args.seq_len, dp_world_size=args.dp, pad_to_multiple_of=128)
    for slot in range(args.runs):
        packer.add_run(slot, batch_size=args.batch_size)
    rows: list[MicroBatch] = []
    batch_id = 0
    while len(rows) < args.packs * args.dp:
        for slot in range(args.runs):
            draws = rng.integers(0, len(pool), args.batch_size)
            packer.add_batch(slot, TrainingBatch(examples=[pool[i] for i in draws]), batch_id=batch_id)
            batch_id += 1
        result = packer.pack(force=True)
        assert result is not None
        packer.take_ready()
        rows += [mb for rank in result.micro_batches for mb in rank if not mb.is_filler]

    tokens = sum(mb.num_tokens for mb in rows)
    stored = sum(_nbytes(mb) for mb in rows)
    pickled = sum(len(pickle.dumps(mb)) for mb in rows)
    expand_s = sum(_expand(mb) for mb in rows)
    expanded = sum(sum(getattr(mb, n).numel() * getattr(mb, n).element_size() for n in _VIEWS) for mb in rows)
    dense_pickled = sum(
        len(pickle.dumps({n: getattr(mb, n) for n in _VIEWS} | {"seq_lens": mb.seq_lens})) for mb in rows
    )
    print(
        f"### MicroBatch layout: {len(rows)} rows, {tokens:,} tokens ({args.distribution}, seq_len {args.seq_len}, "
        f"{args.runs} runs × batch_size {args.batch_size}, dp {args.dp})\n"
    )
    print(
        "| stored B/token | expanded views B/token | pickled B/token (row) | pickled B/token (expanded views) "
        "| expansion CPU per row | expansion ns/token |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {stored / tokens:.2f} | {expanded / tokens:.2f} | {pickled / tokens:.2f} | {dense_pickled / tokens:.2f} "
        f"| {1e6 * expand_s / len(rows):.0f} µs | {1e9 * expand_s / tokens:.2f} |"
    )


if __name__ == "__main__":
    main()
