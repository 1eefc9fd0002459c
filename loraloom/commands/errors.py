"""How the CLI fails: one line with a hint, an exit code by kind, JSON on stderr with --json, and a
traceback only with --debug (or LORALOOM_DEBUG=1).

Commands raise `CliError`; `ErrorHandlingGroup` (the root command group) turns it, click's usage
errors (unknown option, missing argument, bad value) and any other exception into that output.
The exit codes are part of the interface (the README lists them).
"""

import json
import os
from enum import IntEnum
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1
    """Anything else (an unexpected error: run again with --debug for the traceback)."""
    USAGE = 2
    """Bad arguments, a bad config file, or input the service rejected (400, 413, 422)."""
    NOT_FOUND = 3
    """No such run, adapter, tenant, key, file or directory (404)."""
    CONFLICT = 4
    """The object is not in a state that allows it (409), e.g. evicting a completed run."""
    AUTH = 5
    """No key, a wrong key, or a key without the right (401, 403)."""
    UNAVAILABLE = 6
    """The service or the database cannot be reached, or answered 5xx/503."""
    RATE_LIMITED = 7
    """Too many requests (429): retry later."""
    RUN_NOT_COMPLETED = 8
    """`runs watch`: the run ended evicted, failed or deleted."""


_BY_STATUS = {
    400: ExitCode.USAGE,
    401: ExitCode.AUTH,
    403: ExitCode.AUTH,
    404: ExitCode.NOT_FOUND,
    409: ExitCode.CONFLICT,
    413: ExitCode.USAGE,
    422: ExitCode.USAGE,
    429: ExitCode.RATE_LIMITED,
}

_HINTS = {
    ExitCode.AUTH: "check --key (or LORALOOM_API_KEY / LORALOOM_ADMIN_KEY)",
    ExitCode.UNAVAILABLE: "is the service running? check --url (or LORALOOM_URL)",
    ExitCode.RATE_LIMITED: "wait a moment and retry",
}


class CliError(Exception):
    """A failure the user can act on."""

    def __init__(
        self,
        message: str,
        *,
        kind: ExitCode = ExitCode.ERROR,
        hint: str | None = None,
        code: str | None = None,
        details: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.hint = hint if hint is not None else _HINTS.get(kind)
        self.code = code or kind.name.lower()
        self.details = details

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message, "exit_code": int(self.kind)}
        if self.hint:
            body["hint"] = self.hint
        if self.details is not None:
            body["details"] = self.details
        return {"error": body}

    def as_text(self) -> str:
        lines = [f"error: {self.message}"]
        if isinstance(self.details, list):
            lines += [
                f"  {'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}"
                for d in self.details
                if isinstance(d, dict)
            ]
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


def http_error(status: int, body: Any, text: str) -> CliError:
    """The service's uniform error body (`{"error": {code, message, details}}`) as a CliError."""
    kind = _BY_STATUS.get(status, ExitCode.UNAVAILABLE if status >= 500 else ExitCode.ERROR)
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return CliError(f"HTTP {status}: {text[:300]}", kind=kind)
    return CliError(
        f"HTTP {status} {err.get('code')}: {err.get('message')}",
        kind=kind,
        code=str(err.get("code")),
        details=err.get("details") or None,
    )


def _debug(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("LORALOOM_DEBUG", "") not in ("", "0")


def report(error: CliError, *, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(error.as_json()), err=True)
    else:
        typer.echo(error.as_text(), err=True)


def is_usage_error(exc: BaseException) -> bool:
    """Whether `exc` is click's usage error (unknown option, missing argument, bad value, no such
    command), but not the one that prints a group's help. By name, as typer itself tells them apart:
    newer typer raises its private copy of click's (typer._click), older typer click's own."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return "UsageError" in names and "NoArgsIsHelpError" not in names


def usage_error(exc: Any, *, command_path: str) -> CliError:
    """Click's usage error as the CLI's own: its message, and the command's --help as the hint (in
    place of typer's boxed panel with the usage line). `command_path` names the command when the
    error has no context (click's parser raises some, e.g. "requires an argument", without one)."""
    path = exc.ctx.command_path if exc.ctx is not None else command_path
    return CliError(exc.format_message(), kind=ExitCode.USAGE, hint=f"try '{path} --help'")


def named_command_path(ctx: Any, argv: list[str]) -> str:
    """The deepest command `argv` names below `ctx`'s group, e.g. "loraloom runs list"."""
    names, command = [ctx.command_path], ctx.command
    for token in argv:
        if token.startswith("-"):  # the root's own flags (--debug) come before the command
            continue
        sub = command.get_command(ctx, token) if isinstance(command, TyperGroup) else None
        if sub is None:
            break
        names.append(token)
        command = sub
    return " ".join(names)


def _exit_on_usage_error(exc: Any, ctx: Any, argv: list[str]) -> NoReturn:
    report(usage_error(exc, command_path=named_command_path(ctx, argv)), as_json="--json" in argv)
    raise typer.Exit(int(ExitCode.USAGE)) from None


class ErrorHandlingGroup(TyperGroup):
    """The root group: every command's failure becomes one line (or JSON) and its exit code."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta["loraloom.argv"] = list(args)  # for --json / --debug, whichever command has them
        try:
            return super().parse_args(ctx, args)
        except Exception as exc:  # the root's own options, e.g. `loraloom --frobnicate`
            if is_usage_error(exc):
                _exit_on_usage_error(exc, ctx, args)
            raise

    def invoke(self, ctx: Any) -> Any:
        argv: list[str] = ctx.meta.get("loraloom.argv", [])
        try:
            return super().invoke(ctx)
        except CliError as exc:
            if _debug(argv):
                raise
            report(exc, as_json="--json" in argv)
            raise typer.Exit(int(exc.kind)) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except BrokenPipeError:  # `loraloom runs watch ... | head -1`: the reader left, no error of ours;
            raise  # click ends it quietly (exit 1), as it does for --help piped the same way
        except Exception as exc:
            if is_usage_error(exc):  # a subcommand's arguments, or no such command: no traceback to show
                _exit_on_usage_error(exc, ctx, argv)
            if isinstance(exc, TyperException) or _debug(argv):  # click's own handling, or --debug
                raise
            error = CliError(f"{type(exc).__name__}: {exc}", hint="run again with --debug for the traceback")
            report(error, as_json="--json" in argv)
            raise typer.Exit(int(error.kind)) from None


WORKER_EXTRA = ("torch", "transformers", "peft", "safetensors")
"""The modules of the `[worker]` extra (pyproject.toml; tests/app/test_cli_extras.py keeps the two
the same): the worker pool imports every one of them."""
PLOT_EXTRA = ("matplotlib",)
"""The `[plot]` extra's: the demo's reward plot."""


def require_worker_extra(what: str, *, plot: bool = False) -> None:
    """A clear error when a module of the worker extra (and with `plot`, the plot extra) is not
    installed: the API-only install (`pip install loraloom`) has the service, the SDK and the CLI,
    not the trainer. Every module is looked for, not torch alone: with torch installed first (as
    the README says) and `[worker]` forgotten, each rank died on `import transformers`."""
    import importlib.util

    extras = {"worker": WORKER_EXTRA, **({"plot": PLOT_EXTRA} if plot else {})}
    # find_spec locates a module without importing it (torch alone takes seconds to import).
    missing = {
        name: [m for m in modules if importlib.util.find_spec(m) is None] for name, modules in extras.items()
    }
    lacking = [name for name, modules in missing.items() if modules]
    if not lacking:
        return
    modules = [m for name in lacking for m in missing[name]]
    install = f"pip install 'loraloom[{','.join(lacking)}]'"
    if "torch" in modules:  # first, of the build the machine wants: the extra would pull the default one
        install = f"pip install torch==2.13.0 (or a CUDA build), then {install}"
    raise CliError(
        f"{what} needs {', '.join(modules)}, which {'is' if len(modules) == 1 else 'are'} not installed "
        f"(the {' and '.join(lacking)} extra{'s' if len(lacking) > 1 else ''})",
        kind=ExitCode.USAGE,
        hint=install,
    )
