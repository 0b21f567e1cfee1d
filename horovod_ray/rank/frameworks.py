"""Which of horovod's frameworks this process has initialised, and shutting them down.

horovod writes its timeline through a buffered file that only its shutdown flushes whole,
so whoever hands the timeline over (a local run as it ends, rank 0 as its job stops)
shuts horovod down first.
"""

from __future__ import annotations

import sys

_FRAMEWORKS = ("horovod.torch", "horovod.tensorflow")


def running() -> set[str]:
    """The horovod frameworks initialised in this process now."""
    return {
        name
        for name in _FRAMEWORKS
        if name in sys.modules and getattr(sys.modules[name], "is_initialized", lambda: False)()
    }


def shut_down(keep: set[str] = frozenset()) -> None:
    """Shuts down every horovod framework running here but those in ``keep``."""
    for name in running() - set(keep):
        sys.modules[name].shutdown()
