"""Identifiers, validated wherever they enter (they become paths and log fields).

The service issues `<prefix>_` + 12 lowercase hex digits (`run_0123456789ab`). Runs made by
hand in a directory run source may use any `run_*` name the source documents allow, as long
as it cannot escape the output directory or smuggle odd characters into paths and logs.
"""

import re
import secrets

_ISSUED_SUFFIX_RE = re.compile(r"[0-9a-f]{12}")
"""What `new_id` puts after the prefix: `secrets.token_hex(6)`."""
RUN_ID_RE = re.compile(rf"run_{_ISSUED_SUFFIX_RE.pattern}")
"""A run id the service issued."""
RUN_DIR_NAME_RE = re.compile(r"run_[A-Za-z0-9_-]{1,64}")
"""Any run id that is safe as a single path component (directory runs)."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


def is_issued_id(value: str, prefix: str) -> bool:
    """True for an id `new_id(prefix)` issues: `<prefix>_` + 12 lowercase hex (`ten_`, `key_`...)."""
    return value.startswith(f"{prefix}_") and bool(_ISSUED_SUFFIX_RE.fullmatch(value, len(prefix) + 1))


def is_run_id(value: str) -> bool:
    """True for an id the service issued (`run_` + 12 lowercase hex)."""
    return bool(RUN_ID_RE.fullmatch(value))


def is_valid_run_id(run_id: str) -> bool:
    """True for ids that are safe as a single path component (`run_` + [A-Za-z0-9_-], ≤ 68 chars)."""
    return bool(RUN_DIR_NAME_RE.fullmatch(run_id))


def validate_run_id(run_id: str) -> str:
    if not is_valid_run_id(run_id):
        raise ValueError(f"invalid run id {run_id!r}: expected 'run_' followed by 1-64 of [A-Za-z0-9_-]")
    return run_id


MAX_IDEMPOTENCY_KEY = 128
"""The `idempotency_key` columns' length."""
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]+$"
"""An Idempotency-Key (POST /v1/runs, POST /v1/runs/{run_id}/batches): printable ASCII without
space. A key is echoed in messages and logs and compared byte for byte: a tab, a space or a latin-1
byte (Starlette decodes header bytes as latin-1) would store a key a client's own library may not
send back the same."""
_IDEMPOTENCY_KEY_RE = re.compile(IDEMPOTENCY_KEY_PATTERN)


def is_idempotency_key(value: str) -> bool:
    """Whether the service takes `value` as an Idempotency-Key (the SDK checks it before sending)."""
    # fullmatch: `$` alone would also match before a final newline.
    return len(value) <= MAX_IDEMPOTENCY_KEY and _IDEMPOTENCY_KEY_RE.fullmatch(value) is not None
