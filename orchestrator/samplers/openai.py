"""`OpenAICompatibleSampler`: an OpenAI-compatible completions server (e.g. vLLM)
with LoRA adapters loaded at run time.

- Generation: `POST /v1/completions` with the prompts as token-id lists, `n`,
  `max_tokens`, `temperature`, `top_p`, `logprobs: 1`, and `model` = the newest
  adapter's name (the base model's name before any adapter is loaded). Token ids
  come back through vLLM's `return_tokens_as_token_ids` ("token_id:N" strings) or
  its `token_ids` field, whichever the server gives.
- Adapters: `POST /v1/load_lora_adapter {lora_name, lora_path}` (vLLM's runtime
  LoRA API; start vLLM with `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).
  `lora_path` must be readable by the server. The previous adapter is unloaded
  afterwards (best effort), so the server holds one adapter per sampler.
- Logprobs are whatever the server reports. vLLM reports raw logprobs by default;
  run it with `--logprobs-mode processed_logprobs` to get logprobs after the
  temperature, closer to what the trainer recomputes.
- One pooled `httpx.AsyncClient`; retries (connection errors, timeouts, 429, 5xx)
  with the SDK's backoff policy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from contracts.http import RetryPolicy, send_with_retries_async
from orchestrator.errors import ApiError, LoraloomError, error_from_response
from orchestrator.samplers.base import Completion

log = logging.getLogger(__name__)

_TOKEN_ID_PREFIX = "token_id:"


class SamplerError(LoraloomError):
    """The inference server answered something the sampler cannot use."""


def _parse_choice(choice: dict[str, Any]) -> Completion:
    logprobs = choice.get("logprobs") or {}
    token_logprobs = logprobs.get("token_logprobs")
    ids = choice.get("token_ids")
    if ids is None:
        tokens = logprobs.get("tokens") or []
        try:
            ids = [int(t[len(_TOKEN_ID_PREFIX) :]) for t in tokens if t.startswith(_TOKEN_ID_PREFIX)]
        except (AttributeError, ValueError) as exc:
            raise SamplerError(f"cannot read token ids from {tokens[:5]!r}") from exc
        if len(ids) != len(tokens):
            raise SamplerError(
                "the server returned token strings, not ids: it must support return_tokens_as_token_ids (vLLM)"
            )
    if token_logprobs is None:
        raise SamplerError("the server returned no logprobs")
    if any(lp is None for lp in token_logprobs):
        raise SamplerError("the server returned a null logprob for a sampled token")
    if len(token_logprobs) != len(ids):
        raise SamplerError(f"{len(ids)} tokens but {len(token_logprobs)} logprobs")
    reason = choice.get("finish_reason")
    return Completion(
        token_ids=[int(i) for i in ids],
        logprobs=[float(lp) for lp in token_logprobs],
        text=choice.get("text"),
        finish_reason="length" if reason == "length" else "stop",
    )


class OpenAICompatibleSampler:
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 120.0,
        retry: RetryPolicy | None = None,
        max_connections: int = 64,
        unload_previous: bool = True,
        extra_body: dict[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`model`: the served base model's name, used until the first adapter is loaded.
        `extra_body`: extra fields for every completions request (e.g. `top_k`, `seed`)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )
        self._retry = retry or RetryPolicy(max_attempts=4)
        self._unload_previous = unload_previous
        self._extra = dict(extra_body or {})
        self.base_model = model
        self.model = model
        """The `model` field of completions requests: the current adapter's name."""
        self.adapter_step: int | None = None

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> OpenAICompatibleSampler:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        async def attempt() -> httpx.Response:
            return await self._http.post(path, json=body)

        response = await send_with_retries_async(attempt, self._retry, f"POST {path}")
        if not response.is_success:
            raise error_from_response(response)
        return response

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
        if not prompts:
            return []
        body: dict[str, Any] = {
            **self._extra,
            "model": self.model,
            "prompt": [list(map(int, p)) for p in prompts],
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "stream": False,
        }
        if stop_token_ids is not None:
            body["stop_token_ids"] = list(stop_token_ids)
        data = (await self._post("/v1/completions", body)).json()
        choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts) * n:
            raise SamplerError(f"asked for {len(prompts) * n} completions, got {len(choices)}")
        # OpenAI and vLLM number choices prompt-major: index = prompt_index * n + sample_index.
        return [_parse_choice(c) for c in choices]

    async def load_adapter(self, path: str | Path, name: str, step: int) -> None:
        body = {"lora_name": name, "lora_path": str(Path(path).resolve())}
        try:
            await self._post("/v1/load_lora_adapter", body)
        except ApiError as exc:
            # vLLM answers 400 when the name is already loaded: the adapter is there, use it.
            if exc.status != 400 or "already" not in str(exc).lower():
                raise
        previous, self.model, self.adapter_step = self.model, name, step
        log.info("sampler %s now on adapter %s (step %d)", self._http.base_url, name, step)
        if self._unload_previous and previous not in (self.base_model, name):
            try:
                await self._post("/v1/unload_lora_adapter", {"lora_name": previous})
            except (ApiError, httpx.HTTPError) as exc:
                log.warning("could not unload adapter %s: %s", previous, exc)
