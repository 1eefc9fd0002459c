"""The pool's side of Tinker `sample` requests: which weights each sequence decodes with, then
one `trainer_core.sampling.generate` call for all of them.

    the run's current step     its live slot (the adapter the run trains)
    an older saved step        the copy `save_weights_for_sampler` kept on the pool
                               (`{checkpoint_dir}/{run_id}/sampler_weights/step_N`), loaded into a
                               free slot for the duration of the call and reset after it: the live
                               slots (their weights, gradients and optimizers) are never touched
    the base model             no adapter (`SamplingSpec.step` None)

The kept copies go when the run leaves the pool (`remove_sampler_weights`, from the worker's
`release_slot`): a run leaves only for good (evicted, completed, failed, deleted), and the service
takes no sample request for such a run and fails the ones pending, so nothing reads them again.
Its checkpoints and saved states stay while the run exists (another model may still `load_weights` a
saved state); they go when the run is deleted (trainer_core.run_files).

Stop strings need the base model's text: its tokenizer is loaded once, on the first request that
has stop strings (the built-in model's character tokenizer, or the model directory's / hub id's
`AutoTokenizer`, offline from the local cache).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from contracts.durable import follow_umask
from contracts.tinker_work import ManualResult, ManualWorkItem, SampledSequence
from trainer_core.device_errors import raise_if_fatal
from trainer_core.export import export_peft_adapter
from trainer_core.lora import MultiLoRA
from trainer_core.sampling import Decoding, PassLimits, TextDecoder, eos_token_ids, generate
from trainer_core.slots import RunSlot

log = logging.getLogger("loraloom.worker")

__all__ = [
    "SampleServer",
    "COPY_ID_FILE",
    "PEFT_DIR",
    "load_text_decoder",
    "remove_sampler_weights",
    "save_sampler_weights",
    "sampler_weights_dir",
]

ADAPTER_FILE = "adapter.safetensors"
CONFIG_FILE = "lora.json"
PEFT_DIR = "peft"
"""The copy as a PEFT adapter too, for an external sampler (trainer_core.external_sampler)."""
MAX_ERROR_CHARS = 1000
"""The longest exception message a failed request's error repeats (the log has the rest)."""
COPY_ID_FILE = "copy_id"
"""In the PEFT copy: random, new at every save (the adapter's name on the external server)."""


def sampler_weights_dir(checkpoint_dir: Path, run_id: str, step: int) -> Path:
    return checkpoint_dir / run_id / "sampler_weights" / f"step_{step}"


def remove_sampler_weights(checkpoint_dir: Path, run_id: str) -> None:
    """Forget every copy kept for the run's sampling clients (the run has left the pool)."""
    root = checkpoint_dir / run_id / "sampler_weights"
    if root.exists():
        shutil.rmtree(root, ignore_errors=True)
        log.info("run %s: the sampler weights kept for its sampling clients removed", run_id)


def save_sampler_weights(
    checkpoint_dir: Path, run: RunSlot, lora: MultiLoRA, *, peft_base_model: str | None = None
) -> None:
    """Keep the run's adapter of its current step, so that a sampling client of this step still
    samples it after the run trains on. Written at every save: a `load_weights` may have put other
    weights in the slot at a step number already saved, and the newest save names what it holds.
    (Only the pool's loop reads these copies, in the same thread: no reader sees a half-written one;
    an external sampler gets a copy's PEFT adapter (`peft_base_model` given) once it is complete.)"""
    target = sampler_weights_dir(checkpoint_dir, run.run_id, run.progress.step)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in lora.slot_state_dict(run.slot).items()}
    save_file(state, str(tmp / ADAPTER_FILE))
    follow_umask(tmp / ADAPTER_FILE)  # not safetensors' 0600: an external sampler may be another user
    lora_config = run.config.lora
    (tmp / CONFIG_FILE).write_text(
        json.dumps(
            {
                "rank": lora_config.rank,
                "alpha": lora_config.alpha,
                "target_modules": lora_config.target_modules,
            }
        ),
        encoding="utf-8",
    )
    if peft_base_model is not None:
        export_peft_adapter(lora, run.slot, tmp / PEFT_DIR, base_model_name_or_path=peft_base_model)
        # A new name for every copy: the external server must load a rewritten copy again.
        (tmp / PEFT_DIR / COPY_ID_FILE).write_text(secrets.token_hex(8), encoding="utf-8")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def load_text_decoder(base_model: str, cache_dir: Path | None) -> TextDecoder:
    """ids → text with the base model's tokenizer (special tokens left out)."""
    from trainer_core.models import builtin  # the registry's imports; only needed here

    if base_model == builtin.NAME:
        return builtin.TOKENIZER.decode
    from transformers import AutoTokenizer

    local = Path(base_model).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else base_model)

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    return decode


class _Refused(Exception):
    """A request this pool cannot serve: it fails alone, with this message."""


def _vocab_size(model: nn.Module) -> int:
    """Rows of the input embeddings (a transformers causal LM)."""
    return int(cast(Any, model).get_input_embeddings().num_embeddings)


def _crashed(item: ManualWorkItem, what: str, exc: Exception) -> ManualResult:
    """A request that raised on the pool fails alone, with the exception's type and message."""
    log.error("sample request %s %s: %s", item.request_id, what, exc, exc_info=exc)
    message = f"{type(exc).__name__}: {exc}"
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 1] + "…"
    return ManualResult(
        request_id=item.request_id, error=f"the pool could not sample this request: {message}"
    )


def _answer(item: ManualWorkItem, rows: Sequence[Decoding]) -> ManualResult:
    """The request's sequences; it fails if a logprob is not finite (the model's logits overflowed,
    or were NaN): JSON cannot carry one, and the pool's report of the whole round would fail."""
    prompt_logprobs = rows[0].prompt_logprobs  # the same prompt and weights in every row
    values = [lp for d in rows for lp in d.logprobs] + [lp for lp in prompt_logprobs or () if lp is not None]
    if not all(math.isfinite(lp) for lp in values):
        return ManualResult(
            request_id=item.request_id,
            error="the pool could not sample this request: the model's logprobs are not finite "
            "(its logits overflowed, or are NaN); no sequence to return",
        )
    return ManualResult(
        request_id=item.request_id,
        sequences=[
            SampledSequence(tokens=d.generated, logprobs=d.logprobs, stop_reason=d.stop_reason or "length")
            for d in rows
        ],
        prompt_logprobs=prompt_logprobs,
    )


@dataclass
class SampleServer:
    checkpoint_dir: Path
    text_decoder: Callable[[], TextDecoder] | None = None
    """Loads the base model's tokenizer (None: stop strings are refused)."""
    limits: PassLimits = PassLimits()
    """How many sequences one generation pass takes (trainer_core.sampling.PassLimits)."""
    passes: int = 0
    """Generation passes run."""
    _decode: TextDecoder | None = field(default=None, init=False)

    def serve(
        self,
        model: nn.Module,
        lora: MultiLoRA,
        work: Sequence[tuple[int, ManualWorkItem, int | None]],
        slots: Mapping[int, RunSlot],
    ) -> dict[int, ManualResult]:
        """Every sequence of every request (index in the claim, item, the run's live slot or None
        for the base model) decoded together; the result of each request by its index.

        One request's failure is its own: what cannot be served fails alone (`_Refused`), and so
        does a request whose preparation or decoding raises. The pool serves every tenant in one
        process, and an exception out of here stopped it for all of them (probe 2, finding 1). A
        shared pass that raises is run again request by request, so that only the requests that
        raise alone fail (with the exception, which the tenant sees); the others are answered as
        if nothing had happened; a fatal device error stops the pool instead
        (trainer_core.device_errors). Catching here is safe on a multi-rank pool: sampling runs on the
        master alone, with no collective, while the other ranks wait at the round's next one."""
        results: dict[int, ManualResult] = {}
        decodings: dict[int, list[Decoding]] = {}
        slot_of: dict[int, int | None] = {}
        borrowed: dict[tuple[str, int], int] = {}
        free = [s for s in range(lora.n_slots) if s not in slots]
        items = {index: item for index, item, _ in work}
        try:
            eos = eos_token_ids(model)
            vocab_size = _vocab_size(model)
            for index, item, live_slot in work:
                try:
                    slot_of[index] = self._weights_of(item, live_slot, slots, lora, borrowed, free)
                    decodings[index] = self._decodings(item, slot_of[index], eos, vocab_size)
                except _Refused as exc:
                    results[index] = ManualResult(request_id=item.request_id, error=str(exc))
                except Exception as exc:
                    raise_if_fatal(exc)
                    results[index] = _crashed(item, "could not be prepared", exc)
            all_rows = [d for rows in decodings.values() for d in rows]
            if all_rows:
                try:
                    self.passes += generate(model, lora, all_rows, decode=self._decode, limits=self.limits)
                except Exception as exc:
                    raise_if_fatal(exc)
                    log.exception(
                        "a sampling pass of %s request(s) failed; running them one by one", len(decodings)
                    )
                    for index in list(decodings):
                        try:
                            # Fresh rows: the failed pass drew from the generators of the first.
                            rows = self._decodings(items[index], slot_of[index], eos, vocab_size)
                            self.passes += generate(
                                model, lora, rows, decode=self._decode, limits=self.limits
                            )
                            decodings[index] = rows
                        except Exception as exc:
                            raise_if_fatal(exc)
                            del decodings[index]
                            results[index] = _crashed(items[index], "failed while decoding", exc)
        finally:
            for slot in borrowed.values():
                # Seeded: a fresh adapter without drawing from the global RNG (others' dropout).
                lora.reset_slot(slot, seed=0)
        for index, rows in decodings.items():
            results[index] = _answer(items[index], rows)
        return results

    def _weights_of(
        self,
        item: ManualWorkItem,
        live_slot: int | None,
        slots: Mapping[int, RunSlot],
        lora: MultiLoRA,
        borrowed: dict[tuple[str, int], int],
        free: list[int],
    ) -> int | None:
        """The slot whose adapter samples the item (None: the base model)."""
        spec = item.sampling
        if spec is None:
            raise _Refused("sample without sampling parameters")
        if spec.step is None:
            return None
        if live_slot is None:
            raise _Refused(f"the run {item.run_id} is not on this pool")
        if slots[live_slot].progress.step == spec.step:
            return live_slot
        key = (item.run_id, spec.step)
        if key in borrowed:
            return borrowed[key]
        saved = sampler_weights_dir(self.checkpoint_dir, item.run_id, spec.step)
        if not (saved / CONFIG_FILE).exists():
            raise _Refused(
                f"the sampler weights of step {spec.step} are not kept on this pool (saved before it "
                "kept them, or by another pool); save the weights for the sampler again"
            )
        if not free:
            raise _Refused(
                f"no free adapter slot on the pool to load the sampler weights of step {spec.step} "
                f"(the current step is {slots[live_slot].progress.step}); try again later"
            )
        slot = free.pop()
        config = json.loads((saved / CONFIG_FILE).read_text(encoding="utf-8"))
        lora.configure_slot(
            slot, rank=config["rank"], alpha=config["alpha"], target_modules=config["target_modules"]
        )
        borrowed[key] = slot  # reset after the call, whatever happens
        try:
            lora.load_slot_state_dict(slot, load_file(str(saved / ADAPTER_FILE), device="cpu"))
        except (KeyError, ValueError, RuntimeError, OSError) as exc:
            raise_if_fatal(exc)
            raise _Refused(f"the sampler weights of step {spec.step} could not be loaded: {exc}") from exc
        return slot

    def _decodings(
        self, item: ManualWorkItem, slot: int | None, eos: frozenset[int], vocab_size: int
    ) -> list[Decoding]:
        spec = item.sampling
        assert spec is not None  # _weights_of checked
        # The service checks against the pool it knows; one submitted before this pool registered
        # was not, and an id past the embeddings would fail the whole pass.
        if any(not 0 <= t < vocab_size for t in spec.prompt):
            raise _Refused(f"a prompt token id is outside the vocabulary [0, {vocab_size})")
        if spec.stop_strings and self._decode is None:
            if self.text_decoder is None:
                raise _Refused("stop strings: this pool has no tokenizer for its base model")
            try:
                self._decode = self.text_decoder()
            except (OSError, ValueError) as exc:
                raise _Refused(
                    f"stop strings: the base model's tokenizer could not be loaded: {exc}"
                ) from exc
        stop = frozenset(spec.stop_tokens) | (eos if spec.stop_at_eos else frozenset())
        # Without a seed, a fresh one per request (the sequences still differ from each other); not
        # torch.seed(), which would reseed the global RNG that training draws from.
        seed = spec.seed if spec.seed is not None else secrets.randbits(63)
        return [
            Decoding(
                slot=slot,
                prompt=list(spec.prompt),
                spec=spec,
                generator=torch.Generator().manual_seed((seed + k) % 2**63),
                stop_tokens=stop,
            )
            for k in range(spec.num_samples)
        ]
