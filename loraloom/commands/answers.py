"""The service's answers as the CLI reads them.

Every JSON object of an answer is an `Answer`: a field the CLI reads that is not there is an
`UnexpectedAnswer` naming the request ("unexpected answer to GET /v1/runs/run_...: no 'progress'
field"), not `KeyError: 'progress'` with a hint to run again with --debug. Likewise an answer that
is not a JSON object. A --url that points at another service, or at a service of another version,
is what gives one.
"""

import json
from typing import Any

import httpx

from loraloom.commands.errors import CliError, ExitCode

HINT = "is --url (or LORALOOM_URL) a loraloom service, of a version this CLI knows?"


class UnexpectedAnswer(CliError):
    def __init__(self, request: str, problem: str) -> None:
        super().__init__(
            f"unexpected answer to {request}: {problem}",
            kind=ExitCode.ERROR,
            hint=HINT,
            code="unexpected_answer",
        )


class Answer(dict[str, Any]):
    """A JSON object of an answer; reading a field it lacks raises `UnexpectedAnswer`."""

    def __init__(self, fields: dict[str, Any], request: str = "the request") -> None:
        super().__init__(fields)
        self.request = request

    def __missing__(self, key: str) -> Any:
        raise UnexpectedAnswer(self.request, f"no {key!r} field")


def describe(response: httpx.Response) -> str:
    """The request `response` answers, e.g. "GET /v1/runs/run_0123456789ab"."""
    return f"{response.request.method} {response.request.url.path}"


def read_object(response: httpx.Response) -> Answer:
    """`response`'s body, which must be a JSON object."""
    request = describe(response)
    if not response.content:
        raise UnexpectedAnswer(request, f"no content (HTTP {response.status_code})")
    try:
        body = json.loads(response.content, object_hook=lambda fields: Answer(fields, request))
    except ValueError:  # not JSON, or not UTF-8
        kind = response.headers.get("Content-Type") or "no Content-Type"
        raise UnexpectedAnswer(request, f"not JSON ({kind})") from None
    if not isinstance(body, Answer):
        raise UnexpectedAnswer(request, "JSON, but not an object")
    return body
