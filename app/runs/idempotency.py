"""The Idempotency-Key header of the routes that create something under a run (POST /v1/runs and
POST /v1/runs/{run_id}/batches): one definition, so both routes take and refuse the same values.

Printable ASCII without space, 1 to 128 characters (the `idempotency_key` columns' length). A key
is echoed in messages and logs and compared byte for byte: a tab, a space or a latin-1 byte (Starlette
decodes header bytes as latin-1) would store a key a client's own library may not send back the same.
"""

import re
from typing import Any

from fastapi import Header

MAX_IDEMPOTENCY_KEY = 128
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]+$"

_KEY = re.compile(IDEMPOTENCY_KEY_PATTERN)


def idempotency_key_header(description: str) -> Any:
    """The header's declaration (its 422 names `Idempotency-Key`), for `Annotated[str | None, ...]`."""
    return Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=MAX_IDEMPOTENCY_KEY,
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description=description,
    )


def is_idempotency_key(value: str) -> bool:
    """Whether the declaration above takes `value` (for a route that reads the header itself)."""
    # fullmatch: `$` alone would also match before a final newline.
    return len(value) <= MAX_IDEMPOTENCY_KEY and _KEY.fullmatch(value) is not None
