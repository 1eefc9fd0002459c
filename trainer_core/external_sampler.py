"""Tinker `sample` requests served by an external OpenAI-compatible server with LoRA hot-loading
(vLLM) instead of the pool's own multi-LoRA layers (`WorkerSettings.sampler_url`; DESIGN §11).

The pool still claims and reports the requests; only the decoding moves:

    sampler weights of a step    the PEFT adapter the pool keeps for it at `save_weights_for_sampler`
                                 (`{checkpoint_dir}/{run}/sampler_weights/step_N/peft`), hot-loaded
                                 once with `POST /v1/load_lora_adapter` under a name new at every
                                 save of the copy (`COPY_ID_FILE`: a `load_weights` may have put
                                 other weights at a step number already saved)
    the base model               the server's model of that name (`--served-model-name`)

then one `POST /v1/completions` per request: token-id prompt, `n` samples, the request's sampling
parameters, `logprobs` of the sampled tokens and, when asked, `prompt_logprobs`; tokens come back
as `token_id:N` (`return_tokens_as_token_ids`). The server must read the pool's checkpoint
directory at the same path. Its logprobs are its own (vLLM's default: of the model's distribution,
before temperature), so they equal a `forward` of the same tokens only as far as its numerics match
the trainer's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from contracts.tinker_work import ManualResult, ManualWorkItem, SampledSequence, SamplingSpec
from trainer_core.sample_server import COPY_ID_FILE, PEFT_DIR, sampler_weights_dir

log = logging.getLogger("loraloom.worker")

__all__ = ["ExternalSampler"]

TOKEN_ID_PREFIX = "token_id:"


class _Refused(Exception):
    """A request the external server cannot serve: it fails alone, with this message."""


@dataclass
class ExternalSampler:
    url: str
    """The server's root (`http://vllm:8000`), without `/v1`."""
    checkpoint_dir: Path
    base_model: str
    """The name the server serves the base model under."""
    timeout_s: float = 300.0
    _client: httpx.Client | None = field(default=None, init=False)
    _loaded: set[str] = field(default_factory=set, init=False)
    """Adapter names this pool has hot-loaded into the server."""

    def serve(self, work: Sequence[tuple[int, ManualWorkItem, int | None]]) -> dict[int, ManualResult]:
        """Each `sample` request (index in the claim, item, slot: unused) decoded by the server."""
        results: dict[int, ManualResult] = {}
        for index, item, _ in work:
            try:
                results[index] = self._sample(item)
            except _Refused as exc:
                results[index] = ManualResult(request_id=item.request_id, error=str(exc))
        return results

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    # -- one request -----------------------------------------------------------------------------

    def _http(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.url.rstrip("/"), timeout=self.timeout_s)
        return self._client

    def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return self._http().post(path, json=body)
        except httpx.HTTPError as exc:
            raise _Refused(f"the external sampler at {self.url} did not answer {path}: {exc}") from exc

    def _model_name(self, item: ManualWorkItem, spec: SamplingSpec) -> str:
        """The server's model for the request: the base model, or the step's adapter (loaded now
        if the server does not have this copy yet)."""
        if spec.step is None:
            return self.base_model
        peft = sampler_weights_dir(self.checkpoint_dir, item.run_id, spec.step) / PEFT_DIR
        if not (peft / COPY_ID_FILE).is_file():
            raise _Refused(
                f"the sampler weights of step {spec.step} are not kept on this pool as a PEFT adapter "
                "(saved before it served sampling externally, or by another pool); save the weights "
                "for the sampler again"
            )
        copy_id = (peft / COPY_ID_FILE).read_text(encoding="utf-8").strip()
        name = f"{item.run_id}-step{spec.step}-{copy_id}"
        if name not in self._loaded:
            answer = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(peft)})
            # A server restarted under us forgets; one that kept it says so: both are fine to use.
            if answer.status_code != 200 and "already" not in answer.text:
                raise _Refused(
                    f"the external sampler refused the adapter of step {spec.step}: "
                    f"{answer.status_code} {answer.text[:500]}"
                )
            self._loaded.add(name)
            log.info("external sampler: adapter %s loaded from %s", name, peft)
        return name

    def _sample(self, item: ManualWorkItem) -> ManualResult:
        spec = item.sampling
        if spec is None:
            raise _Refused("sample without sampling parameters")
        body: dict[str, Any] = {
            "model": self._model_name(item, spec),
            "prompt": list(spec.prompt),
            "n": spec.num_samples,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "top_k": spec.top_k,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": list(spec.stop_tokens),
            "ignore_eos": not spec.stop_at_eos,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if spec.stop_strings:
            body["stop"] = list(spec.stop_strings)
        if spec.seed is not None:
            body["seed"] = spec.seed
        if spec.prompt_logprobs:
            body["prompt_logprobs"] = 0
        answer = self._post("/v1/completions", body)
        if answer.status_code != 200:
            raise _Refused(f"the external sampler answered {answer.status_code}: {answer.text[:500]}")
        try:
            return _result(item.request_id, spec, answer.json())
        except (KeyError, TypeError, ValueError) as exc:
            raise _Refused(f"the external sampler's answer could not be read: {exc!r}") from exc


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"token {token!r} is not `token_id:N` (return_tokens_as_token_ids)")
    return int(token.removeprefix(TOKEN_ID_PREFIX))


def _prompt_logprobs(spec: SamplingSpec, raw: list[Any] | None) -> list[float | None] | None:
    """vLLM's per-position {token id: {logprob, ...}} (None first) → the prompt tokens' logprobs,
    None for the first and before the last `prompt_logprobs_last_n`."""
    if not spec.prompt_logprobs:
        return None
    if raw is None or len(raw) != len(spec.prompt):
        raise ValueError("prompt_logprobs missing or not one per prompt token")
    first_kept = len(spec.prompt) - spec.prompt_logprobs_last_n if spec.prompt_logprobs_last_n else 1
    out: list[float | None] = []
    for position, (token, entry) in enumerate(zip(spec.prompt, raw, strict=True)):
        if position < max(first_kept, 1) or entry is None:
            out.append(None)
        else:
            out.append(float(entry[str(token)]["logprob"]))
    return out


def _result(request_id: str, spec: SamplingSpec, answer: dict[str, Any]) -> ManualResult:
    choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
    if len(choices) != spec.num_samples:
        raise ValueError(f"{len(choices)} choices for n={spec.num_samples}")
    sequences = []
    for choice in choices:
        logprobs = choice["logprobs"]
        tokens = [_token_id(t) for t in logprobs["tokens"]]
        sequences.append(
            SampledSequence(
                tokens=tokens,
                logprobs=[float(x) for x in logprobs["token_logprobs"]],
                stop_reason="length" if choice.get("finish_reason") == "length" else "stop",
            )
        )
    return ManualResult(
        request_id=request_id,
        sequences=sequences,
        prompt_logprobs=_prompt_logprobs(spec, choices[0].get("prompt_logprobs")),
    )
