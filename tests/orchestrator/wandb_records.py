"""Reading an offline W&B run file (`run-*.wandb`) back, for tests: the LevelDB-log framing that
wandb writes (a 7-byte file header, 32 KiB blocks, records split into FULL/FIRST/MIDDLE/LAST
chunks each with a 7-byte header), then each record as wandb's own protobuf `Record`."""

import json
import struct
import time
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> list[bytes]:
    records, pending, pos = [], b"", HEADER  # the file header: ":W&B", magic, version
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        body = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            records.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            records.append(pending + body)
            pending = b""
        else:  # zero padding at the end
            break
    return records


def history(path: Path) -> list[dict[str, Any]]:
    """Every `log()` row of the run, in order."""
    rows = []
    for raw in _chunks(path.read_bytes()):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
    return rows


def record_types(path: Path) -> list[str]:
    types = []
    for raw in _chunks(path.read_bytes()):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(raw)
        types.append(str(record.WhichOneof("record_type")))
    return types


def wait_until_written(path: Path, timeout_s: float = 60.0) -> None:
    """Wait for the run's `exit` record: `run.finish()` can return before wandb's writer process has
    flushed the file (seen under load: the history rows landed a moment after finish returned)."""
    deadline = time.monotonic() + timeout_s
    while "exit" not in record_types(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} has no exit record after {timeout_s} s: {record_types(path)}")
        time.sleep(0.05)
