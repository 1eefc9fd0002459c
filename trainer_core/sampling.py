"""Sampling on the pool (the Tinker API's `sample`): batched generation with a KV cache through the
multi-LoRA layers.

Every sequence of every claimed sample request (of any tenant) decodes in one generation pass per
*kind of weights*: one pass for all the sequences routed to adapter slots (each row through its own
slot's adapter), one for the sequences of the base model (no adapter). A pass is

    prefill   the prompts, left-padded to the longest, in one forward: (B, P) tokens with an
              attention mask that hides the padding and positions that start at 0 at each row's
              first real token, so a row sees exactly its own prompt; the keys and values go to a
              transformers `DynamicCache`
    decode    one forward of (B', 1) new tokens per step, reading the cache; a row that has
              stopped leaves the batch (`DynamicCache.batch_select_indices`)

The multi-LoRA layers need the tokens of a forward in ascending slot order: the rows are sorted by
slot, and each forward of a (B, L) block routes `L` tokens per row to the row's slot (padding
included: its output is never attended to). The logprob returned for a sampled token is the model's
own (temperature 1, no top-k/top-p), which is what a forward of the same tokens gives: the importance
ratios of a later `forward_backward` start at 1.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from contracts.tinker_work import GREEDY_TEMPERATURE, SamplingSpec
from trainer_core.lora import MultiLoRA

__all__ = ["Decoding", "PassLimits", "TextDecoder", "eos_token_ids", "generate", "pick_token"]

TextDecoder = Callable[[Sequence[int]], str]
"""Token ids → text (the base model's tokenizer): what stop strings are matched against."""


@dataclass
class Decoding:
    """One sequence being sampled: `slot` is its adapter (None: the base model)."""

    slot: int | None
    prompt: list[int]
    spec: SamplingSpec
    generator: torch.Generator
    stop_tokens: frozenset[int]
    """Token ids that end the sequence (the request's, or the model's EOS when it named none)."""
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: list[float | None] | None = None
    """Set by the prefill when the request asks for them."""

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def take(self, logits: Tensor, decode: TextDecoder | None) -> None:
        """Draw the next token from `logits` (V,) of the last position; stop if it ends the sequence.

        A stop token or stop string is part of the returned tokens (the token that completed it:
        a string may end inside a token, which cannot be cut)."""
        logits = logits.float()
        token = pick_token(logits, self.spec, self.generator)
        self.generated.append(token)
        # The model's own logprob (temperature 1): what a forward of these tokens gives.
        self.logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        if token in self.stop_tokens or self._stop_string(decode):
            self.stop_reason = "stop"
        elif len(self.generated) >= self.spec.max_tokens:
            self.stop_reason = "length"

    def _stop_string(self, decode: TextDecoder | None) -> bool:
        if not self.spec.stop_strings or decode is None:
            return False
        text = decode(self.generated)
        return any(stop in text for stop in self.spec.stop_strings)


def pick_token(logits: Tensor, spec: SamplingSpec, generator: torch.Generator) -> int:
    """The next token from `logits` (V,): greedy at temperature 0 and below GREEDY_TEMPERATURE,
    else a draw from the temperature-scaled distribution cut to its top_k tokens and its top_p
    nucleus.

    Total for every temperature, top_k and top_p the spec accepts, and for any logits: the pool
    serves every tenant's samples in one process, and a `torch.multinomial` of a non-finite
    distribution raised out of it (probe 2, finding 1: temperature 1e-40 turned float32 logits into
    inf, the softmax into NaN, and stopped the pool). Where the plain division overflows, the logits
    are shifted by their maximum first (softmax does not change: every value is then <= 0, the
    largest 0); a distribution that is still not one (the model's own logits were NaN or +inf)
    falls back to the most likely token."""
    if spec.temperature < GREEDY_TEMPERATURE:
        return _greedy(logits)
    scaled = logits / spec.temperature
    if not torch.isfinite(scaled.max()):  # +inf or NaN (the max propagates NaN)
        scaled = (logits - logits.max()) / spec.temperature
    if spec.top_k > 0:
        kth = torch.topk(scaled, min(spec.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the most likely tokens until their mass reaches top_p, the first one always (a top_p
        # below float32's smallest, such as 1e-300, compares as 0 and kept none: an empty
        # distribution, on which multinomial raised).
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < spec.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    if not (bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0):
        return _greedy(logits)
    return int(torch.multinomial(probs, 1, generator=generator))


def _greedy(logits: Tensor) -> int:
    """The most likely token; a NaN logit never wins (argmax would pick it)."""
    return int(torch.argmax(torch.where(torch.isnan(logits), float("-inf"), logits)))


def eos_token_ids(model: nn.Module) -> frozenset[int]:
    """The model's end-of-sequence ids (its generation config's, else its config's)."""
    ids: set[int] = set()
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(config, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


@dataclass(frozen=True)
class PassLimits:
    """How many rows one generation pass takes: the cache holds B × (longest prompt + max_tokens)
    positions, and a prefill that scores the prompt keeps (B × longest prompt, V) logits."""

    cache_tokens: int | None = None
    prompt_logit_tokens: int | None = None


@torch.no_grad()
def generate(
    model: nn.Module,
    lora: MultiLoRA,
    decodings: Sequence[Decoding],
    *,
    decode: TextDecoder | None = None,
    limits: PassLimits = PassLimits(),
) -> int:
    """Decode every sequence to its end (in place); returns the generation passes run: one for the
    rows routed to adapters and one for the base model's, each split only where `limits` say.

    The model runs in eval mode meanwhile (no LoRA dropout: the logprobs are a forward's)."""
    was_training = model.training
    model.eval()
    try:
        passes = 0
        routed = sorted((d for d in decodings if d.slot is not None), key=lambda d: d.slot or 0)
        base = [d for d in decodings if d.slot is None]
        for group, use_lora in ((routed, True), (base, False)):
            for chunk in _chunks(group, limits):
                _generate_group(model, lora if use_lora else None, chunk, decode)
                passes += 1
        return passes
    finally:
        model.train(was_training)


def _chunks(rows: list[Decoding], limits: PassLimits) -> Iterator[list[Decoding]]:
    """Consecutive runs of `rows` (their order kept: ascending slots) within `limits`; a row alone
    always makes a pass."""
    chunk: list[Decoding] = []
    longest = longest_prompt = 0
    for d in rows:
        total = max(longest, len(d.prompt) + d.spec.max_tokens)
        prompt = max(longest_prompt, len(d.prompt))
        scores = any(r.spec.prompt_logprobs for r in chunk) or d.spec.prompt_logprobs
        too_big = (limits.cache_tokens is not None and (len(chunk) + 1) * total > limits.cache_tokens) or (
            scores
            and limits.prompt_logit_tokens is not None
            and (len(chunk) + 1) * prompt > limits.prompt_logit_tokens
        )
        if chunk and too_big:
            yield chunk
            chunk, total, prompt = [], len(d.prompt) + d.spec.max_tokens, len(d.prompt)
        chunk.append(d)
        longest, longest_prompt = total, prompt
    if chunk:
        yield chunk


def _generate_group(
    model: nn.Module, lora: MultiLoRA | None, rows: list[Decoding], decode: TextDecoder | None
) -> None:
    """One batched generation pass; `rows` in ascending slot order (routed through `lora`), or all
    of the base model (`lora` None)."""
    device = next(model.parameters()).device
    width = max(len(d.prompt) for d in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # (B, P)
    mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # (B, P)
    for b, d in enumerate(rows):
        input_ids[b, width - len(d.prompt) :] = torch.tensor(d.prompt, dtype=torch.long)
        mask[b, width - len(d.prompt) :] = 1
    # Left padding: each row's positions start at 0 at its first real token (padding gets 0 too;
    # the mask hides it from every real token).
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    cache = DynamicCache(config=getattr(model, "config", None))
    scores_prompt = any(d.spec.prompt_logprobs for d in rows)
    prefill = _forward(model, lora, rows, input_ids, mask, positions, cache, every_position=scores_prompt)
    for d, row_logits in zip(rows, prefill, strict=True):
        if d.spec.prompt_logprobs:
            d.prompt_logprobs = _prompt_logprobs(row_logits, d)
    logits = prefill[:, -1]  # (B, V)
    live = list(rows)
    last_position = positions[:, -1]  # (B,)
    while True:
        # On the CPU: the seeded generators are CPU ones (the same draws on any device).
        for d, row_logits in zip(live, logits.float().cpu(), strict=True):
            d.take(row_logits, decode)
        keep = [i for i, d in enumerate(live) if not d.done]
        if not keep:
            return
        if len(keep) < len(live):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            mask, last_position = mask[index], last_position[index]
            live = [live[i] for i in keep]
        new_ids = torch.tensor([[d.generated[-1]] for d in live], dtype=torch.long, device=device)  # (B', 1)
        mask = torch.cat([mask, torch.ones(len(live), 1, dtype=mask.dtype, device=device)], dim=1)
        last_position = last_position + 1
        logits = _forward(model, lora, live, new_ids, mask, last_position[:, None], cache)[:, -1]  # (B', V)


def _forward(
    model: nn.Module,
    lora: MultiLoRA | None,
    rows: list[Decoding],
    input_ids: Tensor,
    mask: Tensor,
    positions: Tensor,
    cache: DynamicCache,
    *,
    every_position: bool = False,
) -> Tensor:
    """Logits (B, L, V) of every position of `input_ids` (B, L) with `every_position`, else (B, 1, V)
    of the last one only; the cache extended."""
    with _routing(lora, rows, input_ids.shape[1]):
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if every_position else 1,
            **{_cache_argument(type(model)): cache},
        )
    return out.logits


_CACHE_ARGUMENTS: dict[type[nn.Module], str] = {}


def _cache_argument(model_class: type[nn.Module]) -> str:
    """The keyword the model's forward takes its KV cache by: `cache` in recent transformers (where
    `past_key_values` still works, with a FutureWarning on every call), `past_key_values` before."""
    name = _CACHE_ARGUMENTS.get(model_class)
    if name is None:
        takes_cache = "cache" in inspect.signature(model_class.forward).parameters
        name = _CACHE_ARGUMENTS[model_class] = "cache" if takes_cache else "past_key_values"
    return name


def _prompt_logprobs(logits: Tensor, d: Decoding) -> list[float | None]:
    """Per prompt token, its logprob given the tokens before it, from the row's prefill logits
    (P, V) (the prompt is left-padded: it ends at the last position); None for the first token."""
    n = len(d.prompt)
    predicting = logits[logits.shape[0] - n : -1].float()  # (n-1, V): position i predicts token i+1
    targets = torch.tensor(d.prompt[1:], dtype=torch.long, device=logits.device)[:, None]  # (n-1, 1)
    scored = torch.log_softmax(predicting, dim=-1).gather(-1, targets)[:, 0].tolist()
    skipped = 0 if d.spec.prompt_logprobs_last_n is None else max(0, n - d.spec.prompt_logprobs_last_n)
    return [None] * max(1, skipped) + scored[max(1, skipped) - 1 :]


@contextlib.contextmanager
def _routing(lora: MultiLoRA | None, rows: list[Decoding], length: int) -> Iterator[None]:
    """Each row's `length` tokens through its slot's adapter (rows in ascending slot order); no
    LoRA at all for the base model."""
    if lora is None:
        yield
        return
    slots = torch.tensor([d.slot for d in rows], dtype=torch.long)  # (B,)
    counts = torch.bincount(slots, minlength=lora.n_slots) * length  # (n_slots,)
    with lora.segments(counts):
        yield
