"""The README's Tinker example, as written, runs against the service through the unmodified `tinker`
SDK without a FutureWarning. With tinker 0.38 it raised four ("Using the future as the
TrainingClient is deprecated; call .result()", prober finding 4): it used the future of
`create_lora_training_client` as the client. Only the service's address and key are put in; a
thread answers the pool's side (tests/app/tinker_calls.py). Both databases."""

import re
import warnings
from pathlib import Path
from typing import Any

import httpx

from tests.app.api import new_tenant, register
from tests.app.tinker_calls import AnsweringPool

README = Path(__file__).resolve().parents[2] / "README.md"
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def readme_tinker_example() -> str:
    """The first Python block of the README's "Use the Tinker SDK" section."""
    section = README.read_text().split("## Use the Tinker SDK", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found, "no Python block in the README's Tinker section"
    return found.group(1)


def _pointed_at(code: str, url: str, key: str) -> str:
    for placeholder, value in (
        ('"http://127.0.0.1:8000"', repr(url)),
        ('"tml-" + "llk_..."', repr("tml-" + key)),
    ):
        assert code.count(placeholder) == 1, placeholder
        code = code.replace(placeholder, value)
    return code


def test_the_readme_tinker_example_runs_without_warnings(http: httpx.Client) -> None:
    tenant = new_tenant(http)
    # The example keeps the SDK's defaults (rank 32, every module): the README's pool for them.
    pool_id = register(http, max_rank=32, target_modules=ALL_MODULES)
    code = _pointed_at(readme_tinker_example(), str(http.base_url).rstrip("/"), tenant.key)
    namespace: dict[str, Any] = {}
    try:
        with AnsweringPool(str(http.base_url), pool_id), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 (the README's own code)
    finally:
        if "service" in namespace:
            namespace["service"].close("success").result(timeout=30)
    future_warnings = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
    assert future_warnings == []
    assert namespace["path"].endswith("/sampler_weights/final")
    assert type(namespace["sampler"]).__name__ == "SamplingClient"
