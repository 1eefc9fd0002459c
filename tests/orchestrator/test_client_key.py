"""The SDK refuses an API key or base URL that cannot work when the client is built (ValueError, as
the README promises), and does not retry a request httpx refuses to send.

A key read from a file (`open("key.txt").read()`, with its line end) was accepted, then every call
was retried five times as a transport failure (httpx's LocalProtocolError: an illegal header value)
before RetryExhausted; a non-ASCII key (a pasted smart character) raised a bare UnicodeEncodeError
from the first call. A base URL with user:password@ sent Basic auth in place of the key (a 401 that
read as a wrong key); one with a query or fragment lost it on every route (a bare 404). No server:
nothing reaches the network."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from contracts.http import RetryPolicy, send_with_retries, send_with_retries_async
from orchestrator.client import AsyncLoraloomClient, LoraloomClient
from orchestrator.errors import RetryExhausted

CLIENTS = (LoraloomClient, AsyncLoraloomClient)
URL = "http://127.0.0.1:8000"
SECRET = "llk_0123456789abcdef"
NO_WAIT = RetryPolicy(max_attempts=5, backoff_base_s=0.0, backoff_max_s=0.0)

# (key, what the error says about it)
BAD_KEYS = [
    (SECRET + "\n", "a newline as character 21 of 21 (the last)"),
    (SECRET + "\r\n", "a carriage return as character 21 of 22"),
    (" " + SECRET, "a space as character 1 of 21"),
    (SECRET[:4] + "\t" + SECRET[4:], "a tab as character 5 of 21"),
    (SECRET + "é", "a non-ASCII character (U+00E9) as character 21 of 21"),
    (SECRET[:6] + "\u201d" + SECRET[6:], "a non-ASCII character (U+201D) as character 7 of 21"),
    (SECRET + "\x00", "a control character (U+0000)"),
    (SECRET + "\x7f", "a control character (U+007F)"),
]


@pytest.mark.parametrize("client_class", CLIENTS)
@pytest.mark.parametrize(("key", "said"), BAD_KEYS, ids=[repr(k[-2:]) for k, _ in BAD_KEYS])
def test_a_key_that_is_no_printable_token_is_refused_at_construction(
    client_class: type, key: str, said: str
) -> None:
    with pytest.raises(ValueError, match="^api_key holds ") as info:
        client_class(URL, key)
    message = str(info.value)
    assert said in message and "printable ASCII" in message
    # The key is a secret: the message names the character, never the key (nor most of it).
    assert SECRET[4:] not in message and SECRET[6:] not in message


@pytest.mark.parametrize("client_class", CLIENTS)
def test_a_key_that_is_not_a_str_is_refused(client_class: type) -> None:
    """`open("key.txt", "rb").read()` is bytes: f"Bearer {key}" sent "Bearer b'llk_...'" (a 401)."""
    with pytest.raises(ValueError, match="api_key must be a str, not bytes"):
        client_class(URL, SECRET.encode())


@pytest.mark.parametrize("client_class", CLIENTS)
@pytest.mark.parametrize("key", [SECRET, "tml-" + SECRET, "a!~#$%&'*+-.^_`|"])
def test_printable_ascii_keys_are_accepted(client_class: type, key: str) -> None:
    client = client_class(URL, key)
    assert client.settings.api_key == key
    if isinstance(client, LoraloomClient):
        client.close()
    else:
        asyncio.run(client.aclose())


BAD_URLS = [
    ("http://alice:hunter2@127.0.0.1:8000", "holds user info"),
    ("http://alice@127.0.0.1:8000", "holds user info"),
    ("http://127.0.0.1:8000/?tenant=a", "holds a query (?...) or fragment"),
    ("http://127.0.0.1:8000?", "holds a query (?...) or fragment"),
    ("http://127.0.0.1:8000/#top", "holds a query (?...) or fragment"),
]


@pytest.mark.parametrize("client_class", CLIENTS)
@pytest.mark.parametrize(("url", "said"), BAD_URLS, ids=[u for u, _ in BAD_URLS])
def test_a_base_url_with_user_info_a_query_or_a_fragment_is_refused(
    client_class: type, url: str, said: str
) -> None:
    with pytest.raises(ValueError, match="^base_url ") as info:
        client_class(url, SECRET)
    assert said in str(info.value)
    assert "hunter2" not in str(info.value)  # user info may hold a password: not repeated


def _counting_transport(error: Exception) -> tuple[list[httpx.Request], httpx.MockTransport]:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        raise error

    return sent, httpx.MockTransport(handler)


def test_a_local_protocol_error_is_not_retried() -> None:
    """httpx refuses to send the request (here: as h11 refuses an illegal header value): each attempt
    would fail the same way, so the first one raises, where five were made before."""
    sent, transport = _counting_transport(httpx.LocalProtocolError("Illegal header value"))
    with (
        httpx.Client(transport=transport) as http,
        pytest.raises(httpx.LocalProtocolError),
    ):
        send_with_retries(lambda: http.get("http://h/"), NO_WAIT, "GET /")
    assert len(sent) == 1


def test_a_local_protocol_error_is_not_retried_async() -> None:
    sent: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        raise httpx.LocalProtocolError("Illegal header value")

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            await send_with_retries_async(lambda: http.get("http://h/"), NO_WAIT, "GET /")

    with pytest.raises(httpx.LocalProtocolError):
        asyncio.run(go())
    assert len(sent) == 1


def test_a_connection_error_is_still_retried() -> None:
    """The contrast: a transient transport failure keeps its retries."""
    sent, transport = _counting_transport(httpx.ConnectError("refused"))
    with httpx.Client(transport=transport) as http, pytest.raises(RetryExhausted) as info:
        send_with_retries(lambda: http.get("http://h/"), NO_WAIT, "GET /")
    assert len(sent) == 5 and isinstance(info.value.last_error, httpx.ConnectError)


def test_the_client_raises_a_local_protocol_error_at_once() -> None:
    """Through the client: one attempt, not `max_attempts`."""
    sent, transport = _counting_transport(httpx.LocalProtocolError("Illegal header value"))
    with (
        LoraloomClient(URL, SECRET, retry=NO_WAIT, transport=transport) as client,
        pytest.raises(httpx.LocalProtocolError),
    ):
        client.get_run("run_000000000000")
    assert len(sent) == 1
