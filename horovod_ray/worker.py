"""The Ray actor that hosts one Horovod rank, and ``log()`` for code running inside it.

One actor per rank. Its default concurrency group runs user code one call at a time; a
separate ``control`` group answers the driver's long-poll for ``log()`` dicts and its
liveness pings while user code runs, so progress reaches the driver without waiting for
the call to end and a failure can tell dead ranks from live ones at once.
"""

from __future__ import annotations

import collections
import gc
import os
import socket
import threading
from typing import Any, Callable, Mapping, Union

import cloudpickle
import ray

from horovod_ray._stack import gloo_iface_fixed
from horovod_ray.errors import ConfigError
from horovod_ray.network import hostname_address, interface_holding, local_interfaces

CONTROL_GROUP = "control"

# How a function travels to a rank: a key it has seen, (key, payload) to keep, or a
# payload to use once.
FnArg = Union[int, tuple[int, bytes], bytes]


class _LogChannel:
    """Dicts logged by user code on rank 0, waiting for the driver to collect them.

    Calls are numbered and each dict is tagged with the call that logged it, so a poll for
    call ``n`` never returns what an earlier call left behind (those had no callbacks to
    go to). The poll for call ``n`` returns at once when call ``n`` has finished, so the
    last dicts never wait for the poll to time out.
    """

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._current_call = 0
        self._finished_call = 0

    def begin(self, call_id: int) -> None:
        with self._ready:
            self._current_call = call_id

    def end(self, call_id: int) -> None:
        with self._ready:
            self._finished_call = max(self._finished_call, call_id)
            self._ready.notify_all()

    def put(self, item: dict) -> None:
        with self._ready:
            self._items.append((self._current_call, item))
            self._ready.notify_all()

    def take(self, call_id: int, timeout_s: float) -> tuple[list[dict], bool]:
        with self._ready:
            self._ready.wait_for(
                lambda: (
                    self._finished_call >= call_id or any(tag == call_id for tag, _ in self._items)
                ),
                timeout=timeout_s,
            )
            items = [item for tag, item in self._items if tag == call_id]
            self._items = collections.deque((t, i) for t, i in self._items if t > call_id)
            return items, self._finished_call >= call_id


# Set in a worker process once its rank is known; None in the driver and on other ranks.
_channel: _LogChannel | None = None


def log(metrics: Mapping[str, Any]) -> None:
    """Reports a dict of metrics from inside a worker to the driver's callbacks.

    Only rank 0's dicts are delivered (every rank may call it, so training code needs no
    rank check); they reach each callback given to ``execute``/``run``, in order, while
    the call is still running. Outside a horovod_ray worker this does nothing.

    Args:
        metrics: Picklable values keyed by name, e.g. ``{"epoch": 1, "loss": 0.3}``.

    Raises:
        ConfigError: ``metrics`` is not a mapping.
    """
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            "metrics", f"log() takes a dict such as {{'loss': 0.3}}, got {type(metrics).__name__}"
        )
    post(dict(metrics))


def post(item: object) -> None:
    """Queues ``item`` for the driver if this process is rank 0 of a job, else drops it."""
    channel = _channel
    if channel is not None:
        channel.put(item)


class Worker:
    """Hosts one Horovod rank. Created by the executor; not for direct use."""

    def __init__(self) -> None:
        self._executable: Any = None
        self._functions: dict[int, Callable[..., Any]] = {}
        # The function and call id of the last execute(), for execute_again().
        self._last_execute: tuple[Callable[..., Any], int] | None = None

    def _function(self, fn_arg: FnArg) -> Callable[..., Any]:
        if isinstance(fn_arg, int):
            return self._functions[fn_arg]
        if isinstance(fn_arg, tuple):
            key, payload = fn_arg
            fn = self._functions[key] = cloudpickle.loads(payload)
            return fn
        return cloudpickle.loads(fn_arg)

    def node_info(self) -> dict[str, Any]:
        """Where this worker runs: node id and IP, its GPUs, and network interfaces."""
        context = ray.get_runtime_context()
        node_ip = ray.util.get_node_ip_address()
        interfaces = local_interfaces()
        return {
            "node_id": context.get_node_id(),
            "node_ip": node_ip,
            "node_ip_iface": interface_holding(interfaces, node_ip),
            "loopback_iface": interface_holding(interfaces, "127.0.0.1"),
            "gpu_ids": tuple(str(gpu) for gpu in ray.get_gpu_ids()),
            "interfaces": sorted(interfaces),
            "hostname": socket.gethostname(),
            "hostname_address": hostname_address(),
            "gloo_iface_fixed": gloo_iface_fixed(),
            "pid": os.getpid(),
        }

    def setup(self, env: Mapping[str, str], is_log_rank: bool, executable: bytes | None) -> None:
        """Sets the rank's environment, then builds ``executable_cls`` if one was given.

        One call, so that start() costs a single round trip after placement.
        """
        global _channel
        os.environ.update(env)
        _channel = _LogChannel() if is_log_rank else None
        if executable is not None:
            cls, args, kwargs = cloudpickle.loads(executable)
            self._executable = cls(*args, **kwargs)

    def execute(self, fn_arg: FnArg, call_id: int) -> Any:
        fn = self._function(fn_arg)
        self._last_execute = (fn, call_id)
        return self._call(call_id, fn, self._executable)

    def execute_again(self) -> Any:
        """Runs the last execute()'s function again, as the call after it.

        Sent only when that call completed on every rank and no call came after it (see
        RayExecutor._fn_arg), so every rank has the same function and rank 0's next
        call id is the driver's.
        """
        if self._last_execute is None:
            raise RuntimeError("execute_again() before any execute() on this rank")
        fn, call_id = self._last_execute
        self._last_execute = (fn, call_id + 1)
        return self._call(call_id + 1, fn, self._executable)

    def run(self, fn_arg: FnArg, args_payload: bytes, call_id: int) -> Any:
        fn = self._function(fn_arg)
        args, kwargs = cloudpickle.loads(args_payload)
        return self._call(call_id, fn, *args, **kwargs)

    def _call(self, call_id: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        channel = _channel
        if channel is None:
            return fn(*args, **kwargs)
        channel.begin(call_id)
        try:
            return fn(*args, **kwargs)
        finally:
            channel.end(call_id)

    def exit(self) -> None:
        """Ends this rank's process as ``__ray_terminate__`` does, minus a slow teardown.

        Exit handlers and finalizers run as usual; only the interpreter's last garbage
        collections are skipped (the objects are frozen first). With TensorFlow loaded
        those take about 0.7 CPU-seconds per process, spent after stop() has returned
        (see docs/benchmarks.rst, "Fixes found by measuring").
        """
        gc.disable()
        gc.freeze()
        ray.actor.exit_actor()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> int:
        """Answers at once, even while user code runs: proof that the process is alive."""
        return os.getpid()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def next_logs(self, call_id: int, timeout_s: float) -> tuple[list[dict], bool]:
        """Waits up to ``timeout_s`` for dicts logged during call ``call_id``.

        Returns:
            The dicts queued so far, and whether the call has finished.
        """
        channel = _channel
        if channel is None:
            return [], True
        return channel.take(call_id, timeout_s)


# Two control threads: one may sit in a log long-poll while the other answers a ping.
RemoteWorker = ray.remote(concurrency_groups={CONTROL_GROUP: 2})(Worker)
