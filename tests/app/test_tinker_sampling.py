"""The service's side of Tinker sampling, in-process: base-model sampling clients (no run: claimed by
the base model's pool), the SDK's `stop` and prompt-logprob options as the pool receives them, the
answer as the SDK decodes it, and bad sample requests stored nowhere."""

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from tinker.proto.response_conv import deserialize_sample_response

from app.tinker.models import TinkerFuture
from contracts.tinker_work import ManualResult, SampledSequence
from tests.app.api import WORKER_HEADERS, TenantHandle, register

pytestmark = pytest.mark.postgres_only

BASE_MODEL = "loraloom-tiny"


def _headers(tenant: TenantHandle) -> dict[str, str]:
    return {"X-API-Key": "tml-" + tenant.key}


def _base_sampler(client: TestClient, tenant: TenantHandle) -> str:
    headers = _headers(tenant)
    session = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "test"}, headers=headers)
    r = client.post(
        "/api/v1/create_sampling_session",
        json={
            "session_id": session.json()["session_id"],
            "sampling_session_seq_id": 0,
            "base_model": BASE_MODEL,
        },
        headers=headers,
    )
    assert r.status_code == 200, r.text
    sampler_id: str = r.json()["sampling_session_id"]
    return sampler_id


def _sample_body(sampler_id: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    params = extra.pop("sampling_params", {"max_tokens": 3})
    return {
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": params,
        **extra,
    }


def _stored_samples(db) -> int:
    db.expire_all()
    return int(db.scalar(select(func.count()).select_from(TinkerFuture).where(TinkerFuture.kind == "sample")))


def test_base_model_samples_are_claimed_by_its_pool_and_answered_as_the_sdk_reads_them(
    client, tenant, other_tenant
):
    pool_id = register(client)
    sampler_id = _base_sampler(client, tenant)
    info = client.get(f"/api/v1/samplers/{sampler_id}", headers=_headers(other_tenant))
    assert info.status_code == 200 and info.json()["base_model"] == BASE_MODEL  # not private: no adapter
    r = client.post(
        "/api/v1/asample",
        json=_sample_body(
            sampler_id,
            [5, 6, 7],
            sampling_params={"max_tokens": 3, "stop": "ab", "seed": 4, "temperature": 0.5},
            prompt_logprobs=True,
            prompt_logprobs_last_n=2,
        ),
        headers=_headers(tenant),
    )
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]

    claimed = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 8}, headers=WORKER_HEADERS
    ).json()["items"]
    assert len(claimed) == 1
    item = claimed[0]
    assert item["request_id"] == request_id and item["run_id"] == "" and item["kind"] == "sample"
    spec = item["sampling"]
    assert spec["base_model"] == BASE_MODEL and spec["step"] is None
    assert (spec["stop_strings"], spec["stop_tokens"], spec["stop_at_eos"]) == (["ab"], [], False)
    assert (spec["prompt_logprobs"], spec["prompt_logprobs_last_n"], spec["seed"]) == (True, 2, 4)
    # Claimed once: a second claim finds nothing.
    again = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 8}, headers=WORKER_HEADERS
    )
    assert again.json()["items"] == []

    result = ManualResult(
        request_id=request_id,
        sequences=[SampledSequence(tokens=[9, 10], logprobs=[-0.5, -1.5], stop_reason="stop")],
        prompt_logprobs=[None, -2.0, -3.0],
    )
    posted = client.post(
        "/v1/pool/manual/results",
        json={"pool_id": pool_id, "results": [result.model_dump(mode="json")]},
        headers=WORKER_HEADERS,
    )
    assert posted.json()["recorded"] == 1
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=_headers(tenant))
    response = deserialize_sample_response(answer.content)
    assert response.prompt_logprobs == [None, -2.0, -3.0]
    (seq,) = response.sequences
    assert (list(seq.tokens), seq.stop_reason) == ([9, 10], "stop")
    assert seq.logprobs == pytest.approx([-0.5, -1.5])


def test_stop_none_is_the_eos_and_empty_stops_at_nothing(client, tenant):
    pool_id = register(client)
    sampler_id = _base_sampler(client, tenant)
    for stop, expected in ((None, ([], [], True)), ([], ([], [], False)), ([2, 7], ([], [2, 7], False))):
        params = {"max_tokens": 2} if stop is None else {"max_tokens": 2, "stop": stop}
        r = client.post(
            "/api/v1/asample",
            json=_sample_body(sampler_id, [5], sampling_params=params),
            headers=_headers(tenant),
        )
        assert r.status_code == 200, r.text
        (item,) = client.post(
            "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 8}, headers=WORKER_HEADERS
        ).json()["items"]
        spec = item["sampling"]
        assert (spec["stop_strings"], spec["stop_tokens"], spec["stop_at_eos"]) == expected


def test_bad_sample_requests_get_a_4xx_and_store_nothing(client, tenant, db):
    register(client)
    sampler_id = _base_sampler(client, tenant)
    bad: list[tuple[dict[str, Any], int]] = [
        (_sample_body(sampler_id, [5, 6], sampling_params={"max_tokens": 2, "stop": [1, "a"]}), 422),
        (_sample_body(sampler_id, [5, 6], sampling_params={"max_tokens": 2, "stop": [""]}), 422),
        (_sample_body(sampler_id, [5, 6], prompt_logprobs_last_n=1), 422),  # without prompt_logprobs
        (_sample_body(sampler_id, [5, 6], prompt_logprobs=True, prompt_logprobs_last_n=2), 422),  # > len - 1
        (_sample_body(sampler_id, [5, 300]), 422),  # outside the pool's vocabulary (256)
        (_sample_body(sampler_id, [5], sampling_params={"max_tokens": 2, "stop": [256]}), 422),
        (_sample_body(sampler_id, [5], sampling_params={"max_tokens": 2, "temperature": -1}), 422),
        (_sample_body(sampler_id, [5], sampling_params={"max_tokens": 2000}), 422),  # past max_seq_len
        (_sample_body(sampler_id, [5], num_samples=0), 422),
        (_sample_body(sampler_id, [5], sampling_params={"max_tokens": 0}), 422),
        (_sample_body(sampler_id, []), 422),
        (_sample_body(sampler_id, ["a"]), 422),
        ({**_sample_body(sampler_id, [5]), "prompt": {"chunks": [{"type": "image", "data": ""}]}}, 400),
        ({**_sample_body(sampler_id, [5]), "sampling_params": "hot"}, 422),
        (_sample_body(sampler_id, [5], topk_prompt_logprobs=2), 400),
        (_sample_body(sampler_id, [5], prompt_alt_tokens_k=1), 400),
        (_sample_body("smp_nope", [5]), 404),
        (_sample_body("smpbase_bm90LWEtbW9kZWw", [5]), 404),  # "not-a-model": no pool serves it
    ]
    for body, status in bad:
        r = client.post("/api/v1/asample", json=body, headers=_headers(tenant))
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) == {"code", "message", "details"}
    assert _stored_samples(db) == 0
    no_pool = client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": "x", "sampling_session_seq_id": 1, "base_model": "no-such-model"},
        headers=_headers(tenant),
    )
    assert no_pool.status_code == 404 and no_pool.json()["error"]["code"] == "pool_not_found"
