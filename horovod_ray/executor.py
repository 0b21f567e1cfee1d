"""RayExecutor: one Horovod job on Ray, its public API and its life.

The executor checks the arguments, owns the lifecycle (``lifecycle``, one writer) and
admits the calls (``lifecycle.CallGate``); a kind of job (``kinds.JobKind``: ``static.StaticJob`` or
``elastic.ElasticJob``) does the rest: placement, bring-up (``bringup``), calls
(``calls``, ``logs``), failures (``failures``) and release.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.util.placement_group import PlacementGroup

from horovod_ray import config
from horovod_ray.data.spec import data_spec
from horovod_ray.errors import (
    ExecutorStateError,
)
from horovod_ray.job import kinds
from horovod_ray.job.attempt import JobAttempt
from horovod_ray.job.layouts import job_layouts, with_old_names
from horovod_ray.job.lifecycle import (
    CallGate,
    Cancel,
    ExecutorState,
    Lifecycle,
)
from horovod_ray.job.restarting import Restarts
from horovod_ray.rank import calls
from horovod_ray.rank.assignment import RankInfo
from horovod_ray.settings import Settings, create_settings, require_settings

logger = logging.getLogger(__name__)

# Seconds idle workers get to exit on their own at stop() before they are killed.
STOP_GRACE_S = 5.0
# Longest stacks() waits for a rank's answer.
STACKS_TIMEOUT_S = 5.0


class RayExecutor:
    """A Horovod job on Ray: placement, one actor per rank, Gloo rendezvous, teardown.

    A drop-in for ``horovod.ray.RayExecutor`` where the names overlap::

        settings = RayExecutor.create_settings(timeout_s=60)
        with RayExecutor(settings, num_workers=2) as executor:
            sizes = executor.run(lambda: __import__("os").environ["HOROVOD_SIZE"])

    Args:
        settings: From :meth:`create_settings`; None uses the defaults.
        num_workers: Number of ranks, packed onto as few nodes as fit.
        num_hosts: Number of nodes, each running ``num_workers_per_host`` ranks (one
            placement bundle per node, strictly spread). Give this or ``num_workers``.
        num_workers_per_host: Ranks per node with ``num_hosts``.
        cpus_per_worker: CPUs each rank reserves.
        use_gpu: Reserve GPUs; each node's ranks then share ``CUDA_VISIBLE_DEVICES``.
        gpus_per_worker: GPUs per rank with ``use_gpu`` (default 1).
        use_current_placement_group: Inside a placement group (a Tune trial, an actor
            placed in one), place the ranks there instead of reserving a new group. Both
            counts may then be omitted: each bundle takes as many ranks as it fits.
        min_workers: Makes the job elastic (``horovod.elastic``): it runs on no fewer
            than this many ranks, shrinking when ranks or nodes are lost and growing when
            room appears. Only ``run()`` works on an elastic job; leave ``num_workers``
            and ``num_hosts`` unset.
        max_workers: The most ranks an elastic job grows to (None: as many as fit).
        reset_limit: Elastic: fail after more than this many resets (None: no limit).
        cooldown_range: Elastic: (low, high) seconds a failed node is kept out, growing
            between the two with each failure (None: a failed node stays out).
        elastic_timeout: Elastic: seconds the job may stay below ``min_workers``
            (default 600).
        discovery_interval_s: Elastic: how often Ray's node table is read for new room
            (default 1; horovod's driver asks every second, so this may only slow it).
        hosts: horovodrun's host list as (host, ranks) pairs, e.g. ``[("10.0.0.1", 2),
            ("10.0.0.2", 2)]``: each host is a Ray node's address or host name (or
            ``"localhost"`` for the driver's node), gets that many ranks, in that order.
            Give it instead of ``num_workers`` and ``num_hosts``.
        override_discovery: Elastic: True (the default) uses every Ray node with room;
            a horovod ``HostDiscovery`` (``horovod.runner.elastic.discovery``) uses only
            the nodes it names (address, host name or node id), with at most the slots
            it gives each (None: as many as fit), asked as often as Ray's node table.
        num_slots: horovod.ray's older name for ``num_workers_per_host`` (alone: one
            host), with a DeprecationWarning.
        cpus_per_slot: The same for ``cpus_per_worker``.
        gpus_per_slot: The same for ``gpus_per_worker``.
        datasets: Ray Data for the ranks (name -> ``ray.data.Dataset``), split over
            them as the job starts; as ``run()``'s (docs/data.rst).
        data_config: A ``ray.train.DataConfig`` or ``horovod_ray.DataConfig``; as
            ``run()``'s.
        max_restarts: Static jobs: when a call (``run``, ``execute``,
            ``execute_single``) fails because a rank raised or died or a node was lost,
            stop the job, start a new one (placed anew, ``executable_cls`` built again)
            after a back-off of 1 s, 2 s, 4 s, ... (at most 60 s), and make the call
            again, up to this many times over the executor's life; as ``run()``'s, whose
            ``get_checkpoint()`` and ``attempt()`` work the same on the ranks. A
            ``start()`` whose ranks fail is tried again the same way.
            ``run_remote``'s futures are not made again.

    Raises:
        ConfigError: A bad argument, before anything is started.
    """

    create_settings = staticmethod(create_settings)

    def __init__(
        self,
        settings: Settings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int | None = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[int, int] | None = None,
        elastic_timeout: float | None = None,
        discovery_interval_s: float | None = None,
        hosts: Sequence[tuple[str, int]] | None = None,
        override_discovery: Any = True,
        *,
        num_slots: int | None = None,
        cpus_per_slot: float | None = None,
        gpus_per_slot: float | None = None,
        datasets: Mapping[str, Any] | None = None,
        data_config: Any = None,
        max_restarts: int = 0,
        scaling_config: Any = None,
        run_config: Any = None,
    ) -> None:
        # Every argument but settings, the data, the restarts and Ray's config objects says
        # what the job is: its layouts check them all.
        arguments = {k: v for k, v in locals().items() if k in _DEFAULTS and k not in _NOT_LAYOUT}
        wanted = config.from_ray(scaling_config, run_config)
        wanted.refuse_beside({**arguments, "max_restarts": max_restarts}, _DEFAULTS)
        arguments.update(wanted.sizing)
        max_restarts = wanted.run.get("max_restarts", max_restarts)
        self.settings = settings = wanted.settings(require_settings(settings))
        self.layout, self.elastic = job_layouts(**with_old_names(arguments))
        self._data = data_spec(datasets, data_config)
        # Its metrics and GCS record, its side of the run's folder, the timeline's request,
        # its datasets' split.
        self._now = JobAttempt(
            settings,
            self.layout,
            self.elastic,
            self._data,
            on_world=lambda size, resets: self._now.sides.telemetry.world(size, resets),
        )
        self._lifecycle = Lifecycle(
            on_change=lambda state: self._now.sides.telemetry.state(state.value)
        )
        self._calls = CallGate(self._lifecycle, self._now.kind)
        # Set by stop() while start() runs: start() then gives up at its next wait.
        self._cancel = Cancel()
        self._restarts = Restarts(
            max_restarts, self.elastic is not None, self._lifecycle, self._cancel
        )

    # ----------------------------------------------------------------- introspection

    @property
    def state(self) -> ExecutorState:
        """The current lifecycle state."""
        return self._lifecycle.state

    @property
    def job_id(self) -> str:
        """The job's id: its metrics' ``job_id`` label and its ``horovod-ray status`` row."""
        return self._now.sides.telemetry.id

    @property
    def num_workers(self) -> int:
        """Number of ranks of the running job."""
        return len(self._calls.held("num_workers").ranks)

    @property
    def ranks(self) -> list[RankInfo]:
        """Each rank's identity, in world-rank order."""
        return self._calls.held("ranks").ranks

    @property
    def rendezvous_address(self) -> tuple[str, int]:
        """(host, port) of the job's Gloo rendezvous server."""
        return self._calls.held("rendezvous_address").rendezvous_address

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The placement group the ranks run in."""
        return self._calls.held("placement_group").placement_group

    def stacks(self, timeout_s: float = STACKS_TIMEOUT_S) -> dict[int, str]:
        """Every rank's Python stacks now (all threads, file:line and function), also
        while a call runs, which it does not disturb: each rank answers on its control
        thread.

        Returns:
            World rank -> its stacks; a rank that does not answer within ``timeout_s``
            gets a line saying so.
        """
        return self._calls.held("stacks").stacks(timeout_s)

    def __repr__(self) -> str:
        return f"RayExecutor(state={self.state.value}, layout={self.layout})"

    # ------------------------------------------------------------------------ start

    def start(
        self,
        executable_cls: Callable[..., Any] | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: Mapping[str, Any] | None = None,
        extra_env_vars: Mapping[str, object] | None = None,
    ) -> None:
        """Reserves resources, starts one actor per rank and the rendezvous server.

        All or nothing: if any step fails, everything taken so far is released and the
        executor ends FAILED (STOPPED when stop() cancelled it). A bad argument, Ray not
        initialised or a horovod without Gloo raise before anything is taken, and the
        executor stays CREATED.

        Args:
            executable_cls: Built on every rank after its environment is set; ``execute``
                passes the instance to its function.
            executable_args: Positional arguments for ``executable_cls``.
            executable_kwargs: Keyword arguments for ``executable_cls``.
            extra_env_vars: More environment variables for every rank; int, float and
                bool values are passed as ``str(value)``.

        Raises:
            ConfigError: A bad argument (nothing was started); or, once the ranks
                reported their nodes, ``nics`` or ``niceness`` that a node cannot take
                (everything taken is released).
            ExecutorStateError: The executor is not newly created.
            HorovodRayError: Ray is not initialised, or horovod lacks Gloo.
            PlacementTimeoutError: Ray could not place the ranks in time.
            WorkerFailedError: ``executable_cls`` raised on some rank.
            CheckpointError: The settings' storage could not be read (nothing was
                started).
        """
        if self.state is not ExecutorState.CREATED:
            raise ExecutorStateError(
                f"start() needs a new executor, this one is {self.state.value}; "
                f"create a new RayExecutor"
            )
        env, executable = kinds.start_inputs(
            executable_cls, executable_args, executable_kwargs, extra_env_vars
        )
        self._restarts.keep(env, executable)
        self._now.prepare(env)
        if not self._lifecycle.transition([ExecutorState.CREATED], ExecutorState.STARTING):
            raise ExecutorStateError("start() raced with another start() or stop()")

        def attempt(number: int) -> None:
            if number:
                self._restart(number)
            else:
                self._restarts.bring_up(self._now, 0, env, executable)
            self._started()

        self._restarts.loop(attempt, self._release_now, start=True)

    def _restart(self, number: int) -> None:
        """Attempt ``number``: a new ``JobAttempt``, the job's from then on."""

        def install(now: JobAttempt) -> None:
            self._now = now
            self._calls.replace(now.kind)

        self._restarts.restart(
            number,
            self._now.sides.telemetry,
            lambda telemetry: JobAttempt(self.settings, self.layout, None, self._data, telemetry),
            install,
        )

    def _started(self) -> None:
        if (message := self._now.kind.started_message()) is not None:
            logger.log(logging.INFO if self.settings.verbose >= 1 else logging.DEBUG, message)

    # ------------------------------------------------------------------------ calls

    def execute(
        self,
        fn: Callable[[Any], Any],
        callbacks: Sequence[Callable[[dict], None]] | None = None,
    ) -> list[Any]:
        """Runs ``fn(executable)`` on every rank.

        Args:
            fn: Called with the rank's ``executable_cls`` instance (None without one).
            callbacks: Called on the driver with each dict rank 0 passes to ``log()``,
                while ``fn`` runs.

        Returns:
            Each rank's return value, in world-rank order.

        Raises:
            WorkerFailedError: A rank raised or died; the job has been stopped.
        """
        call = calls.prepare_execute(fn)
        return self._run_call(call, calls.check_callbacks(callbacks), "execute")

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        callbacks: Sequence[Callable[[dict], None]] | None = None,
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank.

        Args:
            fn: The function; on an elastic job, with ``hvd.elastic.run`` inside.
            args: Positional arguments for ``fn``.
            kwargs: Keyword arguments for ``fn``.
            callbacks: Called on the driver with each dict rank 0 passes to ``log()``,
                while ``fn`` runs; on an elastic job, a callback with an
                ``on_membership`` method (a ``horovod_ray.Callback``) also gets each
                change of membership there.

        Returns:
            Each rank's return value, in world-rank order.

        Raises:
            WorkerFailedError: A rank raised or died; the job has been stopped.
        """
        call = calls.prepare(fn, args, kwargs)
        return self._run_call(call, calls.check_callbacks(callbacks), "run")

    def _run_call(
        self,
        call: calls.Call,
        callbacks: list[Callable[[dict], None]],
        action: str = "run",
    ) -> list[Any]:
        """Runs a call prepared with ``calls.prepare`` on every rank (``run()`` uses it).

        Returns:
            Each rank's return value, in world-rank order.
        """
        return self._in_call(
            action, call, lambda kind, failing: kind.call(call, callbacks, True, failing)
        )

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[ray.ObjectRef]:
        """Starts ``fn(*args, **kwargs)`` on every rank without waiting.

        Returns:
            One ObjectRef per rank, in world-rank order; ``ray.get`` them. Failures surface
            there as Ray errors (use ``run`` for WorkerFailedError and cleanup).
        """
        call = calls.prepare(fn, args, kwargs)
        return self._calls.held("run_remote", call).send(call)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Runs ``fn(executable)`` on rank 0 only.

        Returns:
            Rank 0's return value (not a list).

        Raises:
            WorkerFailedError: Rank 0 raised or died; the job has been stopped.
        """
        call = calls.prepare_execute(fn)
        return self._in_call(
            "execute_single", call, lambda kind, failing: kind.call(call, [], False, failing)
        )[0]

    def _in_call(
        self,
        action: str,
        call: calls.Call,
        body: Callable[[kinds.JobKind, Callable[[], bool]], list[Any]],
    ) -> list[Any]:
        """Admits ``call`` and runs ``body(kind, failing)`` as one call in flight
        (``CallGate.run``): on any failure the job is stopped, ends FAILED, and the error
        is re-raised; or, within ``max_restarts`` (``restarts.attempts``), a new job is
        started and the call made again."""

        def attempt(number: int) -> list[Any]:
            if number > self._restarts.number:
                self._restart(number)
                self._started()
            kind = self._calls.job(action, call, counted=True)
            return self._calls.run(
                action,
                lambda failing: body(kind, failing),
                self._release_now,
                lambda err: self._restarts.again(err, number),
                kind,
            )

        return self._restarts.loop(attempt, self._release_now)

    def _release_now(self) -> None:
        """Releases the attempt that runs, at once (a failed call's, a failed start's)."""
        self._now.release(grace_s=0)

    # ------------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Stops the job: workers (a grace period, then killed), rendezvous, placement.

        Idempotent; safe in any state, including after a failure. During ``start()`` (from
        another thread), makes ``start()`` give up at its next wait, release what it took
        and raise; returns once it has. While another thread stops the job (a stop(), a
        failed call), returns once that has released it. A call in flight raises
        ``ExecutorStateError``.
        """
        self._calls.stop(  # a call in flight is aborted: no grace, no validations waited for
            self._cancel, lambda busy: self._now.release(0 if busy else STOP_GRACE_S, not busy)
        )

    shutdown = stop

    def __enter__(self) -> RayExecutor:
        if self.state is ExecutorState.CREATED:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# RayExecutor's keywords as it defaults them (a config object beside one given refuses it),
# and those that are not the job's layout.
_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(RayExecutor.__init__).parameters.items()
    if name != "self"
}
_NOT_LAYOUT = (
    "settings",
    "datasets",
    "data_config",
    "max_restarts",
    "scaling_config",
    "run_config",
)
