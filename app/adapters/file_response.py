"""A download served from a file opened before the response starts, whole or one byte range.

Starlette's FileResponse takes a path: it stats the file, sends the headers (Content-Length
included), and only then opens it. A file removed in between (its run deleted, a step uploaded
again) gave a response that announced its length and then closed with no body. An open file is
read whole however its name changes meanwhile: the bytes stay until the last descriptor closes.

A `Range: bytes=…` request gets that part (206), so an interrupted download of a large adapter can
resume (`curl -C -`, download managers) instead of starting over. One range only: a request for
several is answered whole (200), as RFC 9110 §14.2 lets a server do, rather than as multipart. The
range is read from the request when the response is sent, so routes need no parameter for it.
"""

import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import BinaryIO

from fastapi.responses import StreamingResponse
from starlette.concurrency import iterate_in_threadpool
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from app.errors import error_body

_CHUNK = 256 * 1024
_ONE_RANGE = re.compile(r"^bytes=(?P<first>[0-9]{0,19})-(?P<last>[0-9]{0,19})$")
"""A single range (RFC 9110 §14.1.2): `first-last`, `first-` or the suffix `-length`."""


def _chunks(file: BinaryIO, length: int) -> Iterator[bytes]:
    """`length` bytes of `file` from where it stands (fewer only if it is shorter); then closes it."""
    try:
        while length > 0 and (chunk := file.read(min(_CHUNK, length))):
            length -= len(chunk)
            yield chunk
    finally:
        file.close()


class Unsatisfiable(Exception):
    """The range starts past the end of the file (416)."""


def byte_range(header: str, size: int) -> tuple[int, int] | None:
    """The inclusive (first, last) byte of a one-range `Range` header over `size` bytes; None when
    the header is no single byte range (the whole file is sent). Raises `Unsatisfiable`."""
    match = _ONE_RANGE.match(header.replace(" ", "").lower())
    if match is None:
        return None
    first, last = match["first"], match["last"]
    if not first:
        if not last:
            return None  # "bytes=-": no range at all
        suffix = int(last)
        if suffix == 0 or size == 0:
            raise Unsatisfiable
        return max(size - suffix, 0), size - 1
    start = int(first)
    end = size - 1 if not last else min(int(last), size - 1)
    if last and int(last) < start:
        return None  # invalid: ignored, as a header the server does not understand
    if start >= size:
        raise Unsatisfiable
    return start, end


class OpenFileResponse(StreamingResponse):
    """An open file (closed once sent), as an attachment named `filename`: whole, or the one byte
    range a GET asks for (206; 416 when it starts past the end). `If-Range` with anything but this
    response's ETag sends the whole file (the client's part is of another version)."""

    def __init__(
        self,
        file: BinaryIO,
        *,
        media_type: str,
        filename: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        stat = os.fstat(file.fileno())
        self._file = file
        self._offset = file.tell()
        self._size = stat.st_size - self._offset
        # Starlette's FileResponse gives a file without an ETag of its own one of its size and mtime.
        etag = hashlib.md5(f"{stat.st_mtime_ns}-{stat.st_size}".encode(), usedforsecurity=False).hexdigest()
        all_headers = {
            "Content-Length": str(self._size),
            "Content-Disposition": f'attachment; filename="{filename}"',
            "ETag": f'"{etag}"',
            "Accept-Ranges": "bytes",
        } | dict(headers or {})
        super().__init__(_chunks(file, self._size), media_type=media_type, headers=all_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "GET":
            self._answer_range(Headers(scope=scope))
        await super().__call__(scope, receive, send)

    def _answer_range(self, request: Headers) -> None:
        header = request.get("range")
        if header is None:
            return
        if_range = request.get("if-range")
        if if_range is not None and if_range.strip() != self.headers.get("etag"):
            return  # a date, a weak or another tag: the client's part may be of another file
        try:
            wanted = byte_range(header, self._size)
        except Unsatisfiable:
            self._file.close()
            body = json.dumps(
                error_body(
                    "range_not_satisfiable",
                    f"Range {header!r} starts past the end of the {self._size} bytes",
                    details={"size": self._size},
                )
            ).encode()
            self.status_code = 416
            self.headers["content-range"] = f"bytes */{self._size}"
            self.headers["content-type"] = "application/json"
            self.headers["content-length"] = str(len(body))
            del self.headers["content-disposition"]
            self.body_iterator = iterate_in_threadpool(iter([body]))
            return
        if wanted is None:
            return
        first, last = wanted
        self._file.seek(self._offset + first)
        self.status_code = 206
        self.headers["content-range"] = f"bytes {first}-{last}/{self._size}"
        self.headers["content-length"] = str(last - first + 1)
        # The iterator made in __init__ never started: nothing of it holds the file.
        self.body_iterator = iterate_in_threadpool(_chunks(self._file, last - first + 1))
