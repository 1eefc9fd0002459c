"""--help without a type tag on flags: `--json  Print JSON`, not `--json <bool>  Print JSON`.

A flag takes no value, so a type beside it reads as if it took one. Typer 0.27's rich help leaves
the tag out of a flag's row; 0.29's prints `<bool>` there (pyproject allows any typer >= 0.12).
Both show a parameter's own metavar instead of its type when it has one, so every flag gets an
empty one; options that take a value keep their type (`<str>`, `<int range>`, ...).
"""

from typing import Any

from typer.core import TyperGroup

from loraloom.commands.errors import ErrorHandlingGroup


class PlainFlagsGroup(ErrorHandlingGroup):
    """The root group: the CLI's error handling (`ErrorHandlingGroup`), and no type tag on the flags
    of any command under it. Untagged as the root parses its arguments, which every way in (`main`,
    `CliRunner`) and every help page (the root's --help, no arguments) passes through first: typer
    adds the root's completion options after building the group, so `__init__` is too early."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        untag_flags(self, ctx)
        return super().parse_args(ctx, args)


def untag_flags(command: Any, ctx: Any) -> None:
    """Give every flag of `command` (run in `ctx`) and of the commands under it an empty metavar."""
    for param in command.params:
        _untag(param)
    # --help is made on first use and kept (the click typer 0.27 and 0.29 carry): made now, it is
    # untagged too. A click that makes a new one for each help page leaves --help's tag as it was.
    _untag(command.get_help_option(ctx))
    if isinstance(command, TyperGroup):
        for name, sub in command.commands.items():
            # The context the subcommand gets when it runs: its --help's names come from ctx's.
            sub_ctx = sub.context_class(sub, parent=ctx, info_name=name, **sub.context_settings)
            untag_flags(sub, sub_ctx)


def _untag(param: Any) -> None:
    if getattr(param, "is_flag", False):  # an Argument has no is_flag
        param.metavar = ""
