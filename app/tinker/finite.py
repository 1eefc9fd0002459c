"""Finite numbers in what the Tinker routes read and keep.

Python's json module, which parses the routes' JSON bodies (FastAPI, through Starlette), reads the
non-standard literals `NaN`, `Infinity` and `-Infinity`, and a number too large for a float
(`1e999`) as an infinity; pydantic's float fields take all of them. None is a learning rate or a
temperature. Stored in a JSON column, one is refused by Postgres (its json has no NaN: the request
then fails as a whole) and kept by SQLite, whence it cannot be served: Starlette's JSONResponse
refuses to write it, and every poll of that future was a 500, which the SDK retries at once, for
ever. So the numbers a route reads are checked where it reads them, and the field named.
"""

import math
from collections.abc import Sequence

import numpy as np

from app.errors import ValidationFailed
from app.tinker.schemas import field_named

FINITE = "must be a finite number (NaN, Infinity and -Infinity are not numbers JSON allows)"


def first_non_finite(value: object) -> tuple[str, ...] | None:
    """Where in `value` (a decoded JSON value) the first non-finite float is, as a path of keys and
    indexes; None when there is none. For the small objects of a request's parameters: it walks in
    Python (the request guard bounds a body's nesting)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else ()
    if isinstance(value, dict):
        items: list[tuple[str, object]] = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(str(i), v) for i, v in enumerate(value)]
    else:
        return None
    for key, item in items:
        inner = first_non_finite(item)
        if inner is not None:
            return (key, *inner)
    return None


def require_finite(value: object, *, loc: tuple[str, ...]) -> None:
    """A 422 naming the field (`loc` + its path in `value`; a body field's `loc` starts with "body",
    which the message leaves out) when `value` holds a non-finite float."""
    where = first_non_finite(value)
    if where is None:
        return
    path = [*loc, *where]
    raise ValidationFailed(
        f"{field_named(path)} {FINITE}",
        details=[{"loc": path, "msg": FINITE, "type": "finite_number"}],
    )


def all_finite(values: Sequence[float]) -> bool:
    """Whether every one of `values` is finite: one C pass (a result may carry a round's tokens)."""
    return bool(np.isfinite(np.asarray(values, dtype=np.float64)).all())
