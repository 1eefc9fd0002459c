"""The per-micro-batch gradient guard of `trainer_core.step.backward_isolated`: before vs now.

    python -m bench.grad_guard                                  # CPU
    python -m bench.grad_guard --device cuda --runs 1,8

Before each micro-batch's backward the pool keeps the present runs' gradients so that a run whose
gradients come out non-finite can be rolled back without touching the others, and after it checks that
every gradient is finite. Timed here on N runs' LoRA gradients of the Qwen2-0.5B shape (rank 16 on the
seven linears of 24 layers, 336 tensors per run, bench/optimizer_step.py), with the backward itself left
out (it is the same either way):

- before: a clone of every gradient, then ``bool(torch.isfinite(g).all())`` per gradient (a host
  synchronisation each); autograd accumulated into the kept tensors.
- now (`trainer_core.step`): the gradients set aside, the fresh ones checked by one multi-tensor kernel and
  one host read, then added to the set-aside ones by one multi-tensor add.

Median wall ms over --repeats interleaved rounds.
"""

import argparse
import statistics
import time

import torch

from bench.optimizer_step import run_tensors
from trainer_core import step as pool_step


def before(params: list[torch.nn.Parameter], fresh: list[torch.Tensor]) -> bool:
    kept = [None if p.grad is None else p.grad.clone() for p in params]
    for p, g in zip(params, fresh, strict=True):  # what autograd's accumulation does
        assert p.grad is not None
        p.grad.add_(g)
    finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
    del kept
    return finite


def now(params: list[torch.nn.Parameter], fresh: list[torch.Tensor]) -> bool:
    earlier = pool_step._take_grads(params)
    for p, g in zip(params, fresh, strict=True):  # what autograd's fresh gradients are
        p.grad = g
    finite = pool_step._grads_finite(params)
    pool_step._add_back(params, earlier)
    return finite


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--runs", default="1,8")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {device}; rank {args.rank}, 336 LoRA tensors per run")
    print("| runs | before ms | now ms | before ÷ now |")
    print("|---:|---:|---:|---:|")
    for runs in (int(v) for v in args.runs.split(",")):
        params = [q for slot in range(runs) for q in run_tensors(args.rank, args.device, seed=slot)]
        for q in params:
            q.grad = torch.zeros_like(q)
        fresh = [torch.randn_like(q) * 1e-3 for q in params]
        times: dict[str, list[float]] = {"before": [], "now": []}
        for round_ in range(args.repeats + 1):
            for name, guard in (
                (("before", before), ("now", now)) if round_ % 2 else (("now", now), ("before", before))
            ):
                # `now` hands the fresh tensors to the parameters: give each call its own copies.
                given = [g.clone() for g in fresh] if name == "now" else fresh
                sync()
                start = time.perf_counter()
                assert guard(params, given)
                sync()
                if round_:
                    times[name].append((time.perf_counter() - start) * 1e3)
        b, n = statistics.median(times["before"]), statistics.median(times["now"])
        print(f"| {runs} | {b:.1f} | {n:.1f} | {b / n:.1f}× |")


if __name__ == "__main__":
    main()
