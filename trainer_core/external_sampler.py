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

A round's requests go to the server together, at most `concurrency` at a time (vLLM batches the
ones it has, so a round costs about ceil(N / concurrency) generations, not N), each answered into
its own result. One client serves every round of the pool's life, its connections kept alive
between rounds and as many as the requests in flight (`close` at the pool's stop releases them);
it lives on an event loop of its own for the same reason, which each `serve` runs until its round
is done.

Bounds, as the SDK's client has (orchestrator.bounded, which the pool may not import): a round has
a total deadline (`deadline_s` from its start: every exchange of it, connect, send and the whole
answer, ends by then, and a request still waiting for its turn then fails without being sent; so a
hung server costs a round one deadline, not one per request; httpx's `timeout_s` is per socket
operation, which a server trickling bytes never trips) and each answer is read chunk by chunk
under `max_response_bytes` (refused unread when its Content-Length says so). The exchanges run
under asyncio for that: `asyncio.timeout_at` cancels a read a trickle keeps alive, which httpx's
sync client cannot. The answer is checked before use: anything missing, of the wrong type, not
strict JSON (NaN / Infinity) or non-finite fails the request alone, naming the field at fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, cast

import httpx

from contracts.arrays import MAX_TOKEN_ID
from contracts.tinker_work import ManualResult, ManualWorkItem, SampledSequence, SamplingSpec
from trainer_core.sample_server import COPY_ID_FILE, PEFT_DIR, sampler_weights_dir

log = logging.getLogger("loraloom.worker")

__all__ = ["ExternalSampler"]

TOKEN_ID_PREFIX = "token_id:"


class _Refused(Exception):
    """A request the external server cannot serve: it fails alone, with this message."""


class _Unreadable(Exception):
    """What is wrong with an answer, with the path of the field at fault (`choices[0].index`)."""


class _Answer(NamedTuple):
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


@dataclass
class ExternalSampler:
    url: str
    """The server's root (`http://vllm:8000`), without `/v1`."""
    checkpoint_dir: Path
    base_model: str
    """The name the server serves the base model under."""
    timeout_s: float = 300.0
    """httpx's timeout, per socket operation (connect, each read, each write)."""
    deadline_s: float = 600.0
    """Seconds a round of requests may take in all, from its start. The server answers a completion
    only once all its samples are done, so this bounds a whole request's decoding, and the queue
    of a round with more requests than `concurrency`."""
    max_response_bytes: int = 256 * 1024**2
    """The largest answer read: about 100 bytes a sampled token with its logprob (64 samples of 4,096
    tokens: some 26 MB), and prompt logprobs, which vLLM repeats in every sample."""
    concurrency: int = 8
    """Requests of a round in flight at once, and the client's connections to the server."""
    _loaded: set[str] = field(default_factory=set, init=False)
    """Adapter names this pool has hot-loaded into the server."""
    _loading: dict[str, asyncio.Lock] = field(default_factory=dict, init=False, repr=False)
    """Held while an adapter is loaded: the round's other requests for it wait instead of loading it
    again."""
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    """The loop `_http` lives on (its connections belong to it), from the first `serve` to `close`."""
    _http: httpx.AsyncClient | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"ExternalSampler.concurrency must be at least 1, not {self.concurrency}")

    def serve(self, work: Sequence[tuple[int, ManualWorkItem, int | None]]) -> dict[int, ManualResult]:
        """Each `sample` request (index in the claim, item, slot: unused) decoded by the server, by index."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self._serve(work))

    def close(self) -> None:
        """Release the client's connections and its loop (at the pool's stop); a later `serve` opens
        new ones."""
        loop, http = self._loop, self._http
        self._loop, self._http = None, None
        self._loading.clear()  # its locks belong to the loop closed here
        if loop is None:
            return
        try:
            # A round an interrupt (Ctrl-C) left unfinished ends here, not in the next run of the loop.
            leftovers = asyncio.all_tasks(loop)
            if leftovers:
                for task in leftovers:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            if http is not None:
                loop.run_until_complete(http.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.url.rstrip("/"),
                timeout=self.timeout_s,
                limits=httpx.Limits(
                    max_connections=self.concurrency, max_keepalive_connections=self.concurrency
                ),
            )
        return self._http

    async def _serve(self, work: Sequence[tuple[int, ManualWorkItem, int | None]]) -> dict[int, ManualResult]:
        http = self._client()
        deadline = asyncio.get_running_loop().time() + self.deadline_s
        turns = asyncio.Semaphore(self.concurrency)

        async def answer(item: ManualWorkItem) -> ManualResult:
            try:
                async with asyncio.timeout_at(deadline):
                    await turns.acquire()
            except TimeoutError:
                return ManualResult(request_id=item.request_id, error=self._no_turn(len(work)))
            try:
                return await self._sample(http, item, deadline)
            except _Refused as exc:
                return ManualResult(request_id=item.request_id, error=str(exc))
            finally:
                turns.release()

        # Anything but a refusal is a fault of ours: it cancels the round's other requests and fails
        # them all (Manual's catch), as it did when they went one by one.
        try:
            async with asyncio.TaskGroup() as group:
                answers = {index: group.create_task(answer(item)) for index, item, _ in work}
        except ExceptionGroup as faults:
            raise faults.exceptions[0] from None
        return {index: task.result() for index, task in answers.items()}

    def _no_turn(self, requests: int) -> str:
        return (
            f"the external sampler did not get to this request within the deadline of {self.deadline_s:g}s "
            f"of its round: its {requests} requests go {self.concurrency} at a time "
            "(ExternalSampler.deadline_s, ExternalSampler.concurrency)"
        )

    # -- one exchange, bounded -------------------------------------------------------------------

    async def _post(
        self, http: httpx.AsyncClient, path: str, body: dict[str, Any], deadline: float
    ) -> _Answer:
        """One exchange, ended at `deadline` (the loop's time: its round's)."""
        what = f"POST {self.url.rstrip('/')}{path}"
        try:
            async with asyncio.timeout_at(deadline), http.stream("POST", path, json=body) as response:
                return _Answer(response.status_code, await self._read(response, what))
        except TimeoutError as exc:  # asyncio.timeout's (httpx's own are httpx.TimeoutException)
            raise _Refused(
                f"the external sampler did not answer {what} in full within the deadline of "
                f"{self.deadline_s:g}s of its round (ExternalSampler.deadline_s)"
            ) from exc
        except httpx.HTTPError as exc:
            raise _Refused(f"the external sampler at {self.url} did not answer {path}: {exc}") from exc

    async def _read(self, response: httpx.Response, what: str) -> bytes:
        """The answer's body, refused as soon as it passes `max_response_bytes` (before a byte of it
        when its Content-Length says it would): memory holds at most the cap and one chunk."""
        declared = response.headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > self.max_response_bytes:
            raise self._too_large(what, f"its Content-Length is {declared} bytes")
        chunks: list[bytes] = []
        size = 0
        # Closed here when refused: left to the garbage collector, it would be closed by a later
        # round on the pool's loop, or never. (httpx's is an async generator, typed as an iterator.)
        async with contextlib.aclosing(cast(AsyncGenerator[bytes, None], response.aiter_bytes())) as body:
            async for chunk in body:
                size += len(chunk)
                if size > self.max_response_bytes:
                    raise self._too_large(what, "it kept coming")
                chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, what: str, said: str) -> _Refused:
        return _Refused(
            f"the external sampler's answer to {what} is larger than the limit of "
            f"{self.max_response_bytes} bytes ({said}; ExternalSampler.max_response_bytes)"
        )

    # -- one request -----------------------------------------------------------------------------

    async def _model_name(
        self, http: httpx.AsyncClient, item: ManualWorkItem, spec: SamplingSpec, deadline: float
    ) -> str:
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
            async with self._loading.setdefault(name, asyncio.Lock()):
                if name not in self._loaded:  # not loaded meanwhile by another request of the round
                    await self._load(http, name, peft, spec.step, deadline)
            # Waiters hold the lock itself, and find the name loaded: one lock per step for the
            # pool's life would be a slow leak.
            if name in self._loaded:
                self._loading.pop(name, None)
        return name

    async def _load(self, http: httpx.AsyncClient, name: str, peft: Path, step: int, deadline: float) -> None:
        answer = await self._post(
            http, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(peft)}, deadline
        )
        # A server restarted under us forgets; one that kept it says so: both are fine to use.
        if answer.status != 200 and "already" not in answer.text:
            raise _Refused(
                f"the external sampler refused the adapter of step {step}: {answer.status} {answer.text[:500]}"
            )
        self._loaded.add(name)
        log.info("external sampler: adapter %s loaded from %s", name, peft)

    async def _sample(self, http: httpx.AsyncClient, item: ManualWorkItem, deadline: float) -> ManualResult:
        spec = item.sampling
        if spec is None:
            raise _Refused("sample without sampling parameters")
        body: dict[str, Any] = {
            "model": await self._model_name(http, item, spec, deadline),
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
        answer = await self._post(http, "/v1/completions", body, deadline)
        if answer.status != 200:
            raise _Refused(f"the external sampler answered {answer.status}: {answer.text[:500]}")
        try:
            return _result(item.request_id, spec, _strict_json(answer.body))
        except _Unreadable as exc:
            raise _Refused(
                f"the external sampler's answer to POST {self.url.rstrip('/')}/v1/completions "
                f"could not be read: {exc}"
            ) from exc


# -- reading an answer: every problem is an _Unreadable naming the field ---------------------------


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _strict_json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:  # JSONDecodeError, a bad UTF-8 byte, an over-long integer, NaN
        raise _Unreadable(f"it is not JSON ({exc}): {_shown(raw[:200])}") from exc


def _field(obj: Any, key: str, path: str, kind: type, wanted: str) -> Any:
    if not isinstance(obj, dict):
        raise _Unreadable(f"{path} is {_shown(obj)}, not an object")
    value = obj.get(key)
    if not isinstance(value, kind):
        raise _Unreadable(f"{path}.{key} is {'missing' if key not in obj else _shown(value)}, not {wanted}")
    return value


def _logprob(value: Any, path: str) -> float:
    number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    if not math.isfinite(number):
        raise _Unreadable(f"{path} is {_shown(value)}, not a finite number")
    return number


def _token_id(token: Any, path: str) -> int:
    """A `token_id:N` string of `return_tokens_as_token_ids`."""
    digits = token.removeprefix(TOKEN_ID_PREFIX) if isinstance(token, str) else ""
    if not (
        isinstance(token, str)
        and token.startswith(TOKEN_ID_PREFIX)
        and digits.isascii()
        and digits.isdigit()
        and len(digits) <= len(str(MAX_TOKEN_ID))  # no int() of a megabyte of digits
        and int(digits) <= MAX_TOKEN_ID
    ):
        raise _Unreadable(f"{path} is {_shown(token)}, not `token_id:N` (return_tokens_as_token_ids)")
    return int(digits)


def _prompt_logprobs(spec: SamplingSpec, raw: Any, path: str) -> list[float | None] | None:
    """vLLM's per-position {token id: {logprob, ...}} (None first) → the prompt tokens' logprobs,
    None for the first and before the last `prompt_logprobs_last_n`."""
    if not spec.prompt_logprobs:
        return None
    if not isinstance(raw, list) or len(raw) != len(spec.prompt):
        raise _Unreadable(f"{path} is {_shown(raw)}, not a list of one entry per prompt token")
    first_kept = len(spec.prompt) - spec.prompt_logprobs_last_n if spec.prompt_logprobs_last_n else 1
    out: list[float | None] = []
    for position, (token, entry) in enumerate(zip(spec.prompt, raw, strict=True)):
        if position < max(first_kept, 1) or entry is None:
            out.append(None)
        else:
            at = f"{path}[{position}]"
            scored = _field(entry, str(token), at, dict, f"an object (for prompt token {token})")
            out.append(_logprob(scored.get("logprob"), f"{at}.{token}.logprob"))
    return out


def _sequence(choice: dict[str, Any], path: str) -> SampledSequence:
    logprobs = _field(choice, "logprobs", path, dict, "an object")
    where = f"{path}.logprobs"
    tokens = _field(logprobs, "tokens", where, list, "a list")
    values = _field(logprobs, "token_logprobs", where, list, "a list")
    if len(tokens) != len(values):
        raise _Unreadable(f"{where} has {len(tokens)} tokens but {len(values)} logprobs")
    return SampledSequence(
        tokens=[_token_id(t, f"{where}.tokens[{k}]") for k, t in enumerate(tokens)],
        logprobs=[_logprob(v, f"{where}.token_logprobs[{k}]") for k, v in enumerate(values)],
        stop_reason="length" if choice.get("finish_reason") == "length" else "stop",
    )


def _result(request_id: str, spec: SamplingSpec, answer: Any) -> ManualResult:
    choices = _field(answer, "choices", "the answer", list, "a list")
    if len(choices) != spec.num_samples:
        raise _Unreadable(f"{len(choices)} choices for n={spec.num_samples}")
    by_index: dict[int, tuple[str, dict[str, Any]]] = {}
    for position, choice in enumerate(choices):
        path = f"choices[{position}]"
        if not isinstance(choice, dict):
            raise _Unreadable(f"{path} is {_shown(choice)}, not an object")
        index = choice.get("index", position)  # vLLM numbers them; one that does not is read in order
        if type(index) is not int or not 0 <= index < len(choices) or index in by_index:
            raise _Unreadable(f"{path}.index is {_shown(index)}, not a distinct index below {len(choices)}")
        by_index[index] = (path, choice)
    ordered = [by_index[i] for i in range(len(choices))]
    first_path, first = ordered[0]
    return ManualResult(
        request_id=request_id,
        sequences=[_sequence(choice, path) for path, choice in ordered],
        prompt_logprobs=_prompt_logprobs(spec, first.get("prompt_logprobs"), f"{first_path}.prompt_logprobs"),
    )
