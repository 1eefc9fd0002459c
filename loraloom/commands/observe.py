"""Following what the trainer did: `adapters list/download`, `metrics` (table, JSON, plot) and
`runs watch` (a live progress bar until the run ends). Tenant API key; polling only the runs,
adapters and metrics routes."""

import errno
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from contracts.http import LoraloomError
from loraloom.commands.answers import UnexpectedAnswer, describe
from loraloom.commands.errors import CliError, ExitCode
from loraloom.commands.http import (
    DEFAULT_URL,
    AdminKeyOpt,
    JsonOpt,
    KeyOpt,
    UrlOpt,
    api,
    echo_json,
    request,
    table,
)
from loraloom.commands.ids import RunIdArg, StepOpt
from loraloom.commands.shown import terminal_safe
from orchestrator.archive import MARKER_NAME, DestinationInUse, extract_adapter
from orchestrator.bounded import Sink
from orchestrator.client import DEFAULT_MAX_DOWNLOAD_BYTES, DEFAULT_TRANSFER_DEADLINE_S

adapters_cli = typer.Typer(help="Adapters the trainer published (tenant API key).", no_args_is_help=True)
pools_cli = typer.Typer(help="Worker pools (admin key).", no_args_is_help=True)

FINAL = {"completed", "evicted", "failed", "deleted"}
METRIC_COLUMNS = ("loss", "entropy", "grad_norm", "lr", "tokens", "samples", "step_time_s")


@adapters_cli.command("list")
def adapters_list(
    run_id: RunIdArg,
    limit: Annotated[int, typer.Option(help="Page size (1..200).")] = 200,
    cursor: Annotated[str | None, typer.Option(help="Continue from a previous page.")] = None,
    newest_first: Annotated[bool, typer.Option("--newest-first", help="Newest step first.")] = False,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List a run's adapters, one per published step, a page at a time (oldest step first)."""
    params: dict[str, Any] = {"limit": limit}
    if cursor is not None:
        params["cursor"] = cursor
    if newest_first:
        params["newest_first"] = "true"
    data = api("GET", f"/v1/runs/{run_id}/adapters", url=url, key=key, params=params)
    if as_json:
        echo_json(data)
        return
    table(
        data["items"],
        [("STEP", "step"), ("BYTES", "size_bytes"), ("SHA256", "sha256"), ("CREATED", "created_at")],
    )
    if data.get("next_cursor"):
        # As `runs list` says how to go on, with the options the next page must be asked with again.
        again = (f" --limit {limit}" if limit != 200 else "") + (" --newest-first" if newest_first else "")
        typer.echo(f"more: --cursor {data['next_cursor']}{again}")


@adapters_cli.command("download")
def adapters_download(
    run_id: RunIdArg,
    step: StepOpt = "latest",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Directory (default: ./<run_id>-step-<N>).")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Download an adapter as a PEFT directory (adapter_config.json, adapter_model.safetensors)."""
    # As the SDK does: the archive goes to an unnamed file on the destination's file system, not to
    # memory, under the SDK's download cap and transfer deadline. Missing parent directories are
    # created, as the SDK's download_adapter creates them (and `metrics --plot` does); a place that
    # cannot be written is refused here, before the download.
    near = output.resolve().parent if output is not None else Path.cwd()
    what = f"-o {output}" if output is not None else f"the current directory {near}"
    try:
        near.mkdir(parents=True, exist_ok=True)
        archive = tempfile.TemporaryFile(dir=near)  # noqa: SIM115  # closed by the `with` below
    except OSError as exc:
        raise path_error(what, exc) from None
    with archive:
        r = request(
            "GET",
            f"/v1/runs/{run_id}/adapters/{step}",
            url=url,
            key=key,
            timeout=300.0,
            deadline=DEFAULT_TRANSFER_DEADLINE_S,
            sink=Sink(archive, DEFAULT_MAX_DOWNLOAD_BYTES),
        )
        got = _adapter_step(r)
        dest = (output or Path(f"{run_id}-step-{got}")).resolve()
        sha = r.headers.get("ETag", "").strip('"') or None
        archive.seek(0)
        try:
            # The SDK's extraction: only regular files inside dest, the whole capped (a small gzip
            # can expand to gigabytes), dest replaced in one rename and never a directory of other
            # files.
            extract_adapter(archive, dest, sha256=sha, step=got)
        except LoraloomError as exc:
            raise CliError(
                str(exc), kind=ExitCode.USAGE if isinstance(exc, DestinationInUse) else ExitCode.ERROR
            ) from None
        except OSError as exc:
            raise path_error(f"-o {output}" if output is not None else str(dest), exc) from None
    files = sorted(p.name for p in dest.iterdir() if p.name != MARKER_NAME)
    if as_json:
        echo_json({"run_id": run_id, "step": got, "path": str(dest), "files": files})
    else:
        typer.echo(f"adapter of {run_id} at step {got}: {dest} ({', '.join(files)})")


UNWRITABLE = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS}
)
"""The errors of a path that cannot be written as given (no such place, not a directory, not
allowed, read-only): the user's to fix, a usage error. Others (a full disk) are exit code 1."""


def path_error(what: str, exc: OSError) -> CliError:
    """An OSError writing an output path as one line naming that path (`what`: the option and its
    value), in place of a FileNotFoundError with exit code 1 ("unexpected error")."""
    kind = ExitCode.USAGE if exc.errno in UNWRITABLE else ExitCode.ERROR
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EEXIST and exc.filename:  # a directory to create is a file ("File exists")
        reason = f"{exc.filename} is not a directory"
    return CliError(f"{what}: cannot write there: {reason}", kind=kind)


def prepare_output_file(what: str, path: Path) -> None:
    """Before any request: `path`'s directory exists (missing ones are created, as for
    `adapters download -o`) and a file can be created in it (a temporary file, removed at once),
    so an unwritable place is refused before the run's metrics are fetched."""
    try:
        path.resolve().parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.resolve().parent):
            pass
    except OSError as exc:
        raise path_error(what, exc) from None


def _adapter_step(response: httpx.Response) -> int:
    """The step of a downloaded adapter, from its X-Adapter-Step header."""
    value = response.headers.get("X-Adapter-Step", "0")
    if not (value.isascii() and value.isdigit()):
        raise UnexpectedAnswer(describe(response), f"X-Adapter-Step {value!r} is not a step")
    return int(value)


PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg")
"""What --plot writes (matplotlib picks the format by the suffix)."""


def metrics(
    run_id: RunIdArg,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG of loss (and reward, if reported) per step.")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's metrics per step: table, --json, or --plot FILE.png.

    Each row is a trainer step beside the reward of the batches it trained (ROLLOUT: the adapter
    step they were sampled with, one or more steps before)."""
    if plot is not None and plot.suffix.lower() not in PLOT_SUFFIXES:
        raise CliError(
            f"--plot {plot}: not an image file name",
            kind=ExitCode.USAGE,
            hint=f"end it in {', '.join(PLOT_SUFFIXES)}",
        )
    if plot is not None:
        prepare_output_file(f"--plot {plot}", plot)
    items = _all_metrics(run_id, url=url, key=key)
    if plot is not None:
        _plot(run_id, items, plot)
    if as_json:
        echo_json({"items": items})
        return
    if not items:
        typer.echo(f"{run_id}: no step reported yet")
        if plot is not None:
            typer.echo(f"plot: {plot} (empty: no step reported yet)")
        return
    rows = _aligned_rows(items)
    columns = [("STEP", "step")] + [
        (c.upper(), c)
        for c in ("rollout", "reward", *METRIC_COLUMNS)
        if any(r.get(c) is not None for r in rows)
    ]
    table(rows, columns)
    if any(r.get("rollout") is not None for r in rows):
        typer.echo(
            "ROLLOUT: the adapter step its batches were sampled with; REWARD: their mean (STEP -: not trained yet)"
        )
    if plot is not None:
        typer.echo(f"plot: {plot}")


def _all_metrics(run_id: str, *, url: str, key: str | None) -> list[dict[str, Any]]:
    """Every step's metrics, page after page (the service pages them by step, 200 at most)."""
    items: list[dict[str, Any]] = []
    since: int | None = 0
    while since is not None:
        page = api("GET", f"/v1/runs/{run_id}/metrics", url=url, key=key, params={"since_step": since})
        items += page["items"]
        since = page.get("next_since_step")
    return items


def _aligned_rows(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trainer step with the rollout steps it trained and their reward (the service's
    `trained_*` fields); then the rollout steps with rewards that no step has trained yet (STEP "-").
    Without rewards (e.g. SFT) the trainer's rows alone.

    An item's `reward` is keyed by rollout step (the adapter step its batches were sampled with),
    trained one or more steps later: never beside the same item's loss."""
    if not any(_mean(item.get("reward")) is not None for item in items):
        return [item for item in items if item.get("created_at")]
    rows = [
        item
        | {
            "rollout": ",".join(map(str, item.get("trained_rollout_steps") or [])) or None,
            "reward": _mean(item.get("trained_reward")),
        }
        for item in items
        if item.get("created_at")
    ]
    done = {rollout for item in items for rollout in item.get("trained_rollout_steps") or []}
    rows += [
        {"step": None, "rollout": str(item["step"]), "reward": mean}
        for item in items
        if item["step"] not in done and (mean := _mean(item.get("reward"))) is not None
    ]
    return rows


def _mean(aggregate: object) -> float | None:
    """The mean of a reward aggregate (mean, std, min, max, count); None for a missing one."""
    return aggregate.get("mean") if isinstance(aggregate, dict) else None


def _plot(run_id: str, items: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise CliError(
            "--plot needs matplotlib", kind=ExitCode.USAGE, hint="pip install 'loraloom[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = {"loss": lambda i: i.get("loss"), "reward (mean)": lambda i: _mean(i.get("reward"))}
    series = [name for name, value in values.items() if any(value(i) is not None for i in items)]
    fig, axes = plt.subplots(len(series) or 1, 1, figsize=(7, 2.5 * max(len(series), 1)), squeeze=False)
    for ax, name in zip(axes[:, 0], series, strict=False):
        points = [(i["step"], v) for i in items if (v := values[name](i)) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        ax.set_ylabel(name)
        # Rewards are per rollout step, the adapter step a batch was sampled with, not the step that trained it.
        ax.set_xlabel("rollout step (adapter sampled with)" if name.startswith("reward") else "trainer step")
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(f"{run_id}: metrics per step")
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # made by prepare_output_file, unless since removed
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise path_error(f"--plot {path}", exc) from None
    finally:
        plt.close(fig)


def runs_watch(
    run_id: RunIdArg,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 2.0,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Follow a run: its steps as a progress bar and its latest metrics, until it ends.

    Exit code 0 if it completed, 8 if it was evicted, failed or deleted."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the dev dependencies

    run = api("GET", f"/v1/runs/{run_id}", url=url, key=key)
    total = run["config"]["max_steps"]
    # On a terminal, a bar redrawn in place; elsewhere (a log file, a pipe) a line per change of step
    # or status, not a bar frame per poll (1,800 lines an hour at the default interval).
    on_terminal = not as_json and sys.stderr.isatty()
    bar = tqdm(total=total, desc=run["name"], unit="step", disable=not on_terminal)
    shown: tuple[int, str] | None = None
    try:
        while True:
            step = run["progress"]["step"]
            bar.update(step - bar.n)
            deleted = run["status"] == "deleted"  # its metrics are a 404
            latest = _latest_metrics(run_id, step, url=url, key=key) if step and not deleted else {}
            bar.set_postfix({"status": run["status"], **latest}, refresh=True)
            if as_json:
                typer.echo(json.dumps({"status": run["status"], "step": step, "metrics": latest}))
            elif not on_terminal and shown != (step, run["status"]):
                figures = "".join(f" {name}={value}" for name, value in latest.items())
                name = terminal_safe(run["name"])
                typer.echo(f"{name}: step {step}/{total} {run['status']}{figures}", err=True)
                shown = (step, run["status"])
            if run["status"] in FINAL:
                break
            time.sleep(interval)
            run = api("GET", f"/v1/runs/{run_id}", url=url, key=key)
    finally:
        bar.close()
    reason = run.get("eviction_reason") or run.get("failure_reason")
    shown_reason = f": {terminal_safe(reason)}" if reason else ""
    typer.echo(f"{run_id} {run['status']}{shown_reason}", err=as_json)
    if run["status"] != "completed":
        raise typer.Exit(int(ExitCode.RUN_NOT_COMPLETED))


def _latest_metrics(run_id: str, step: int, *, url: str, key: str | None) -> dict[str, str]:
    """The trainer's figures of `step` (asked for by step: the first page of a run's metrics ends at
    step 200)."""
    params = {"since_step": step, "limit": 1}
    try:
        items = api("GET", f"/v1/runs/{run_id}/metrics", url=url, key=key, params=params)["items"]
    except CliError as refused:
        # Deleted since it was read (a deleted run's metrics are a 404): no figures; the next read
        # of the run says it is deleted, and the watch ends as it does for any run that stopped.
        if isinstance(refused.details, dict) and refused.details.get("status") == "deleted":
            return {}
        raise
    last = items[0] if items and items[0]["step"] == step else {}
    return {k: f"{last[k]:.4g}" for k in ("loss", "grad_norm") if isinstance(last.get(k), int | float)}


@pools_cli.command("list")
def pools_list(url: UrlOpt = DEFAULT_URL, key: AdminKeyOpt = None, as_json: JsonOpt = False) -> None:
    """List the worker pools that registered (alive, dead or stopped)."""
    data = api("GET", "/v1/admin/pools", url=url, key=key, key_env="LORALOOM_ADMIN_KEY")
    if as_json:
        echo_json(data)
        return
    table(
        data["items"],
        [
            ("ID", "id"),
            ("BASE MODEL", "base_model"),
            ("STATUS", "status"),
            ("SLOTS", "slots"),
            ("RANKS", "world_size"),
            ("MAX RANK", "max_rank"),
            ("SEQ LEN", "max_seq_len"),
            ("LAST HEARTBEAT", "last_heartbeat_at"),
        ],
    )
