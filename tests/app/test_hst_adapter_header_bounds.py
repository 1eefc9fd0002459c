"""An uploaded adapter's safetensors header is bounded before any work grows with it (hostile probe,
2026-11-29): a shape of 80,000 dimensions of 10**18 was multiplied out (big integers, quadratic,
holding the GIL: every other tenant's requests waited 30 s), a header of 1,000,000 tensors cost 104 s
of CPU and a 331 MB 422 listing each. Both adapter uploads run the same check: the tenant's
(POST /v1/adapters) and the pool's (PUT /v1/pool/runs/{run_id}/adapters/{step}). Each refusal here is
a 422 of a bounded size, nothing is stored, and the costly step is shown not to have run (its calls
counted), never timed."""

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from app.adapters import upload as upload_module
from app.adapters import uploads
from app.adapters.upload import MAX_SAFETENSORS_HEADER_BYTES
from app.config import Settings
from contracts.peft import MAX_ADAPTER_TENSORS, MAX_TENSOR_DIMS, AdapterProblem, adapter_problems
from tests.app.api import POOL_SPEC, WORKER_HEADERS, TenantHandle, create_run, register
from tests.app.test_adapters import tar_bytes

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
Q_PROJ = "base_model.model.model.layers.{layer}.self_attn.q_proj"
MAX_REFUSAL_BYTES = 32 * 1024
"""A refusal's body, whatever the header holds: at most 21 problems (uploads.MAX_LISTED_PROBLEMS and one
counting the rest) of a few hundred characters each, in `message` and in `details`."""


def _upload(
    client: TestClient, tenant: TenantHandle, weights: bytes, config: dict[str, Any] | None = None
) -> Any:
    """POST /v1/adapters of an adapter whose safetensors file is `weights` (and its config)."""
    return client.post(
        "/v1/adapters",
        params={"name": "mine"},
        content=_adapter(weights, CONFIG if config is None else config),
        headers=tenant.headers | {"Content-Type": "application/x-tar"},
    )


def _safetensors(header: dict[str, Any], data: bytes, *, pad_to: int = 0) -> bytes:
    """A safetensors file written by hand (the library refuses to write what these tests need)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * max(0, pad_to - len(raw))  # the format pads its header with spaces
    return len(raw).to_bytes(8, "little") + raw + data


def _adapter(weights: bytes, config: dict[str, Any] = CONFIG) -> bytes:
    return tar_bytes(
        {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": weights}
    )


def _one_tensor(shape: object, *, data: bytes = b"\0" * 4) -> bytes:
    return _adapter(
        _safetensors({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, len(data)]}}, data)
    )


def _pair(layer: int = 0, *, rank: int = 4, dims: int = 32) -> dict[str, torch.Tensor]:
    module = Q_PROJ.format(layer=layer)
    return {
        f"{module}.lora_A.weight": torch.zeros(rank, dims),
        f"{module}.lora_B.weight": torch.zeros(dims, rank),
    }


Upload = Callable[[bytes], Any]
"""Sends an adapter tar through one of the two upload routes; returns the response."""


@pytest.fixture
def pool(client: TestClient) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)


@pytest.fixture(params=["tenant", "pool"])
def send(request: pytest.FixtureRequest, client: TestClient, tenant: TenantHandle, pool: None) -> Upload:
    """Both routes that take an adapter tar."""
    if request.param == "tenant":
        return lambda body: client.post(
            "/v1/adapters",
            params={"name": "mine"},
            content=body,
            headers=tenant.headers | {"Content-Type": "application/x-tar"},
        )
    run_id = create_run(client, tenant)["id"]
    return lambda body: client.put(
        f"/v1/pool/runs/{run_id}/adapters/1",
        content=body,
        headers=WORKER_HEADERS | {"Content-Type": "application/x-tar"},
    )


def _nothing_stored(client: TestClient, tenant: TenantHandle, settings: Settings) -> None:
    assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []
    runs = client.get("/v1/runs", headers=tenant.headers).json()["items"]
    for run in runs:
        listed = client.get(f"/v1/runs/{run['id']}/adapters", headers=tenant.headers).json()
        assert listed["items"] == [], listed
    # Files: neither an uploaded adapter's nor a step's, nor a staging leftover of either.
    uploaded = settings.data_dir / "adapters"
    assert (list(uploaded.iterdir()) if uploaded.exists() else []) == []
    assert list(settings.data_dir.rglob("*step_*")) == []


def _refused(response: Any, *, kind: str = "invalid_safetensors") -> dict[str, Any]:
    assert response.status_code == 422, response.text[:2000]
    assert len(response.content) <= MAX_REFUSAL_BYTES, (len(response.content), response.text[:500])
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "invalid_adapter", error
    assert all(set(d) == {"loc", "msg", "type"} for d in error["details"]), error
    assert kind in [d["type"] for d in error["details"]], error
    return error


@pytest.fixture
def products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every shape `math.prod` multiplies out while a test runs."""
    seen: list[int] = []
    real = math.prod

    def counted(iterable: Any, /, **kwargs: Any) -> Any:
        items = list(iterable)
        seen.append(len(items))
        return real(items, **kwargs)

    monkeypatch.setattr(math, "prod", counted)
    return seen


# --- shapes ------------------------------------------------------------------------------------------


def test_a_shape_of_many_dimensions_is_refused_before_it_is_multiplied(
    client: TestClient, tenant: TenantHandle, settings: Settings, send: Upload, products: list[int]
) -> None:
    """The probe's shape, 10,000 dimensions of 10**18 here (80,000 took 49 s to multiply out)."""
    error = _refused(send(_one_tensor([10**18] * 10_000)))
    assert "10000 dimensions (at most 8)" in error["message"], error
    assert [n for n in products if n > MAX_TENSOR_DIMS] == []
    _nothing_stored(client, tenant, settings)


@pytest.mark.parametrize(
    ("shape", "said"),
    [
        ([10**18, 10**18], "more 4-byte elements than the file's 4 bytes of data"),
        ([0, 10**18], "more 4-byte elements than the file's 4 bytes of data"),
        ([10**999] * MAX_TENSOR_DIMS, "(an integer of 1000 digits)"),
        ([True], "a malformed shape [True]"),
        ([-1], "a malformed shape [-1]"),
        ([1.0], "a malformed shape [1.0]"),
        ({"a": 1}, "a malformed shape (not a list"),
    ],
)
def test_a_dimension_that_is_no_count_of_what_the_data_holds_is_refused(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    send: Upload,
    products: list[int],
    shape: object,
    said: str,
) -> None:
    """Whole numbers >= 0, none larger than the data could hold: `true` counted as 1 (a tensor of shape
    [true] was stored through the pool's route), and a dimension of 1000 digits was repeated whole in
    the message."""
    error = _refused(send(_one_tensor(shape)))
    assert said in error["message"], error
    assert products == []
    _nothing_stored(client, tenant, settings)


def test_a_long_shape_is_cut_in_the_message(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool: None
) -> None:
    """A well-formed shape the pool cannot load (the tenant's route checks it against the pool's model)
    is shown by its first dimensions and its length."""
    ones = [1] * MAX_TENSOR_DIMS
    weights = _safetensors(
        {f"{Q_PROJ.format(layer=0)}.lora_A.weight": {"dtype": "F32", "shape": ones, "data_offsets": [0, 4]}},
        b"\0" * 4,
    )
    r = _upload(client, tenant, weights)
    error = _refused(r, kind="adapter_weights_mismatch")
    assert (
        f"has shape [1, 1, 1, 1, ... ({MAX_TENSOR_DIMS} dimensions)], expected [4, 32]" in error["message"]
    ), error
    _nothing_stored(client, tenant, settings)


# --- the number of tensors and the header's size ------------------------------------------------------


def test_more_tensors_than_an_adapter_has_are_refused_before_any_is_checked(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    send: Upload,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's header of 1,000,000 tensors, at the smallest count over the bound here."""
    checked: list[str] = []
    real = upload_module._check_tensor

    def counted(name: str, info: object, data_len: int) -> None:
        checked.append(name)
        real(name, info, data_len)

    monkeypatch.setattr(upload_module, "_check_tensor", counted)
    count = MAX_ADAPTER_TENSORS + 1
    header = {
        f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(count)
    }
    error = _refused(send(_adapter(_safetensors(header, b"\0" * 4 * count))))
    assert f"it lists {count} tensors; an adapter has at most {MAX_ADAPTER_TENSORS}" in error["message"], (
        error
    )
    assert checked == []
    _nothing_stored(client, tenant, settings)


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the safetensors headers (and configs) the upload parsed as JSON."""
    sizes: list[int] = []
    real = upload_module._parse_json

    def counted(raw: bytes) -> Any:
        sizes.append(len(raw))
        return real(raw)

    monkeypatch.setattr(upload_module, "_parse_json", counted)
    return sizes


def _legit_header() -> tuple[dict[str, Any], bytes]:
    """The header of a real adapter's weights, parsed, and their data."""
    legit = save(_pair())
    header_len = int.from_bytes(legit[:8], "little")
    return json.loads(legit[8 : 8 + header_len]), legit[8 + header_len :]


def test_a_header_over_its_bound_is_refused_before_it_is_parsed(
    client: TestClient, tenant: TenantHandle, settings: Settings, send: Upload, parsed: list[int]
) -> None:
    """A well-formed adapter whose header is padded past the bound (the format pads with spaces): the
    bound was the safetensors library's 100 MB, parsed whole (1,000,000 tensors: 2 GB of memory)."""
    header, data = _legit_header()
    weights = _safetensors(header, data, pad_to=MAX_SAFETENSORS_HEADER_BYTES + 1)
    error = _refused(send(_adapter(weights)))
    assert f"its header is {MAX_SAFETENSORS_HEADER_BYTES + 1} bytes (at most" in error["message"], error
    assert [n for n in parsed if n > MAX_SAFETENSORS_HEADER_BYTES] == []
    _nothing_stored(client, tenant, settings)
    at_bound = _safetensors(header, data, pad_to=MAX_SAFETENSORS_HEADER_BYTES)
    r = send(_adapter(at_bound))
    assert r.status_code == 201, r.text[:2000]


def test_a_header_of_many_small_entries_is_refused_before_it_is_parsed(
    client: TestClient, tenant: TenantHandle, settings: Settings, send: Upload, parsed: list[int]
) -> None:
    """A header within its size made of tiny entries (the prober's 700,000 metadata entries in 8 MiB:
    3.1 s of parsing, the GIL held): its quotes and commas are counted first. Fewer, but more metadata
    entries than an adapter has, are refused once parsed."""
    header, data = _legit_header()
    flood = header | {"__metadata__": {str(i): "" for i in range(700_000)}}
    error = _refused(send(_adapter(_safetensors(flood, data))))
    assert "quotes and commas (at most" in error["message"], error
    assert [n for n in parsed if n > 1 << 20] == []
    many = header | {"__metadata__": {str(i): "" for i in range(upload_module.MAX_METADATA_ENTRIES + 1)}}
    error = _refused(send(_adapter(_safetensors(many, data))))
    assert f"__metadata__ has {upload_module.MAX_METADATA_ENTRIES + 1} entries" in error["message"], error
    _nothing_stored(client, tenant, settings)


def test_more_tensors_than_the_pools_model_can_have_are_refused_before_any_is_checked(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    pool: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Against the live pool (2 layers, 4 module types: 16 tensors at most), before the pool's import
    rules look at each tensor; the config's own problems are still named."""
    looked_at: list[int] = []

    def counted(config: object, header: dict[str, object], **kwargs: Any) -> list[AdapterProblem]:
        looked_at.append(len(header))
        return adapter_problems(config, header, **kwargs)

    monkeypatch.setattr(uploads, "adapter_problems", counted)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(9):
        tensors |= _pair(layer)
    r = _upload(client, tenant, save(tensors), CONFIG | {"r": 1000})
    error = _refused(r, kind="too_many_tensors")
    assert "it lists 18 tensors; an adapter of the pool of 'loraloom-tiny' has at most 16" in error["message"]
    assert [d["loc"] for d in error["details"]] == [["body", "r"], ["body", "adapter_model.safetensors"]]
    assert looked_at == []
    _nothing_stored(client, tenant, settings)
    # A module the pool does not adapt is still named: the likelier cause of the count.
    r = _upload(client, tenant, save(tensors), CONFIG | {"target_modules": ["q_proj", "gate_proj"]})
    error = _refused(r, kind="too_many_tensors")
    assert [(d["loc"], d["type"]) for d in error["details"]] == [
        (["body", "target_modules"], "target_modules_not_adaptable"),
        (["body", "adapter_model.safetensors"], "too_many_tensors"),
    ]
    assert looked_at == []
    _nothing_stored(client, tenant, settings)
    # As many as the model has, every module of both layers: kept.
    tensors = {}
    for layer in range(2):
        for module in POOL_SPEC["target_modules"]:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, 32)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(32, 4)
    r = _upload(client, tenant, save(tensors), CONFIG | {"target_modules": POOL_SPEC["target_modules"]})
    assert r.status_code == 201, r.text
    assert looked_at == [16]


def test_the_problems_of_a_refused_upload_are_listed_up_to_a_bound(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    """60 tensors of the wrong shape: 20 listed, the rest counted (one problem per tensor made the
    probe's 422 331 MB)."""
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=30)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(30):
        tensors |= _pair(layer, dims=31)
    r = _upload(client, tenant, save(tensors))
    error = _refused(r, kind="adapter_weights_mismatch")
    details = error["details"]
    assert len(details) == uploads.MAX_LISTED_PROBLEMS + 1, details
    assert details[-1] == {
        "loc": ["body"],
        "msg": "and 40 more problems, not listed",
        "type": "more_problems",
    }
    assert error["message"].endswith("; and 40 more problems, not listed"), error["message"]
    _nothing_stored(client, tenant, settings)


@pytest.mark.parametrize("where", ["unexpected", "module"])
def test_a_long_tensor_name_is_cut_in_the_message(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool: None, where: str
) -> None:
    """A tensor's name is as long as the header lets it be (8 MiB): a name of 100,000 characters was
    repeated whole in the message and in its problem."""
    long = "x" * 100_000
    name = long if where == "unexpected" else f"base_model.model.{long}.lora_A.weight"
    tensors = _pair() | {name: torch.zeros(4, 32)}
    r = _upload(client, tenant, save(tensors))
    error = _refused(r, kind="adapter_weights_mismatch")
    assert "... (100000 characters)" in error["message"], error
    _nothing_stored(client, tenant, settings)
