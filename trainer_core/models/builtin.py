"""`loraloom-tiny`: the built-in base model for tests and the demo.

A small Llama-style model built from a config and warmed up for a few seconds on
arithmetic in the demo envs' formats, with deliberately noisy answers: it learns the
format (digits, then end-of-sequence; `y`/`n` for a check) and puts only part of its mass
on the right answer. So RL has room to improve it visibly, and there is signal from the
first step. Deterministic (seeded); cached on disk after the first build.
"""

import contextlib
import json
import logging
import os
import random
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

# The tokenizer is the SDK's character tokenizer: the model and the envs must share one vocabulary.
from orchestrator.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer()

log = logging.getLogger("loraloom.models")

NAME = "loraloom-tiny"
VERSION = 3
WARMUP_STEPS = 600
WARMUP_CORRECT_FRACTION = 0.6
"""Share of warm-up examples with the right answer (the rest: a random plausible answer)."""


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=TOKENIZER.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=TOKENIZER.bos_token_id,
        eos_token_id=TOKENIZER.eos_token_id,
        pad_token_id=TOKENIZER.pad_token_id,
        attn_implementation="eager",
    )


def solver_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def checker_prompt(a: int, b: int, proposed: int) -> str:
    return f"{a}+{b}={proposed} ok?"


def _warmup_text(rng: random.Random, max_operand: int) -> tuple[str, str]:
    """One (prompt, completion) pair with a noisy answer."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    correct = a + b
    if rng.random() < 0.5:
        answer = correct if rng.random() < WARMUP_CORRECT_FRACTION else rng.randint(0, 2 * max_operand)
        return solver_prompt(a, b), str(answer)
    proposed = correct if rng.random() < 0.5 else rng.randint(0, 2 * max_operand)
    truthful = rng.random() < WARMUP_CORRECT_FRACTION + 0.25
    says_yes = (proposed == correct) if truthful else rng.random() < 0.5
    return checker_prompt(a, b, proposed), "y" if says_yes else "n"


def build(*, seed: int = 0, warmup_steps: int = WARMUP_STEPS, max_operand: int = 9) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(warmup_steps):
        rows = []
        for _ in range(32):
            prompt, completion = _warmup_text(rng, max_operand)
            p_ids = TOKENIZER.encode(prompt, add_bos=True)
            rows.append((p_ids, TOKENIZER.encode(completion) + [TOKENIZER.eos_token_id]))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((len(rows), width), TOKENIZER.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)  # learn completions only
            mask[i, : len(p) + len(c)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model


def cached_path(cache_dir: Path) -> Path:
    return cache_dir / f"{NAME}-v{VERSION}"


def load(cache_dir: Path) -> PreTrainedModel:
    """Load the built-in model, building and caching it on first use."""
    path = cached_path(cache_dir)
    marker = path / "BUILT"
    if not marker.exists():
        log.info("building %s (one-off warm-up, cached in %s)", NAME, path)
        model = build()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        model.save_pretrained(tmp)
        (tmp / "BUILT").write_text(json.dumps({"name": NAME, "version": VERSION}))
        path.parent.mkdir(parents=True, exist_ok=True)
        # If another process finished first, theirs is identical (seeded): keep it.
        with contextlib.suppress(OSError):
            os.replace(tmp, path)
    return LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")
