"""A small OpenAI-compatible completions server (the parts of vLLM's API the
OpenAICompatibleSampler uses), for tests: deterministic tokens and logprobs,
runtime LoRA load/unload, and a record of every request."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

EOS = 2


class FakeOpenAIServer:
    def __init__(
        self, base_model: str = "tiny-base", *, token_ids_field: bool = False, plain_tokens: bool = False
    ):
        self.base_model = base_model
        self.loaded: dict[str, str] = {}
        self.completion_requests: list[dict[str, Any]] = []
        self.lora_calls: list[tuple[str, dict[str, Any]]] = []
        self.client_ports: list[int] = []
        self.token_ids_field = token_ids_field
        self.plain_tokens = plain_tokens
        self.app = self._build()

    @staticmethod
    def tokens_for(prompt: list[int], j: int, max_tokens: int) -> list[int]:
        """Completion j of `prompt`: a few tokens derived from the prompt, then EOS."""
        body = [(prompt[-1] + j + k) % 50 + 4 for k in range(3)]
        return (body + [EOS])[:max_tokens]

    def _build(self) -> FastAPI:
        app = FastAPI()
        srv = self

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse(
                {"object": "error", "message": message, "type": "BadRequestError", "code": status}, status
            )

        @app.post("/v1/completions")
        async def completions(request: Request) -> JSONResponse:
            body = await request.json()
            srv.completion_requests.append(body)
            srv.client_ports.append(request.client.port if request.client else -1)
            if body["model"] != srv.base_model and body["model"] not in srv.loaded:
                return error(404, f"The model `{body['model']}` does not exist.")
            n, max_tokens = body.get("n", 1), body["max_tokens"]
            choices = []
            for i, prompt in enumerate(body["prompt"]):
                for j in range(n):
                    ids = srv.tokens_for(prompt, j, max_tokens)
                    tokens = [f"t{t}" if srv.plain_tokens else f"token_id:{t}" for t in ids]
                    choice: dict[str, Any] = {
                        "index": i * n + j,
                        "text": "".join(tokens),
                        "logprobs": {
                            "tokens": tokens,
                            "token_logprobs": [-0.1 * (k + 1) for k in range(len(ids))],
                            "top_logprobs": None,
                            "text_offset": list(range(len(ids))),
                        },
                        "finish_reason": "stop" if ids[-1] == EOS else "length",
                    }
                    if srv.token_ids_field:
                        choice["token_ids"] = ids
                        choice["logprobs"]["tokens"] = [f"t{t}" for t in ids]
                    choices.append(choice)
            choices.reverse()  # clients must order by index, not by position
            return JSONResponse(
                {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": choices}
            )

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request) -> Any:
            body = await request.json()
            srv.lora_calls.append(("load", body))
            if body["lora_name"] in srv.loaded:
                return error(400, f"The lora adapter '{body['lora_name']}' has already been loaded.")
            srv.loaded[body["lora_name"]] = body["lora_path"]
            return JSONResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request) -> Any:
            body = await request.json()
            srv.lora_calls.append(("unload", body))
            if srv.loaded.pop(body["lora_name"], None) is None:
                return error(404, f"The lora adapter '{body['lora_name']}' cannot be found.")
            return JSONResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

        return app
