"""The demo's own lines ("[demo] alice created run ...", the Ctrl-C message) come out whole while
its runs' progress bars are live. They were printed with `typer.echo`, which wrote them where a bar
had left the cursor: at the end of the top bar's line ("...0/30 [00:00<?, ?it/s][demo] alice ...").

The bars and the lines go to one stream here, as both reach one terminal, and a small terminal
model replays what that terminal would show."""

import io
import re
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout

import pytest
from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the dev dependencies

from loraloom import demo

_CONTROL = re.compile(r"\r|\n|\x1b\[A|[^\r\n\x1b]+")


def terminal(output: str) -> list[str]:
    """The rows a terminal shows after `output`: tqdm draws with carriage returns, newlines and
    cursor-up; text overwrites what is under the cursor."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for token in _CONTROL.findall(output):
        if token == "\r":
            col = 0
        elif token == "\n":  # a terminal's newline also returns the carriage (onlcr)
            row, col = row + 1, 0
            if row == len(rows):
                rows.append([])
        elif token == "\x1b[A":
            row = max(row - 1, 0)
        else:
            line = rows[row]
            line.extend(" " * (col - len(line)))
            line[col : col + len(token)] = token
            col += len(token)
    return ["".join(r).rstrip() for r in rows]


@contextmanager
def one_screen() -> Iterator[io.StringIO]:
    """stdout and stderr as one stream, as a terminal has them (in the test's body: pytest's own
    capture replaces both between a fixture's set-up and the test)."""
    stream = io.StringIO()
    with redirect_stdout(stream), redirect_stderr(stream):
        yield stream


@pytest.mark.parametrize("err", [False, True], ids=["stdout", "stderr"])
def test_a_line_printed_while_the_bars_are_live_is_whole(err: bool) -> None:
    message = "[demo] alice created run arith-rloo (run_bbf894a98d1d): active"
    with one_screen() as screen:
        # As run_demo draws them: one bar per run, each at its own position.
        bars = {name: tqdm(total=30, desc=f"{name:12s}", position=i) for i, name in enumerate(("a", "b"))}
        demo.say(message, err=err)
        for bar in bars.values():
            bar.update(1)  # the bars go on drawing after it
        demo._close(bars)
    rows = terminal(screen.getvalue())
    assert message in rows, rows
    assert all(row.startswith(("a ", "b ")) for row in rows if row and row != message), rows


def test_the_interrupted_message_comes_after_the_closed_bars() -> None:
    """On Ctrl-C the demo closes the bars, then says so: a bar closed later drew over the message."""
    with one_screen() as screen:
        bars = {"a": tqdm(total=30, desc="a", position=0), "b": tqdm(total=30, desc="b", position=1)}
        demo._close(bars)
        demo.say("[demo] interrupted: the service and the worker pool are stopped", err=True)
        demo._close(bars)  # run_demo's `finally` closes them again: nothing more is drawn
    rows = [row for row in terminal(screen.getvalue()) if row]
    assert rows[-1] == "[demo] interrupted: the service and the worker pool are stopped", rows
