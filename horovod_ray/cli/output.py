"""The ranks' lines on the driver, as horovodrun writes them: ``[RANK]<stream>:`` prefixes,
optional timestamps, and ``--output-filename``'s per-rank files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO


def rank_dir_name(rank: int, size: int) -> str:
    """``rank.R``, zero-padded so that the names sort in rank order (as horovodrun)."""
    return f"rank.{rank:0{len(str(size - 1))}d}"


class Output:
    """Writes the ranks' lines with horovodrun's prefixes, to the terminal and to files.

    With ``timestamps``, each line also starts with the time it reached the driver, in
    horovodrun's format (``time.asctime``, local time; its launcher stamps what it reads).
    """

    def __init__(
        self, stdout: IO[str], stderr: IO[str], output_dir: str | None, timestamps: bool = False
    ) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._output_dir = output_dir
        self._timestamps = timestamps
        self._size = 0
        self._files: dict[tuple[int, str], IO[str]] = {}

    def open(self, size: int) -> None:
        """Creates ``DIR/rank.R/{stdout,stderr}`` for every rank, as horovodrun does (an
        elastic job's ranks past ``size`` get theirs when they first write)."""
        self._size = size
        for rank in range(size if self._output_dir is not None else 0):
            if (rank, "stdout") not in self._files:  # a restarted job writes on
                self._open_rank(rank)

    def _open_rank(self, rank: int) -> None:
        folder = Path(self._output_dir, rank_dir_name(rank, max(self._size, rank + 1)))
        folder.mkdir(parents=True, exist_ok=True)
        for stream in self._streams:
            self._files[rank, stream] = open(folder / stream, "w", encoding="utf-8")

    def write(self, rank: int, lines: list[tuple[str, str]]) -> None:
        previous = None
        stamp = time.asctime() if self._timestamps else ""
        if self._output_dir is not None and (rank, "stdout") not in self._files:
            self._open_rank(rank)
        for stream, line in lines:
            if previous is not None and stream != previous:
                # Keep a rank's stdout and stderr in order when both go to one terminal.
                self._flush(rank, previous)
            text = f"{stamp}[{rank}]<{stream}>:{line}"
            self._streams[stream].write(text)
            file = self._files.get((rank, stream))
            if file is not None:
                file.write(text)
            previous = stream
        if previous is not None:
            self._flush(rank, previous)

    def _flush(self, rank: int, stream: str) -> None:
        self._streams[stream].flush()
        file = self._files.get((rank, stream))
        if file is not None:
            file.flush()

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
