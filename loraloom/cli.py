"""The `loraloom` command line (Typer).

`serve` and `db upgrade` act locally; `tenants`, `keys` and `runs` talk to a running
service over HTTP (--url / LORALOOM_URL), with the admin key (LORALOOM_ADMIN_KEY) or a
tenant API key (LORALOOM_API_KEY) as --key.
"""

# isort: off
# First, before the imports that take seconds: a Ctrl-C during them exits 130 quietly.
from loraloom.commands import startup
# isort: on

import functools
import importlib.metadata
import json
import logging
import math
import re
import secrets
import shutil
import socket
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import tomli_w
import typer

from loraloom.commands import observe, preflight, revisions
from loraloom.commands.errors import CliError, ExitCode, require_worker_extra
from loraloom.commands.http import DEFAULT_URL, AdminKeyOpt, JsonOpt, KeyOpt, UrlOpt, api, request
from loraloom.commands.http import echo_json as _echo_json
from loraloom.commands.http import table as _table
from loraloom.commands.ids import KeyIdArg, RunIdArg, TenantIdArg
from loraloom.commands.plain_flags import PlainFlagsGroup
from loraloom.commands.shown import terminal_safe
from loraloom.commands.worker import worker

cli = typer.Typer(
    cls=PlainFlagsGroup,  # the CLI's error handling, and --help without <bool> beside flags
    help="loraloom: multi-tenant RL training service for LoRA adapters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_cli = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
tenants_cli = typer.Typer(help="Tenants (admin key).", no_args_is_help=True)
keys_cli = typer.Typer(help="Tenants' API keys (admin key).", no_args_is_help=True)
runs_cli = typer.Typer(help="Runs (tenant API key).", no_args_is_help=True)
cli.add_typer(db_cli, name="db")
cli.add_typer(tenants_cli, name="tenants")
cli.add_typer(keys_cli, name="keys")
cli.add_typer(runs_cli, name="runs")
cli.add_typer(observe.adapters_cli, name="adapters")
cli.add_typer(observe.pools_cli, name="pools")
cli.command("metrics")(observe.metrics)
runs_cli.command("watch")(observe.runs_watch)
cli.command("worker")(worker)


def _version() -> str:
    try:
        return importlib.metadata.version("loraloom")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"loraloom {_version()}")
        raise typer.Exit()


@cli.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit."),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", envvar="LORALOOM_DEBUG", help="Show tracebacks of failures.")
    ] = False,
) -> None:
    """loraloom: multi-tenant RL training service for LoRA adapters."""


def _fail(message: str, kind: ExitCode = ExitCode.USAGE) -> NoReturn:
    raise CliError(message, kind=kind)


def _print_run(run: dict[str, Any]) -> None:
    slot = f", slot {run['slot']}" if run.get("slot") is not None else ""
    typer.echo(f"{run['id']}  {terminal_safe(run['name'])}  {run['status']}{slot}")


def _print_run_details(run: dict[str, Any]) -> None:
    progress = run["progress"]
    fields = [
        ("id", run["id"]),
        ("name", run["name"]),
        ("tenant", run["tenant_id"]),
        ("status", run["status"]),
        ("waiting", run.get("waiting_reason")),
        ("slot", run["slot"]),
        ("base model", run["base_model"]),
        (
            "progress",
            f"step {progress['step']}/{run['config']['max_steps']}, "
            f"{progress['total_samples']} samples, {progress['total_tokens']} tokens",
        ),
        ("eviction", f"{run['eviction_reason']} (by {run['evicted_by']})" if run["evicted_by"] else None),
        ("failure", run["failure_reason"]),
        ("created", run["created_at"]),
        ("started", run["started_at"]),
        ("finished", run["finished_at"]),
        ("last heartbeat", run["last_heartbeat_at"]),
    ]
    for label, value in fields:
        if value is not None:  # free text (a reason) on lines of its own, never posing as a field
            typer.echo(f"{label + ':':<16}{terminal_safe(str(value), indent=16)}")


# --- local commands --------------------------------------------------------------------


@cli.command()
def version() -> None:
    """Print the version."""
    typer.echo(f"loraloom {_version()}")


@cli.command()
def tokenizer(
    directory: Annotated[
        Path, typer.Argument(help="Where to write it; its name is what get_tokenizer() loads.")
    ] = Path("loraloom-tiny"),
) -> None:
    """Write the built-in model's character tokenizer as Hugging Face files.

    For the Tinker SDK's get_tokenizer() against the built-in model: get_info names the base model
    ("loraloom-tiny", never a path on the service's machine) and the SDK loads that name with
    AutoTokenizer.from_pretrained on your machine, so run this once in the directory your script
    runs from. Hub and local models need nothing of the kind."""
    from contracts.tokenizer_files import save_char_tokenizer

    if directory.exists() and not directory.is_dir():
        raise CliError(f"{directory} exists and is not a directory", kind=ExitCode.USAGE)
    try:
        save_char_tokenizer(directory)
    except OSError as exc:
        raise CliError(f"cannot write the tokenizer into {directory}: {exc.strerror or exc}") from None
    typer.echo(f"wrote the built-in tokenizer into {directory}/ (tokenizer.json, tokenizer_config.json)")


@cli.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            envvar="LORALOOM_API_WORKERS",
            help="uvicorn worker processes (one process is CPU-bound at a few thousand samples/s of "
            "ingestion; the service is stateless apart from Postgres and the data directory).",
        ),
    ] = 1,
) -> None:
    """Run the API service (settings from LORALOOM_* environment variables)."""
    import uvicorn

    from app.serving import uvicorn_options

    settings = _service_settings()
    preflight.check_database(settings.database_url)
    preflight.check_data_dir(str(settings.data_dir))
    preflight.check_port(host, port)
    # Both unset is a legitimate service (tenants made earlier, no pool yet), but the first admin or
    # pool call's 403 points at the caller's key: say it here, where the fix is.
    for variable, value, disabled in (
        ("LORALOOM_ADMIN_KEY", settings.admin_key, "admin routes (tenants, keys) refuse every request"),
        ("LORALOOM_WORKER_TOKEN", settings.worker_token, "no worker pool can connect"),
    ):
        if not value:
            typer.echo(f"note: {variable} is not set: {disabled}", err=True)
    for warning in preflight.weak_credentials(settings):
        typer.echo(f"warning: {warning}", err=True)

    # httptools with a header-size limit (431) and keep-alive timeout: see app/serving.py.
    uvicorn.run(
        "app.main:create_app", factory=True, host=host, port=port, workers=workers, **uvicorn_options()
    )


def _service_settings() -> Any:
    """The service's settings from LORALOOM_* variables; a bad value is a usage error naming the
    variable (not pydantic's report with a traceback hint)."""
    from pydantic import ValidationError

    from app.config import Settings

    try:
        return Settings()
    except ValidationError as exc:
        # A field's error names its variable; one across fields (loc ()) names its own.
        problems = "; ".join(
            f"LORALOOM_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}"
            if e["loc"]
            else str(e["msg"]).removeprefix("Value error, ")
            for e in exc.errors()
        )
        raise CliError(
            f"invalid service settings: {problems}",
            kind=ExitCode.USAGE,
            hint="fix the variable (README: Configuration)",
        ) from None


@db_cli.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Migrate the database (LORALOOM_DATABASE_URL) to the newest schema."""
    from alembic.script.revision import ResolutionError
    from alembic.util import CommandError

    from app import migrate

    url = _service_settings().database_url
    preflight.refuse_in_memory(url)  # migrated, it would be gone with the command's connection
    try:
        migrate.upgrade(url, revision)
    except CommandError as exc:  # an unknown revision, or one this version cannot reach
        if isinstance(exc.__cause__, ResolutionError):
            raise revisions.unknown_revision(revision) from None
        raise CliError(f"cannot migrate to {revision!r}: {exc}", kind=ExitCode.USAGE) from None
    except Exception as exc:
        if (problem := preflight.database_problem(exc, url)) is not None:
            raise problem from None
        raise
    now = migrate.database_revision(url)
    # What the schema is at, not the argument echoed: `upgrade` never goes back (e.g. to "base").
    typer.echo(
        f"database schema at {now} (asked: {revision})"
        if revision != "head"
        else f"database schema at {now} (head)"
    )


# --- tenants and keys (admin) ----------------------------------------------------------


@tenants_cli.command("create")
def tenants_create(
    name: Annotated[str, typer.Argument(help="Unique tenant name.")],
    quota: Annotated[int, typer.Option("--quota", help="How many of its runs may hold a slot at once.")] = 2,
    url: UrlOpt = DEFAULT_URL,
    key: AdminKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a tenant."""
    t = api(
        "POST",
        "/v1/tenants",
        url=url,
        key=key,
        key_env="LORALOOM_ADMIN_KEY",
        json_body={"name": name, "max_concurrent_runs": quota},
    )
    if as_json:
        _echo_json(t)
    else:
        typer.echo(f"tenant {t['name']}: {t['id']} (quota {t['max_concurrent_runs']})")


@tenants_cli.command("list")
def tenants_list(url: UrlOpt = DEFAULT_URL, key: AdminKeyOpt = None, as_json: JsonOpt = False) -> None:
    """List tenants."""
    data = api("GET", "/v1/tenants", url=url, key=key, key_env="LORALOOM_ADMIN_KEY")
    if as_json:
        _echo_json(data)
    else:
        _table(
            data["items"],
            [("ID", "id"), ("NAME", "name"), ("QUOTA", "max_concurrent_runs"), ("CREATED", "created_at")],
        )


@tenants_cli.command("update")
def tenants_update(
    tenant_id: TenantIdArg,
    max_concurrent_runs: Annotated[
        int | None,
        typer.Option(
            "--max-concurrent-runs",
            "--quota",
            help="How many of its runs may hold a slot at once. Lowered below its active runs, they keep "
            "their slots and its queued runs wait; raised, its queued runs that now fit start at once.",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="Its new name, unique whatever the case (another tenant's is refused; another case of "
            "its own is a rename). Its id, keys and runs stay.",
        ),
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    key: AdminKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a tenant's quota of concurrent runs, its name, or both."""
    if max_concurrent_runs is None and name is None:
        _fail("nothing to change: pass --max-concurrent-runs (--quota), --name or both")
    body: dict[str, Any] = {}
    if max_concurrent_runs is not None:
        body["max_concurrent_runs"] = max_concurrent_runs
    if name is not None:
        body["name"] = name
    t = api(
        "PATCH", f"/v1/tenants/{tenant_id}", url=url, key=key, key_env="LORALOOM_ADMIN_KEY", json_body=body
    )
    if as_json:
        _echo_json(t)
    else:
        typer.echo(f"tenant {t['name']}: {t['id']} (quota {t['max_concurrent_runs']})")


@tenants_cli.command("delete")
def tenants_delete(
    tenant_id: TenantIdArg,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    url: UrlOpt = DEFAULT_URL,
    key: AdminKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete a tenant with its API keys and runs (their files too)."""
    if not yes:
        if not sys.stdin.isatty():  # no one to ask: say what to do (typer's "Aborted." said nothing)
            _fail(f"not deleting {tenant_id} without confirmation: pass --yes (no terminal to ask on)")
        if not typer.confirm(f"delete tenant {tenant_id}, its API keys and all its runs?"):
            typer.echo("not deleted")
            return
    request("DELETE", f"/v1/tenants/{tenant_id}", url=url, key=key, key_env="LORALOOM_ADMIN_KEY")
    # The service answers 204 (no body): --json says what was done, as the text does.
    _echo_json({"id": tenant_id, "deleted": True}) if as_json else typer.echo(f"deleted {tenant_id}")


@keys_cli.command("list")
def keys_list(
    tenant_id: TenantIdArg,
    url: UrlOpt = DEFAULT_URL,
    key: AdminKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List a tenant's API keys (prefixes only; revoked ones too)."""
    data = api("GET", f"/v1/tenants/{tenant_id}/keys", url=url, key=key, key_env="LORALOOM_ADMIN_KEY")
    if as_json:
        _echo_json(data)
    else:
        _table(
            data["items"],
            [("ID", "id"), ("PREFIX", "prefix"), ("CREATED", "created_at"), ("REVOKED", "revoked_at")],
        )


@keys_cli.command("create")
def keys_create(
    tenant_id: TenantIdArg,
    url: UrlOpt = DEFAULT_URL,
    key: AdminKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create an API key for a tenant. The key is shown once."""
    k = api("POST", f"/v1/tenants/{tenant_id}/keys", url=url, key=key, key_env="LORALOOM_ADMIN_KEY")
    if as_json:
        _echo_json(k)
    else:
        typer.echo(f"API key {k['id']} for {k['tenant_id']} (shown once, store it now):")
        typer.echo(k["key"])


@keys_cli.command("revoke")
def keys_revoke(
    tenant_id: TenantIdArg,
    key_id: KeyIdArg,
    url: UrlOpt = DEFAULT_URL,
    key: AdminKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Revoke an API key."""
    path = f"/v1/tenants/{tenant_id}/keys/{key_id}"
    request("DELETE", path, url=url, key=key, key_env="LORALOOM_ADMIN_KEY")
    # 204, as for tenants delete.
    done = {"id": key_id, "tenant_id": tenant_id, "revoked": True}
    _echo_json(done) if as_json else typer.echo(f"revoked {key_id}")


# --- runs (tenant) ---------------------------------------------------------------------


_YAML = "tag:yaml.org,2002:"
_YAML_12_RESOLVERS = [
    ("bool", "^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("int", "^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+.0123456789",
    ),
]
"""YAML 1.2's core schema for plain booleans, integers and floats (the spec's section 10.3.2)."""


@functools.cache
def _yaml_loader() -> Any:
    """PyYAML's SafeLoader with YAML 1.2 scalars. PyYAML implements YAML 1.1, whose resolvers read
    `lr: 1e-3` as a string (a float needs a dot there: 1.0e-3), `heartbeat_timeout: 1:30` as the
    base-60 integer 90, `yes`/`no`/`on`/`off` as booleans and `010` as octal 8. Here, as in YAML 1.2
    (and JSON): booleans are true/false only, integers decimal, 0o octal or 0x hex, floats include
    1e-3, `.inf` and `.nan`; anything else is a string (so `1:30` reaches the service, which refuses
    it as no number, rather than silently becoming 90). Nulls, timestamps (a date in metadata) and
    merge keys (<<) stay as PyYAML reads them; `=` is a string, not YAML 1.1's "value" tag."""
    import yaml

    class Yaml12Loader(yaml.SafeLoader):
        pass

    replaced = {_YAML + tag for tag in ("bool", "int", "float", "value")}
    Yaml12Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in replaced]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    for tag, pattern, first in _YAML_12_RESOLVERS:  # int before float: "10" matches both, and is an int
        Yaml12Loader.add_implicit_resolver(_YAML + tag, re.compile(pattern), list(first))

    def number(kind: type[int] | type[float]) -> Any:
        def construct(loader: yaml.SafeLoader, node: Any) -> int | float:
            text = str(loader.construct_scalar(node))
            try:
                if kind is int:
                    prefix = text[:2].lower()
                    return int(text[2:], 8 if prefix == "0o" else 16) if prefix in ("0o", "0x") else int(text)
                special = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
                return special[text.lower()] if text.lower() in special else float(text)
            except ValueError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{text!r} is not a YAML 1.2 {kind.__name__}", node.start_mark
                ) from None

        return construct

    Yaml12Loader.add_constructor(_YAML + "int", number(int))
    Yaml12Loader.add_constructor(_YAML + "float", number(float))
    return Yaml12Loader


MAX_FILE_VALUES = 1_000_000
"""Values a run file may expand to (YAML aliases share one object that the JSON sent repeats: nine
levels of nine aliases are 387 million strings). Far above any run body the service takes (1 MiB)."""


_KEY_TYPES: dict[type, str] = {bool: "a boolean", int: "an integer", float: "a float", type(None): "null"}


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _shape_problem(doc: Any) -> str | None:
    """What makes a parsed file unsendable as JSON, else None: a mapping key that is not a string
    (YAML's `1:`, `true:`, `null:` became "1" and "None", and 1 and true one key), a value that
    contains itself (a recursive YAML anchor), or more than MAX_FILE_VALUES values once aliases are
    expanded. Iterative, so any depth; each problem names where it is, as dotted keys."""
    on_path: set[int] = set()
    stack: list[tuple[Any, str, bool]] = [(doc, "", False)]
    count = 0
    while stack:
        item, where, leaving = stack.pop()
        if leaving:
            on_path.discard(id(item))
            continue
        if not isinstance(item, dict | list):
            continue
        if id(item) in on_path:
            return f"{where} refers to a table or list that holds it (a recursive YAML anchor)"
        count += len(item)
        if count > MAX_FILE_VALUES:
            return (
                f"it expands to more than {MAX_FILE_VALUES} values (YAML aliases repeat what they refer to)"
            )
        on_path.add(id(item))
        stack.append((item, where, True))
        if isinstance(item, list):
            stack.extend((child, f"{where}[{i}]", False) for i, child in enumerate(item))
            continue
        for k, child in item.items():
            if not isinstance(k, str):
                shown = "null" if k is None else str(k).lower() if isinstance(k, bool) else repr(k)
                return (
                    f"the key {shown} {'in ' + where if where else 'at the top level'} is not a string "
                    f"but {_KEY_TYPES.get(type(k)) or _a(type(k).__name__)}: quote it"
                )
            stack.append((child, f"{where}.{k}" if where else k, False))
    return None


def _parse_run_file(path: Path) -> tuple[Any, str]:
    """The file's parsed document and its format ("toml", "yaml" or "json", by the suffix)."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        _fail(f"{path}: not UTF-8 text (byte {exc.start})")
    suffix = path.suffix.lower()
    fmt = "toml" if suffix == ".toml" else "yaml" if suffix in (".yaml", ".yml") else "json"
    try:
        if fmt == "toml":
            return tomllib.loads(text), fmt
        if fmt == "yaml":
            return yaml.load(text, Loader=_yaml_loader()), fmt  # noqa: S506  # a SafeLoader subclass
        return json.loads(text), fmt
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        _fail(f"{path}: not valid {fmt.upper()}: {exc}")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        _fail(f"{path}: not valid YAML: {getattr(exc, 'problem', None) or 'parse error'}{where}")
    except RecursionError:  # each parser recurses once per level of nesting
        _fail(f"{path}: nested too deeply to read")


def load_run_file(path: Path, name: str | None) -> tuple[dict[str, Any], str]:
    """A create-run body from a file, and its format ("toml", "yaml" or "json", by the suffix).
    The file holds either the whole body (`name` and `config`) or only the config; the name then
    defaults to the file's stem. --name overrides either. YAML is read with YAML 1.2's scalars
    (`_yaml_loader`)."""
    if name == "":  # was ignored: the file's name was used
        _fail("--name is empty: give the run a name, or leave --name out to use the file's")
    doc, fmt = _parse_run_file(path)
    if not isinstance(doc, dict):
        _fail(f"{path}: expected a table/mapping/object at the top level")
    if problem := _shape_problem(doc):  # found by pydantic's JSON encoding (exit 1), or not at all
        _fail(f"{path}: {problem}")
    if "name" in doc and not (isinstance(doc["name"], str) and doc["name"]):
        # Was replaced by the file's stem without a word (or, in a whole body, sent on to a 422).
        given = doc["name"]
        shown = "empty" if given == "" else f"not a string: {json.dumps(given, default=str)[:60]}"
        _fail(f"{path}: name is {shown}")
    if isinstance(doc.get("config"), dict):
        body = doc
    else:  # only the config, perhaps with the run's name beside it
        body = {"config": {k: v for k, v in doc.items() if k != "name"}}
        if "name" in doc:
            body["name"] = doc["name"]
    body = {"name": name or body.get("name") or path.stem, **{k: v for k, v in body.items() if k != "name"}}
    from contracts.names import run_name_problem  # the service's rule: its 422, said before sending

    if (refused := run_name_problem(body["name"])) is not None:
        source = (
            "--name" if name else f"{path}: name" if "name" in doc else f"{path}: the file's stem (the name)"
        )
        _fail(f"{source} {refused.message}")
    return body, fmt


@runs_cli.command("create")
def runs_create(
    config_file: Annotated[
        Path, typer.Argument(help="CONFIG.toml, CONFIG.yaml or CONFIG.json.", exists=True, dir_okay=False)
    ],
    name: Annotated[str | None, typer.Option("--name", help="Run name (default: from the file).")] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="Retry-safe: the same key and file give the same run."),
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a run from a config file; it is active if it got a slot, else queued."""
    from pydantic_core import to_jsonable_python

    body, _ = load_run_file(config_file, name)
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    # Sent as JSON whatever the file's format: TOML re-written repeats every nested table's dotted
    # header (a config within the metadata bounds could pass the 64 KiB TOML body bound), and JSON
    # has no dates, which YAML and TOML files may hold: they go as the service writes them (ISO 8601).
    run = api("POST", "/v1/runs", url=url, key=key, json_body=to_jsonable_python(body), headers=headers)
    _echo_json(run) if as_json else _print_run(run)


@runs_cli.command("list")
def runs_list(
    status: Annotated[str | None, typer.Option(help="Only runs in this state.")] = None,
    limit: Annotated[int, typer.Option(help="Page size (1..200).")] = 50,
    cursor: Annotated[str | None, typer.Option(help="Continue from a previous page.")] = None,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List your runs, newest first."""
    params = {k: v for k, v in {"status": status, "limit": limit, "cursor": cursor}.items() if v is not None}
    data = api("GET", "/v1/runs", url=url, key=key, params=params)
    if as_json:
        _echo_json(data)
        return
    rows = [{**r, "step": r["progress"]["step"]} for r in data["items"]]
    _table(
        rows,
        [
            ("ID", "id"),
            ("NAME", "name"),
            ("STATUS", "status"),
            ("SLOT", "slot"),
            ("STEP", "step"),
            ("BASE MODEL", "base_model"),
            ("CREATED", "created_at"),
        ],
    )
    if data["next_cursor"]:
        typer.echo(f"more: --cursor {data['next_cursor']}")


@runs_cli.command("show")
def runs_show(
    run_id: RunIdArg,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a run."""
    run = api("GET", f"/v1/runs/{run_id}", url=url, key=key)
    _echo_json(run) if as_json else _print_run_details(run)


EVICTED_FROM_THE_CLI = "evicted from the command line"
"""The reason `runs evict` sends when given none. The API has no default (its `reason` is required,
a 422 without one); the dashboard's form sends "evicted from the dashboard" the same way."""


@runs_cli.command("evict")
def runs_evict(
    run_id: RunIdArg,
    reason: Annotated[
        str,
        typer.Option(
            "--reason",
            help="Why (kept with the run, and in evicted.txt). Left out or blank: the default.",
        ),
    ] = EVICTED_FROM_THE_CLI,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Evict a queued or active run; its slot goes to the oldest queued run."""
    # Blank as the dashboard's form does: `--reason "$WHY"` with WHY unset is no reason, not a 422.
    body = {"reason": reason if reason.strip() else EVICTED_FROM_THE_CLI}
    run = api("POST", f"/v1/runs/{run_id}/evict", url=url, key=key, json_body=body)
    _echo_json(run) if as_json else _print_run(run)


@runs_cli.command("delete")
def runs_delete(
    run_id: RunIdArg,
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete a run and its files."""
    run = api("DELETE", f"/v1/runs/{run_id}", url=url, key=key)
    _echo_json(run) if as_json else _print_run(run)


# --- the interim demo ------------------------------------------------------------------


@contextmanager
def background_server(app: Any, port: int = 0) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1:`port` (0: a free one) in a thread; yields its URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the service did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def interim_demo(root: Path = Path(".loraloom/demo"), port: int = 0) -> None:
    """Start the service on SQLite under `root` and walk through tenants, keys and runs."""
    from app import migrate
    from app.config import Settings
    from app.main import create_app

    root = root.resolve()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    admin_key = "adm_" + secrets.token_urlsafe(24)
    settings = Settings(
        database_url=f"sqlite:///{root}/loraloom.db",
        data_dir=root / "data",
        admin_key=admin_key,
        max_concurrent_runs=2,
    )
    migrate.upgrade(settings.database_url)

    def say(text: str) -> None:
        typer.echo("")
        typer.secho(f"# {text}", bold=True)

    def cmd(line: str) -> None:
        typer.secho(f"$ loraloom {line}", fg=typer.colors.CYAN)

    with background_server(create_app(settings), port) as url:
        say(f"service on {url}: SQLite in {root}/, 2 slots for the base model loraloom-tiny")
        admin_api = functools.partial(api, url=url, key=admin_key, key_env="LORALOOM_ADMIN_KEY")

        say("the admin creates two tenants and an API key for each")
        keys: dict[str, str] = {}
        for name, quota in (("acme", 2), ("globex", 1)):
            cmd(f"tenants create {name} --quota {quota}")
            t = admin_api("POST", "/v1/tenants", json_body={"name": name, "max_concurrent_runs": quota})
            typer.echo(f"tenant {name}: {t['id']} (quota {quota})")
            cmd(f"keys create {t['id']}")
            keys[name] = admin_api("POST", f"/v1/tenants/{t['id']}/keys")["key"]
            typer.echo(f"API key for {name}: {keys[name][:12]}… (shown once)")

        def create(tenant: str, run_name: str, max_steps: int) -> dict[str, Any]:
            cmd(f"runs create {run_name}.toml   # as {tenant}; max_steps = {max_steps}")
            body = tomli_w.dumps({"name": run_name, "config": {"max_steps": max_steps, "lora": {"rank": 8}}})
            run = api(
                "POST",
                "/v1/runs",
                url=url,
                key=keys[tenant],
                content=body.encode(),
                headers={"Content-Type": "application/toml"},
            )
            _print_run(run)
            return run

        say("runs take the two slots, first come first served, within each tenant's quota")
        a1 = create("acme", "acme-math", 50)
        g1 = create("globex", "globex-code", 50)
        a2 = create("acme", "acme-chat", 30)
        g2 = create("globex", "globex-agent", 30)
        typer.echo("acme-chat waits for a slot; globex-agent also waits for globex's quota (1)")

        say("tenants are isolated: globex cannot see acme's run")
        cmd(f"runs show {a1['id']}   # with globex's key")
        r = httpx.get(f"{url}/v1/runs/{a1['id']}", headers={"Authorization": f"Bearer {keys['globex']}"})
        typer.echo(f"HTTP {r.status_code} {r.json()['error']['code']}")

        say("globex evicts its run: the freed slot goes to the oldest queued run that fits (acme-chat)")
        cmd(f'runs evict {g1["id"]} --reason "reward plateaued"')
        _print_run(
            api(
                "POST",
                f"/v1/runs/{g1['id']}/evict",
                url=url,
                key=keys["globex"],
                json_body={"reason": "reward plateaued"},
            )
        )
        _print_run(api("GET", f"/v1/runs/{a2['id']}", url=url, key=keys["acme"]))

        say("the database is the truth; run directories are its projection")
        for run in (a1, g1):
            control = settings.runs_dir / run["id"] / "control"
            for f in sorted(control.iterdir()):
                lines = f.read_text().strip().splitlines()
                typer.echo(f"{f.relative_to(root)}:")
                typer.echo(
                    "\n".join("    " + line for line in lines[:6]) + ("\n    …" if len(lines) > 6 else "")
                )

        say("acme deletes a run: its slot frees, globex-agent gets it, its directory goes")
        cmd(f"runs delete {a1['id']}")
        _print_run(api("DELETE", f"/v1/runs/{a1['id']}", url=url, key=keys["acme"]))
        _print_run(api("GET", f"/v1/runs/{g2['id']}", url=url, key=keys["globex"]))
        typer.echo(f"{a1['id']} directory exists: {(settings.runs_dir / a1['id']).exists()}")

        say("acme's runs")
        cmd("runs list")
        data = api("GET", "/v1/runs", url=url, key=keys["acme"])
        _table(
            [{**x, "step": x["progress"]["step"]} for x in data["items"]],
            [("ID", "id"), ("NAME", "name"), ("STATUS", "status"), ("SLOT", "slot"), ("STEP", "step")],
        )

    say(
        f"done. The database and run directories are in {root}/. To serve them (an admin key of your own: "
        "the demo's is gone):\n"
        f"  LORALOOM_DATABASE_URL=sqlite:///{root}/loraloom.db LORALOOM_DATA_DIR={root}/data "
        "LORALOOM_ADMIN_KEY=<a secret> loraloom serve"
    )


@cli.command()
def demo(
    steps: Annotated[int, typer.Option(min=2, help="Trainer steps per run.")] = 30,
    output_dir: Annotated[Path, typer.Option(help="Where the plot, results and adapters go.")] = Path(
        "demo-output"
    ),
    interim: Annotated[bool, typer.Option(help="Only walk through tenants and runs (no training).")] = False,
    port: Annotated[int, typer.Option(min=0, max=65535, help="The service's port (0: any free port).")] = 0,
) -> None:
    """The demo on the embedded default: service, worker pool and four runs that visibly learn.

    State goes to ./.loraloom/demo, the built-in model's cache to $LORALOOM_MODEL_CACHE
    (./.loraloom/models), both relative to the directory you run it from."""
    if port:  # taken: another server would answer the demo's requests (not a traceback later)
        preflight.check_port("127.0.0.1", port)
    if interim:
        interim_demo(port=port)
        return
    require_worker_extra("the demo (it trains with the worker pool)", plot=True)
    from loraloom.demo import run_demo  # imports torch: only for the real demo

    # The built-in model's first build logs its progress every few seconds: show it.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    models_log = logging.getLogger("loraloom.models")
    models_log.addHandler(handler)
    models_log.setLevel(logging.INFO)

    run_demo(
        steps=steps, output_dir=output_dir, port=port
    )  # 0: a port the service's parent holds from its pick


def main() -> None:
    startup.started()
    cli()
