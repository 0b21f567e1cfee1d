"""The rendezvous server's batched bodies, as this repository's horovod build packs them.

A body is a 4-byte big-endian count, the fields' lengths (4 bytes big-endian each), then
the fields' bytes. A batched request's first field is its keys, newline-separated;
``_mset`` then has one field per value, ``_mget`` optionally one field of (part, parts)
pairs that has the server cut each value (patches/horovod-0.28.1-rendezvous-batched.patch
holds the C++ half: ``PackBatch`` and ``UnpackFields`` in horovod's ``http_store.cc``).
"""

from __future__ import annotations

import itertools
import struct
from typing import Sequence


def pack_fields(fields: Sequence[bytes]) -> bytes:
    """Batched bodies: a 4-byte big-endian count, the fields' lengths (4 bytes each),
    then the fields' bytes; both ends pack and unpack them without a step per field in
    Python (a 4096-rank scope moves 16M fields)."""
    return struct.pack(f">I{len(fields)}I", len(fields), *map(len, fields)) + b"".join(fields)


def unpack_fields(body: bytes) -> list[bytes]:
    """The fields of a batched body.

    Raises:
        ValueError: The body is truncated or longer than its fields.
    """
    if len(body) < 4:
        raise ValueError("truncated field count")
    (count,) = struct.unpack_from(">I", body)
    start = 4 * (count + 1)
    if len(body) < start:
        raise ValueError("truncated field lengths")
    ends = list(itertools.accumulate(struct.unpack_from(f">{count}I", body, 4), initial=start))
    if ends[-1] != len(body):
        raise ValueError(f"truncated fields: {ends[-1]} bytes announced, {len(body)} sent")
    return [body[a:b] for a, b in itertools.pairwise(ends)]


def pack_batch(keys: Sequence[str], values: Sequence[bytes] = ()) -> bytes:
    """A batched request: the keys, newline-separated, as the first field; then values."""
    return pack_fields(["\n".join(keys).encode("ascii"), *values])


def unpack_batch(body: bytes) -> tuple[list[str], list[bytes]]:
    """(keys, values) of a batched request.

    Raises:
        ValueError: The body is malformed.
    """
    fields = unpack_fields(body)
    if not fields:
        raise ValueError("no key field")
    keys = fields[0].decode("ascii").split("\n") if fields[0] else []
    return keys, fields[1:]


def cut_parts(values: Sequence[bytes], cuts: bytes) -> list[bytes]:
    """Part ``k`` of ``n`` equal parts of each value, for (k, n) pairs packed as 4-byte
    big-endian numbers; ``n == 0`` keeps the value whole. A rank reads only the address
    each peer published for it, not the peer's whole list: O(N^2) bytes, not O(N^3).

    Raises:
        ValueError: A value does not split into its ``n`` parts, or ``k >= n``.
    """
    spec = struct.unpack(f">{2 * len(values)}I", cuts)
    parts = []
    for value, part, count in zip(values, spec[0::2], spec[1::2], strict=True):
        if count:
            size, rest = divmod(len(value), count)
            if rest or part >= count:
                raise ValueError(f"cannot take part {part} of {count} of {len(value)} bytes")
            value = value[part * size : (part + 1) * size]
        parts.append(value)
    return parts
