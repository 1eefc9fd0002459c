"""`loraloom db upgrade REVISION` with a revision that does not exist: say which ones do. Alembic's
own "Can't locate revision identified by '0005'" reads as if the migrations were broken, while the
numbering simply skips 0005 (it was never released)."""

from loraloom.commands.errors import CliError, ExitCode


def known_revisions() -> list[str]:
    """The revisions shipped with this code, oldest first."""
    from alembic.script import ScriptDirectory

    from app.migrate import alembic_config

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return [s.revision for s in reversed(list(script.walk_revisions()))]


def _numbered(revisions: list[str]) -> bool:
    return bool(revisions) and all(r.isascii() and r.isdigit() for r in revisions)


def describe(revisions: list[str]) -> str:
    """`0001–0004, 0006–0019 (head)`: runs of consecutive numbers as ranges, the last one the head."""
    if not _numbered(revisions):
        return ", ".join(revisions) + " (head)" if revisions else "none"
    runs: list[list[str]] = []
    for rev in revisions:
        if runs and int(rev) == int(runs[-1][-1]) + 1:
            runs[-1].append(rev)
        else:
            runs.append([rev])
    parts = [run[0] if len(run) == 1 else f"{run[0]}–{run[-1]}" for run in runs]
    return ", ".join(parts) + " (head)"


def unknown_revision(revision: str, revisions: list[str] | None = None) -> CliError:
    """The error for a revision Alembic cannot locate: the known ones, and for a number between two
    of them, those two."""
    revisions = known_revisions() if revisions is None else revisions
    message = f"there is no revision {revision!r}"
    if _numbered(revisions) and revision.isascii() and revision.isdigit():
        below = [r for r in revisions if int(r) < int(revision)]
        above = [r for r in revisions if int(r) > int(revision)]
        if below and above:
            message += f": the migrations go from {below[-1]} to {above[0]} (the numbering skips it)"
        elif below:
            message += f": the newest (the head) is {below[-1]}"
    return CliError(
        message,
        kind=ExitCode.USAGE,
        hint=f"the revisions are {describe(revisions)}; `loraloom db upgrade` alone migrates to the head",
    )
