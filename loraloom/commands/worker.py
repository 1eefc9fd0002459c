"""`loraloom worker`: the worker pool under torchrun, configured like the service.

Every option is a field of `trainer_core.settings.WorkerSettings`: LORALOOM_* variables first,
then the flags given here (a flag wins). A setting with two variables (--slots:
LORALOOM_MAX_CONCURRENT_RUNS or LORALOOM_SLOTS) refuses to start with them set to different
values, naming both, unless its flag is given: the flag wins over both. Relative paths are resolved
against the caller's working directory once, here, and the ranks get absolute ones. The token is
checked against the service before any rank starts, so a wrong one fails in a second, not after the
model has loaded.
"""

import json
import os
import signal
from contextlib import suppress
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import httpx
import typer
from pydantic import ValidationError

from contracts.http import error_from_response
from contracts.run_config import DEFAULT_BASE_MODEL
from loraloom.commands.errors import CliError, ExitCode, require_worker_extra
from loraloom.commands.http import check_url
from loraloom.commands.preflight import check_port
from orchestrator.client import api_key_problem

SERVICE = "Service"
MODEL = "Model"
POOL = "Pool"
LOOP = "Loop"
LAUNCH = "Launcher"


def _opt(panel: str, help: str, *decls: str, **kw: Any) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=panel, show_default=False, **kw)


def worker(
    url: Annotated[str | None, _opt(SERVICE, "Base URL of the service [LORALOOM_URL].")] = None,
    token: Annotated[
        str | None, _opt(SERVICE, "The service's worker token [LORALOOM_WORKER_TOKEN].", envvar=None)
    ] = None,
    token_file: Annotated[
        Path | None,
        _opt(
            SERVICE,
            "Read the worker token from this file (e.g. a Docker secret) [LORALOOM_WORKER_TOKEN_FILE].",
        ),
    ] = None,
    runs_dir: Annotated[
        Path | None,
        _opt(
            SERVICE,
            "Train the run_* directories under DIR (control/orch.toml, rollouts/step_N/) without the "
            "service [LORALOOM_RUNS_DIR].",
        ),
    ] = None,
    heartbeat_file: Annotated[
        Path | None, _opt(SERVICE, "Touched after every accepted heartbeat [LORALOOM_HEARTBEAT_FILE].")
    ] = None,
    base_model: Annotated[
        str | None,
        _opt(MODEL, "loraloom-tiny (built in), a local HF directory, or a hub id [LORALOOM_BASE_MODEL]."),
    ] = None,
    model_cache_dir: Annotated[
        Path | None,
        _opt(MODEL, "Where the built-in model is cached [LORALOOM_MODEL_CACHE] (./.loraloom/models)."),
    ] = None,
    device: Annotated[str | None, _opt(MODEL, "auto, cpu or cuda [LORALOOM_DEVICE].")] = None,
    dtype: Annotated[str | None, _opt(MODEL, "auto, fp32 or bf16 [LORALOOM_DTYPE].")] = None,
    attention: Annotated[
        str | None, _opt(MODEL, "auto, packed, flash_attention_2, sdpa or eager [LORALOOM_ATTENTION].")
    ] = None,
    gradient_checkpointing: Annotated[
        bool | None,
        _opt(
            MODEL,
            "Recompute layers in the backward instead of keeping their activations: less memory, about "
            "one more forward per step [LORALOOM_GRADIENT_CHECKPOINTING] (off).",
            "--gradient-checkpointing",  # on only: a --no- twin would squeeze the help's columns
        ),
    ] = None,
    slots: Annotated[
        int | None,
        _opt(POOL, "Concurrent runs (LoRA slots) [LORALOOM_MAX_CONCURRENT_RUNS or LORALOOM_SLOTS] (4)."),
    ] = None,
    max_rank: Annotated[
        int | None, _opt(POOL, "Largest LoRA rank a run may ask for [LORALOOM_MAX_RANK] (16).")
    ] = None,
    target_modules: Annotated[
        str | None,
        _opt(
            POOL,
            "Comma-separated linear layers with LoRA slots [LORALOOM_TARGET_MODULES] "
            "(q_proj,k_proj,v_proj,o_proj).",
        ),
    ] = None,
    seq_len: Annotated[
        int | None,
        _opt(
            POOL,
            "Tokens per packed micro-batch [LORALOOM_SEQ_LEN] (1024). On a GPU, 8192-16384 where memory "
            "allows: each micro-batch has a host cost that barely grows with its length (docs/benchmarks.md).",
        ),
    ] = None,
    checkpoint_dir: Annotated[
        Path | None,
        _opt(POOL, "Per-run checkpoints go under DIR/<run_id>/ [LORALOOM_CHECKPOINT_DIR] (data-dir/runs)."),
    ] = None,
    data_dir: Annotated[
        Path | None,
        _opt(POOL, "The artifact store shared with the service [LORALOOM_DATA_DIR] (./.loraloom/data)."),
    ] = None,
    sampler_url: Annotated[
        str | None,
        _opt(
            POOL,
            "An OpenAI-compatible server with LoRA hot-loading (vLLM) that serves Tinker sample "
            "[LORALOOM_SAMPLER_URL] (unset: the pool serves it).",
        ),
    ] = None,
    sampler_deadline: Annotated[
        float | None,
        _opt(
            POOL,
            "Seconds a round of requests to the sampler may take in all, their generations included "
            "[LORALOOM_SAMPLER_DEADLINE] (600).",
        ),
    ] = None,
    sampler_concurrency: Annotated[
        int | None,
        _opt(POOL, "Requests in flight at once to the sampler [LORALOOM_SAMPLER_CONCURRENCY] (8)."),
    ] = None,
    sampler_max_response_bytes: Annotated[
        int | None,
        _opt(
            POOL,
            "Largest answer read from the sampler, in bytes [LORALOOM_SAMPLER_MAX_RESPONSE_BYTES] "
            "(268435456: 256 MiB).",
        ),
    ] = None,
    pack_timeout: Annotated[
        float | None, _opt(LOOP, "Seconds buffered work waits for a full pack [LORALOOM_PACK_TIMEOUT] (2).")
    ] = None,
    poll_interval: Annotated[
        float | None, _opt(LOOP, "Seconds between polls when idle [LORALOOM_POLL_INTERVAL] (0.2).")
    ] = None,
    max_claim: Annotated[
        int | None, _opt(LOOP, "Batches claimed per request [LORALOOM_MAX_CLAIM] (64).")
    ] = None,
    exit_when_idle: Annotated[
        float | None, _opt(LOOP, "Exit after this many idle seconds [LORALOOM_EXIT_WHEN_IDLE].")
    ] = None,
    nproc_per_node: Annotated[
        int | None, _opt(LAUNCH, "Ranks (processes); one per GPU [LORALOOM_WORKER_RANKS] (1).")
    ] = None,
    master_port: Annotated[
        int | None, _opt(LAUNCH, "Port the ranks meet on; 0: any free port [LORALOOM_MASTER_PORT] (29517).")
    ] = None,
    dry_run: Annotated[
        bool, _opt(LAUNCH, "Print the resolved settings as JSON (token hidden) and exit.")
    ] = False,
) -> None:
    """Run the worker pool under torchrun (ranks talk gloo on CPU, nccl on GPU)."""
    flags = {
        k: v for k, v in locals().items() if k not in ("token", "token_file", "dry_run") and v is not None
    }
    if token is not None:
        flags["worker_token"] = token
    if token_file is not None:
        flags["worker_token_file"] = token_file
        if token is None:
            flags["worker_token"] = None  # a flag wins over LORALOOM_WORKER_TOKEN, as every flag does
    settings = build_settings(flags)
    if dry_run:
        if settings.runs_dir is None:  # the real start refuses such a URL (check_token): so does this
            check_url(settings.url)
        shown = settings.model_dump(mode="json", exclude={"worker_token"})
        # Where checkpoints really go (unset, the field said null; with --runs-dir, not it at all).
        shown["checkpoint_dir"] = str(settings.checkpoint_home)
        shown["token"] = _token_source(
            settings, token_flag=token is not None, file_flag=token_file is not None
        )
        typer.echo(json.dumps(shown, indent=2))
        return
    require_worker_extra("the worker pool")  # local checks before the network: ours are named first
    _check_base_model(settings.base_model)
    _check_master_port(settings.nproc_per_node, settings.master_port)
    if settings.runs_dir is None:
        _check_token_file(settings.worker_token, settings.worker_token_file)
        if not settings.token:
            raise CliError(
                "no worker token",
                kind=ExitCode.AUTH,
                hint="pass --token or set LORALOOM_WORKER_TOKEN (or --runs-dir DIR to train without the service)",
            )
        if problem := api_key_problem(settings.token):  # else a bare UnicodeEncodeError, or httpx's refusal
            source = _token_source(settings, token_flag=token is not None, file_flag=token_file is not None)
            raise CliError(
                f"the worker token ({source}) {problem}",
                kind=ExitCode.USAGE,
                hint="give the token as the service's LORALOOM_WORKER_TOKEN holds it",
            )
        check_token(settings.url, settings.token)
    raise typer.Exit(_launch(settings))


def build_settings(flags: dict[str, Any]) -> Any:
    """`WorkerSettings` from the environment and `flags`, relative paths resolved against the cwd."""
    from trainer_core.settings import WorkerSettings, settings_problems

    try:
        return WorkerSettings(**flags).resolved()
    except ValidationError as exc:
        problems = settings_problems(exc, given=flags, environ=os.environ, flags=_SPELT_OTHERWISE)
        raise CliError(
            f"invalid worker settings: {problems}",
            kind=ExitCode.USAGE,
            hint="fix the flag or variable named (`loraloom worker --help` lists them)",
        ) from None


_SPELT_OTHERWISE = {"worker_token": "--token", "worker_token_file": "--token-file"}
"""This command's flags whose names are not their settings' (`--worker-token`...)."""


def _token_source(settings: Any, *, token_flag: bool, file_flag: bool) -> str:
    """Where the worker token comes from, for --dry-run: the flag, file or variable, never the token."""
    if settings.worker_token:
        return "from --token" if token_flag else "from LORALOOM_WORKER_TOKEN"
    path = settings.worker_token_file
    if path is None:
        if settings.runs_dir is not None:
            return "none (not needed with --runs-dir)"
        return "none: pass --token or --token-file, or set LORALOOM_WORKER_TOKEN"
    where = f"{'--token-file' if file_flag else 'LORALOOM_WORKER_TOKEN_FILE'} {path}"
    try:
        found = bool(path.read_text().strip())
    except OSError as exc:
        return f"none: cannot read {where}: {exc.strerror or exc}"
    return f"from {where}" if found else f"none: {where} is empty"


def _check_token_file(token: Any, path: Path | None) -> None:
    """A token file that is used must be readable and hold a token (else the error names the file)."""
    if token or path is None:
        return
    try:
        text = path.read_text()
    except OSError as exc:
        raise CliError(
            f"cannot read the worker token file {path}: {exc.strerror or exc}", kind=ExitCode.USAGE
        ) from None
    if not text.strip():
        raise CliError(f"the worker token file {path} is empty", kind=ExitCode.USAGE)


def check_token(url: str, token: str) -> None:
    """Ask the service whether it accepts `token` (a pool route that needs no registration; an
    unknown pool's 404 there is the token accepted), after checking that a loraloom service answers
    at `url` at all (a URL with a path, e.g. /v1, got 404s too, and the ranks died on one after
    loading the model)."""
    check_url(url)
    base = url.rstrip("/")
    try:
        ready = httpx.get(f"{base}/readyz", timeout=10)
        r = httpx.get(
            f"{base}/v1/pool/state",
            params={"pool_id": "pool_tokencheck"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the service at {url}: {exc}", kind=ExitCode.UNAVAILABLE) from None
    if ready.status_code == 404:
        raise CliError(
            f"no loraloom service at {url}: GET /readyz answered 404",
            kind=ExitCode.USAGE,
            hint="give the service's base URL, without a path such as /v1",
        )
    if r.status_code in (401, 403):
        raise CliError(
            f"the service at {url} refused the worker token (HTTP {r.status_code}: "
            f"{error_from_response(r).message})",
            kind=ExitCode.AUTH,
            hint="use the service's LORALOOM_WORKER_TOKEN",
        )


_MODEL_HINT = "give a local Hugging Face model directory, a hub id (org/name) or loraloom-tiny"


def _check_base_model(name: str) -> None:
    """What can be told without loading the model or the network: a path-like name that is not a
    directory (not the hub's "invalid repo id"), a directory without config.json (not transformers'
    "Unrecognized model"), a hub id that is not in the cache while the hub is offline (not a traceback
    per rank after the ranks started). Anything else is the ranks' to find out."""
    if name == DEFAULT_BASE_MODEL:
        return
    local = Path(name).expanduser()
    # The rule of trainer_core.models.registry.looks_local (not imported: it would load torch here).
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise CliError(
                f"base model {name}: the directory has no config.json, so it is not a Hugging Face "
                "model directory",
                kind=ExitCode.USAGE,
                hint="give the directory save_pretrained() wrote (config.json beside the weights), "
                "a hub id (org/name) or loraloom-tiny",
            )
    elif looks_local:
        raise CliError(
            f"base model {name}: the directory does not exist",
            kind=ExitCode.NOT_FOUND,
            hint=_MODEL_HINT,
        )
    else:
        _check_hub_model(name)


def _check_hub_model(repo_id: str) -> None:
    """Offline (HF_HUB_OFFLINE=1), a hub id must be in the local cache; online the ranks download it."""
    import importlib.util

    if importlib.util.find_spec("huggingface_hub") is None:
        return  # no transformers either: the ranks say so
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except HFValidationError as exc:
        raise CliError(
            f"base model {repo_id} is neither a local directory nor a valid hub id: {exc}",
            kind=ExitCode.USAGE,
            hint=_MODEL_HINT,
        ) from None
    if constants.HF_HUB_OFFLINE and not isinstance(cached, str):
        raise CliError(
            f"base model {repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
            "and the hub is offline (HF_HUB_OFFLINE)",
            kind=ExitCode.NOT_FOUND,
            hint=f"download it first (`hf download {repo_id}` with the same HF_HOME), unset "
            "HF_HUB_OFFLINE, or give a local model directory",
        )


def _check_master_port(nproc_per_node: int, master_port: int | None) -> None:
    """The port the ranks meet on is free: torchrun would fail with a traceback of its own."""
    from loraloom.launch import rendezvous_port

    port = rendezvous_port(nproc_per_node, master_port)
    if port is not None:
        check_port("127.0.0.1", port, flag="--master-port")


def _launch(settings: Any) -> int:
    from loraloom.launch import launch_pool  # torch is imported only by the ranks themselves

    where = settings.runs_dir if settings.runs_dir is not None else settings.url
    typer.echo(f"starting {settings.nproc_per_node} rank(s) of the worker pool on {where}", err=True)
    # The token travels in the environment, not on the command line of every rank (`ps` shows those).
    env = {"LORALOOM_WORKER_TOKEN": settings.token} if settings.token else {}
    pool = launch_pool(
        nproc_per_node=settings.nproc_per_node,
        worker_args=settings.flags(),
        master_port=settings.master_port,
        env=env,
    )

    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        # The pool runs in its own process group: pass Ctrl-C, SIGTERM or a closed terminal (SIGHUP)
        # on. To the ranks themselves when they are up: each finishes its step, the pool
        # deregisters, and torchrun sees them end well (signalled itself, it prints a traceback per
        # rank and fails). A second signal kills the group (the ranks die with torchrun).
        received.append(signum)
        with suppress(ProcessLookupError):
            if len(received) > 1:
                typer.echo("second signal: killing the worker pool", err=True)
                os.killpg(pool.pid, signal.SIGKILL)
                return
            typer.echo("stopping the worker pool after its current step (again to kill it)", err=True)
            ranks = _children(pool.pid)
            for rank in ranks:
                os.kill(rank, signal.SIGTERM)
            if not ranks:  # still starting: torchrun stops whatever it started
                os.killpg(pool.pid, signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    code = pool.wait()
    if received and code != 0:
        return 128 + received[0]  # stopped by a signal, as a shell reports it (Ctrl-C: 130)
    return code


def _children(pid: int) -> list[int]:
    """The processes `pid` started (torchrun's ranks), from /proc; empty where that cannot be read."""
    found: list[int] = []
    with suppress(OSError, ValueError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(child) for child in (task / "children").read_text().split()]
    return found
