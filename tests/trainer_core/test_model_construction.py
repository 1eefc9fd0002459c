"""Two threads loading models at once leave transformers' process-wide state as it was
(`trainer_core.models.construction`).

transformers' `from_pretrained` makes `PreTrainedModel.tie_weights` a no-op and sets torch's default
dtype while it loads, and restores what it found. Two loads that overlapped restored each other's
patch: the process never tied embeddings again (tests/trainer_core/test_target_modules.py's tied
Qwen models failed on a pytest-xdist worker that had run test_builtin_cache.py's racing builds), and a
bf16 load could leave bf16 the default dtype. The overlap is forced here: the first load waits, inside
its own, until the second has arrived (inside its load, or at the lock that keeps it out).
"""

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedModel

from trainer_core.models import builtin, construction
from trainer_core.models.tiny import build_model

WAIT_S = 60.0
"""Only so that a bug fails the test instead of hanging it."""


class _AnnouncingLock:
    """`construction`'s lock, saying when the second load reaches it."""

    def __init__(self, lock: Any, arrived: threading.Event) -> None:
        self.lock, self.arrived = lock, arrived

    def __enter__(self) -> None:
        if threading.current_thread().name == "second":
            self.arrived.set()  # it waits here for the first load to end
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_overlapping_loads_leave_weight_tying_and_the_default_dtype_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever happens, the worker's later tests get transformers' own tie_weights and fp32 back.
    monkeypatch.setattr(PreTrainedModel, "tie_weights", PreTrainedModel.tie_weights)
    tie_weights = PreTrainedModel.tie_weights
    monkeypatch.setattr(builtin, "build", lambda: LlamaForCausalLM(builtin.tiny_llama_config()))
    builtin.load(tmp_path)  # cached: the threads below only load

    first_inside, second_arrived, first_done = threading.Event(), threading.Event(), threading.Event()
    monkeypatch.setattr(construction, "_LOCK", _AnnouncingLock(construction._LOCK, second_arrived))
    real_init = LlamaForCausalLM.__init__

    def init(self: LlamaForCausalLM, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)  # inside from_pretrained's patches
        if threading.current_thread().name == "first":
            first_inside.set()
            assert second_arrived.wait(WAIT_S)
        else:
            second_arrived.set()
            assert first_done.wait(WAIT_S)  # ends after the first: restores last

    monkeypatch.setattr(LlamaForCausalLM, "__init__", init)
    failed: list[BaseException] = []

    def load(dtype: torch.dtype, done: threading.Event | None) -> None:
        try:
            builtin.load(tmp_path, dtype=dtype)
        except BaseException as exc:  # the thread's failure must fail the test
            failed.append(exc)
        finally:
            if done is not None:
                done.set()

    first = threading.Thread(target=load, args=(torch.bfloat16, first_done), name="first")
    second = threading.Thread(target=load, args=(torch.float32, None), name="second")
    first.start()
    assert first_inside.wait(WAIT_S)
    second.start()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert not failed, failed

    assert PreTrainedModel.tie_weights is tie_weights
    assert torch.get_default_dtype() == torch.float32
    tied = build_model("qwen2", seed=0, tie_word_embeddings=True)
    assert tied.get_submodule("lm_head").weight is tied.get_input_embeddings().weight
