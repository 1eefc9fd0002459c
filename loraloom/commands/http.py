"""The CLI's HTTP plumbing and output helpers: one request with readable errors, JSON and tables."""

import json
import os
from collections.abc import Sequence
from typing import Annotated, Any

import httpx
import typer

from contracts.http import api_prefix_problem, tinker_surface_hint
from loraloom.commands.answers import Answer, read_object
from loraloom.commands.errors import CliError, ExitCode, http_error
from loraloom.commands.shown import terminal_safe
from orchestrator import bounded
from orchestrator.client import (
    DEFAULT_DEADLINE_S,
    DEFAULT_MAX_RESPONSE_BYTES,
    api_key_problem,
    url_parts_problem,
)
from orchestrator.errors import DeadlineExceeded, ResponseTooLarge

DEFAULT_URL = "http://127.0.0.1:8000"

UrlOpt = Annotated[
    str, typer.Option("--url", envvar="LORALOOM_URL", help="Base URL of the service, without /v1.")
]
KeyOpt = Annotated[
    str | None, typer.Option("--key", envvar="LORALOOM_API_KEY", help="Tenant API key.", show_default=False)
]
AdminKeyOpt = Annotated[
    str | None, typer.Option("--key", envvar="LORALOOM_ADMIN_KEY", help="Admin key.", show_default=False)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (errors too, on stderr).")]


def request(
    method: str,
    path: str,
    *,
    url: str,
    key: str | None,
    key_env: str = "LORALOOM_API_KEY",
    timeout: float = 30.0,
    deadline: float = DEFAULT_DEADLINE_S,
    sink: bounded.Sink | None = None,
    **kwargs: Any,
) -> httpx.Response:
    """One request; the response if it is a success, else a `CliError` of the right kind.

    Bounded as the SDK's requests are (`orchestrator.bounded`): `timeout` per socket operation,
    `deadline` for the whole exchange, the answer read under the SDK's 64 MiB cap, or into `sink`
    (a download) under its own."""
    if not key:
        raise CliError("no key", kind=ExitCode.AUTH, hint=f"pass --key or set {key_env}")
    check_key(key, key_env)
    headers = {"Authorization": f"Bearer {key}", **(kwargs.pop("headers", None) or {})}
    check_url(url)
    try:
        with httpx.Client(base_url=url, timeout=timeout) as client:
            bounded.install_deadline(client)
            built = client.build_request(method, path, headers=headers, **kwargs)
            r = bounded.send(
                client, built, deadline_s=deadline, max_bytes=DEFAULT_MAX_RESPONSE_BYTES, sink=sink
            )
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach {url}: {exc}", kind=ExitCode.UNAVAILABLE) from None
    except DeadlineExceeded as exc:
        raise CliError(str(exc), kind=ExitCode.UNAVAILABLE, hint="is the service overloaded?") from None
    except ResponseTooLarge as exc:
        raise CliError(str(exc), kind=ExitCode.ERROR, hint="is --url the loraloom service?") from None
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            body = None
        error = http_error(r.status_code, body, r.text)
        if r.status_code == 401 and (hint := tinker_surface_hint(url)):
            error.hint = hint  # not "check --key": the key is likely right, the URL is not
        raise error
    return r


def api(
    method: str,
    path: str,
    *,
    url: str,
    key: str | None,
    key_env: str = "LORALOOM_API_KEY",
    json_body: Any = None,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
    params: dict[str, Any] | None = None,
) -> Answer:
    """One request; its answer, a JSON object (for a route that answers 204, `request`)."""
    r = request(
        method,
        path,
        url=url,
        key=key,
        key_env=key_env,
        json=json_body,
        content=content,
        headers=headers,
        params=params,
    )
    return read_object(r)


def echo_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    """Rows as a plain aligned table; `columns` are (heading, key)."""
    cells = [[h for h, _ in columns]] + [
        ["-" if r.get(k) is None else _cell(r.get(k)) for _, k in columns] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else terminal_safe(str(value))


def check_url(url: str) -> None:
    """A usage error for a URL without its scheme (httpx's "missing protocol" read as "cannot reach"),
    one that ends with the Tinker surface's /api/v1 (each command got a 401, read as a wrong key), or
    one that ends with /v1 (every route already starts with /v1: each command got a 404), or one with
    user info (sent as Basic auth in place of the key: a 401) or a query or fragment (dropped: a 404)."""
    if not url.lower().startswith(("http://", "https://")):
        raise CliError(
            f"{url!r} is not an http:// or https:// URL",
            kind=ExitCode.USAGE,
            hint="give the service's base URL, e.g. http://127.0.0.1:8000",
        )
    if problem := url_parts_problem(url):
        raise CliError(
            f"{'LORALOOM_URL' if os.environ.get('LORALOOM_URL') == url else '--url'} {problem}",
            kind=ExitCode.USAGE,
            hint="the base URL is the scheme, host and port (and a proxy's path prefix, if any)",
        )
    if problem := api_prefix_problem(url):
        raise CliError(
            problem,
            kind=ExitCode.USAGE,
            hint="the base URL is where /v1/... and /api/v1/... start, e.g. http://127.0.0.1:8000",
        )


def check_key(key: str, key_env: str) -> None:
    """A usage error for a key that cannot be a header value (a non-ASCII character raised a bare
    UnicodeEncodeError, a line end was refused by httpx), naming where it came from: the variable
    when it holds this very value, else --key. The key itself is never printed."""
    if problem := api_key_problem(key):
        origin = key_env if os.environ.get(key_env) == key else "--key"
        raise CliError(f"{origin} {problem}", kind=ExitCode.USAGE, hint=f"check --key (or {key_env})")
