"""Text from the service, made safe to print on a terminal.

Free text a client wrote (an eviction reason allows newlines; a failure reason is the pool's) is
printed among the CLI's own lines: a newline followed by `status:         active` forged a field
of `loraloom runs show`, a bidirectional override (U+202E) reorders what follows it, and an escape
sequence rewrites the screen. Every control, format and separator character but the newline, the
tab and the zero-width joiners is shown as its `\\uXXXX` escape; a newline either starts an
indented continuation line (a field's value) or is escaped too (a table cell, one line).
"""

import unicodedata

_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
_JOINERS = frozenset("\u200c\u200d")
"""Format characters shown as they are: they join what is around them (emoji sequences, Persian
words), and move or hide nothing."""


def terminal_safe(text: str, *, indent: int | None = None) -> str:
    """`text` with every character that could change how a terminal shows the lines around it
    escaped. `indent`: the column a value starts at, where its continuation lines start too (a
    newline kept); None: one line (a newline escaped as `\\n`)."""
    if text.isascii() and text.isprintable():
        return text  # the common case: nothing to look at
    out = []
    for char in text:
        if char == "\n":
            out.append("\\n" if indent is None else "\n" + " " * indent)
        elif char == "\t" or char in _JOINERS:
            out.append(char)
        elif unicodedata.category(char) in _ESCAPED_CATEGORIES:
            out.append(f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}")
        else:
            out.append(char)
    return "".join(out)
