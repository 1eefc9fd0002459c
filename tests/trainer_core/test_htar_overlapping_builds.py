"""Two threads building the built-in model do so one after the other (the process's model lock,
trainer_core/models/construction.py, held around the whole of `builtin.build`): the first is held
inside its build, after seeding and before drawing its initial weights, while the second starts.
The second waits at the lock until the first is done, and both build the weights a lone build does.
Overlapping builds drew each other's initial weights (the seed and torch's RNG are the process's)."""

import hashlib
import threading
from collections.abc import Callable
from types import TracebackType

import pytest
from transformers import LlamaConfig

from trainer_core.models import builtin, construction

WAIT_S = 120.0
"""How long a step of the choreography may take: a bug fails the test rather than hanging it."""


def _short_build() -> str:
    """The sha256 of a two-step build's weights (the smallest the other build tests use)."""
    digest = hashlib.sha256()
    for name, tensor in builtin.build(clean_steps=2, noisy_steps=1).state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


class WatchedLock:
    """The process's model lock (a real `threading.Lock` inside) that says who holds it and who waits:
    the test sees the second build arrive at the lock without sleeping on it."""

    def __init__(self, log: list[str], arrived: threading.Event) -> None:
        self._lock = threading.Lock()
        self._log, self._arrived = log, arrived

    def __enter__(self) -> None:
        me = threading.current_thread().name
        if not self._lock.acquire(blocking=False):
            self._log.append(f"{me} waits")
            self._arrived.set()
            self._lock.acquire()
        self._log.append(f"{me} holds")

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._log.append(f"{threading.current_thread().name} releases")  # before the other may enter
        self._lock.release()


def test_a_second_build_waits_for_the_first_and_both_build_a_lone_builds_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lone = _short_build()

    log: list[str] = []
    first_paused, second_arrived, release_first = threading.Event(), threading.Event(), threading.Event()
    monkeypatch.setattr(construction, "_LOCK", WatchedLock(log, second_arrived))
    config: Callable[[], LlamaConfig] = builtin.tiny_llama_config

    def paused_config() -> LlamaConfig:
        # Called inside the build, after `torch.manual_seed` and before the initial weights are drawn.
        me = threading.current_thread().name
        log.append(f"{me} builds")
        if me == "first":
            first_paused.set()
            assert release_first.wait(WAIT_S), "the first build was never released"
        else:
            second_arrived.set()  # without the lock: the second got into its build
        return config()

    monkeypatch.setattr(builtin, "tiny_llama_config", paused_config)
    hashes: dict[str, str] = {}
    failed: list[BaseException] = []

    def build() -> None:
        try:
            hashes[threading.current_thread().name] = _short_build()
        except BaseException as exc:  # the thread's failure must fail the test
            failed.append(exc)

    first = threading.Thread(target=build, name="first")
    second = threading.Thread(target=build, name="second")
    first.start()
    try:
        assert first_paused.wait(WAIT_S), "the first build never reached its pause point"
        second.start()
        assert second_arrived.wait(WAIT_S), "the second build neither waited at the lock nor built"
        # The first is still held inside its build: the second must be waiting, not building.
        assert "second builds" not in log, log
        assert log[-1] == "second waits", log
    finally:
        release_first.set()
        first.join(WAIT_S)
        if second.ident is not None:  # started
            second.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive()
    assert not failed, failed
    assert log == [
        "first holds",
        "first builds",
        "second waits",
        "first releases",
        "second holds",
        "second builds",
        "second releases",
    ]
    assert hashes == {"first": lone, "second": lone}
