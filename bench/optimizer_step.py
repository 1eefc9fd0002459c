"""The per-run optimizer step (`MultiRunOptimizer`): one tensor at a time vs torch's multi-tensor kernels.

    python -m bench.optimizer_step                          # CPU
    python -m bench.optimizer_step --device cuda --runs 1,8

Each run has the LoRA tensors of rank --rank on all seven linears of a Qwen2-0.5B-shaped model (24
layers: 336 tensors, 8.8M parameters per run), fp32 master weights as the worker keeps them. One
optimizer step of N runs (their gradients copied in beforehand, untimed): scaling by the loss-token
count, the per-run norm, clipping and AdamW (`MultiRunOptimizer.step`), timed for ``impl="loop"`` (what the pool
ran) and ``impl="foreach"``, configs interleaved over --repeats rounds after a warm-up; median wall ms
(the step ends with the norm read on the host, which synchronises a GPU). Also checks that the two
implementations give the same parameters after --check-steps steps, to the printed difference.
"""

import argparse
import statistics
import time

import torch

from contracts.run_config import OptimSettings, SchedulerSettings
from trainer_core.optim import OPTIM_IMPLS, MultiRunOptimizer, OptimImpl

HIDDEN, INTERMEDIATE, KV, LAYERS = 896, 4864, 128, 24
LINEARS = {  # (in, out) of each LoRA-wrapped linear of one layer
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV),
    "v_proj": (HIDDEN, KV),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTERMEDIATE),
    "up_proj": (HIDDEN, INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
}


def run_tensors(rank: int, device: str, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(LAYERS):
        for fan_in, fan_out in LINEARS.values():
            for shape in ((rank, fan_in), (fan_out, rank)):
                params.append(torch.nn.Parameter(torch.randn(*shape, generator=gen).to(device) * 0.02))
    return params


def build(
    impl: OptimImpl, runs: int, rank: int, device: str
) -> tuple[MultiRunOptimizer, list[list[torch.nn.Parameter]]]:
    opt = MultiRunOptimizer(runs, impl=impl)
    params = []
    for slot in range(runs):
        ps = run_tensors(rank, device, seed=slot)
        opt.create(slot, ps, optim=OptimSettings(lr=1e-3), scheduler=SchedulerSettings(), max_steps=10**6)
        params.append(ps)
    return opt, params


def set_grads(params: list[list[torch.nn.Parameter]], step: int) -> None:
    for slot, ps in enumerate(params):
        gen = torch.Generator().manual_seed(1000 * step + slot)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)


def load_grads(
    opt: MultiRunOptimizer, params: list[list[torch.nn.Parameter]], grads: list[list[torch.Tensor]]
) -> None:
    """A backward pass's gradients (copies: the step scales them in place) and loss-token counts."""
    for slot, (ps, gs) in enumerate(zip(params, grads, strict=True)):
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        opt.add_loss_tokens(slot, 1000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--runs", default="1,8", help="runs stepped together, comma-separated")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--check-steps", type=int, default=3)
    args = p.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    # Same result: a few steps of each implementation from the same start and gradients.
    finals = {}
    for impl in OPTIM_IMPLS:
        opt, params = build(impl, 2, args.rank, args.device)
        for step in range(args.check_steps):
            set_grads(params, step)
            for slot in range(2):
                opt.add_loss_tokens(slot, 1000)
            opt.step([0, 1])
        finals[impl] = torch.cat([q.detach().flatten() for ps in params for q in ps])
    diff = (finals["loop"] - finals["foreach"]).abs().max().item()
    print(f"max |loop - foreach| over 2 runs' parameters after {args.check_steps} steps: {diff:.3g}")

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, {device}; rank {args.rank}, {len(LINEARS) * LAYERS * 2} tensors per run"
    )
    print("| runs | impl | step ms (median) | ms per run | loop ÷ foreach |")
    print("|---:|---|---:|---:|---:|")
    for runs in (int(v) for v in args.runs.split(",")):
        setups = {impl: build(impl, runs, args.rank, args.device) for impl in OPTIM_IMPLS}
        grads = [[torch.randn_like(q) for q in ps] for ps in setups["loop"][1]]
        times: dict[OptimImpl, list[float]] = {impl: [] for impl in OPTIM_IMPLS}
        for round_ in range(args.repeats + 1):
            for impl in OPTIM_IMPLS if round_ % 2 == 0 else OPTIM_IMPLS[::-1]:
                opt, params = setups[impl]
                load_grads(opt, params, grads)
                sync()
                start = time.perf_counter()
                opt.step(list(range(runs)))
                sync()
                if round_:  # the first round warms up
                    times[impl].append((time.perf_counter() - start) * 1e3)
        med = {impl: statistics.median(t) for impl, t in times.items()}
        for impl in OPTIM_IMPLS:
            ratio = f"{med['loop'] / med['foreach']:.1f}×" if impl == "foreach" else ""
            print(f"| {runs} | {impl} | {med[impl]:.1f} | {med[impl] / runs:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
