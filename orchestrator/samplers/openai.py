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
- Bounds, as for the SDK's own client (`orchestrator.bounded`): each attempt has a
  total deadline (`deadline`: connect, send, the whole answer; httpx's `timeout` is
  per socket operation, which a server trickling bytes never trips) and its answer
  is read chunk by chunk under `max_response_bytes`. Overruns raise
  `DeadlineExceeded` / `ResponseTooLarge` (naming the URL and the limit) and are not
  retried.
- The answer is checked before use: anything missing, of the wrong type, not strict
  JSON (NaN / Infinity), non-finite, or fewer or more choices than asked raises
  `SamplerError` naming the URL and the field (`choices[1].logprobs.tokens[3]`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import httpx

from contracts.arrays import MAX_TOKEN_ID
from contracts.http import RetryPolicy, send_with_retries_async
from orchestrator import bounded
from orchestrator.errors import ApiError, LoraloomError, error_from_response
from orchestrator.samplers.base import Completion

log = logging.getLogger(__name__)

_TOKEN_ID_PREFIX = "token_id:"

DEFAULT_DEADLINE_S = 600.0
"""Total time one attempt may take. vLLM answers a non-streamed completion only once every sample
is done, so this bounds a whole generation: raise it (and `timeout`) for very long ones."""
DEFAULT_MAX_RESPONSE_BYTES = 256 * 1024**2
"""The largest answer read: about 100 bytes a sampled token with its logprob, so some 2.5 million
tokens (all prompts times `n` times their length) per call."""


class SamplerError(LoraloomError):
    """The inference server answered something the sampler cannot use."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    """Reads one completions answer; every problem raises `SamplerError` with the request and the
    path of the field at fault, never a KeyError / TypeError from deep inside."""

    def __init__(self, what: str) -> None:
        self.what = what
        """The request, `POST http://host:port/v1/completions`."""

    def fail(self, problem: str) -> NoReturn:
        raise SamplerError(f"{self.what}: {problem}")

    def field(self, obj: dict[str, Any], key: str, path: str, kind: type, wanted: str) -> Any:
        value = obj.get(key)
        if not isinstance(value, kind):
            self.fail(f"{path}.{key} is {'missing' if key not in obj else _shown(value)}, not {wanted}")
        return value

    def logprob(self, value: Any, path: str) -> float:
        if value is None:
            self.fail(f"{path} is null: the server returned a null logprob for a sampled token")
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        if not math.isfinite(number):
            self.fail(f"{path} is {_shown(value)}, not a finite number")
        return number

    def token_id(self, value: Any, path: str) -> int:
        if type(value) is not int or not 0 <= value <= MAX_TOKEN_ID:
            self.fail(f"{path} is {_shown(value)}, not a token id (an integer in [0, {MAX_TOKEN_ID}])")
        return value

    def id_of_token(self, token: Any, path: str) -> int:
        """A "token_id:N" string of `return_tokens_as_token_ids`."""
        if not isinstance(token, str):
            self.fail(f"{path} is {_shown(token)}, not a string")
        if not token.startswith(_TOKEN_ID_PREFIX):
            self.fail(
                f"{path} is {_shown(token)}: the server returned token strings, not ids: "
                "it must support return_tokens_as_token_ids (vLLM)"
            )
        digits = token[len(_TOKEN_ID_PREFIX) :]
        if not (digits.isascii() and digits.isdigit() and len(digits) <= len(str(MAX_TOKEN_ID))):
            self.fail(f"{path} is {_shown(token)}, not token_id:N with N a token id")
        return self.token_id(int(digits), path)

    def completion(self, choice: dict[str, Any], path: str) -> Completion:
        logprobs = self.field(choice, "logprobs", path, dict, "an object (the server returned no logprobs)")
        where = f"{path}.logprobs"
        token_logprobs = self.field(logprobs, "token_logprobs", where, list, "a list")
        lps = [self.logprob(v, f"{where}.token_logprobs[{k}]") for k, v in enumerate(token_logprobs)]
        if choice.get("token_ids") is not None:
            raw = self.field(choice, "token_ids", path, list, "a list")
            ids = [self.token_id(v, f"{path}.token_ids[{k}]") for k, v in enumerate(raw)]
        else:
            tokens = self.field(logprobs, "tokens", where, list, "a list")
            ids = [self.id_of_token(t, f"{where}.tokens[{k}]") for k, t in enumerate(tokens)]
        if len(lps) != len(ids):
            self.fail(f"{path} has {len(ids)} tokens but {len(lps)} logprobs")
        text = choice.get("text")
        if text is not None and not isinstance(text, str):
            self.fail(f"{path}.text is {_shown(text)}, not a string")
        return Completion(
            token_ids=ids,
            logprobs=lps,
            text=text,
            finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
        )

    def completions(self, raw: bytes, expected: int) -> list[Completion]:
        """`expected` completions, in `index` order (OpenAI and vLLM number choices prompt-major:
        index = prompt_index * n + sample_index; a server that leaves it out is read in order)."""
        try:
            answer = json.loads(raw, parse_constant=_no_constant)
        except ValueError as exc:  # JSONDecodeError, a bad UTF-8 byte, an over-long integer, NaN
            self.fail(f"the answer is not JSON ({exc}): {_shown(raw[:200])}")
        if not isinstance(answer, dict):
            self.fail(f"the answer is {_shown(answer)}, not a JSON object")
        choices = self.field(answer, "choices", "answer", list, "a list")
        if len(choices) != expected:
            self.fail(f"asked for {expected} completions, got {len(choices)}")
        by_index: dict[int, tuple[str, dict[str, Any]]] = {}
        for position, choice in enumerate(choices):
            path = f"choices[{position}]"
            if not isinstance(choice, dict):
                self.fail(f"{path} is {_shown(choice)}, not an object")
            index = choice.get("index", position)
            if type(index) is not int or not 0 <= index < expected or index in by_index:
                self.fail(f"{path}.index is {_shown(index)}, not a distinct index below {expected}")
            by_index[index] = (path, choice)
        return [self.completion(choice, path) for path, choice in (by_index[i] for i in range(expected))]


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


class OpenAICompatibleSampler:
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 120.0,
        deadline: float | None = DEFAULT_DEADLINE_S,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        retry: RetryPolicy | None = None,
        max_connections: int = 64,
        unload_previous: bool = True,
        extra_body: dict[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`model`: the served base model's name, used until the first adapter is loaded.
        `timeout`: httpx's, per socket operation; `deadline`: seconds one attempt may take in all
        (None: none); `max_response_bytes`: the largest answer read.
        `extra_body`: extra fields for every completions request (e.g. `top_k`, `seed`)."""
        if deadline is not None and not deadline > 0:
            raise ValueError(f"deadline must be > 0 seconds or None, not {deadline!r}")
        if (
            isinstance(max_response_bytes, bool)
            or not isinstance(max_response_bytes, int)
            or max_response_bytes < 1
        ):
            raise ValueError(
                f"max_response_bytes must be a positive number of bytes, not {max_response_bytes!r}"
            )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )
        self._deadline = deadline
        self._max_response_bytes = max_response_bytes
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
        """The answer, read whole within the bounds (a 2xx; an error answer raises its ApiError)."""

        async def attempt() -> httpx.Response:
            request = self._http.build_request("POST", path, json=body)
            return await bounded.send_async(
                self._http, request, deadline_s=self._deadline, max_bytes=self._max_response_bytes
            )

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
        response = await self._post("/v1/completions", body)
        reader = _Reader(f"{response.request.method} {response.request.url}")
        return reader.completions(response.content, len(prompts) * n)

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
