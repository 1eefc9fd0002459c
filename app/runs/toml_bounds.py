"""Bounds on a TOML run body checked on its text, before tomllib parses it.

tomllib (pure Python) takes time quadratic in the dotted parts of one key or table header, and in a
key's parts times its table header's: a 64 KiB body of one key `a.a.a...` of 32,700 parts took 50 s
of CPU, a 64-part header over 64-part keys 0.5 s. The bounds a run body is held to after the parse
(32 levels of nesting, 2,000 values) come too late for that, so the text is scanned first: strings
and comments are blanked out (what is left is keys, values' bare words and punctuation), and what
makes the parse slow is measured there, with regular expressions and string methods (C-speed passes,
linear: no pattern retries inside a run it already matched). What tomllib itself would refuse
further on is left to it: the scan stops where a string is left unterminated, as tomllib does.
"""

import re
from dataclasses import dataclass
from typing import Literal

from app.request_guard import MAX_JSON_DEPTH, too_deep

MAX_KEY_PARTS = 64
"""Dotted parts of one key or table header (`[a.b.c]` is 3). Each part nests a table, and a run body
nests at most MAX_JSON_DEPTH (32) levels (config.metadata, its deepest field, 8 of its own): a key of
more than 32 parts could only be refused after the parse. Twice that bound leaves room for any body
that could pass (and for a bound raised later), while the parse of a key this long stays in
microseconds (the time is quadratic in the parts)."""

MAX_KEY_CHECK_PARTS = 65536
"""The parts tomllib walks to check the body's keys, in all. For each key/value pair it checks each
prefix of the pair's full key (its table header's parts, then its own one more at a time: K prefixes
of up to H + K parts), K * (H + K), taking H as the body's longest header's (over, never under). A
64-part header over 500 keys of 64 parts took 0.5 s; within this bound a body parses in tens of
milliseconds. A body of tomli_w's (one-part keys, as the CLI writes it) stays under 2,000 pairs *
(9 + 1) = 20,000 (config.metadata, the deepest field, is 8 levels deep), and one that gives each of
config.metadata's 1,000 values its own key `config.metadata.x = 1` is 9,000."""

_STRING = (
    r'"""(?:[^"\\]++|\\[\s\S]|"(?!""))*+"""(?:""?)?'  # multi-line basic: up to 2 quotes end its text
    r"|'''(?:[^']++|'(?!''))*+'''(?:''?)?"  # multi-line literal
    r'|"(?!"")(?:[^"\\\n]++|\\.)*+"'  # basic (not the start of an unterminated multi-line one)
    r"|'(?!'')[^'\n]*+'"  # literal
)
_STRING_OR_COMMENT = re.compile(rf"{_STRING}|#[^\n]*+")

_TERMINATED_PREFIX = re.compile(rf"(?:[^\"'#]++|{_STRING}|#[^\n]*+)*+")
"""The text up to its first unterminated string (tomllib's error is there, or before): possessive,
so no position is tried twice; a failed multi-line string is not retried as short strings."""

_PART = r"[A-Za-z0-9_\x01-]"
"""A character of a key part once strings are blanked to \\x01 (a quoted part is one such run)."""

_LONG_CHAIN = re.compile(rf"(?<![A-Za-z0-9_\x01.-]){_PART}++(?:\.{_PART}++){{{MAX_KEY_PARTS}}}")
"""More than MAX_KEY_PARTS dot-separated parts, from a chain's first part only (the lookbehind): a
chain is walked once, not once from each of its parts."""

_CHAIN = re.compile(rf"{_PART}++(?:\.{_PART}++)*+")

_KEY = re.compile(rf"(?<![A-Za-z0-9_\x01.-]){_PART}++(?:\.{_PART}++)*+(?==)")
"""A key of a key/value pair: a chain followed by `=` (a value's chain, a float or a time, never is)."""

_HEADER = re.compile(rf"(?:^|\n)\[\[?({_PART}++(?:\.{_PART}++)*+)")
"""A table or array-of-tables header's key, at the start of a line (a line of a multi-line array
may look like one: that only makes the longest header longer)."""


@dataclass(frozen=True)
class TomlTextExcess:
    """A bound the body's text exceeds: `measured` of `bound`, `limit` at most."""

    bound: Literal["depth", "values", "key_parts", "key_check_parts"]
    limit: int
    measured: int


def toml_text_excess(text: str, *, max_values: int) -> TomlTextExcess | None:
    """The first bound the TOML text exceeds before it is parsed, or None (see skeleton_excess)."""
    return skeleton_excess(toml_skeleton(text), max_values=max_values)


def skeleton_excess(skeleton: str, *, max_values: int) -> TomlTextExcess | None:
    """The first bound a TOML text's skeleton (toml_skeleton) exceeds, or None: nesting of arrays and
    inline tables (tomllib recurses: past ~300 levels, a RecursionError), then more key/value pairs,
    commas or table headers than `max_values` (each is a distinct value of the parsed body), then a
    key or header of more than MAX_KEY_PARTS parts, then MAX_KEY_CHECK_PARTS."""
    if too_deep(skeleton.encode(), MAX_JSON_DEPTH):  # no quotes are left: only brackets count
        return TomlTextExcess("depth", MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1)
    headers = skeleton.count("\n[") + skeleton.startswith("[")
    values = max(skeleton.count("="), skeleton.count(","), headers)
    if values > max_values:
        return TomlTextExcess("values", max_values, values)
    long_chain = _LONG_CHAIN.search(skeleton)
    if long_chain is not None:
        chain = _CHAIN.match(skeleton, long_chain.start())
        parts = chain.group().count(".") + 1 if chain is not None else MAX_KEY_PARTS + 1
        return TomlTextExcess("key_parts", MAX_KEY_PARTS, parts)
    # At most `max_values` headers and keys here, each of at most MAX_KEY_PARTS parts.
    header_parts = max((header.count(".") + 1 for header in _HEADER.findall(skeleton)), default=0)
    key_parts = [key.count(".") + 1 for key in _KEY.findall(skeleton)]
    checked = sum(parts * (header_parts + parts) for parts in key_parts)
    if checked > MAX_KEY_CHECK_PARTS:
        return TomlTextExcess("key_check_parts", MAX_KEY_CHECK_PARTS, checked)
    return None


def toml_skeleton(text: str) -> str:
    """The text up to its first unterminated string, each string and comment replaced by \\x01 (a
    key part's character: a quoted key part stays one part), spaces and tabs dropped (TOML allows
    them around a key's dots; nothing else that bounds a chain is a space). Newlines stay: a table
    header starts a line."""
    prefix = _TERMINATED_PREFIX.match(text)
    scanned = text[: prefix.end()] if prefix is not None else ""
    return _STRING_OR_COMMENT.sub("\x01", scanned).replace(" ", "").replace("\t", "")
