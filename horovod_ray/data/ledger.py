"""Where an epoch of an ordered split stands: which rows it has left, and how the ranks
share them (pure: no Ray).

An ordered split numbers a dataset's rows 0..N-1 once (Ray Data's order, kept) and hands
them out by number. A split of ``rest`` (ranges of rows the epoch has left, in order) over
``world`` ranks gives each rank the same count, ``q = len(rest) // world``: rank ``r``
takes rows ``r*q`` to ``(r+1)*q`` of ``rest``'s concatenation, and the last
``len(rest) % world`` rows wait. In lockstep every rank has taken the same ``taken`` rows
of its part, so one ledger (rank 0's) says what all have read. When the world changes, or a
job resumes, the rows no rank has taken (each part's tail, and the rows that waited) are
split again over the new world: no row is read twice in an epoch, and none is left out but
the fewer than ``world`` rows that wait in the epoch's last split.

Example: 10 rows on 3 ranks: parts [0, 3), [3, 6), [6, 9); row 9 waits. After 2 rows each,
2 ranks remain: rest [2, 3), [5, 6), [8, 10), 4 rows: rank 0 takes 2 and 5, rank 1 8 and 9.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from horovod_ray.errors import ConfigError

Ranges = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Ledger:
    """One epoch's position.

    Attributes:
        rows: Rows of the dataset (N).
        epoch: The epoch's number, from 0.
        rest: The rows the epoch had left when the current split was made.
        world: The ranks of the current split.
        taken: Rows each rank has taken of its part of that split.
    """

    rows: int
    epoch: int
    rest: Ranges
    world: int
    taken: int = 0

    @property
    def share(self) -> int:
        """Rows each rank's part of the current split holds."""
        return length(self.rest) // self.world

    @property
    def complete(self) -> bool:
        """Whether every rank has read its whole part: the epoch is over."""
        return self.taken >= self.share

    def part(self, rank: int) -> Ranges:
        """The rows of ``rank``'s part it has not taken yet."""
        share = self.share
        return cut(self.rest, rank * share + self.taken, (rank + 1) * share)

    def left(self) -> Ranges:
        """The rows no rank has taken: each part's tail, then the rows that waited."""
        share, total = self.share, length(self.rest)
        pieces: list[tuple[int, int]] = []
        for rank in range(self.world):
            pieces.extend(cut(self.rest, rank * share + self.taken, (rank + 1) * share))
        pieces.extend(cut(self.rest, self.world * share, total))
        return merged(pieces)

    def resplit(self, world: int) -> Ledger:
        """The next pass over ``world`` ranks: what this epoch has left, or, once it is
        over, the whole of the next epoch."""
        if self.complete:
            return Ledger(self.rows, self.epoch + 1, whole(self.rows), world)
        return Ledger(self.rows, self.epoch, self.left(), world)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (JSON) of where the epoch stands; one that is over says the next."""
        ledger = self.resplit(self.world) if self.complete else self
        return {
            "rows": ledger.rows,
            "epoch": ledger.epoch,
            "rest": [list(piece) for piece in ledger.rest],
            "world": ledger.world,
            "taken": ledger.taken,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], rows: int) -> Ledger:
        """The ledger :meth:`as_dict` wrote, for a dataset of ``rows`` rows.

        Raises:
            ConfigError: Not such a dict, or one of a dataset of another size.
        """
        try:
            ledger = cls(
                int(state["rows"]),
                int(state["epoch"]),
                tuple((int(a), int(b)) for a, b in state["rest"]),
                int(state["world"]),
                int(state["taken"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(
                "state", f"load_state_dict takes what state_dict() returned, got {state!r}"
            ) from err
        if ledger.rows != rows:
            raise ConfigError(
                "state",
                f"this position is of a dataset of {ledger.rows} rows, the job's has {rows}: "
                "resume with the same dataset",
            )
        return ledger


def whole(rows: int) -> Ranges:
    return ((0, rows),) if rows else ()


def length(ranges: Ranges) -> int:
    return sum(end - start for start, end in ranges)


def cut(ranges: Ranges, begin: int, end: int) -> Ranges:
    """Rows ``begin`` to ``end`` of the concatenation of ``ranges``, as ranges."""
    pieces, offset = [], 0
    for start, stop in ranges:
        size = stop - start
        low, high = max(begin - offset, 0), min(end - offset, size)
        if low < high:
            pieces.append((start + low, start + high))
        offset += size
    return tuple(pieces)


def merged(pieces: list[tuple[int, int]]) -> Ranges:
    """``pieces`` sorted, with touching ranges joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(p for p in pieces if p[0] < p[1]):
        if out and out[-1][1] >= start:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)
