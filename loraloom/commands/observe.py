"""Following what the trainer did: `adapters list/download`, `metrics` (table, JSON, plot) and
`runs watch` (a live progress bar until the run ends). Tenant API key; polling only the runs,
adapters and metrics routes."""

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

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

adapters_cli = typer.Typer(help="Adapters the trainer published (tenant API key).", no_args_is_help=True)
pools_cli = typer.Typer(help="Worker pools (admin key).", no_args_is_help=True)

RunArg = Annotated[str, typer.Argument(help="run_...")]
FINAL = {"completed", "evicted", "failed", "deleted"}
METRIC_COLUMNS = ("loss", "entropy", "grad_norm", "lr", "tokens", "samples", "step_time_s")


@adapters_cli.command("list")
def adapters_list(
    run_id: RunArg, url: UrlOpt = DEFAULT_URL, key: KeyOpt = None, as_json: JsonOpt = False
) -> None:
    """List a run's adapters, one per published step."""
    data = api("GET", f"/v1/runs/{run_id}/adapters", url=url, key=key)
    if as_json:
        echo_json(data)
        return
    table(
        data["items"],
        [("STEP", "step"), ("BYTES", "size_bytes"), ("SHA256", "sha256"), ("CREATED", "created_at")],
    )


@adapters_cli.command("download")
def adapters_download(
    run_id: RunArg,
    step: Annotated[str, typer.Option(help="A step number or 'latest'.")] = "latest",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Directory (default: ./<run_id>-step-<N>).")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Download an adapter as a PEFT directory (adapter_config.json, adapter_model.safetensors)."""
    r = request("GET", f"/v1/runs/{run_id}/adapters/{step}", url=url, key=key, timeout=300.0)
    got = int(r.headers.get("X-Adapter-Step", "0"))
    dest = (output or Path(f"{run_id}-step-{got}")).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")  # "data": no absolute paths, links or devices
    files = sorted(p.name for p in dest.iterdir())
    if as_json:
        echo_json({"run_id": run_id, "step": got, "path": str(dest), "files": files})
    else:
        typer.echo(f"adapter of {run_id} at step {got}: {dest} ({', '.join(files)})")


PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg")
"""What --plot writes (matplotlib picks the format by the suffix)."""


def metrics(
    run_id: RunArg,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG of loss (and reward, if reported) per step.")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's metrics per step: table, --json, or --plot FILE.png."""
    if plot is not None and plot.suffix.lower() not in PLOT_SUFFIXES:
        raise CliError(
            f"--plot {plot}: not an image file name",
            kind=ExitCode.USAGE,
            hint=f"end it in {', '.join(PLOT_SUFFIXES)}",
        )
    items: list[dict[str, Any]] = api("GET", f"/v1/runs/{run_id}/metrics", url=url, key=key)["items"]
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
    rows = [i | {"reward": _reward_mean(i)} for i in items]
    columns = [("STEP", "step")] + [
        (c.upper(), c) for c in ("reward", *METRIC_COLUMNS) if any(r.get(c) is not None for r in rows)
    ]
    table(rows, columns)
    if plot is not None:
        typer.echo(f"plot: {plot}")


def _reward_mean(item: dict[str, Any]) -> float | None:
    """The step's mean reward: the service reports rewards as an aggregate (mean, std, count, ...)."""
    reward = item.get("reward")
    return reward.get("mean") if isinstance(reward, dict) else reward


def _plot(run_id: str, items: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise CliError(
            "--plot needs matplotlib", kind=ExitCode.USAGE, hint="pip install 'loraloom[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = {"loss": lambda i: i.get("loss"), "reward (mean)": _reward_mean}
    series = [name for name, value in values.items() if any(value(i) is not None for i in items)]
    fig, axes = plt.subplots(len(series) or 1, 1, figsize=(7, 2.5 * max(len(series), 1)), squeeze=False)
    for ax, name in zip(axes[:, 0], series, strict=False):
        points = [(i["step"], v) for i in items if (v := values[name](i)) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(f"{run_id}: metrics per step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def runs_watch(
    run_id: RunArg,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 2.0,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Follow a run: its steps as a progress bar and its latest metrics, until it ends.

    Exit code 0 if it completed, 8 if it was evicted, failed or deleted."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the dev dependencies

    run = api("GET", f"/v1/runs/{run_id}", url=url, key=key)
    bar = tqdm(total=run["config"]["max_steps"], desc=run["name"], unit="step", disable=as_json)
    try:
        while True:
            step = run["progress"]["step"]
            bar.update(step - bar.n)
            latest = _latest_metrics(run_id, url=url, key=key) if step else {}
            bar.set_postfix({"status": run["status"], **latest}, refresh=True)
            if as_json:
                typer.echo(json.dumps({"status": run["status"], "step": step, "metrics": latest}))
            if run["status"] in FINAL:
                break
            time.sleep(interval)
            run = api("GET", f"/v1/runs/{run_id}", url=url, key=key)
    finally:
        bar.close()
    reason = run.get("eviction_reason") or run.get("failure_reason")
    typer.echo(f"{run_id} {run['status']}" + (f": {reason}" if reason else ""), err=as_json)
    if run["status"] != "completed":
        raise typer.Exit(int(ExitCode.RUN_NOT_COMPLETED))


def _latest_metrics(run_id: str, *, url: str, key: str | None) -> dict[str, str]:
    items = api("GET", f"/v1/runs/{run_id}/metrics", url=url, key=key)["items"]
    if not items:
        return {}
    last = items[-1]
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
