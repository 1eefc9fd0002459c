"""Which exceptions leave the accelerator unusable: the pool stops on them instead of failing a request.

The pool catches what one Tinker request raises so that the request fails alone and the other
tenants' work goes on (trainer_core.manual, trainer_core.sample_server). That is right for an error
of the request (a loss that raises, weights that do not fit, a full disk), not for an error of the
device. A CUDA error such as "an illegal memory access was encountered" or "device-side assert
triggered" is sticky: the CUDA context is corrupted, every later kernel fails or, worse, computes on
memory in an undefined state, and a pool that went on would train every tenant on garbage. Those are
re-raised: the pool process stops, and the service returns its work to pending for the next pool.

Out of memory is not one of them: the caching allocator raises `torch.OutOfMemoryError` before the
kernel that needed the memory runs, so the context and every tensor are intact; the failed pass's
tensors are freed as its frames unwind, and the request (or a smaller row: the manual passes run a
failed row's requests one by one) can fail alone. A backward that runs out of memory half-way may
have accumulated part of its gradient, which the manual passes roll back (trainer_core.grad_rollback).
"""

import torch

FATAL_MARKERS = (
    "CUDA error",
    "CUDA driver error",
    "CUBLAS_STATUS_",
    "CUDNN_STATUS_",
    "cuDNN error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "NCCL error",
)
"""Texts of the device errors torch raises as a plain RuntimeError (older builds, cuBLAS / cuDNN)."""
OUT_OF_MEMORY = "out of memory"
"""Recoverable even when a CUDA call reports it ("CUDA error: out of memory" is not sticky)."""


def is_fatal_device_error(exc: BaseException) -> bool:
    """True for an error of the accelerator after which the process state is undefined; looks along
    the exception's causes (a failed backward is re-raised wrapped)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _fatal(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def raise_if_fatal(exc: BaseException) -> None:
    """Re-raise `exc` (from inside its `except`) when it is a fatal device error."""
    if is_fatal_device_error(exc):
        raise exc


_ACCELERATOR_ERROR: type[BaseException] | None = getattr(torch, "AcceleratorError", None)
"""torch >= 2.8's type of device errors; older torch (the project allows 2.4) raises RuntimeErrors only."""


def _fatal(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    text = str(exc)
    if OUT_OF_MEMORY in text.lower():
        return False
    if _ACCELERATOR_ERROR is not None and isinstance(exc, _ACCELERATOR_ERROR):
        return True
    return isinstance(exc, RuntimeError) and any(marker in text for marker in FATAL_MARKERS)
