"""Multi-LoRA forward+backward benchmark: N adapters in one micro-batch vs one, and vs peft.

    python -m bench.multilora                                   # CPU, fp32, defaults below
    python -m bench.multilora --device cuda --dtype bf16 --repeats 20 --warmup 5

A Llama-style model built from a config (random weights), LoRA of rank --rank on all seven
projections. One micro-batch is --tokens tokens: --tokens / --seq-len sequences of --seq-len
tokens, split evenly across N adapters (N must divide the number of sequences, so every adapter
gets whole sequences and attention costs the same in every mode). Modes:

- multi:      trainer_core.lora, one forward/backward over the whole micro-batch, N slots mixed
              (path "auto"); ratio column = time / time of multi at N = 1 on the same tokens.
- multi-loop: the same with the per-segment loop path forced (the reference path).
- peft:       one PeftModel with N adapters; per adapter: set_adapter, forward/backward on that
              adapter's sub-batch (what peft offers for training several adapters).

Timing: every (mode, N) is built in one process and timed in interleaved rounds (on a shared,
noisy machine a slow period then hits all configs alike); median and min over --repeats rounds,
after --warmup untimed steps each, as wall time and process CPU time; ratios use CPU time on the
CPU (other processes' share of a shared machine is not counted) and wall time on CUDA. Peak
memory: each (mode, N) in a fresh subprocess, one step: on CUDA max_memory_allocated minus what
was allocated before the step; on CPU the growth of the resident set over the step (VmHWM, reset
first; model, adapters and inputs already built). Prints a markdown table.
"""

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from trainer_core.lora import PathName

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Result:
    mode: str
    n: int
    median_ms: float
    min_ms: float
    median_cpu_ms: float
    peak_mem_mb: float
    path: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--ns", default="1,2,4,8,16", help="adapter counts, comma-separated")
    p.add_argument("--modes", default="multi,peft", help="of multi, multi-loop, peft")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per config (>= 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds over all configs")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "mode:n": peak memory, internal
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> torch.nn.Module:
    from trainer_core.models.tiny import build_model

    model = build_model(
        "llama",
        seed=0,
        dtype=DTYPES[args.dtype],
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=args.seq_len,
    )
    return model.to(args.device).train()


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits  # (S, L, V)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def multi_step_fn(args: argparse.Namespace, n: int, path: "PathName") -> tuple[Callable[[], None], str]:
    from trainer_core.lora import SegmentLayout, apply_multi_lora

    model = build(args)
    handle = apply_multi_lora(model, TARGETS, n_slots=n, max_rank=args.rank, path=path)
    params = []
    for slot in range(n):
        handle.configure_slot(slot, rank=args.rank, alpha=2.0 * args.rank)
        handle.reset_slot(slot, seed=slot)
        params += handle.slot_parameters(slot)
    ids = make_ids(args)
    counts = [args.tokens // n] * n

    def step() -> None:
        for p in params:
            p.grad = None
        with handle.segments(counts):
            loss_of(model, ids).backward()

    layer = next(iter(handle.layers.values()))
    chosen = layer.resolve_path(layer.lora_A[0].device, layer.lora_A[0].dtype, SegmentLayout(tuple(counts)))
    return step, chosen


def peft_step_fn(args: argparse.Namespace, n: int) -> tuple[Callable[[], None], str]:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0)
    # Adapters in the model's dtype, as trainer_core's (peft would upcast bf16 adapters to fp32).
    model = get_peft_model(build(args), config, adapter_name="a0", autocast_adapter_dtype=False)
    for i in range(1, n):
        model.add_adapter(f"a{i}", config, autocast_adapter_dtype=False)
    ids = make_ids(args)
    rows = ids.shape[0] // n

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        for i in range(n):
            model.set_adapter(f"a{i}")
            loss_of(model, ids[i * rows : (i + 1) * rows]).backward()

    return step, "peft"


def make_ids(args: argparse.Namespace) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.tokens // args.seq_len, args.seq_len), generator=gen)
    return ids.to(args.device)  # (S, L)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_step(args: argparse.Namespace, mode: str, n: int) -> tuple[Callable[[], None], str]:
    if mode == "peft":
        return peft_step_fn(args, n)
    return multi_step_fn(args, n, "loop" if mode == "multi-loop" else "auto")


Timings = dict[tuple[str, int], list[tuple[float, float]]]


def time_all(
    args: argparse.Namespace, configs: list[tuple[str, int]]
) -> tuple[Timings, dict[tuple[str, int], str]]:
    """Every config built in this process, then timed in interleaved rounds: (wall ms, CPU ms).

    Interleaving makes a shared machine's slow periods hit every config alike instead of
    whichever config happened to run during them. Process CPU time does not count the time
    other processes held the cores, so on CPU it is the steadier measure of the work done.
    """
    steps, paths = {}, {}
    for key in configs:
        steps[key], paths[key] = make_step(args, *key)
        steps[key]()  # first step: allocator and autograd warm-up
    for _ in range(args.warmup - 1):
        for key in configs:
            steps[key]()
    times: Timings = {key: [] for key in configs}
    for round_ in range(args.repeats):
        order = configs[round_ % len(configs) :] + configs[: round_ % len(configs)]
        for key in order:
            sync(args.device)
            wall, cpu = time.perf_counter(), time.process_time()
            steps[key]()
            sync(args.device)
            times[key].append(((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3))
        print(f"  round {round_ + 1}/{args.repeats} done", file=sys.stderr)
    return times, paths


def _proc_status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_memory_worker(args: argparse.Namespace) -> float:
    """In a fresh process: peak memory (MB) of one forward/backward of config `args.worker`.

    CPU: resident-set growth over the step. VmHWM is reset to the current RSS first (Linux
    clear_refs), because ru_maxrss would still hold the model build's peak and, after
    fork+exec, even the parent's.
    """
    mode, n = args.worker.split(":")
    step, _ = make_step(args, mode, int(n))
    sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        step()
        sync(args.device)
        return (torch.cuda.max_memory_allocated() - held) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _proc_status_kb("VmRSS")
    step()
    return (_proc_status_kb("VmHWM") - before) / 1024


def peak_memory(argv: list[str], mode: str, n: int) -> float:
    cmd = [sys.executable, "-m", "bench.multilora", *argv, "--worker", f"{mode}:{n}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def run_all(args: argparse.Namespace, argv: list[str]) -> list[Result]:
    ns = [int(v) for v in args.ns.split(",")]
    n_seqs = args.tokens // args.seq_len
    if args.tokens % args.seq_len or any(n_seqs % n for n in ns):
        raise SystemExit(f"--tokens/--seq-len = {n_seqs} sequences must divide evenly by every N in {ns}")
    configs = [(mode, n) for mode in args.modes.split(",") for n in ns]
    # Memory first, while this process is still small (its children start from its size).
    mems = {key: float("nan") if args.no_memory else peak_memory(argv, *key) for key in configs}
    times, paths = time_all(args, configs)
    results = []
    for key in configs:
        wall, cpu = zip(*times[key], strict=True)
        results.append(
            Result(*key, statistics.median(wall), min(wall), statistics.median(cpu), mems[key], paths[key])
        )
    return results


def table(results: list[Result], basis: str) -> str:
    """Ratios on the median `basis` time ("wall" or "cpu")."""

    def t(r: Result) -> float:
        return r.median_cpu_ms if basis == "cpu" else r.median_ms

    base = {r.mode: t(r) for r in results if r.n == 1}
    peft = {r.n: t(r) for r in results if r.mode == "peft"}
    lines = [
        "| mode | N | path | median wall ms | min wall ms | median CPU ms "
        f"| ratio to N=1 ({basis}) | speed-up vs peft ({basis}) | peak mem MB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = f"{t(r) / base[r.mode]:.3f}" if r.mode in base else "-"
        speedup = f"{peft[r.n] / t(r):.2f}x" if r.n in peft and r.mode != "peft" else "-"
        lines.append(
            f"| {r.mode} | {r.n} | {r.path} | {r.median_ms:.0f} | {r.min_ms:.0f} | {r.median_cpu_ms:.0f} "
            f"| {ratio} | {speedup} | {r.peak_mem_mb:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        print(peak_memory_worker(args))
        return
    results = run_all(args, argv)
    print(
        f"torch {torch.__version__}, device {args.device}, dtype {args.dtype}, threads {args.threads or 'default'}"
    )
    # On a GPU the CPU time is only the host's; on the CPU it is the work, whoever else runs.
    print(table(results, "wall" if args.device == "cuda" else "cpu"))


if __name__ == "__main__":
    main()
