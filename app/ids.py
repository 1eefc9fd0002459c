"""Public identifiers: a prefix and 12 lowercase hex digits, validated wherever they enter."""

import re
import secrets

RUN_ID_RE = re.compile(r"^run_[0-9a-f]{12}$")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


def is_run_id(value: str) -> bool:
    return bool(RUN_ID_RE.fullmatch(value))
