"""The frames rank 0 writes to each follower's stdin: kind (1 byte), payload length (4 bytes),
payload. The first frame is the worker's config (pickled); then plans (a StepPlan's protobuf
bytes), resets between Execute streams, and a stop."""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import IO, NamedTuple

_HEADER = struct.Struct("<BI")


class Kind(IntEnum):
    CONFIG = 0
    PLAN = 1
    RESET = 2
    STOP = 3


class Frame(NamedTuple):
    kind: Kind
    data: bytes


def encode(kind: Kind, data: bytes) -> bytes:
    return _HEADER.pack(kind, len(data)) + data


def read_frame(stream: IO[bytes]) -> Frame | None:
    """The next frame, or None at end-of-file (rank 0 is gone)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    kind, length = _HEADER.unpack(header)
    data = stream.read(length)
    return Frame(Kind(kind), data) if len(data) == length else None
