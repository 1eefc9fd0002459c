"""--help shows no type beside a flag (`--json  Print JSON`, not `--json <bool>  Print JSON`) and
keeps the type of every option that takes a value, on every command's help page.

Typer 0.29's rich help prints `<bool>` beside flags; 0.27's gets `<boolean>` for them too and drops
it by name. So the type is checked where each reads it (`_type_shown`) as well as on the pages the
installed typer renders."""

from collections.abc import Iterator
from typing import Any

import typer
from typer.testing import CliRunner

from loraloom.cli import cli

runner = CliRunner()

FLAGS = {
    "loraloom --version",
    "loraloom --debug",
    "loraloom --install-completion",
    "loraloom --show-completion",
    "loraloom --help",
    "loraloom runs list --json",
    "loraloom runs evict --help",
    "loraloom tenants delete --yes",
    "loraloom adapters list --newest-first",
    "loraloom worker --gradient-checkpointing",
    "loraloom worker --dry-run",
    "loraloom demo --interim",
}
TYPED = {
    "loraloom runs list --limit": "<int>",
    "loraloom runs evict --reason": "<str>",
    "loraloom metrics --plot": "<path>",
    "loraloom worker --pack-timeout": "<float>",
    "loraloom serve --port": "<int range>",
}


def _commands(command: Any, ctx: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """Every command under `command` (itself first): its path, the command, and its context."""
    yield path, command, ctx
    for name, sub in getattr(command, "commands", {}).items():
        sub_ctx = sub.context_class(sub, parent=ctx, info_name=name, **sub.context_settings)
        yield from _commands(sub, sub_ctx, f"{path} {name}")


def _type_shown(param: Any, ctx: Any) -> str:
    """The type text help shows beside an option: typer 0.29's display type, or 0.27's metavar."""
    display_type = getattr(param, "display_type_rich", None)
    return (display_type(ctx) if display_type else param.make_metavar(ctx)) or ""


def _options() -> dict[str, tuple[str, bool]]:
    """'loraloom runs list --json' -> (the type help shows beside it, whether it is a flag), for every
    option of every command."""
    root = typer.main.get_command(cli)
    # Parsed as for a help page (resilient: no help printed, no required argument asked for).
    ctx = root.make_context("loraloom", [], resilient_parsing=True)
    return {
        f"{path} {param.opts[0]}": (_type_shown(param, cmd_ctx), param.is_flag)
        for path, command, cmd_ctx in _commands(root, ctx, "loraloom")
        for param in command.get_params(cmd_ctx)
        if param.param_type_name == "option"
    }


def test_flags_show_no_type_and_options_keep_theirs() -> None:
    options = _options()
    assert {flag: options[flag] for flag in FLAGS} == dict.fromkeys(FLAGS, ("", True))
    assert {option: options[option][0] for option in TYPED} == TYPED
    # Every other option too: a type beside exactly the options that take a value.
    assert [name for name, (shown, is_flag) in options.items() if bool(shown) == is_flag] == []


def _help_pages() -> Iterator[tuple[str, str]]:
    """Every command's path and its --help page, as this typer renders it."""
    root = typer.main.get_command(cli)
    ctx = root.make_context("loraloom", [], resilient_parsing=True)
    for path, _, _ in _commands(root, ctx, "loraloom"):
        args = path.split()[1:]
        result = runner.invoke(cli, [*args, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        yield path, result.output


def test_no_help_page_shows_a_bool_type() -> None:
    pages = dict(_help_pages())
    assert len(pages) == 30  # the root, its groups and their commands
    assert [path for path, page in pages.items() if "<bool" in page] == []
    json_row = next(line for line in pages["loraloom runs list"].splitlines() if "--json" in line)
    limit_row = next(line for line in pages["loraloom runs list"].splitlines() if "--limit" in line)
    assert "<" not in json_row and "<int>" in limit_row
