"""`loraloom demo` and the examples start the service and the pool in sessions of their own, so a
SIGTERM or SIGHUP to the parent must unwind through its clean-up instead of killing it outright
(seen before the fix: the service and the pool outlived a SIGTERM'd demo)."""

import os
import signal

import pytest

from loraloom.embedded import signals_as_exit


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_unwinds_and_the_old_handler_comes_back(sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    cleaned = False
    with pytest.raises(SystemExit) as stopped:
        try:
            with signals_as_exit():
                os.kill(os.getpid(), sig)
                signal.sigtimedwait([], 0)  # let the handler run before the next line
                raise AssertionError("the signal did not stop the block")
        finally:
            cleaned = True
    assert cleaned and stopped.value.code == 128 + sig
    assert signal.getsignal(sig) == before
