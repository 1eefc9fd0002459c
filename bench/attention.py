"""Packed ÷ batched attention: one packed row against the same samples as a plain causal batch.

    python -m bench.attention                                  # CPU, fp32, L = 4096 and 8192
    python -m bench.attention --lengths 4096 --impls packed --no-memory
    python -m bench.attention --device cuda --dtype bf16 --lengths 8192,16384 --impls auto,packed,sdpa

The same S samples of L/S tokens each (default S = 16) run two ways: as one packed row of L tokens
(`trainer_core.packing.Packer` → `forward_packed`, as the worker trains) and as a plain causal batch of
S rows of L/S tokens (no padding: equal lengths, so the batch does exactly the useful work and the
ratio measures what packing costs). Two parts:

- **model** (the acceptance figure): a Qwen2-0.5B-layout model (hidden 896, 14 heads, 2 KV heads,
  head_dim 64, intermediate 4864; --layers layers, --vocab vocabulary) is built from a config, saved, and
  loaded through the pool's own loader, `trainer_core.models.registry.load_base_model(dir,
  attn_implementation=..., dtype=...)`; LoRA as the worker applies it (`apply_multi_lora`, q/k/v/o, 4
  slots of rank 16, fp32 master weights), the samples spread over the 4 slots; training mode; one
  forward + backward with next-token cross-entropy. For each attention implementation of --impls
  (``packed``: per-sample SDPA, the new default; ``eager``: the old pool default, dense (1,1,L,L) mask;
  ``sdpa``: dense mask through SDPA; ``auto``: what the loader picks for the device): packed and batched
  time, ratio, and peak memory.
- **kernels** (how the packed kernel was chosen): attention alone (forward + backward of q, k, v with the
  model's head layout), packed row vs the batched SDPA: per-segment SDPA (`segment_attention`), one SDPA
  with the dense additive mask, ``flex_attention`` with a block mask where it can run, and torch's
  flash varlen kernel (``torch.nn.attention.varlen.varlen_attn``: CUDA, half dtypes) where it can run.

Timing: every config is built once in this process and timed in interleaved rounds (a slow period of a
shared machine hits all configs alike): median over --repeats rounds after --warmup untimed steps, as
wall and process CPU time; ratios use CPU time on CPU (other processes' share of the cores is not
counted) and wall time on CUDA. Peak memory (model part): each config again in a fresh subprocess, one
step: on CUDA ``max_memory_allocated`` minus what was allocated before it; on CPU the growth of the
resident set over the step (VmHWM reset through /proc/self/clear_refs first). Prints markdown tables.
"""

import argparse
import inspect
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
SLOTS = 4
RANK = 16
Step = Callable[[], None]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--lengths", default="4096,8192", help="row lengths L, comma-separated")
    p.add_argument("--samples", type=int, default=16, help="samples per row (S); L must divide by it")
    p.add_argument("--impls", default="packed,eager", help="of auto, packed, eager, sdpa, flash_attention_2")
    p.add_argument("--parts", default="model,kernels", help="of model, kernels")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=1024, help="small: the LM head is not what is measured")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)  # internal: memory workers
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: "impl:L:layout"
    return p.parse_args(argv)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- model part -------------------------------------------------------------------------------------


def save_model(args: argparse.Namespace, path: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=max(int(v) for v in args.lengths.split(",")),
        use_sliding_window=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def model_step(args: argparse.Namespace, model_dir: str, impl: str, length: int, layout: str) -> Step:
    """One forward + backward of the row ("packed") or the batch ("batched"), through load_base_model."""
    from bench.packed_row import packed_row
    from trainer_core.lora import apply_multi_lora
    from trainer_core.modeling import forward_packed
    from trainer_core.models.registry import load_base_model

    model = load_base_model(model_dir, dtype=args.dtype, attn_implementation=impl, device=args.device)
    model.to(args.device)
    lora = apply_multi_lora(model, TARGETS, SLOTS, RANK, dtype=torch.float32)
    for slot in range(SLOTS):
        lora.reset_slot(slot, seed=slot)
    model.train()
    n = length // args.samples
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(1, args.vocab, (args.samples, n), generator=gen)  # (S, n)
    per_slot = args.samples // SLOTS

    if layout == "packed":
        row = packed_row(ids, SLOTS)
        targets = row.input_ids[1:].to(args.device)

        def step() -> None:
            with lora.segments(row.slot_token_counts):
                logits = forward_packed(model, row)  # (L, V)
            F.cross_entropy(logits[:-1].float(), targets).backward()

        return step

    batch = ids.to(args.device)
    counts = [per_slot * n] * SLOTS  # samples are in slot order: S/4 rows per slot

    def step_batched() -> None:
        with lora.segments(counts):
            logits = model(input_ids=batch, use_cache=False).logits  # (S, n, V)
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten()).backward()

    return step_batched


def _proc_status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_memory_worker(args: argparse.Namespace) -> float:
    """In a fresh process: peak memory (MiB) of one step of config ``args.worker``."""
    impl, length, layout = args.worker.split(":")
    step = model_step(args, args.model_dir, impl, int(length), layout)
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


def peak_memory(argv: list[str], model_dir: str, key: tuple[str, int, str]) -> float:
    impl, length, layout = key
    cmd = [sys.executable, "-m", "bench.attention", *argv, "--model-dir", model_dir]
    cmd += ["--worker", f"{impl}:{length}:{layout}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


# ---- kernels part -----------------------------------------------------------------------------------


def kernel_steps(args: argparse.Namespace, length: int) -> dict[str, Step | str]:
    """Attention alone on the model's head layout; a string instead of a step says why it cannot run."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from trainer_core.modeling import packed_attention_mask, segment_ids
    from trainer_core.models.attention import segment_attention

    heads, kv_heads, head_dim = 14, 2, 64
    n = length // args.samples
    dtype, device = DTYPES[args.dtype], args.device

    def leaf(*shape: int) -> torch.Tensor:
        # As in the model: projections come out (B, T, heads, D) and attention sees them transposed.
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)

    q, k, v = (leaf(1, length, h, head_dim) for h in (heads, kv_heads, kv_heads))
    qb, kb, vb = (leaf(args.samples, n, h, head_dim) for h in (heads, kv_heads, kv_heads))
    lens = [n] * args.samples
    mask = packed_attention_mask(lens, dtype=dtype, device=device)  # (1, 1, L, L)

    def t(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)

    def batched() -> None:
        out = F.scaled_dot_product_attention(t(qb), t(kb), t(vb), is_causal=True, enable_gqa=True)
        out.transpose(1, 2).contiguous().sum().backward()  # (S, n, H, D), as transformers returns it

    def per_segment() -> None:
        segment_attention(t(q), t(k), t(v), lens).contiguous().sum().backward()

    def dense_mask() -> None:
        # As transformers' SDPA path does with a mask: the KV heads repeated, the mask added to the scores.
        rep = heads // kv_heads
        out = F.scaled_dot_product_attention(
            t(q), t(k).repeat_interleave(rep, 1), t(v).repeat_interleave(rep, 1), attn_mask=mask
        )
        out.transpose(1, 2).contiguous().sum().backward()

    steps: dict[str, Step | str] = {
        "batched SDPA (S rows, is_causal)": batched,
        "packed: per-segment SDPA (chosen)": per_segment,
        "packed: SDPA + dense (1,1,L,L) mask": dense_mask,
    }
    seg = segment_ids(lens, device)
    block_mask = create_block_mask(
        lambda b, h, qi, ki: (seg[qi] == seg[ki]) & (qi >= ki), None, None, length, length, device=device
    )

    def flex() -> None:
        out = flex_attention(t(q), t(k), t(v), block_mask=block_mask, enable_gqa=True)
        assert isinstance(out, torch.Tensor)
        out.transpose(1, 2).contiguous().sum().backward()

    try:
        flex()
        steps["packed: flex_attention + block mask (eager)"] = flex
    except Exception as exc:  # noqa: BLE001 - reported in the table: why this kernel cannot run here
        steps["packed: flex_attention + block mask"] = f"cannot run: {str(exc).splitlines()[0][:120]}"
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)  # (S+1,)

    def varlen() -> None:
        out = varlen_causal(q[0], k[0], v[0], cu_seqlens, n)  # (L, H, D)
        out.contiguous().sum().backward()

    try:
        varlen()
        steps["packed: torch varlen_attn (one call)"] = varlen
    except Exception as exc:  # noqa: BLE001 - CUDA-only, half dtypes only: said in the table
        steps["packed: torch varlen_attn"] = f"cannot run: {str(exc).splitlines()[0][:120]}"
    return steps


def varlen_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """torch's flash varlen attention, causal, (T, H, D) → (T, H, D); its keyword arguments differ
    between torch versions (``is_causal`` or ``window_size``; ``enable_gqa`` or not), so read them."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, object] = {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)  # type: ignore[arg-type]
    return out[0] if isinstance(out, tuple) else out


# ---- timing and report ------------------------------------------------------------------------------


@dataclass
class Timing:
    wall_ms: float
    cpu_ms: float


def time_interleaved(args: argparse.Namespace, steps: dict[str, Step]) -> dict[str, Timing]:
    keys = list(steps)
    for key in keys:
        for _ in range(args.warmup):
            steps[key]()
    samples: dict[str, list[tuple[float, float]]] = {key: [] for key in keys}
    for round_ in range(args.repeats):
        for key in keys[round_ % len(keys) :] + keys[: round_ % len(keys)]:
            sync(args.device)
            wall, cpu = time.perf_counter(), time.process_time()
            steps[key]()
            sync(args.device)
            samples[key].append(((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3))
        print(f"  round {round_ + 1}/{args.repeats}", file=sys.stderr)
    return {
        key: Timing(statistics.median(w for w, _ in s), statistics.median(c for _, c in s))
        for key, s in samples.items()
    }


def basis(args: argparse.Namespace, t: Timing) -> float:
    return t.cpu_ms if args.device == "cpu" else t.wall_ms


def ms(args: argparse.Namespace, value: float) -> str:
    """Whole ms on the CPU; on a GPU a kernel takes a few ms, so two decimals."""
    return f"{value:.0f}" if args.device == "cpu" else f"{value:.2f}"


def run_model_part(args: argparse.Namespace, argv: list[str], model_dir: str) -> str:
    from trainer_core.models.precision import resolve_attn_implementation, resolve_dtype

    dtype = resolve_dtype(args.dtype, args.device)
    impls = [resolve_attn_implementation(i, args.device, dtype) for i in args.impls.split(",")]
    impls = list(dict.fromkeys(impls))
    lengths = [int(v) for v in args.lengths.split(",")]
    keys = [
        (impl, length, layout) for length in lengths for impl in impls for layout in ("packed", "batched")
    ]
    # Memory first, while this process is small (its children start from its size).
    mem = {key: float("nan") if args.no_memory else peak_memory(argv, model_dir, key) for key in keys}
    lines = [
        "| L | attention (load_base_model) | packed ms | batched ms | packed ÷ batched "
        f"({'CPU' if args.device == 'cpu' else 'wall'}) | packed peak MiB | batched peak MiB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for length in lengths:  # one length at a time: only its models are alive
        steps = {
            f"{impl}:{layout}": model_step(args, model_dir, impl, length, layout)
            for impl in impls
            for layout in ("packed", "batched")
        }
        print(f"model part, L = {length}", file=sys.stderr)
        times = time_interleaved(args, steps)
        for impl in impls:
            p, b = times[f"{impl}:packed"], times[f"{impl}:batched"]
            lines.append(
                f"| {length} | {impl} | {ms(args, basis(args, p))} | {ms(args, basis(args, b))} | "
                f"{basis(args, p) / basis(args, b):.2f} | {mem[(impl, length, 'packed')]:.0f} | "
                f"{mem[(impl, length, 'batched')]:.0f} |"
            )
        del steps
    return "\n".join(lines)


def run_kernel_part(args: argparse.Namespace) -> str:
    lines = [
        f"| L | kernel (fwd + bwd) | ms ({'CPU' if args.device == 'cpu' else 'wall'}) | ÷ batched |",
        "|---:|---|---:|---:|",
    ]
    for length in (int(v) for v in args.lengths.split(",")):
        steps = kernel_steps(args, length)
        runnable = {k: s for k, s in steps.items() if not isinstance(s, str)}
        print(f"kernels, L = {length}", file=sys.stderr)
        times = time_interleaved(args, runnable)
        base = basis(args, times["batched SDPA (S rows, is_causal)"])
        for key, step in steps.items():
            if isinstance(step, str):
                lines.append(f"| {length} | {key} | {step} | - |")
            else:
                lines.append(
                    f"| {length} | {key} | {ms(args, basis(args, times[key]))} | "
                    f"{basis(args, times[key]) / base:.2f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        print(f"{peak_memory_worker(args):.1f}")
        return
    lengths = [int(v) for v in args.lengths.split(",")]
    if any(length % args.samples for length in lengths) or args.samples % SLOTS:
        raise SystemExit(f"every L must divide by --samples, and --samples by {SLOTS} (the slots)")
    print(
        f"torch {torch.__version__}, device {args.device}, dtype {args.dtype}, threads {torch.get_num_threads()}, "
        f"S = {args.samples} samples per row, load average {os.getloadavg()[0]:.1f} at start"
    )
    parts = args.parts.split(",")
    if "model" in parts:
        with tempfile.TemporaryDirectory(prefix="bench-attention-") as tmp:
            save_model(args, Path(tmp))
            print("\n" + run_model_part(args, argv, tmp))
    if "kernels" in parts:
        print("\n" + run_kernel_part(args))
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
