"""A linear-time `http.cookies._unquote` on the Pythons whose own is quadratic (CVE-2024-7592).

Every request's `Cookie` header is parsed before a route runs: FastAPI reads `request.cookies`
whenever a route has dependencies, and Starlette's parser unquotes each value with
`http.cookies._unquote`. Before Python 3.11.10 / 3.12.6 that function searches the rest of a quoted
value again for every backslash in it, so one request without any key, carrying `Cookie: x="` +
15,500 backslashes + `"` (inside the 16 KiB head limit), held the event loop for 7 s, and every
other tenant's requests with it; four at once, 24 s.

`install()` replaces it, on those versions only, with one regex pass that decodes exactly as the
original does: `\\ooo` (octal, first digit 0-3) is that character, a backslash before any other
character but a newline is that character, anything else is kept. Later Pythons ship the same fix;
there `install()` leaves the standard library alone."""

import http.cookies
import re
import sys

STDLIB_UNQUOTE = getattr(http.cookies, "_unquote")  # noqa: B009
"""The standard library's own, as this module found it (the tests compare the two)."""

_ESCAPE = re.compile(r"\\(?:([0-3][0-7][0-7])|(.))")
"""One escape: an octal one, or a backslash before any character (`.`: not a newline, as the
original's `[\\].`)."""


def _decoded(match: re.Match[str]) -> str:
    octal, quoted = match.groups()
    return chr(int(octal, 8)) if octal is not None else quoted


def unquote(value: str | None) -> str | None:
    """What `http.cookies._unquote` returns, in one pass: an unquoted value is returned as it is; a
    quoted one ("...") loses its quotes and has its escapes decoded."""
    if value is None or len(value) < 2 or value[0] != '"' or value[-1] != '"':
        return value
    return _ESCAPE.sub(_decoded, value[1:-1])


def is_affected(version: tuple[int, ...]) -> bool:
    """Whether this Python's `_unquote` is the quadratic one (fixed in 3.11.10, 3.12.6, 3.13.0)."""
    return version < (3, 11, 10) or (3, 12, 0) <= version < (3, 12, 6)


def install() -> None:
    """Put `unquote` in the standard library's place where its own is quadratic (idempotent)."""
    if is_affected(sys.version_info[:3]):
        setattr(http.cookies, "_unquote", unquote)  # noqa: B010  (a private name typeshed omits)
