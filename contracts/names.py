"""What a run's name may hold: the one rule, checked by the service (POST /v1/runs, JSON or TOML),
the SDK (orchestrator.client) and the CLI (`loraloom runs create`) before anything is sent. The same
rule, of another length, can hold for any label a client gives and others are shown (`label_problem`);
an uploaded adapter's name takes the run names' own.

A name is shown wherever a run is: run lists, the dashboard, events, log lines, terminals. It must
read as what it is, so it holds none of:

- control characters: C0 (U+0000-U+001F, tab and newline included), DEL and C1 (U+0080-U+009F);
  an escape or a carriage return rewrites what a terminal shows around it, a newline forges a log line;
- invisible format characters (Unicode category Cf): bidirectional overrides and isolates
  (U+202A-U+202E, U+2066-U+2069) show `eval-gpt<U+202E>exe.txt` as another name, and zero-width
  ones (U+200B, U+FEFF) make two names that look the same differ. Except the zero-width joiner and
  non-joiner (U+200D, U+200C) between two visible characters: Persian, Indic scripts and emoji
  sequences (👩‍💻) are written with them;
- line and paragraph separators (U+2028, U+2029), and lone surrogates (not characters at all);
- whitespace only, or whitespace at either end (`"gsm8k "` listed beside `"gsm8k"`).

A message names a character by its code point (`U+202E`) and Unicode name, never as itself.
"""

import unicodedata
from dataclasses import dataclass

MAX_RUN_NAME_CHARS = 128
"""The `runs.name` column's length."""

RUN_NAME_RULE = (
    f"1 to {MAX_RUN_NAME_CHARS} characters; no control character (C0, DEL, C1), invisible format "
    "character (Unicode Cf: bidirectional controls, zero-width characters), line or paragraph "
    "separator, and no whitespace at either end"
)
"""The rule in words, for the API document and help texts."""

RUN_NAME_PATTERN = (
    r"^(?![\s\u200c\u200d])(?!.*[\u200c\u200d](?:[\s\u200c\u200d]|$))(?!.*\s[\u200c\u200d])"
    r"[^\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    r"\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]*(?<!\s)$"
)
"""The rule as a JSON Schema pattern, for the API document's validators (generated clients, schema
checkers): every refused character of the Basic Multilingual Plane (as of Unicode 14, Python 3.11's)
and whitespace at either end. `run_name_problem` is the rule itself; the pattern leaves out what a
JSON Schema pattern cannot say portably (lone surrogates, format characters beyond U+FFFF)."""

_BIDI_CONTROLS = frozenset(
    chr(code) for code in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
)
"""Format characters that reorder or direct text (Cf as well; named apart for a clearer message)."""

_JOINERS = frozenset("\u200c\u200d")
"""ZERO WIDTH NON-JOINER and JOINER: taken between two visible characters (see the module's text)."""


@dataclass(frozen=True)
class NameProblem:
    """Why a name (or another label) is refused: `type` for a 422's detail, `message` completing
    "name ..." (or the label's field)."""

    type: str
    message: str


def _described(char: str) -> str:
    """`U+202E RIGHT-TO-LEFT OVERRIDE`: safe to print, whatever the character does."""
    name = unicodedata.name(char, "")
    return f"U+{ord(char):04X}" + (f" {name}" if name else "")


def _kind(char: str) -> str | None:
    """What kind of refused character `char` is, or None for one a name may hold."""
    category = unicodedata.category(char)
    if char in _BIDI_CONTROLS:
        return "a bidirectional text control"
    if category == "Cc":
        return "a control character"
    if category == "Cf":
        return "an invisible format character"
    if category in ("Zl", "Zp"):
        return "a line or paragraph separator"
    if category == "Cs":
        return "a lone surrogate, not a character"
    return None


def _between_visible(name: str, index: int) -> bool:
    """Whether `name[index]` has a visible character on each side (neither whitespace, nor a joiner,
    nor any other refused character)."""
    if index == 0 or index == len(name) - 1:
        return False
    return all(not c.isspace() and _kind(c) is None for c in (name[index - 1], name[index + 1]))


def label_problem(text: str, *, max_chars: int, kind: str) -> NameProblem | None:
    """Why `text` cannot be a label shown to others (this module's rule, within `max_chars`), or
    None. The first refused character is named (with its position, counted from 1), before any
    problem of whitespace: a C1 or separator is whitespace too. `kind` names the problem types
    (`{kind}_character`, `{kind}_whitespace`; `string_too_short`/`string_too_long` as pydantic's)."""
    if not text:
        return NameProblem("string_too_short", "must not be empty")
    if len(text) > max_chars:
        return NameProblem("string_too_long", f"must be at most {max_chars} characters, not {len(text)}")
    for position, char in enumerate(text, start=1):
        refused = _kind(char)
        if refused is not None and char in _JOINERS and _between_visible(text, position - 1):
            continue
        if refused is not None:
            return NameProblem(
                f"{kind}_character", f"must not contain {_described(char)} ({refused}, character {position})"
            )
    if text.isspace():
        return NameProblem(f"{kind}_whitespace", "must not be only whitespace")
    if text[0].isspace():
        return NameProblem(f"{kind}_whitespace", f"must not start with whitespace ({_described(text[0])})")
    if text[-1].isspace():
        return NameProblem(f"{kind}_whitespace", f"must not end with whitespace ({_described(text[-1])})")
    return None


def run_name_problem(name: str) -> NameProblem | None:
    """Why `name` cannot be a run's name (or an uploaded adapter's), or None: `label_problem` within
    MAX_RUN_NAME_CHARS, its problem types `run_name_character` and `run_name_whitespace`."""
    return label_problem(name, max_chars=MAX_RUN_NAME_CHARS, kind="run_name")
