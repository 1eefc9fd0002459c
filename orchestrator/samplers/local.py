"""`LocalSampler`: sampling in process with a transformers causal LM and the run's
PEFT adapter.

Which logprob is reported. Tokens are sampled from softmax(logits / T), truncated
to the top-p nucleus and renormalised when top_p < 1. The logprob reported for a
sampled token is log softmax(logits / T)[token], over the *whole* vocabulary,
without the top-p renormalisation: that is the distribution the trainer
recomputes (it divides its logits by the batch's `temperature` and knows nothing
of top-p), so the importance ratio trainer/sampler is 1 when the weights agree.
With temperature 0 (greedy) the reported logprob is that of the T=1 distribution.

Generation is batched: all prompts x n rows, left-padded, one forward pass for
the prompts and one per new token on the KV cache (position ids follow each
row's real tokens, so padding changes nothing). The model is not thread-safe, so
calls are serialised by a lock and run in a worker thread (`asyncio.to_thread`)
to keep the event loop free.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from contracts.layout import ADAPTER_CONFIG
from orchestrator.samplers.base import Completion

log = logging.getLogger(__name__)


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` (B, V); returns (tokens (B,), logprobs (B,)).

    The logprob is under softmax(logits / T) over the full vocabulary (module docstring)."""
    logits = logits.float()
    if temperature <= 0.0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # renormalises the nucleus
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def kv_cache_name() -> str:
    """What transformers calls the KV cache, as a forward argument and an output field: `cache` in
    recent versions, where `past_key_values` is deprecated (a FutureWarning on every forward and a
    logged warning for the output's field), `past_key_values` before."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in fields else "past_key_values"


class LocalSampler:
    """Transformers causal LM + (optionally) one PEFT LoRA adapter, swapped when a new step appears.

    Give each LocalSampler its own model object: loading an adapter injects LoRA
    layers into the model in place."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
        seed: int | None = None,
        max_batch_rows: int = 256,
        decode: Any = None,
    ) -> None:
        """`model`: a transformers causal LM (e.g. LlamaForCausalLM). `eos_token_id`: the default
        stop token. `decode`: optional callable ids -> text to fill `Completion.text`."""
        self._base = model
        self._model = model.eval()
        self._peft: Any = None
        self._eos = eos_token_id if eos_token_id is not None else getattr(model.config, "eos_token_id", None)
        self._pad = pad_token_id
        self._max_rows = max_batch_rows
        self._decode = decode
        self._generator = torch.Generator(device="cpu")
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()
        self._lock = threading.Lock()
        self._cache_name = kv_cache_name()
        self._adapters_loaded = 0
        self.adapter_name: str | None = None
        self.adapter_step: int | None = None

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, **kwargs: Any) -> LocalSampler:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), torch_dtype=torch.float32)
        return cls(model, **kwargs)

    @property
    def model(self) -> Any:
        """The model sampled from (the PeftModel once an adapter is loaded)."""
        return self._model

    # ---- adapters -------------------------------------------------------------------------

    def load_adapter_sync(self, path: str | Path, name: str, step: int) -> None:
        from peft import PeftModel

        path = Path(path)
        if not (path / ADAPTER_CONFIG).is_file():
            raise FileNotFoundError(f"{path} holds no adapter_config.json")
        # PEFT names become module attribute keys: use our own names, not the caller's.
        internal = f"adapter{self._adapters_loaded}"
        with self._lock:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(
                    self._base, str(path), adapter_name=internal, is_trainable=False
                )
            else:
                previous = self._peft.active_adapter
                self._peft.load_adapter(str(path), adapter_name=internal, is_trainable=False)
                self._peft.set_adapter(internal)
                self._peft.delete_adapter(previous)
            self._adapters_loaded += 1
            self._model = self._peft.eval()
            self.adapter_name, self.adapter_step = name, step
        log.info("local sampler now on adapter %s (step %d) from %s", name, step, path)

    async def load_adapter(self, path: str | Path, name: str, step: int) -> None:
        await asyncio.to_thread(self.load_adapter_sync, path, name, step)

    # ---- generation ------------------------------------------------------------------------

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[Completion]:
        return await asyncio.to_thread(
            self.generate_sync,
            prompts,
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=stop_token_ids,
        )

    def generate_sync(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[Completion]:
        if n < 1 or max_tokens < 1:
            raise ValueError("n and max_tokens must be >= 1")
        if not 0.0 < top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        stops = (
            set(stop_token_ids)
            if stop_token_ids is not None
            else ({self._eos} if self._eos is not None else set())
        )
        rows = [list(p) for p in prompts for _ in range(n)]
        out: list[Completion] = []
        with self._lock:
            for start in range(0, len(rows), self._max_rows):
                out.extend(
                    self._generate_rows(
                        rows[start : start + self._max_rows], max_tokens, temperature, top_p, stops
                    )
                )
        return out

    @torch.inference_mode()
    def _generate_rows(
        self, rows: list[list[int]], max_tokens: int, temperature: float, top_p: float, stops: set[int]
    ) -> list[Completion]:
        device = next(self._model.parameters()).device
        batch, width = len(rows), max(len(r) for r in rows)
        input_ids = torch.full((batch, width), self._pad, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for b, row in enumerate(rows):  # left padding: every row's last prompt token is at -1
            input_ids[b, width - len(row) :] = torch.tensor(row)
            attention[b, width - len(row) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # (B, L)

        out = self._model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True
        )
        past, logits = getattr(out, self._cache_name), out.logits[:, -1, :]  # (B, V)
        next_pos = positions[:, -1:] + 1  # (B, 1)

        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        finished = [False] * batch
        for t in range(max_tokens):
            sampled, sampled_lp = sample_tokens(logits.cpu(), temperature, top_p, self._generator)
            for b in range(batch):
                if finished[b]:
                    continue
                tok = int(sampled[b])
                tokens[b].append(tok)
                logprobs[b].append(float(sampled_lp[b]))
                finished[b] = tok in stops
            if all(finished) or t == max_tokens - 1:
                break
            # Finished rows keep being fed (a pad token) so the batch stays rectangular; their outputs are unused.
            feed = torch.tensor(
                [self._pad if finished[b] else int(sampled[b]) for b in range(batch)], device=device
            )
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long, device=device)], dim=1)
            out = self._model(
                input_ids=feed[:, None],
                attention_mask=attention,
                position_ids=next_pos,
                use_cache=True,
                **{self._cache_name: past},
            )
            past, logits = getattr(out, self._cache_name), out.logits[:, -1, :]
            next_pos = next_pos + 1

        completions = []
        for b in range(batch):
            stopped = bool(tokens[b]) and tokens[b][-1] in stops
            text = self._decode(tokens[b]) if self._decode is not None else None
            completions.append(
                Completion(tokens[b], logprobs[b], text=text, finish_reason="stop" if stopped else "length")
            )
        return completions
