"""The errors horovod_ray raises.

Every error derives from :class:`HorovodRayError`. Errors may cross process boundaries
(a Tune trial, a Ray task), so each one pickles with its arguments and keeps its text.
"""

from __future__ import annotations

import contextlib
import re
import traceback
from types import TracebackType
from typing import Iterator, Mapping

import cloudpickle


class HorovodRayError(Exception):
    """Root of every error raised by horovod_ray."""


class ConfigError(HorovodRayError, ValueError):
    """A parameter has a bad value; raised before any Ray resource is taken.

    Attributes:
        parameter: The name of the offending parameter.
    """

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(message)
        self.parameter = parameter

    def __reduce__(self):
        return (type(self), (self.parameter, str(self)))


class DatasetNotFoundError(HorovodRayError, KeyError):
    """``get_dataset_shard(name)`` named no dataset of the job (a ``KeyError``, as Ray
    Train's; its text reads plainly, not quoted as a key)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PlacementTimeoutError(HorovodRayError, TimeoutError):
    """Ray could not reserve the job's placement group in time."""


class RendezvousError(HorovodRayError):
    """The Gloo rendezvous server could not start, or ranks never joined it."""


class ExecutorStateError(HorovodRayError):
    """A RayExecutor method was called in a state that does not allow it."""


class StartCancelledError(ExecutorStateError):
    """``start()`` gave up because ``stop()`` was called while it ran; all was released."""

    def __init__(
        self,
        message: str = (
            "start() was cancelled: stop() was called while the job was starting; "
            "everything it had taken was released"
        ),
    ) -> None:
        super().__init__(message)


class ElasticLimitError(HorovodRayError, RuntimeError):
    """An elastic job hit one of its limits (too few ranks for too long, too many resets);
    a RuntimeError too, as horovod.ray raised.

    Attributes:
        limit: ``"min_workers"`` or ``"reset_limit"``.
        wanted: Ranks the job needed (``min_workers``).
        available: Ranks the cluster could hold when it gave up.
    """

    def __init__(self, limit: str, wanted: int, available: int, message: str) -> None:
        super().__init__(message)
        self.limit, self.wanted, self.available = limit, wanted, available

    def __reduce__(self):
        return (type(self), (self.limit, self.wanted, self.available, str(self)))


class WorkerFailedError(HorovodRayError, RuntimeError):
    """One or more Horovod ranks raised an exception or died; a RuntimeError too, as
    horovod.ray raised.

    Attributes:
        failures: World rank -> what happened on it: the node and the original error text
            (with its traceback when the rank raised).
    """

    def __init__(self, failures: Mapping[int, str], message: str | None = None) -> None:
        self.failures: dict[int, str] = dict(sorted(failures.items()))
        if message is None:
            message = describe_failures(self.failures)
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.failures, str(self)))


class HangError(WorkerFailedError):
    """Ranks waited in a collective that others never entered, for ``stall_timeout_s``;
    or every rank waited inside one for its peers' data for ``timeout_s`` (Gloo's timeout:
    a network that went silent), and then no rank is missing.

    Attributes:
        missing: The ranks that never reached it (their stacks are in ``failures``).
        waiting: The ranks that waited in it.
        failures: World rank -> where a missing rank was, its Python stacks at that
            moment, and the collectives it did not reach; for a silent network, where
            each rank waited and Gloo's error.
    """

    def __init__(
        self,
        failures: Mapping[int, str],
        message: str | None = None,
        missing: tuple[int, ...] = (),
        waiting: tuple[int, ...] = (),
    ) -> None:
        super().__init__(failures, message)
        self.missing, self.waiting = tuple(missing), tuple(waiting)

    def __reduce__(self):
        return (type(self), (self.failures, str(self), self.missing, self.waiting))


class NodeDrainingError(WorkerFailedError):
    """Ray began draining a node that ranks of a static job run on (a spot node about to
    be preempted, a node taken back): the job was stopped then, not when the node died.
    A static job cannot leave a node; ``run(max_restarts=N)`` starts it again on the
    nodes that stay, and an elastic job leaves such a node at a ``commit()``.

    Attributes:
        failures: World rank -> its node, and the seconds left to the drain's deadline.
    """


class CheckpointError(HorovodRayError):
    """A checkpoint could not be read from or written to the run's storage: the text
    names the path, the action and the filesystem's own error."""


class RankError(HorovodRayError):
    """What a rank's function raised, as the driver receives it: the exception's type,
    message and traceback as text, and the exception itself still pickled.

    The rank sends this in place of its exception, so that reading a failure never
    imports the module that defines it: a TensorFlow error would make the driver import
    TensorFlow (seconds) before it could stop the job and restart it. It is the
    ``__cause__`` of the ``WorkerFailedError`` that names the rank.

    Attributes:
        type_name: The exception's class (``ValueError``, ``module.Class`` outside the
            builtins).
        text: The traceback as the rank printed it, ending in ``Type: message``.
    """

    def __init__(self, type_name: str, text: str, pickled: bytes | None = None) -> None:
        super().__init__(text)
        self.type_name, self.text, self._pickled = type_name, text, pickled

    def __reduce__(self):
        return (type(self), (self.type_name, self.text, self._pickled))

    @classmethod
    def of(cls, err: BaseException, frames: TracebackType | None) -> RankError:
        """``err``, with its traceback from ``frames`` on (the rank's own frames cut)."""
        module, name = type(err).__module__, type(err).__qualname__
        try:
            pickled = cloudpickle.dumps(err)
        except Exception:  # noqa: BLE001 - the text still says what happened
            pickled = None
        return cls(
            name if module == "builtins" else f"{module}.{name}",
            "".join(traceback.format_exception(type(err), err, frames)).rstrip("\n"),
            pickled,
        )

    def original(self) -> BaseException:
        """The exception the rank raised, unpickled here (importing its module).

        Raises:
            HorovodRayError: It could not be pickled on the rank, or cannot be
                unpickled here.
        """
        if self._pickled is None:
            raise HorovodRayError(f"the rank's {self.type_name} could not be pickled")
        try:
            return cloudpickle.loads(self._pickled)
        except Exception as err:
            raise HorovodRayError(
                f"the rank's {self.type_name} cannot be unpickled here: {err}"
            ) from err


def describe_failures(failures: Mapping[int, str]) -> str:
    """The message of a WorkerFailedError: a heading, then each failed rank's text."""
    ranks = ", ".join(str(rank) for rank in failures)
    noun = "rank" if len(failures) == 1 else "ranks"
    lines = [f"Horovod {noun} {ranks} failed; the job was stopped."]
    for rank, what in failures.items():
        lines.append(f"--- rank {rank}: {what}")
    return "\n".join(lines)


def interrupt_in(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind ``err``, if it is one.

    Ctrl-C landing just as a Ray wait returns surfaces as CPython's SystemError
    ("returned a result with an exception set") caused by the KeyboardInterrupt.
    """
    if isinstance(err, KeyboardInterrupt):
        return err
    if isinstance(err, SystemError) and isinstance(err.__cause__, KeyboardInterrupt):
        return err.__cause__
    return None


def start_error(err: BaseException, cancelled: bool) -> BaseException:
    """What a failed start() raises for ``err`` (the cause it chains from)."""
    interrupt = interrupt_in(err)
    if interrupt is not None:
        return interrupt
    if cancelled and not isinstance(err, StartCancelledError):
        return StartCancelledError()
    if isinstance(err, HorovodRayError):
        return err
    return HorovodRayError(f"RayExecutor.start() failed: {err}")


@contextlib.contextmanager
def named_as(names: Mapping[str, str]) -> Iterator[None]:
    """Re-raises a ConfigError from within with its parameter under the caller's name for
    it (``names``: the inner name -> the caller's), so that a front such as ``run()``
    names what its user passed."""
    try:
        yield
    except ConfigError as err:
        name = names.get(err.parameter)
        if name is None:
            raise
        message = re.sub(rf"\b{err.parameter}\b", name, str(err))
        raise ConfigError(name, message) from None
