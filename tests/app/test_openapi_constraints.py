"""The document's constraints are the service's: on a table of inputs, the published schema accepts
exactly what the service's own parsers accept (those parsers are what the routes call).

Rules a JSON schema cannot state (per-token lists as long as their ids, seq_len, the run's vocabulary)
are in the descriptions and out of this table."""

import json
from copy import deepcopy
from typing import Any

import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from pydantic import ValidationError

from app.adapters.router import _parse_step
from app.batches.validation import decode_and_validate
from app.config import Settings
from app.errors import AppError
from app.main import create_app
from app.openapi import build_documents
from app.runs.schemas import EvictRequest, parse_run_create
from app.tenants.schemas import TenantCreate

PUBLIC, _ = build_documents(create_app(Settings(database_url="sqlite:///:memory:")))


def _schema_accepts(component: str, value: Any) -> bool:
    root = {"$ref": f"#/components/schemas/{component}", "components": PUBLIC["components"]}
    return Draft202012Validator(root).is_valid(value)


def _service_accepts(parse: Any, value: Any) -> bool:
    try:
        parse(value)
    except (AppError, ValidationError, ValueError):
        return False
    return True


# --------------------------------------------------------------------------- create run


def _run(**config: Any) -> dict[str, Any]:
    return {"name": "r", "config": config}


RUN_CREATE = [
    _run(),
    {"name": "r"},
    {"name": ""},
    {"name": "a\x01b"},
    {"name": "r", "extra": 1},
    _run(seed=0),
    _run(seed=False),
    _run(seed="3"),
    _run(seed=-1),
    _run(seed=2**31),
    _run(max_steps=1.5),
    _run(batch_size=0),
    _run(seq_len=7),
    _run(heartbeat_timeout=None),
    _run(heartbeat_timeout=0),
    _run(heartbeat_timeout="10"),
    _run(lora={"rank": 8, "target_modules": ["q_proj", "v_proj"]}),
    _run(lora={"target_modules": []}),
    _run(lora={"target_modules": ["attn"]}),
    _run(lora={"target_modules": ["q_proj", "q_proj"]}),
    _run(lora={"alpha": True}),
    _run(lora={"dropout": 1.0}),
    _run(optim={"betas": [0.9, 0.99]}),
    _run(optim={"betas": [1.0, 0.99]}),
    _run(optim={"betas": [0.9]}),
    _run(optim={"betas": ["0.9", 0.99]}),
    _run(optim={"lr": 0}),
    _run(scheduler={"kind": "cosine"}),
    _run(scheduler={"kind": "step"}),
    _run(loss={"kind": "sequence_is", "mask_ratio_high": 0.5}),
    _run(metadata={f"k{i}": i for i in range(64)}),
    _run(metadata={f"k{i}": i for i in range(65)}),
    _run(unknown=1),
    _run(base_model=""),
]


def _parse_run(value: Any) -> Any:
    return parse_run_create(json.dumps(value).encode(), "application/json")


@pytest.mark.parametrize("body", RUN_CREATE, ids=[json.dumps(b)[:60] for b in RUN_CREATE])
def test_run_create_schema_is_the_service(body):
    assert _schema_accepts("RunCreate", body) == _service_accepts(_parse_run, body)


# --------------------------------------------------------------------------- rollout batches


def _sample(**overrides: Any) -> dict[str, Any]:
    sample: dict[str, Any] = {
        "prompt_ids": [1, 2],
        "prompt_mask": [True, True],
        "completion_ids": [3],
        "completion_mask": [True],
        "completion_logprobs": [-0.5],
        "advantage": 1.0,
    }
    return {k: v for k, v in (sample | overrides).items() if v is not ...}


def _batch(*samples: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"examples": list(samples) or [_sample()], **fields}


BATCHES = [
    _batch(),
    _batch(temperature=0.7, step=3, env="math", agent="solver"),
    {"examples": []},
    {},
    _batch(temperature=0),
    _batch(step=-1),
    _batch(env="x" * 256),
    _batch(env="x" * 257),
    _batch(agent=None),
    _batch(unknown=1),
    _batch(_sample(advantage=...)),
    _batch(_sample(advantage=None)),
    _batch(_sample(advantage=[0.5])),
    _batch(_sample(prompt_ids=[], prompt_mask=[])),
    _batch(_sample(completion_ids=[], completion_mask=[], completion_logprobs=[])),
    _batch(_sample(prompt_ids=[-1, 2])),
    _batch(_sample(completion_logprobs=[0.1])),
    _batch(_sample(teacher_logprobs=[-0.2])),
    _batch(_sample(teacher_logprobs=[0.2])),
    _batch(_sample(weights=[0.0])),
    _batch(_sample(weights=[-1.0])),
    _batch(_sample(reward=1.0, token_rewards=[0.5])),
    _batch(_sample(metrics={"ok": 1.0})),
    _batch(_sample(metrics={"": 1.0})),
    _batch(_sample(metrics={f"m{i}": 1.0 for i in range(17)})),
    _batch(_sample(prompt_ids=[True, 2])),
    _batch(_sample(extra=1)),
]


def _parse_batch(value: Any) -> Any:
    return decode_and_validate(json.dumps(value).encode(), msgpack=False, seq_len=1_000, vocab_size=None)


@pytest.mark.parametrize("body", BATCHES, ids=[json.dumps(b)[:80] for b in BATCHES])
def test_training_batch_schema_is_the_service(body):
    assert _schema_accepts("TrainingBatch", body) == _service_accepts(_parse_batch, body)


# --------------------------------------------------------------------------- small bodies and parameters

TENANTS = [
    {"name": "acme"},
    {"name": "acme.research_2-b", "max_concurrent_runs": 1024},
    {"name": ""},
    {"name": "-acme"},
    {"name": "a b"},
    {"name": "acme", "max_concurrent_runs": 0},
    {"name": "acme", "max_concurrent_runs": True},
    {"name": "acme", "extra": 1},
]


@pytest.mark.parametrize("body", TENANTS, ids=[json.dumps(b) for b in TENANTS])
def test_tenant_create_schema_is_the_service(body):
    assert _schema_accepts("TenantCreate", body) == _service_accepts(
        lambda v: TenantCreate.model_validate_json(json.dumps(v)), body
    )


EVICTIONS = [
    {"reason": "done"},
    {"reason": "done", "by": "orchestrator"},
    {"reason": ""},
    {"reason": "done", "by": "trainer"},
    {"by": "user"},
]


@pytest.mark.parametrize("body", EVICTIONS, ids=[json.dumps(b) for b in EVICTIONS])
def test_evict_schema_is_the_service(body):
    assert _schema_accepts("EvictRequest", body) == _service_accepts(
        lambda v: EvictRequest.model_validate_json(json.dumps(v)), body
    )


STEPS = ["latest", "0", "12", "123456789", "1234567890", "-1", "1.5", "Latest", "", "١٢"]


@pytest.mark.parametrize("step", STEPS)
def test_step_parameter_pattern_is_the_service(step):
    op = PUBLIC["paths"]["/v1/runs/{run_id}/adapters/{step}"]["get"]
    schema = deepcopy(next(p for p in op["parameters"] if p["name"] == "step")["schema"])
    assert Draft202012Validator(schema).is_valid(step) == _service_accepts(_parse_step, step)
