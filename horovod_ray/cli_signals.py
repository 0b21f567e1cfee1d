"""Ctrl-C and SIGTERM for ``horovod-ray run``: the first asks the run to stop (the ranks'
trees are ended, the exit status says which signal), a second interrupts at once."""

from __future__ import annotations

import signal
import threading
from typing import Callable

# The shell's convention for "ended by signal N", which horovodrun's users script against.
SIGNAL_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Signals:
    """Turns the first Ctrl-C or SIGTERM into a request to stop; a second one interrupts.

    While the job starts, the request also calls ``on_signal`` (which stops the executor,
    so that a start waiting for room gives up at once).
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.on_signal: Callable[[], None] | None = None
        self._previous: dict = {}

    def __enter__(self) -> Signals:
        self.install()
        return self

    def install(self) -> None:
        """(Re)installs the handlers: ``ray.init`` puts in its own for SIGTERM."""
        for signum in SIGNAL_STATUS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        if self.on_signal is not None:
            threading.Thread(target=self.on_signal, daemon=True).start()

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
