"""Tinker `sample` served by an external OpenAI-compatible server with LoRA hot-loading
(trainer_core.external_sampler), against a small local fake that speaks vLLM's API: the kept
sampler weights are hot-loaded as a PEFT adapter once per copy, each request is one
`/v1/completions` with the request's parameters, and the answer comes back as the SDK's tokens,
logprobs, stop reasons and prompt logprobs; what the server cannot serve fails alone."""

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from contracts.progress import Progress
from contracts.run_config import LoraSettings, RunConfig
from contracts.tinker_work import ManualWorkItem, SamplingSpec
from tests.trainer_core.test_sampling import tiny_model
from trainer_core.external_sampler import ExternalSampler
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.sample_server import PEFT_DIR, sampler_weights_dir, save_sampler_weights
from trainer_core.slots import RunSlot

CONFIG = RunConfig(lora=LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj")))
BASE = "loraloom-tiny"


class FakeVllm:
    """Records what it is sent; answers completions with tokens prompt[-1] + 1, + 2, ... and
    logprob -0.25 each, `finish_reason` "length", and prompt logprobs -1.0 per position. Served
    (`serving_fake_vllm`) over HTTP/1.1 with keep-alive, as vLLM is, it also records the connection
    each request came on and how many were in flight at once, and calls `hold` (a test's pause
    point) with each completions body before answering it."""

    def __init__(self) -> None:
        self.loads: list[dict[str, Any]] = []
        self.completions: list[dict[str, Any]] = []
        self.adapters: set[str] = set()
        self.changed = threading.Condition()
        """Guards the counts below; notified whenever one changes."""
        self.peers: list[tuple[str, int]] = []
        """The client's address of each request: one per connection."""
        self.open_connections = 0
        self.in_flight = 0
        """Requests arrived and not yet answered."""
        self.arrived = 0
        self.most_in_flight = 0
        self.hold: Callable[[dict[str, Any]], None] | None = None

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any] | str]:
        if path == "/v1/load_lora_adapter":
            self.loads.append(body)
            if not (Path(body["lora_path"]) / "adapter_config.json").is_file():
                return 400, "no adapter_config.json"
            self.adapters.add(body["lora_name"])
            return 200, "Success"
        if path == "/v1/completions":
            self.completions.append(body)
            if body["model"] not in self.adapters | {BASE}:
                return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
            prompt = body["prompt"]
            choices = []
            for index in range(body["n"]):
                tokens = [prompt[-1] + index + k for k in range(1, body["max_tokens"] + 1)]
                choice: dict[str, Any] = {
                    "index": index,
                    "text": "",
                    "finish_reason": "length",
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in tokens],
                        "token_logprobs": [-0.25] * len(tokens),
                    },
                }
                if "prompt_logprobs" in body:
                    choice["prompt_logprobs"] = [None] + [
                        {str(t): {"logprob": -1.0, "rank": 1}} for t in prompt[1:]
                    ]
                choices.append(choice)
            return 200, {"id": "cmpl-1", "object": "text_completion", "choices": choices}
        return 404, "not found"


@contextmanager
def serving_fake_vllm() -> Iterator[tuple[str, FakeVllm]]:
    """A FakeVllm on a free local port, in a thread: (its URL, it)."""
    fake = FakeVllm()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client that keeps its connections is seen to

        def setup(self) -> None:
            super().setup()
            with fake.changed:
                fake.open_connections += 1
                fake.changed.notify_all()

        def finish(self) -> None:
            super().finish()
            with fake.changed:
                fake.open_connections -= 1
                fake.changed.notify_all()

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with fake.changed:
                fake.peers.append(self.client_address)
                fake.in_flight += 1
                fake.arrived += 1
                fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
                fake.changed.notify_all()
            try:
                if fake.hold is not None and self.path == "/v1/completions":
                    fake.hold(body)
                status, answer = fake.handle(self.path, body)
            finally:
                # Before the answer goes out: the client may send its next request once it has it.
                with fake.changed:
                    fake.in_flight -= 1
                    fake.changed.notify_all()
            raw = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", fake
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_vllm() -> Iterator[tuple[str, FakeVllm]]:
    with serving_fake_vllm() as served:
        yield served


def item(request_id: str, step: int | None, prompt: list[int], **spec: Any) -> ManualWorkItem:
    """A `sample` work item: 2 samples of 3 tokens of `prompt` from `step`'s adapter (None: the base model)."""
    sampling = SamplingSpec(
        prompt=prompt,
        num_samples=spec.pop("num_samples", 2),
        max_tokens=3,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        step=step,
        base_model=BASE if step is None else None,
        **spec,
    )
    run_id = "" if step is None else "run_a"
    return ManualWorkItem(request_id=request_id, run_id=run_id, seq_id=0, kind="sample", sampling=sampling)


def test_samples_are_served_by_the_external_server_with_the_kept_adapter_hot_loaded_once(tmp_path, fake_vllm):
    url, fake = fake_vllm
    _, lora = tiny_model(PACKED_ATTENTION)
    run = RunSlot(0, "run_a", CONFIG, Progress(step=1))
    save_sampler_weights(tmp_path, run, lora, peft_base_model=BASE)
    peft = sampler_weights_dir(tmp_path, "run_a", 1) / PEFT_DIR
    # The kept copy is a PEFT adapter of the slot's weights.
    assert json.loads((peft / "adapter_config.json").read_text())["base_model_name_or_path"] == BASE
    assert load_file(str(peft / "adapter_model.safetensors"))

    sampler = ExternalSampler(url, tmp_path, BASE)
    work = [
        (0, item("adapter", 1, [5, 6, 7], seed=11, stop_tokens=[2], stop_strings=["ab"]), 0),
        (1, item("base", None, [8, 9], num_samples=1, prompt_logprobs=True, prompt_logprobs_last_n=1), None),
        (2, item("not-kept", 4, [1, 2]), 0),
    ]
    results = sampler.serve(work)

    assert [load["lora_path"] for load in fake.loads] == [str(peft)]
    adapter_name = fake.loads[0]["lora_name"]
    assert adapter_name.startswith("run_a-step1-")
    # The round's requests went together: each is found by its prompt, not by its place.
    sent = next(c for c in fake.completions if c["prompt"] == [5, 6, 7])
    base_sent = next(c for c in fake.completions if c["prompt"] == [8, 9])
    assert {k: sent[k] for k in ("model", "prompt", "n", "max_tokens", "temperature", "top_k", "top_p")} == {
        "model": adapter_name,
        "prompt": [5, 6, 7],
        "n": 2,
        "max_tokens": 3,
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.9,
    }
    assert (sent["seed"], sent["stop_token_ids"], sent["stop"], sent["ignore_eos"]) == (11, [2], ["ab"], True)
    assert sent["return_tokens_as_token_ids"] is True and "prompt_logprobs" not in sent
    assert base_sent["model"] == BASE and base_sent["prompt_logprobs"] == 0

    first = results[0]
    assert first.error is None and first.sequences is not None
    assert [s.tokens for s in first.sequences] == [[8, 9, 10], [9, 10, 11]]
    assert all(s.logprobs == [-0.25] * 3 and s.stop_reason == "length" for s in first.sequences)
    assert first.prompt_logprobs is None
    base = results[1]
    assert base.sequences is not None and [s.tokens for s in base.sequences] == [[10, 11, 12]]
    assert base.prompt_logprobs == [None, -1.0]
    # Not kept on this pool: that request fails alone, the server is not asked.
    assert results[2].error is not None and "not kept on this pool as a PEFT adapter" in results[2].error
    assert len(fake.completions) == 2

    # The same copy is loaded once; a rewritten copy (a new save of that step) is loaded again.
    sampler.serve([(0, item("again", 1, [5]), 0)])
    assert len(fake.loads) == 1 and fake.completions[-1]["model"] == adapter_name
    save_sampler_weights(tmp_path, run, lora, peft_base_model=BASE)
    sampler.serve([(0, item("resaved", 1, [5]), 0)])
    assert len(fake.loads) == 2 and fake.completions[-1]["model"] != adapter_name
    sampler.close()


def test_a_server_that_refuses_or_is_down_fails_the_request_alone(tmp_path, fake_vllm):
    url, fake = fake_vllm
    _, lora = tiny_model(PACKED_ATTENTION)
    run = RunSlot(0, "run_a", CONFIG, Progress(step=1))
    save_sampler_weights(tmp_path, run, lora)  # no PEFT copy: not kept for an external sampler
    down = ExternalSampler("http://127.0.0.1:9", tmp_path, BASE, timeout_s=2.0)
    result = down.serve([(3, item("base", None, [1, 2]), None)])[3]
    down.close()
    assert result.error is not None and "did not answer /v1/completions" in result.error
    refusing = ExternalSampler(url, tmp_path, "a-model-it-does-not-serve")
    refused = refusing.serve([(0, item("x", None, [1]), None)])
    refusing.close()
    assert refused[0].error is not None and refused[0].error.startswith("the external sampler answered 404")
