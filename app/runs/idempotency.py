"""The Idempotency-Key header of the routes that create something under a run (POST /v1/runs and
POST /v1/runs/{run_id}/batches): one declaration, so both routes take and refuse the same values
(what a key may be is contracts.ids.IDEMPOTENCY_KEY_PATTERN, which the SDK checks too).
"""

from typing import Any

from fastapi import Header

from contracts.ids import IDEMPOTENCY_KEY_PATTERN, MAX_IDEMPOTENCY_KEY, is_idempotency_key

__all__ = ["idempotency_key_header", "is_idempotency_key"]


def idempotency_key_header(description: str) -> Any:
    """The header's declaration (its 422 names `Idempotency-Key`), for `Annotated[str | None, ...]`."""
    return Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=MAX_IDEMPOTENCY_KEY,
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description=description,
    )
