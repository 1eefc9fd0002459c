"""Free text from the service printed by the CLI cannot forge its lines nor drive the terminal
(loraloom/commands/shown.py): an eviction reason `ok\\nstatus:         active` printed a second
`status:` field in `loraloom runs show`, and a right-to-left override reordered the rest of its line."""

import pytest

from loraloom import cli
from loraloom.commands.http import table
from loraloom.commands.shown import terminal_safe

FORGED = "ok\nstatus:         active \u202eevil\x1b[2J\u2028tail"


def _run(**fields: object) -> dict[str, object]:
    run: dict[str, object] = {
        "id": "run_000000000001",
        "name": "r",
        "tenant_id": "ten_000000000001",
        "status": "evicted",
        "slot": None,
        "base_model": "tiny",
        "progress": {"step": 3, "total_samples": 12, "total_tokens": 96},
        "config": {"max_steps": 10},
        "eviction_reason": FORGED,
        "evicted_by": "user",
        "failure_reason": None,
        "created_at": "2026-11-29T00:00:00Z",
        "started_at": None,
        "finished_at": None,
        "last_heartbeat_at": None,
    }
    return run | fields


def test_a_reason_cannot_forge_a_field_of_runs_show(capsys: pytest.CaptureFixture[str]) -> None:
    cli._print_run_details(_run())
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("status:")] == ["status:         evicted"]
    eviction = lines.index("eviction:       ok")
    # The reason's next line is a continuation, indented to the values' column, its controls escaped.
    assert (
        lines[eviction + 1] == " " * 16 + "status:         active \\u202eevil\\u001b[2J\\u2028tail (by user)"
    )
    assert not any(c in "".join(lines) for c in "\u202e\x1b\u2028")


def test_table_cells_and_one_line_values_stay_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    table([{"name": FORGED, "n": 1}], [("NAME", "name"), ("N", "n")])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("ok\\nstatus:")
    assert terminal_safe("a\tb") == "a\tb"  # a tab is shown as it is
    assert terminal_safe("\U0001f469\u200d\U0001f4bb") == "\U0001f469\u200d\U0001f4bb"  # joined
    assert terminal_safe("\ufeffbom\u200b") == "\\ufeffbom\\u200b"
    assert terminal_safe("plain ascii") == "plain ascii"
    assert terminal_safe("caf\u00e9 \u65e5\u672c") == "caf\u00e9 \u65e5\u672c"
