"""The pool's client to an external OpenAI-compatible server (trainer_core.external_sampler) against a
hung, hostile or broken one: each exchange ends at its total deadline however the server trickles,
an answer over `max_response_bytes` is refused without being read whole, and a malformed answer
fails its request alone with an error naming the URL and the field at fault (a KeyError, TypeError
or AttributeError from inside would have failed every sample of the round instead). The hostile
servers are the SDK bounds tests' bare socket server; the malformed answers are the fake vLLM's own
(tests/trainer_core/test_external_sampler.py), rewritten on their way out."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from contracts.tinker_work import ManualResult
from tests.orchestrator.test_client_bounds import CAP, RawServer, endless_chunks, huge_length
from tests.orchestrator.test_sampler_openai_bounds import trickle_completion, trickle_headers
from tests.trainer_core.test_external_sampler import BASE, FakeVllm, item, serving_fake_vllm
from trainer_core.external_sampler import ExternalSampler

Answer = dict[str, Any]


def served_alone(sampler: ExternalSampler, **spec: Any) -> ManualResult:
    """One base-model request (prompt [5, 6, 7], 2 samples of 3 tokens unless `spec` says otherwise)."""
    return sampler.serve([(0, item("r", None, [5, 6, 7], **spec), None)])[0]


# ---- the deadline ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)  # a guard: without the deadline the trickle would go on until then
@pytest.mark.parametrize("script", [trickle_completion, trickle_headers], ids=["body", "headers"])
def test_a_trickled_answer_fails_the_request_at_the_deadline(script: Any, tmp_path: Path) -> None:
    with RawServer(script) as server:
        sampler = ExternalSampler(server.url, tmp_path, BASE, timeout_s=30.0, deadline_s=0.5)
        result = served_alone(sampler)
    assert result.sequences is None and result.error is not None
    assert f"POST {server.url}/v1/completions" in result.error
    assert "within the deadline of 0.5s" in result.error and "deadline_s" in result.error


# ---- the size cap ---------------------------------------------------------------------------------


def test_a_content_length_over_the_cap_is_refused_unread(tmp_path: Path) -> None:
    with RawServer(huge_length) as server:
        result = served_alone(ExternalSampler(server.url, tmp_path, BASE, max_response_bytes=CAP))
    assert result.error is not None and f"POST {server.url}/v1/completions" in result.error
    assert f"larger than the limit of {CAP} bytes" in result.error
    assert f"its Content-Length is {10 * CAP} bytes" in result.error and "max_response_bytes" in result.error


def test_an_endless_chunked_answer_stops_at_the_cap(tmp_path: Path) -> None:
    """10x the cap, chunked with no length: refused as soon as the bytes read pass the cap, and
    memory never held more than the cap and a chunk."""
    with RawServer(endless_chunks) as server:
        sampler = ExternalSampler(server.url, tmp_path, BASE, max_response_bytes=CAP)
        tracemalloc.start()
        try:
            result = served_alone(sampler)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert result.error is not None and "it kept coming" in result.error
    assert peak < 2 * CAP


def test_normal_answers_pass_under_tight_bounds(tmp_path: Path) -> None:
    with serving_fake_vllm() as (url, _):
        tight = ExternalSampler(url, tmp_path, BASE, deadline_s=5.0, max_response_bytes=2048)
        passed = served_alone(tight)
        refused = served_alone(tight, num_samples=32)  # the same request, over 2 KiB
    assert passed.error is None and passed.sequences is not None and len(passed.sequences) == 2
    assert refused.error is not None and "larger than the limit of 2048 bytes" in refused.error


# ---- malformed answers ----------------------------------------------------------------------------

DELETE = object()


def _set(path: str, value: Any) -> Callable[[Answer], Answer]:
    """Set (or with DELETE, remove) the field at a dotted path such as `choices.0.index`."""

    def mangle(answer: Answer) -> Answer:
        *parents, last = path.split(".")
        node: Any = answer
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        key_: Any = int(last) if isinstance(node, list) else last
        if value is DELETE:
            del node[key_]
        else:
            node[key_] = value
        return answer

    return mangle


MALFORMED: list[tuple[str, Callable[[Answer], Any], str]] = [
    ("not-json", lambda a: "<html>502 Bad Gateway</html>", "it is not JSON"),
    ("not-an-object", lambda a: [a], "the answer is [{"),
    ("no-choices", _set("choices", DELETE), "the answer.choices is missing, not a list"),
    ("fewer-choices", _set("choices.1", DELETE), "1 choices for n=2"),
    ("choice-not-an-object", _set("choices.0", 3), "choices[0] is 3, not an object"),
    ("index-not-an-int", _set("choices.1.index", "0"), "choices[1].index is '0', not a distinct index"),
    ("index-repeated", _set("choices.1.index", 0), "choices[1].index is 0, not a distinct index below 2"),
    ("no-logprobs", _set("choices.0.logprobs", DELETE), "choices[0].logprobs is missing, not an object"),
    ("tokens-not-a-list", _set("choices.0.logprobs.tokens", "x"), "choices[0].logprobs.tokens is 'x'"),
    ("token-not-a-string", _set("choices.0.logprobs.tokens.1", 7), "tokens[1] is 7, not `token_id:N`"),
    ("token-text", _set("choices.0.logprobs.tokens.1", "hello"), "tokens[1] is 'hello', not `token_id:N`"),
    ("token-id-junk", _set("choices.0.logprobs.tokens.0", "token_id:-3"), "tokens[0] is 'token_id:-3'"),
    ("token-id-huge", _set("choices.0.logprobs.tokens.0", "token_id:" + "9" * 5000), "tokens[0] is 'token_"),
    ("token-id-int64", _set("choices.0.logprobs.tokens.0", "token_id:4294967296"), "'token_id:4294967296'"),
    ("logprob-a-string", _set("choices.1.logprobs.token_logprobs.2", "-1"), "token_logprobs[2] is '-1', not"),
    ("logprob-null", _set("choices.0.logprobs.token_logprobs.0", None), "token_logprobs[0] is None, not a"),
    ("logprob-nan", _set("choices.0.logprobs.token_logprobs.0", float("nan")), "NaN is not a JSON number"),
    ("logprob-infinity", _set("choices.0.logprobs.token_logprobs.0", float("inf")), "Infinity is not a JSON"),
    ("fewer-logprobs", _set("choices.0.logprobs.token_logprobs.0", DELETE), "has 3 tokens but 2 logprobs"),
]

PROMPT_MALFORMED: list[tuple[str, Callable[[Answer], Any], str]] = [
    ("missing", _set("choices.0.prompt_logprobs", DELETE), "choices[0].prompt_logprobs is None, not a list"),
    ("short", _set("choices.0.prompt_logprobs.2", DELETE), "not a list of one entry per prompt token"),
    ("no-token-key", _set("choices.0.prompt_logprobs.2", {"99": {}}), "prompt_logprobs[2].7 is missing"),
    ("entry-not-an-object", _set("choices.0.prompt_logprobs.1", [1]), "prompt_logprobs[1] is [1], not an"),
    ("logprob-missing", _set("choices.0.prompt_logprobs.2.7", {}), "prompt_logprobs[2].7.logprob is None"),
    ("logprob-nan", _set("choices.0.prompt_logprobs.2.7.logprob", float("nan")), "NaN is not a JSON number"),
]


@pytest.fixture
def mangled_vllm() -> Iterator[Callable[[Callable[[Answer], Any]], str]]:
    """The fake vLLM, serving; calling the fixture with `mangle` rewrites its completions answers
    from then on (a str is sent as it is, the rest as json.dumps writes it, NaN and Infinity
    literals included). Gives the server's URL."""
    with serving_fake_vllm() as (url, fake):

        def install(mangle: Callable[[Answer], Any]) -> str:
            def handle(path: str, body: dict[str, Any]) -> tuple[int, Any]:
                status, answer = FakeVllm.handle(fake, path, body)
                if isinstance(answer, str):  # an error answer, not a completion
                    return status, answer
                return (status, mangle(answer)) if path == "/v1/completions" else (status, answer)

            fake.handle = handle  # type: ignore[method-assign]
            return url

        yield install


@pytest.mark.parametrize(("mangle", "problem"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_a_malformed_answer_fails_the_request_naming_what_is_wrong(
    mangle: Callable[[Answer], Any], problem: str, mangled_vllm: Any, tmp_path: Path
) -> None:
    url = mangled_vllm(mangle)
    result = served_alone(ExternalSampler(url, tmp_path, BASE))
    assert result.sequences is None and result.error is not None
    assert result.error.startswith(
        f"the external sampler's answer to POST {url}/v1/completions could not be read: "
    )
    assert problem in result.error


@pytest.mark.parametrize(
    ("mangle", "problem"), [c[1:] for c in PROMPT_MALFORMED], ids=[c[0] for c in PROMPT_MALFORMED]
)
def test_malformed_prompt_logprobs_fail_the_request_naming_what_is_wrong(
    mangle: Callable[[Answer], Any], problem: str, mangled_vllm: Any, tmp_path: Path
) -> None:
    url = mangled_vllm(mangle)
    result = served_alone(ExternalSampler(url, tmp_path, BASE), prompt_logprobs=True)
    assert result.error is not None and "could not be read: " in result.error and problem in result.error


def test_an_unchanged_answer_passes_the_same_checks(mangled_vllm: Any, tmp_path: Path) -> None:
    """The rewriting itself changes nothing: the malformed cases fail for what they changed."""
    url = mangled_vllm(lambda answer: answer)
    result = served_alone(ExternalSampler(url, tmp_path, BASE), prompt_logprobs=True)
    assert result.error is None and result.sequences is not None
    assert [s.tokens for s in result.sequences] == [[8, 9, 10], [9, 10, 11]]
    assert result.prompt_logprobs == [None, -1.0, -1.0]
