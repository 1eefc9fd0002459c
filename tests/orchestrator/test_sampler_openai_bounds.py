"""OpenAICompatibleSampler against a hung, hostile or broken inference server: each attempt ends at
its total deadline however the server trickles, an answer over `max_response_bytes` is refused
without being read whole, and every malformed answer raises a `SamplerError` naming the URL and the
field at fault (never a KeyError / TypeError from inside). The hostile servers are the SDK bounds
tests' bare socket server (tests/orchestrator/test_client_bounds.py); the malformed answers are the
fake vLLM's own (tests/orchestrator/fake_openai.py), rewritten on their way out."""

from __future__ import annotations

import json
import socket
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request, Response

from contracts.http import RetryPolicy
from orchestrator import errors
from orchestrator.samplers import OpenAICompatibleSampler
from orchestrator.samplers.openai import DEFAULT_DEADLINE_S, DEFAULT_MAX_RESPONSE_BYTES, SamplerError
from tests.orchestrator.fake_openai import FakeOpenAIServer
from tests.orchestrator.servers import serve
from tests.orchestrator.test_client_bounds import (
    CAP,
    SLACK,
    SMALL_BUFFERS,
    RawServer,
    endless_chunks,
    huge_length,
)

FAST = RetryPolicy(max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.02)
TRICKLE_EVERY_S = 0.02
"""The trickling servers send a byte this often: each read is quick, so only a total deadline ends it."""


def trickle_completion(server: RawServer, conn: socket.socket) -> None:
    """The start of a completions answer, then a space every TRICKLE_EVERY_S until the test ends:
    the answer never completes, so the client's deadline is the only way out."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
    server.body(conn, b'{"choices": [')
    while not server.stop.wait(TRICKLE_EVERY_S):
        server.body(conn, b" ")


def trickle_headers(server: RawServer, conn: socket.socket) -> None:
    """A header that never ends: no response object ever reaches the client."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while not server.stop.wait(TRICKLE_EVERY_S):
        conn.sendall(b"a")


def counted(script: Callable[[RawServer, socket.socket], None], calls: list[int]) -> Any:
    def run(server: RawServer, conn: socket.socket) -> None:
        calls.append(1)
        script(server, conn)

    return run


def sampler(url: str, **kwargs: Any) -> OpenAICompatibleSampler:
    """Small client socket buffers: what the server got out is then close to what the client read."""
    transport = httpx.AsyncHTTPTransport(socket_options=SMALL_BUFFERS)
    return OpenAICompatibleSampler(url, "tiny-base", retry=FAST, transport=transport, **kwargs)


# ---- the deadline ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)  # a guard: without the deadline the trickle would go on until then
@pytest.mark.parametrize("script", [trickle_completion, trickle_headers], ids=["body", "headers"])
async def test_a_trickled_answer_ends_at_the_deadline_and_is_not_retried(
    script: Callable[[RawServer, socket.socket], None],
) -> None:
    connections: list[int] = []
    with RawServer(counted(script, connections)) as server:
        async with sampler(server.url, deadline=0.5, timeout=30.0) as s:
            with pytest.raises(errors.DeadlineExceeded) as caught:
                await s.generate([[1, 2]], n=2, max_tokens=8)
    assert caught.value.url == f"POST {server.url}/v1/completions" and caught.value.limit_s == 0.5
    assert f"{server.url}/v1/completions" in str(caught.value) and "deadline of 0.5s" in str(caught.value)
    assert len(connections) == 1  # three attempts allowed: a deadline is not retried


@pytest.mark.timeout(60)
async def test_loading_an_adapter_is_bounded_too(tmp_path: Path) -> None:
    with RawServer(trickle_completion) as server:
        async with sampler(server.url, deadline=0.5, timeout=30.0) as s:
            with pytest.raises(errors.DeadlineExceeded) as caught:
                await s.load_adapter(tmp_path, "run_x-step-1", 1)
            assert s.model == "tiny-base"  # not switched to an adapter the server never confirmed
    assert caught.value.url == f"POST {server.url}/v1/load_lora_adapter"


# ---- the size cap ---------------------------------------------------------------------------------


async def test_a_content_length_over_the_cap_is_refused_unread() -> None:
    with RawServer(huge_length) as server:
        async with sampler(server.url, max_response_bytes=CAP) as s:
            with pytest.raises(errors.ResponseTooLarge) as caught:
                await s.generate([[1, 2]], n=1, max_tokens=8)
    assert caught.value.declared == 10 * CAP and caught.value.limit_bytes == CAP
    assert f"POST {server.url}/v1/completions" in str(caught.value)
    assert "max_response_bytes" in str(caught.value)
    assert server.body_sent <= SLACK


async def test_an_endless_chunked_answer_stops_at_the_cap() -> None:
    """10x the cap, chunked with no length: refused once the bytes read pass the cap; the server got
    no more than the cap and a chunk out (plus the socket buffers), and memory held no more."""
    with RawServer(endless_chunks) as server:
        async with sampler(server.url, max_response_bytes=CAP) as s:
            tracemalloc.start()
            try:
                with pytest.raises(errors.ResponseTooLarge) as caught:
                    await s.generate([[1, 2]], n=1, max_tokens=8)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    assert caught.value.declared is None and caught.value.url == f"POST {server.url}/v1/completions"
    assert server.body_sent <= CAP + SLACK and peak < 2 * CAP


async def test_normal_answers_pass_under_tight_bounds_and_defaults_are_set() -> None:
    fake = FakeOpenAIServer()
    with serve(fake.app) as url:
        async with OpenAICompatibleSampler(url, "tiny-base", deadline=5.0, max_response_bytes=4096) as s:
            assert len(await s.generate([[1, 2], [3]], n=2, max_tokens=4)) == 4
            with pytest.raises(errors.ResponseTooLarge):  # the same call, over 4 KiB
                await s.generate([[1, 2], [3]], n=16, max_tokens=4)
        async with OpenAICompatibleSampler(url, "tiny-base") as s:
            assert (s._deadline, s._max_response_bytes) == (DEFAULT_DEADLINE_S, DEFAULT_MAX_RESPONSE_BYTES)
            assert len(await s.generate([[1, 2]], n=16, max_tokens=4)) == 16


@pytest.mark.parametrize(
    "bad", [{"deadline": 0}, {"deadline": -1.0}, {"max_response_bytes": 0}, {"max_response_bytes": True}]
)
def test_bad_bounds_are_refused_at_construction(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        OpenAICompatibleSampler("http://sampler.invalid", "tiny-base", **bad)


# ---- malformed answers ----------------------------------------------------------------------------

Answer = dict[str, Any]


def _set(path: str, value: Any) -> Callable[[Answer], Answer]:
    """Set (or with `value` DELETE, remove) the field at a dotted path such as `choices.0.text`."""

    def mangle(answer: Answer) -> Answer:
        *parents, last = path.split(".")
        node: Any = answer
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is DELETE:
            del node[int(last) if isinstance(node, list) else last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return answer

    return mangle


DELETE = object()
BIG = "__1e999__"
"""Replaced by the bare literal 1e999 in the answer's text: JSON that Python reads as inf."""

MALFORMED: list[tuple[str, Callable[[Answer], Any], str]] = [
    ("not-json", lambda a: b"<html>502 Bad Gateway</html>", "the answer is not JSON"),
    ("not-utf8", lambda a: b'{"choices": ["\xff"]}', "the answer is not JSON"),
    ("not-an-object", lambda a: [a], "the answer is [{"),
    ("no-choices", _set("choices", DELETE), "answer.choices is missing, not a list"),
    ("choices-not-a-list", _set("choices", {"0": 1}), "answer.choices is {'0': 1}, not a list"),
    ("fewer-choices", _set("choices.1", DELETE), "asked for 2 completions, got 1"),
    ("more-choices", lambda a: {**a, "choices": [*a["choices"], a["choices"][0]]}, "asked for 2 completions"),
    ("choice-not-an-object", _set("choices.0", "oops"), "choices[0] is 'oops', not an object"),
    ("index-not-an-int", _set("choices.0.index", "1"), "choices[0].index is '1', not a distinct index"),
    ("index-repeated", _set("choices.0.index", 0), "choices[1].index is 0, not a distinct index below 2"),
    ("index-out-of-range", _set("choices.0.index", 7), "choices[0].index is 7, not a distinct index"),
    ("no-logprobs", _set("choices.0.logprobs", None), "choices[0].logprobs is None, not an object"),
    ("no-tokens", _set("choices.0.logprobs.tokens", DELETE), "choices[0].logprobs.tokens is missing"),
    ("logprobs-not-a-list", _set("choices.0.logprobs.token_logprobs", "x"), "token_logprobs is 'x', not a"),
    ("logprob-a-string", _set("choices.1.logprobs.token_logprobs.2", "-0.3"), "token_logprobs[2] is '-0.3'"),
    ("logprob-null", _set("choices.0.logprobs.token_logprobs.0", None), "null logprob for a sampled token"),
    ("logprob-bool", _set("choices.0.logprobs.token_logprobs.0", True), "token_logprobs[0] is True, not a"),
    ("logprob-nan", _set("choices.0.logprobs.token_logprobs.0", float("nan")), "NaN is not a JSON number"),
    ("logprob-infinity", _set("choices.0.logprobs.token_logprobs.1", -float("inf")), "-Infinity is not a"),
    ("logprob-overflow", _set("choices.0.logprobs.token_logprobs.1", BIG), "token_logprobs[1] is inf, not a"),
    ("fewer-logprobs", _set("choices.0.logprobs.token_logprobs.0", DELETE), "has 4 tokens but 3 logprobs"),
    ("token-not-a-string", _set("choices.0.logprobs.tokens.1", 17), "tokens[1] is 17, not a string"),
    ("token-text", _set("choices.0.logprobs.tokens.1", "hello"), "return_tokens_as_token_ids"),
    ("token-id-junk", _set("choices.0.logprobs.tokens.1", "token_id:1_0"), "tokens[1] is 'token_id:1_0'"),
    ("token-id-huge", _set("choices.0.logprobs.tokens.1", "token_id:" + "9" * 5000), "tokens[1] is 'token_"),
    ("token-ids-float", _set("choices.0.token_ids", [1.5, 4, 5, 2]), "token_ids[0] is 1.5, not a token id"),
    ("token-ids-string", _set("choices.0.token_ids", ["7", 4, 5, 2]), "token_ids[0] is '7', not a token id"),
    ("token-ids-bool", _set("choices.0.token_ids", [4, True, 5, 2]), "token_ids[1] is True, not a token id"),
    ("token-ids-negative", _set("choices.0.token_ids", [4, 5, -1, 2]), "token_ids[2] is -1, not a token id"),
    ("token-ids-int64", _set("choices.0.token_ids", [4, 5, 2**40, 2]), "token_ids[2] is 1099511627776"),
    ("token-ids-not-a-list", _set("choices.0.token_ids", 7), "choices[0].token_ids is 7, not a list"),
    ("text-not-a-string", _set("choices.0.text", 5), "choices[0].text is 5, not a string"),
]


def mangled(mangle: Callable[[Answer], Any]) -> FakeOpenAIServer:
    """The fake vLLM, its completions answers rewritten by `mangle` (bytes are sent as they are; the
    rest as Python's json.dumps writes it, NaN and Infinity literals included)."""
    fake = FakeOpenAIServer()

    @fake.app.middleware("http")
    async def rewrite(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        response = await call_next(request)
        if request.url.path != "/v1/completions":
            return response
        body = b"".join([chunk async for chunk in response.body_iterator])
        out = mangle(json.loads(body))
        raw = out if isinstance(out, bytes) else json.dumps(out).replace(f'"{BIG}"', "1e999").encode()
        return Response(raw, media_type="application/json")

    return fake


@pytest.mark.parametrize(("mangle", "problem"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
async def test_a_malformed_answer_raises_a_sampler_error_naming_what_is_wrong(
    mangle: Callable[[Answer], Any], problem: str
) -> None:
    with serve(mangled(mangle).app) as url:
        async with OpenAICompatibleSampler(url, "tiny-base", retry=FAST) as s:
            with pytest.raises(SamplerError) as caught:
                await s.generate([[1, 9]], n=2, max_tokens=4)
    assert str(caught.value).startswith(f"POST {url}/v1/completions: ")
    assert problem in str(caught.value)


async def test_an_unchanged_answer_passes_the_same_checks() -> None:
    """The rewriting itself changes nothing: the malformed cases fail for what they changed."""
    with serve(mangled(lambda answer: answer).app) as url:
        async with OpenAICompatibleSampler(url, "tiny-base", retry=FAST) as s:
            out = await s.generate([[1, 9]], n=2, max_tokens=4)
    assert [c.token_ids for c in out] == [FakeOpenAIServer.tokens_for([1, 9], j, 4) for j in range(2)]
