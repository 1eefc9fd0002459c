"""Sampling throughput on the pool: KV-cache batched generation (trainer_core.sampling, what the pool
runs) vs. the previous decoder (no cache: every new token re-reads every sequence in one packed
forward per row of <= --seq-len tokens).

    python -m bench.sampling                              # CPU, fp32, the defaults below
    python -m bench.sampling --model medium --sequences 16 --max-tokens 128

--sequences sequences of random --prompt-len-token prompts, spread over --adapters LoRA slots (rank
8 on q/k/v/o), each decoding exactly --max-tokens tokens (no stop) at temperature 1 with its own
seed. Both decoders draw from the same seeds, so they produce the same tokens: the bench checks it
and reports the largest difference of the returned logprobs. --model: `builtin` (loraloom-tiny, the
CPU deployment's model) or `medium` (a random Llama, hidden 512, 4 layers, 8 heads). Timing: wall
and process CPU time of one full generation per repeat, after one untimed warm-up; median of
--repeats. Tokens/s counts generated tokens.
"""

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from contracts.tinker_work import SamplingSpec
from trainer_core.lora import MultiLoRA, apply_multi_lora
from trainer_core.modeling import forward_packed
from trainer_core.packing import MicroBatch
from trainer_core.sampling import Decoding, generate, pick_token

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build(model_name: str, adapters: int) -> tuple[nn.Module, MultiLoRA]:
    torch.manual_seed(0)
    if model_name == "builtin":
        from tests.e2e.helpers import MODEL_CACHE
        from trainer_core.models.registry import load_base_model

        model: nn.Module = load_base_model("loraloom-tiny", cache_dir=MODEL_CACHE)
    else:
        attention: dict[str, Any] = {"attn_implementation": "loraloom_packed"}
        config = LlamaConfig(
            vocab_size=2048,
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=1024,
            **attention,
        )
        model = LlamaForCausalLM(config)
        for p in model.parameters():
            p.requires_grad_(False)
    lora = apply_multi_lora(model, TARGETS, n_slots=adapters, max_rank=8)
    with torch.no_grad():
        for slot in range(adapters):
            lora.configure_slot(slot, rank=8, alpha=16.0)
            lora.reset_slot(slot, seed=slot)
            for p in lora.slot_parameters(slot):
                p.add_(0.05 * torch.randn(p.shape))
    return model.eval(), lora


def decodings(args: argparse.Namespace, vocab: int) -> list[Decoding]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(args.sequences):
        prompt = torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist()
        spec = SamplingSpec(
            prompt=prompt, num_samples=1, max_tokens=args.max_tokens, temperature=1.0, top_k=-1, top_p=1.0
        )
        out.append(
            Decoding(
                slot=i % args.adapters,
                prompt=prompt,
                spec=spec,
                generator=torch.Generator().manual_seed(100 + i),
                stop_tokens=frozenset(),
            )
        )
    return out


def cached(model: nn.Module, lora: MultiLoRA, rows: list[Decoding], _seq_len: int) -> None:
    generate(model, lora, rows)


@torch.no_grad()
def recompute(model: nn.Module, lora: MultiLoRA, rows: list[Decoding], seq_len: int) -> None:
    """The decoder before the KV cache: per new token, every live sequence in full, packed."""
    while any(not d.done for d in rows):
        live = sorted((d for d in rows if not d.done), key=lambda d: d.slot or 0)
        packed: list[list[Decoding]] = []
        used = seq_len
        for d in live:
            n = len(d.prompt) + len(d.generated)
            if used + n > seq_len:
                packed.append([])
                used = 0
            packed[-1].append(d)
            used += n
        for row in packed:
            seqs = [d.prompt + d.generated for d in row]
            lens = [len(s) for s in seqs]
            mb = MicroBatch.without_loss(
                torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                seq_lens=lens,
                slots=[d.slot or 0 for d in row],
                n_slots=lora.n_slots,
            )
            with lora.segments(mb.slot_token_counts):
                logits = forward_packed(model, mb).float()  # (L, V)
            ends = torch.cumsum(torch.tensor(lens), 0) - 1
            for d, end in zip(row, ends.tolist(), strict=True):
                token = pick_token(logits[end], d.spec, d.generator)
                d.generated.append(token)
                d.logprobs.append(float(torch.log_softmax(logits[end], -1)[token]))
                if len(d.generated) >= d.spec.max_tokens:
                    d.stop_reason = "length"


Decoder = Callable[[nn.Module, MultiLoRA, list[Decoding], int], None]


def time_one(decoder: Decoder, model: nn.Module, lora: MultiLoRA, args: argparse.Namespace, vocab: int):
    walls, cpus = [], []
    rows: list[Decoding] = []
    for repeat in range(args.repeats + 1):
        rows = decodings(args, vocab)
        wall, cpu = time.perf_counter(), time.process_time()
        decoder(model, lora, rows, args.seq_len)
        if repeat:  # the first is the warm-up
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["builtin", "medium"], default="builtin")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256, help="row length of the no-cache decoder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, lora = build(args.model, args.adapters)
    vocab = int(cast(Any, model).config.vocab_size)
    generated = args.sequences * args.max_tokens
    results = {}
    print("| decoder | wall s | CPU s | tokens/s (wall) | tokens/s (CPU) |\n|---|---|---|---|---|")
    for name, decoder in (("no cache (before)", recompute), ("KV cache (now)", cached)):
        wall, cpu, rows = time_one(decoder, model, lora, args, vocab)
        results[name] = rows
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {generated / wall:.0f} | {generated / cpu:.0f} |")
    before, now = results.values()
    same = all(a.generated == b.generated for a, b in zip(before, now, strict=True))
    diff = max(
        abs(x - y)
        for a, b in zip(before, now, strict=True)
        for x, y in zip(a.logprobs, b.logprobs, strict=True)
    )
    print(f"\nsame tokens: {same}; largest logprob difference: {diff:.2e}")


if __name__ == "__main__":
    main()
