"""A download served from a file opened before the response starts.

Starlette's FileResponse takes a path: it stats the file, sends the headers (Content-Length
included), and only then opens it. A file removed in between (its run deleted, a step uploaded
again) gave a response that announced its length and then closed with no body. An open file is
read whole however its name changes meanwhile: the bytes stay until the last descriptor closes.
"""

import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import BinaryIO

from fastapi.responses import StreamingResponse

_CHUNK = 256 * 1024


def _chunks(file: BinaryIO) -> Iterator[bytes]:
    try:
        while chunk := file.read(_CHUNK):
            yield chunk
    finally:
        file.close()


class OpenFileResponse(StreamingResponse):
    """The whole of an open file (it is closed once sent), as an attachment named `filename`."""

    def __init__(
        self,
        file: BinaryIO,
        *,
        media_type: str,
        filename: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        stat = os.fstat(file.fileno())
        size = stat.st_size - file.tell()
        # Starlette's FileResponse gives a file without an ETag of its own one of its size and mtime.
        etag = hashlib.md5(f"{stat.st_mtime_ns}-{stat.st_size}".encode(), usedforsecurity=False).hexdigest()
        all_headers = {
            "Content-Length": str(size),
            "Content-Disposition": f'attachment; filename="{filename}"',
            "ETag": f'"{etag}"',
        } | dict(headers or {})
        super().__init__(_chunks(file), media_type=media_type, headers=all_headers)
