"""`loraloom-tiny`: the built-in base model for tests and the demo.

A small Llama-style model built from a config and warmed up for ~20 s (one CPU core) on
arithmetic in the demo envs' formats, in two phases: clean answers until it knows the
single-digit sums (greedy decoding is right ~85% of the time), then deliberately noisy
ones at a low learning rate, so that sampling at temperature 1 puts only about half of
its mass on the right answer and the rest on random plausible numbers. That noise is
one prompt-independent mode which a LoRA can learn to suppress in a few dozen RL steps,
so RL has room to improve it visibly, with signal from the first step. (A model that
simply does not know some sums, e.g. the v3 warm-up at a constant lr, gives RL nothing
it can learn in that time: rewards stay flat.) The checker format (`y`/`n`, then
end-of-sequence) is learned too, but not to verify sums: its verdicts start close to a
coin flip. Deterministic on one machine (seeded, on `BUILD_THREADS` threads); cached on disk
after the first build.
"""

import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from contracts.durable import atomic_replace_dir, beside, final_name_of, follow_umask, fsync_path, untouched

# The tokenizer is the SDK's character tokenizer: the model and the envs must share one vocabulary.
from contracts.tokenizer import CharTokenizer
from contracts.tokenizer_files import TOKENIZER_FILE, save_char_tokenizer
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.models.construction import one_at_a_time

TOKENIZER = CharTokenizer()

log = logging.getLogger("loraloom.models")

NAME = "loraloom-tiny"
VERSION = 5
WARMUP_CLEAN_STEPS = 600
"""Phase 1: right answers and truthful checks only, so that the model learns the sums."""
WARMUP_NOISY_STEPS = 150
"""Phase 2: noisy answers (at a low learning rate), so that it is no longer sure of them."""
WARMUP_STEPS = WARMUP_CLEAN_STEPS + WARMUP_NOISY_STEPS
WARMUP_CORRECT_FRACTION = 0.7
"""Share of phase-2 examples with the right answer (the rest: a random plausible answer)."""
WARMUP_BATCH = 32
PROGRESS_EVERY_S = 5.0
"""The build logs a line with its progress this often."""
WARMUP_LR = 3e-3
"""Phase 1 peak lr (linear warm-up over 50 steps, then cosine to 0); phase 2 starts at a tenth."""
BUILD_THREADS = 1
"""The warm-up runs on this many CPU threads, whatever the caller set (a pool: its cores split between
its ranks; tests: 1). The thread count changes how torch splits its reductions, hence their rounding,
and 750 steps of training carry a last-bit difference into other weights: built with 2 threads on
one machine the weights differed (sha256 3112fb49... against 0cda5799... with 1), and so did the
base model's validation reward in examples/sft_then_rl.py. Across CPUs the weights may still differ
(torch and MKL pick their kernels by instruction set: AVX2, AVX-512), and across torch versions."""


# A PretrainedConfig keyword LlamaConfig does not declare. Eager: the warm-up's padded batches need
# no packing, and the cached weights were built with it.
_EAGER: dict[str, Any] = {"attn_implementation": "eager"}


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
        **_EAGER,
    )


def solver_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def checker_prompt(a: int, b: int, proposed: int) -> str:
    return f"{a}+{b}={proposed} ok?"


def _warmup_text(rng: random.Random, max_operand: int, correct_fraction: float) -> tuple[str, str]:
    """One (prompt, completion) pair; answers are right with probability `correct_fraction`."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    correct = a + b
    if rng.random() < 0.5:
        answer = correct if rng.random() < correct_fraction else rng.randint(0, 2 * max_operand)
        return solver_prompt(a, b), str(answer)
    proposed = correct if rng.random() < 0.5 else rng.randint(0, 2 * max_operand)
    truthful = rng.random() < min(1.0, correct_fraction + 0.25)
    says_yes = (proposed == correct) if truthful else rng.random() < 0.5
    return checker_prompt(a, b, proposed), "y" if says_yes else "n"


def _lr(step: int, clean_steps: int, noisy_steps: int, peak: float) -> float:
    if step < clean_steps:
        warm = min(50, max(1, clean_steps // 10))
        if step < warm:
            return peak * (step + 1) / warm
        return peak * 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, clean_steps - warm)))
    t = (step - clean_steps) / max(1, noisy_steps)
    return 0.1 * peak * 0.5 * (1.0 + math.cos(math.pi * t))


def build(
    *,
    seed: int = 0,
    clean_steps: int = WARMUP_CLEAN_STEPS,
    noisy_steps: int = WARMUP_NOISY_STEPS,
    correct_fraction: float = WARMUP_CORRECT_FRACTION,
    max_operand: int = 9,
) -> LlamaForCausalLM:
    """Phase 1 teaches the sums (the cosine schedule matters: at a constant 3e-3 the model
    never learns them); phase 2, on noisy answers at a low lr, flattens the answer
    distribution while keeping the right answer its mode, so sampling at temperature 1
    is right only part of the time and RL can sharpen it.

    Built on `BUILD_THREADS` CPU threads whatever the caller's setting, and the caller's torch RNG
    is left as it was: a pool seeds its LoRA initialisations before it loads the base model, and
    building it or finding it cached must not change what they draw."""
    # The whole build under the process's model lock (`construction`): transformers patches globals
    # while another thread loads, and the seed, the RNG and the thread count are the process's: two
    # builds overlapping drew each other's initial weights and left the caller on one thread.
    with one_at_a_time(), torch.random.fork_rng(devices=[]), _threads(BUILD_THREADS):
        return _warm_up(seed, clean_steps, noisy_steps, correct_fraction, max_operand)


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _warm_up(
    seed: int, clean_steps: int, noisy_steps: int, correct_fraction: float, max_operand: int
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR)
    model.train()
    total = clean_steps + noisy_steps
    started = last_report = time.monotonic()
    for step in range(total):
        now = time.monotonic()
        if step and now - last_report >= PROGRESS_EVERY_S:
            # A loaded machine can take minutes here: say what is happening, with an estimate.
            left = (now - started) / step * (total - step)
            log.info(
                "building %s: warm-up step %d/%d (%d%%), %.0f s so far, about %.0f s left",
                NAME,
                step,
                total,
                100 * step // total,
                now - started,
                left,
            )
            last_report = now
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, clean_steps, noisy_steps, WARMUP_LR)
        fraction = 1.0 if step < clean_steps else correct_fraction
        rows = []
        for _ in range(WARMUP_BATCH):
            prompt, completion = _warmup_text(rng, max_operand, fraction)
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


BUILT_FILE = "BUILT"
"""Written last into a build's directory: the directory under its final name is complete."""

STALE_TEMPORARY_S = 600.0
"""A build's temporary directory untouched this long is a dead build's (its process was killed while
saving: the save takes seconds) and goes; a younger one may be a live build's and is left alone."""

_LEGACY_TEMPORARY = re.compile(r"\.(.+)\.[0-9]+\.tmp")
"""Temporaries of builds before `beside` named them (`.loraloom-tiny-vN.<pid>.tmp`): the loser of a
race left its own behind, which a cache still holds."""


def load(
    cache_dir: Path, *, dtype: torch.dtype = torch.float32, attn_implementation: str = PACKED_ATTENTION
) -> PreTrainedModel:
    """Load the built-in model, building and caching it on first use.

    The weights are built and cached in fp32 with eager attention (the warm-up's padded batches); the
    copy returned is in ``dtype`` with ``attn_implementation`` (see `trainer_core.models.precision`).
    Processes that find no cache at once (the demo and a pool, pytest-xdist workers) each build it;
    all of them end up loading the one complete directory (`_publish`), and none leaves its
    temporary behind.
    """
    path = cached_path(cache_dir)
    _remove_dead_temporaries(path)
    if not (path / BUILT_FILE).exists():
        log.info("building %s (one-off warm-up of %d steps, cached in %s)", NAME, WARMUP_STEPS, path)
        _publish(build(), path)
    if not (path / TOKENIZER_FILE).exists():
        # Beside the weights (caches built before it was written get it now): the directory loads
        # in transformers as a whole, model and tokenizer.
        with contextlib.suppress(OSError):
            save_char_tokenizer(path, TOKENIZER)
    with one_at_a_time():  # transformers patches globals while it loads (`construction`)
        return LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)


def _publish(model: PreTrainedModel, path: Path) -> None:
    """Save `model` whole (weights, tokenizer, `BUILT_FILE`) into a temporary of its own beside `path`,
    then rename it to `path`. A rename is atomic, so `path` is either absent or complete. If another
    build got there first, its directory is identical (the build is seeded): the rename fails
    (`path` is a non-empty directory) and this build's temporary is removed, whatever happened."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = beside(path)  # unique per build: two threads of one process too (a pid is not)
    try:
        model.save_pretrained(tmp)
        save_char_tokenizer(tmp, TOKENIZER)
        (tmp / BUILT_FILE).write_text(json.dumps({"name": NAME, "version": VERSION}))
        # On disk before the rename: a crash must not leave a marked directory of partial files,
        # which no later start would rebuild.
        for file in tmp.iterdir():
            follow_umask(file)  # save_pretrained's model.safetensors is 0600: a shared cache's users read it
            fsync_path(file)
        fsync_path(tmp)
        try:
            os.replace(tmp, path)
        except OSError:
            if (path / BUILT_FILE).exists():
                return  # another build's complete directory is there: keep it (the same weights)
            # Not a build's (those are complete): what a hand left there goes. Should another build
            # move in meanwhile, this one fails; loading then finds theirs.
            with contextlib.suppress(OSError):
                atomic_replace_dir(tmp, path)
            return
        fsync_path(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the loser's, or a failed save's


def _remove_dead_temporaries(path: Path) -> None:
    """Remove the temporaries of builds of `path` that died while saving (killed; before this module
    named them with `beside`, also the ones the loser of a race left). Only those untouched for
    `STALE_TEMPORARY_S`: a live build's is seconds old. Best effort, like the cache itself."""
    cutoff = time.time() - STALE_TEMPORARY_S
    try:
        names = os.listdir(path.parent)
    except OSError:
        return  # no cache yet
    for name in names:
        legacy = _LEGACY_TEMPORARY.fullmatch(name)
        whose = final_name_of(name) or (legacy[1] if legacy else None)
        if whose == path.name and untouched(path.parent / name, since=cutoff):
            log.info("removing %s, left by a build that did not finish", path.parent / name)
            shutil.rmtree(path.parent / name, ignore_errors=True)
