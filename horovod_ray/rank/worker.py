"""The Ray actor that hosts one Horovod rank.

One actor per rank. Its default concurrency group runs user code one call at a time; a
separate ``control`` group answers the driver's long-poll for ``log()`` dicts and its
liveness pings while user code runs, so progress reaches the driver without waiting for
the call to end and a failure can tell dead ranks from live ones at once. How calls and
logs travel is in ``calls.py`` and ``logs.py``, both halves of each.
"""

from __future__ import annotations

import gc
import os
import socket
import stat
import sys
import threading
import traceback
from typing import Any, Mapping

import cloudpickle
import ray

from horovod_ray.errors import RankError
from horovod_ray.rank import dropped, logs, preemption, priority, report, session, timeline
from horovod_ray.rank import metrics as rank_metrics
from horovod_ray.rank.calls import RankCalls, invoke
from horovod_ray.rank.network import (
    NodeFacts,
    hostname_address,
    interface_holding,
    local_interfaces,
)
from horovod_ray.stack.build import gloo_iface_fixed

CONTROL_GROUP = "control"
# How much of a rank's stderr stderr_tail() reads back.
STDERR_TAIL = 64 * 1024


class Worker:
    """Hosts one Horovod rank. Created by the executor; not for direct use."""

    def __init__(self) -> None:
        self._executable: Any = None
        self._calls = RankCalls()

    def node_info(self) -> NodeFacts:
        """Where this worker runs: node id and IP, its GPUs, and network interfaces."""
        context = ray.get_runtime_context()
        node_ip = ray.util.get_node_ip_address()
        interfaces = local_interfaces()
        fixed = gloo_iface_fixed()
        return NodeFacts(
            node_id=context.get_node_id(),
            node_ip=node_ip,
            node_ip_iface=interface_holding(interfaces, node_ip),
            loopback_iface=interface_holding(interfaces, "127.0.0.1"),
            interfaces=tuple(sorted(interfaces)),
            gpu_ids=tuple(str(gpu) for gpu in ray.get_gpu_ids()),
            hostname=socket.gethostname(),
            # Only a horovod without the fix binds to it (a name lookup can be slow).
            hostname_address=None if fixed else hostname_address(),
            gloo_iface_fixed=fixed,
            pid=os.getpid(),
            niceness=os.nice(0),
            lowest_niceness=priority.own_lowest_allowed(),
        )

    def setup(
        self,
        env: Mapping[str, str],
        is_log_rank: bool,
        executable: bytes | None,
        niceness: int | None,
    ) -> None:
        """Sets the rank's environment and niceness, then builds ``executable_cls``.

        One call, so that start() costs a single round trip after placement. ``niceness``
        None keeps the process's; ``executable`` None builds nothing.
        """
        os.environ.update(env)
        if niceness is not None:
            priority.apply(niceness)
        # The rank's session: each concern below keeps its part in it.
        session.install(session.RankSession(in_actor=True))
        logs.open_channel(is_log_rank)
        timeline.choose()
        preemption.open_folder()
        rank_metrics.start(node=ray.util.get_node_ip_address())
        # Everything the process holds before user code (Ray, this package) lives as long
        # as the process: frozen, it is no longer walked by each full collection. Importing
        # TensorFlow runs about six of them, which then take a third less time (see
        # docs/benchmarks.rst, "A rank's garbage collector skips Ray's objects"). Nothing
        # is pinned that a collection would free: one here found no garbage, measured.
        gc.freeze()
        if executable is not None:
            cls, args, kwargs = cloudpickle.loads(executable)
            self._executable = cls(*args, **kwargs)

    def take_datasets(self, shards: dict[str, Any]) -> None:
        """This rank's iterators over the job's datasets, for ``get_dataset_shard``."""
        from horovod_ray.rank import datasets

        datasets.give(shards)

    def call(
        self,
        call_id: int | tuple[int, int, bool],
        key: int | None,
        fn: bytes | None,
        args: bytes | None,
        as_raised: bool = False,
    ) -> Any:
        """Runs one call (see calls.Message): ``fn(executable)`` or ``fn(*args)``.

        What the function raises goes back as a :class:`RankError`, read on the driver
        without importing the exception's module; ``as_raised`` sends the exception
        itself (``run_remote``: the caller reads the refs and may catch its type).
        ``call_id`` is (id, that of a repeat still on its way, whether it went bare) when
        it was sent after that repeat.
        """
        if isinstance(call_id, tuple):
            call_id, overtaken, bare = call_id
            self._calls.overtook(overtaken, bare)
        function, arguments = self._calls.resolve(call_id, key, fn, args)
        return self._run(call_id, function, arguments, as_raised)

    def again(self, call_id: int, as_raised: bool = False) -> Any:
        """Runs call ``call_id - 1`` again, as ``call_id`` (see calls.Dispatcher)."""
        function, arguments = self._calls.repeat(call_id)
        return self._run(call_id, function, arguments, as_raised)

    def again_next(self) -> Any:
        """:meth:`again` sent with no argument: this rank works out its id (see
        calls.Dispatcher)."""
        return self.again(self._calls.next_repeat_id())

    def _run(self, call_id: int, function: Any, arguments: bytes | None, as_raised: bool) -> Any:
        logs.begin(call_id)
        rank_metrics.call_running(True)
        dropped.drop_reported()  # every rank's last call returned: rank 0 is done with them
        try:
            result = invoke(function, arguments, self._executable)
            report.flush()  # the call's checkpoints are persisted before it returns
            return result
        except Exception as err:
            if as_raised:
                raise
            # From the frame below this one: what ran the function and the function's own.
            raise RankError.of(err, err.__traceback__.tb_next) from None
        finally:
            rank_metrics.call_running(False)
            logs.end(call_id)

    def exit(self) -> None:
        """Ends this rank's process as ``__ray_terminate__`` does, minus a slow teardown.

        Exit handlers and finalizers run as usual; only the interpreter's last garbage
        collections are skipped (the objects are frozen first). With TensorFlow loaded
        those take about 0.7 CPU-seconds per process, spent after stop() has returned
        (see docs/benchmarks.rst, "Fixes found by measuring").
        """
        dropped.drop_reported()
        gc.disable()
        gc.freeze()
        ray.actor.exit_actor()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> int:
        """Answers at once, even while user code runs: proof that the process is alive."""
        return os.getpid()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stacks(self) -> str:
        """This process's Python stacks, every thread but the one answering."""
        return thread_stacks(skip=threading.get_ident())

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stderr_tail(self, size: int = STDERR_TAIL) -> str:
        """The last ``size`` bytes this process wrote to stderr, where that is a file (as
        Ray makes it); "" otherwise. horovod's own warnings and errors go there."""
        path = f"/proc/{os.getpid()}/fd/2"
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                return ""  # a terminal or a pipe: nothing to read back
            with open(path, "rb") as stderr:
                stderr.seek(max(0, os.fstat(stderr.fileno()).st_size - size))
                return stderr.read().decode("utf-8", "replace")
        except OSError:
            return ""

    @ray.method(concurrency_group=CONTROL_GROUP)
    def next_logs(self, call_id: int, timeout_s: float) -> tuple[list[dict], bool]:
        """Waits up to ``timeout_s`` for dicts logged during call ``call_id``.

        Returns:
            The dicts queued so far, and whether the call has finished.
        """
        return logs.take(call_id, timeout_s)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def take_timeline(self) -> bytes | None:
        """horovod's timeline as rank 0 wrote it (``settings.timeline``), for the driver as
        the job stops: horovod is shut down first, so that it is whole (see
        ``timeline.take``); a file of this package's own is removed once read. None: no
        file."""
        return timeline.take()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def finish_uploads(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s``, while user code runs, for the checkpoint uploads this
        process has in flight now to commit (a static job about to be stopped for a drain
        asks rank 0); checkpoints reported meanwhile are not waited for.

        Returns:
            Whether they are done (one that failed counts as done: the upload thread
            commits nothing after it).
        """
        return report.finish_submitted(timeout_s)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def preempt(self, version: int, text: str) -> None:
        """Hands this rank the driver's preemption notice ``version`` (a node of the job
        drains), for ``get_preemption_info()``."""
        preemption.deliver(version, text)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def preemption_state(self) -> tuple[bool, bool]:
        """Whether the function asked for the notice, and whether (rank 0) it committed
        its just-in-time checkpoint."""
        return preemption.state()


def thread_stacks(skip: int | None = None) -> str:
    """Every thread's stack (but ``skip``'s), innermost call last, as tracebacks print."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sorted(sys._current_frames().items()):
        if ident != skip:
            stack = "".join(traceback.format_stack(frame))
            parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    return "\n".join(parts)


# Two control threads: one may sit in a log long-poll while the other answers a ping.
RemoteWorker = ray.remote(concurrency_groups={CONTROL_GROUP: 2})(Worker)
