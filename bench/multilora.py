"""Multi-LoRA forward+backward benchmark: N adapters in one micro-batch vs one, and vs peft.

    python -m bench.multilora                                   # CPU, fp32, defaults below
    python -m bench.multilora --device cuda --dtype bf16 --preset qwen2-0.5b --tokens 8192 --seq-len 512 \
        --ns 1,8,16 --repeats 10 --warmup 3                     # issue 15 item 7 (GPU)

A model built from a config (random weights; --arch, default a Llama layout, or --preset qwen2-0.5b:
Qwen2-0.5B's shape, 24 layers, vocabulary 151,936, tied embeddings), saved to a temporary directory and
loaded through the pool's own loader (`trainer_core.models.registry.load_base_model`: the dtype and the
attention implementation it picks for the device), LoRA of rank --rank on all seven projections with fp32
master weights, as the worker applies them. One micro-batch is --tokens tokens: --tokens / --seq-len
sequences of --seq-len tokens, split evenly across N adapters (N must divide the number of sequences, so
every adapter gets whole sequences and attention costs the same in every mode). Modes:

- multi:      trainer_core.lora, one forward/backward over the whole micro-batch, N slots mixed
              (path "auto"); with --layout packed (the default) the sequences are one packed row built by
              the worker's `Packer` and run through `forward_packed`, as the pool trains; with
              --layout batched a plain (sequences, seq_len) batch. Ratio column = time / time of multi
              at N = 1 on the same tokens.
- multi-loop: the same with the per-segment loop path forced (the reference path).
- multi-base: "multi" with another version of trainer_core/lora.py (--baseline-lora FILE, e.g.
              ``git show REV:trainer_core/lora.py > /tmp/lora_base.py``), timed in the same rounds: an A/B
              of a change to the LoRA layer on the same machine, minute and model.
- peft:       one PeftModel with N adapters (fp32 adapter weights, like ours); per adapter: set_adapter,
              forward/backward on that adapter's sub-batch as a plain batch (what peft offers for
              training several adapters).

Throughput: tokens/s of the median step, and model-FLOPs utilisation against --peak-tflops (default:
989 for an H100/H200's dense bf16, else none): FLOPs per token = 6 × (the parameters every token
multiplies: the layers' linears and the LM head, not the embedding lookup) + 6 × layers × seq_len ×
attention width (QKᵀ and AV, causal: half of the 12 × ... of a full square), the usual training count
(PaLM, appendix B). With a frozen base the weight gradients of the base are not computed, so the
hardware does about 2/3 of that; MFU is quoted on the usual count so that it compares with others'.

Timing: every (mode, N) is built in one process and timed in interleaved rounds (on a shared,
noisy machine a slow period then hits all configs alike); median and min over --repeats rounds,
after --warmup untimed steps each, as wall time and process CPU time; ratios use CPU time on the
CPU (other processes' share of a shared machine is not counted) and wall time on CUDA. Peak
memory: each (mode, N) in a fresh subprocess, one step: on CUDA max_memory_allocated minus what
was allocated before the step; on CPU the growth of the resident set over the step (VmHWM, reset
first; model, adapters and inputs already built). Prints a markdown table.
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from bench.packed_row import packed_row
from trainer_core.modeling import forward_packed

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
    p.add_argument(
        "--preset", default=None, choices=sorted(PRESETS), help="a known shape (overrides the sizes)"
    )
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"])
    p.add_argument("--tie", action="store_true", help="tie the LM head to the embeddings")
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
    p.add_argument("--modes", default="multi,peft", help="of multi, multi-loop, multi-base, peft")
    p.add_argument("--baseline-lora", default=None, help="the lora.py that mode multi-base runs")
    p.add_argument("--layout", default="packed", choices=["packed", "batched"], help="of the multi modes")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="for MFU (0: by device name, else none)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per config (>= 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds over all configs")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument(
        "--profile", action="store_true", help="then profile one step of each config (where the time goes)"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "mode:n": peak memory, internal
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)  # internal: the saved model
    args = p.parse_args(argv)
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)
    return args


PRESETS: dict[str, dict[str, object]] = {
    # Qwen/Qwen2-0.5B's config.json: 494M parameters, 136M of them the (tied) embedding.
    "qwen2-0.5b": {
        "arch": "qwen2",
        "hidden": 896,
        "layers": 24,
        "heads": 14,
        "kv_heads": 2,
        "intermediate": 4864,
        "vocab": 151936,
        "tie": True,
    },
}


def save_model(args: argparse.Namespace, path: str) -> None:
    """The model of the arguments, random weights from a fixed seed, saved as a checkpoint directory."""
    from trainer_core.models.tiny import build_model

    model = build_model(
        args.arch,
        seed=0,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=max(args.seq_len, args.tokens),
        tie_word_embeddings=args.tie,
    )
    torch.nn.Module.to(model, DTYPES[args.dtype]).save_pretrained(path)


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The saved model through the pool's loader (dtype as asked; attention as the loader picks it)."""
    from trainer_core.models.registry import load_base_model

    model = load_base_model(args.model_dir, dtype=args.dtype, device=args.device)
    return model.to(args.device).train()


def flops_per_token(args: argparse.Namespace) -> float:
    """Training FLOPs per token, the usual count (see the module docstring)."""
    head_dim = args.hidden // args.heads
    attn_width = args.heads * head_dim
    per_layer = (
        args.hidden * attn_width * 2  # q, o
        + args.hidden * args.kv_heads * head_dim * 2  # k, v
        + args.hidden * args.intermediate * 3  # gate, up, down
    )
    matmul_params = args.layers * per_layer + args.hidden * args.vocab  # + LM head
    return 6.0 * matmul_params + 6.0 * args.layers * args.seq_len * attn_width


def peak_tflops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return float(args.peak_tflops)
    if args.device == "cuda" and any(m in torch.cuda.get_device_name() for m in ("H100", "H200")):
        return 989.0  # dense bf16 of the SXM parts (NVIDIA's datasheet, without sparsity)
    return None


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits  # (S, L, V)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def lora_module(args: argparse.Namespace, baseline: bool) -> ModuleType:
    """trainer_core.lora, or for the baseline the file --baseline-lora loaded as a module of its own."""
    if not baseline:
        import trainer_core.lora

        return trainer_core.lora
    if not args.baseline_lora:
        raise SystemExit("mode multi-base needs --baseline-lora FILE")
    if "lora_baseline" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lora_baseline", args.baseline_lora)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["lora_baseline"] = module
        spec.loader.exec_module(module)
    return sys.modules["lora_baseline"]


def multi_step_fn(
    args: argparse.Namespace, n: int, path: "PathName", *, baseline: bool = False
) -> tuple[Callable[[], None], str]:
    lora = lora_module(args, baseline)
    SegmentLayout, apply_multi_lora = lora.SegmentLayout, lora.apply_multi_lora

    model = build(args)
    # As the worker: fp32 LoRA weights (the master weights) whatever the base's dtype.
    handle = apply_multi_lora(model, TARGETS, n_slots=n, max_rank=args.rank, path=path)
    params = []
    for slot in range(n):
        handle.configure_slot(slot, rank=args.rank, alpha=2.0 * args.rank)
        handle.reset_slot(slot, seed=slot)
        params += handle.slot_parameters(slot)
    ids = make_ids(args)
    counts = [args.tokens // n] * n
    compute_dtype = next(p for p in model.parameters() if not p.requires_grad).dtype

    if args.layout == "packed":
        row = packed_row(ids, n)
        targets = row.input_ids[1:].to(args.device)

        def step() -> None:
            for p in params:
                p.grad = None
            with handle.segments(row.slot_token_counts):
                logits = forward_packed(model, row)  # (L, V)
            F.cross_entropy(logits[:-1].float(), targets).backward()

    else:

        def step() -> None:
            for p in params:
                p.grad = None
            with handle.segments(counts):
                loss_of(model, ids).backward()

    layer = next(iter(handle.layers.values()))
    chosen = layer.resolve_path(layer.lora_A[0].device, compute_dtype, SegmentLayout(tuple(counts)))
    impl = getattr(model.config, "_attn_implementation", "?")
    return step, f"{chosen}, {args.layout}, {impl}"


def peft_step_fn(args: argparse.Namespace, n: int) -> tuple[Callable[[], None], str]:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0)
    # fp32 adapter weights, as trainer_core's (peft's default upcasts them: autocast_adapter_dtype).
    model = get_peft_model(build(args), config, adapter_name="a0")
    for i in range(1, n):
        model.add_adapter(f"a{i}", config)
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
    ids = torch.randint(1, args.vocab, (args.tokens // args.seq_len, args.seq_len), generator=gen)
    return ids.to(args.device)  # (S, L)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_step(args: argparse.Namespace, mode: str, n: int) -> tuple[Callable[[], None], str]:
    if mode == "peft":
        return peft_step_fn(args, n)
    return multi_step_fn(args, n, "loop" if mode == "multi-loop" else "auto", baseline=mode == "multi-base")


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
    if args.profile:
        for key in configs:
            print(profile_step(args, key, steps[key]))
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


def profile_step(args: argparse.Namespace, key: tuple[str, int], step: Callable[[], None]) -> str:
    """One step under torch.profiler: its wall time, kernel launches, the time the GPU was busy with
    kernels (a step whose kernels keep the GPU busy for a fraction of its wall time is bound by the host),
    and the operators by self CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    sync(args.device)
    with profile(activities=activities) as prof:
        wall = time.perf_counter()
        step()
        sync(args.device)
        wall = time.perf_counter() - wall
    events = prof.key_averages()
    launches = sum(e.count for e in events if "LaunchKernel" in e.key)
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    head = (
        f"profile {key[0]} N={key[1]}: {wall * 1e3:.1f} ms under the profiler, {launches} kernel launches, "
        f"GPU busy {busy_us / 1e3:.1f} ms ({busy_us / 1e6 / wall:.0%})"
    )
    return head + "\n" + events.table(sort_by="self_cpu_time_total", row_limit=15)


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


def peak_memory(argv: list[str], model_dir: str, mode: str, n: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "bench.multilora",
        *argv,
        "--model-dir",
        model_dir,
        "--worker",
        f"{mode}:{n}",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def run_all(args: argparse.Namespace, argv: list[str]) -> list[Result]:
    ns = [int(v) for v in args.ns.split(",")]
    n_seqs = args.tokens // args.seq_len
    if args.tokens % args.seq_len or any(n_seqs % n for n in ns):
        raise SystemExit(f"--tokens/--seq-len = {n_seqs} sequences must divide evenly by every N in {ns}")
    configs = [(mode, n) for mode in args.modes.split(",") for n in ns]
    # Memory first, while this process is still small (its children start from its size).
    mems = {
        key: float("nan") if args.no_memory else peak_memory(argv, args.model_dir, *key) for key in configs
    }
    times, paths = time_all(args, configs)
    results = []
    for key in configs:
        wall, cpu = zip(*times[key], strict=True)
        results.append(
            Result(*key, statistics.median(wall), min(wall), statistics.median(cpu), mems[key], paths[key])
        )
    return results


def table(results: list[Result], basis: str, tokens: int, flops: float, peak: float | None) -> str:
    """Ratios on the median `basis` time ("wall" or "cpu"); tokens/s and MFU on the median wall time."""

    def t(r: Result) -> float:
        return r.median_cpu_ms if basis == "cpu" else r.median_ms

    base = {r.mode: t(r) for r in results if r.n == 1}
    peft = {r.n: t(r) for r in results if r.mode == "peft"}
    lines = [
        "| mode | N | path | median wall ms | min wall ms | median CPU ms "
        f"| ratio to N=1 ({basis}) | speed-up vs peft ({basis}) | tokens/s | MFU | peak mem MB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = f"{t(r) / base[r.mode]:.3f}" if r.mode in base else "-"
        speedup = f"{peft[r.n] / t(r):.2f}x" if r.n in peft and r.mode != "peft" else "-"
        rate = tokens / (r.median_ms / 1e3)
        mfu = f"{rate * flops / (peak * 1e12):.1%}" if peak else "-"
        lines.append(
            f"| {r.mode} | {r.n} | {r.path} | {r.median_ms:.1f} | {r.min_ms:.1f} | {r.median_cpu_ms:.0f} "
            f"| {ratio} | {speedup} | {rate:,.0f} | {mfu} | {r.peak_mem_mb:.0f} |"
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
    with tempfile.TemporaryDirectory(prefix="bench-multilora-") as model_dir:
        args.model_dir = model_dir
        save_model(args, model_dir)
        results = run_all(args, argv)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, device {device}, dtype {args.dtype}, threads {args.threads or 'default'}, "
        f"{args.arch} hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
        f"{args.tokens} tokens per step ({args.tokens // args.seq_len} x {args.seq_len}), "
        f"model FLOPs/token {flops_per_token(args) / 1e9:.3f} G"
    )
    # On a GPU the CPU time is only the host's; on the CPU it is the work, whoever else runs.
    basis = "wall" if args.device == "cuda" else "cpu"
    print(table(results, basis, args.tokens, flops_per_token(args), peak_tflops(args)))
    base = {r.n: r for r in results if r.mode == "multi-base"}
    for r in results:
        if r.mode == "multi" and r.n in base:
            b = base[r.n]
            print(
                f"multi ÷ multi-base at N = {r.n}: {r.median_ms / b.median_ms:.3f} (median wall), {r.min_ms / b.min_ms:.3f} (min wall)"
            )


if __name__ == "__main__":
    main()
