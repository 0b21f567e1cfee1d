"""RayExecutor: one Horovod job on Ray, its public API and its life.

The parts: ``lifecycle`` (states and their one writer), ``job`` (start all-or-nothing,
release), ``calls`` and ``logs`` (how calls and rank 0's log dicts travel, both halves),
``failures`` (who failed, decided by a pure function), ``network`` (each node's Gloo
interface), ``rendezvous`` and ``placement``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.util.client import ray as ray_client
from ray.util.placement_group import PlacementGroup

from horovod_ray import calls, elastic, failures, job, logs, placement
from horovod_ray._stack import require_gloo
from horovod_ray.errors import (
    ConfigError,
    ExecutorStateError,
    HorovodRayError,
    StartCancelledError,
)
from horovod_ray.lifecycle import FINAL, ExecutorState, Lifecycle
from horovod_ray.ranks import RankInfo
from horovod_ray.settings import (
    ElasticLayout,
    Settings,
    WorkerLayout,
    check_env,
    create_settings,
)

logger = logging.getLogger(__name__)

# Seconds idle workers get to exit on their own at stop() before they are killed.
STOP_GRACE_S = 5.0
# Longest stop() waits for a cancelled start() to release what it took.
STOP_CANCEL_S = 30.0


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
    ) -> None:
        if settings is None:
            settings = create_settings()
        if not isinstance(settings, Settings):
            raise ConfigError(
                "settings",
                f"settings must come from RayExecutor.create_settings(...), "
                f"got {type(settings).__name__}",
            )
        self.settings = settings
        self.elastic: ElasticLayout | None = None
        elastic_only = {
            "reset_limit": reset_limit,
            "cooldown_range": cooldown_range,
            "elastic_timeout": elastic_timeout,
            "discovery_interval_s": discovery_interval_s,
        }
        if min_workers is None and max_workers is None:
            for name, value in elastic_only.items():
                if value is not None:
                    raise ConfigError(
                        name, f"{name} is for elastic jobs: give min_workers too, or drop it"
                    )
        else:
            if num_workers is not None or num_hosts is not None:
                raise ConfigError(
                    "min_workers",
                    "an elastic job (min_workers/max_workers) sizes itself: leave "
                    "num_workers and num_hosts unset",
                )
            if min_workers is None:
                raise ConfigError(
                    "min_workers", "max_workers needs min_workers (the fewest ranks to run on)"
                )
            self.elastic = ElasticLayout(
                min_workers=min_workers,
                max_workers=max_workers,
                reset_limit=reset_limit,
                cooldown_range=cooldown_range,
                elastic_timeout_s=600 if elastic_timeout is None else elastic_timeout,
                discovery_interval_s=1.0 if discovery_interval_s is None else discovery_interval_s,
            )
            num_workers = min_workers
        self.layout = WorkerLayout(
            num_workers=num_workers,
            num_hosts=num_hosts,
            num_workers_per_host=num_workers_per_host,
            cpus_per_worker=cpus_per_worker,
            use_gpu=use_gpu,
            gpus_per_worker=gpus_per_worker,
            use_current_placement_group=use_current_placement_group,
        )
        if not use_current_placement_group:
            self.layout.require_counts()
        self._lifecycle = Lifecycle()
        # An elastic job's start() keeps what each run() needs; run() holds the live run.
        self._elastic_setup: tuple[dict[str, str], bytes | None] | None = None
        self._elastic_run: elastic.ElasticRun | None = None
        # Set by stop() while start() runs: start() then gives up at its next wait.
        self._cancel = threading.Event()
        self._lock = threading.RLock()
        self._job: job.Job | None = None
        self._dispatcher = calls.Dispatcher()
        self._calls_in_flight = 0

    # ----------------------------------------------------------------- introspection

    @property
    def state(self) -> ExecutorState:
        """The current lifecycle state."""
        return self._lifecycle.state

    @property
    def num_workers(self) -> int:
        """Number of ranks of the running job."""
        return len(self._running("num_workers").members)

    @property
    def ranks(self) -> list[RankInfo]:
        """Each rank's identity, in world-rank order."""
        return [m.rank for m in self._running("ranks").members]

    @property
    def rendezvous_address(self) -> tuple[str, int]:
        """(host, port) of the job's Gloo rendezvous server."""
        return self._running("rendezvous_address").rendezvous.address

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The placement group the ranks run in."""
        return self._running("placement_group").held.group

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
        executor ends FAILED.

        Args:
            executable_cls: Built on every rank after its environment is set; ``execute``
                passes the instance to its function.
            executable_args: Positional arguments for ``executable_cls``.
            executable_kwargs: Keyword arguments for ``executable_cls``.
            extra_env_vars: More environment variables for every rank; int, float and
                bool values are passed as ``str(value)``.

        Raises:
            ConfigError: A bad argument (nothing was started).
            ExecutorStateError: The executor is not newly created.
            HorovodRayError: Ray is not initialised, or horovod lacks Gloo.
            PlacementTimeoutError: Ray could not place the ranks in time.
            WorkerFailedError: ``executable_cls`` raised on some rank.
        """
        if self.state is not ExecutorState.CREATED:
            raise ExecutorStateError(
                f"start() needs a new executor, this one is {self.state.value}; "
                f"create a new RayExecutor"
            )
        if executable_cls is not None and not callable(executable_cls):
            raise ConfigError(
                "executable_cls", f"executable_cls must be a class, got {executable_cls!r}"
            )
        args = calls.as_tuple("executable_args", executable_args)
        kwargs = calls.as_kwargs("executable_kwargs", executable_kwargs)
        executable = (
            None
            if executable_cls is None
            else calls.pickle_value("executable_cls", (executable_cls, args, kwargs))
        )
        env = check_env(extra_env_vars)
        require_gloo()
        if not ray.is_initialized():
            raise HorovodRayError(
                "Ray is not initialised: call ray.init() (or ray.init(address=...) for a "
                "cluster) before RayExecutor.start(); horovod_ray.run() does it for you"
            )
        if self.elastic is not None:
            self._start_elastic(env, executable)
            return
        group = placement.current_group(self.layout)
        if group is None:
            self.layout.require_counts()
            plan = placement.plan_new_group(self.layout)
        else:
            plan = placement.plan_existing_group(self.layout, group.bundle_specs)
        if not self._lifecycle.transition([ExecutorState.CREATED], ExecutorState.STARTING):
            raise ExecutorStateError("start() raced with another start() or stop()")

        held = job.Held()
        try:
            started = job.start(
                self.settings, self.layout, plan, group, executable, env, held, self._check
            )
            self._check()
        except BaseException as err:
            cancelled = self._cancel.is_set()
            try:
                job.release(held, grace_s=0)
            finally:
                final = ExecutorState.STOPPED if cancelled else ExecutorState.FAILED
                self._lifecycle.transition([ExecutorState.STARTING], final)
            interrupt = _interrupt_in(err)
            if interrupt is not None:
                raise interrupt from None
            if cancelled and not isinstance(err, StartCancelledError):
                raise StartCancelledError() from err
            if isinstance(err, HorovodRayError):
                raise
            raise HorovodRayError(f"RayExecutor.start() failed: {err}") from err
        with self._lock:
            self._job = started
        self._lifecycle.transition([ExecutorState.STARTING], ExecutorState.RUNNING)
        self._log_ranks(started)

    def _start_elastic(self, env: dict[str, str], executable: bytes | None) -> None:
        """An elastic job takes nothing at start(): each run() places its own ranks."""
        if ray_client.is_connected():
            raise HorovodRayError(
                "elastic jobs need their driver inside the cluster (horovod's elastic "
                "driver answers the ranks directly), not a Ray Client (ray://) driver; "
                "submit the script with `ray job submit` instead"
            )
        if not self._lifecycle.transition([ExecutorState.CREATED], ExecutorState.STARTING):
            raise ExecutorStateError("start() raced with another start() or stop()")
        self._elastic_setup = (env, executable)
        self._lifecycle.transition([ExecutorState.STARTING], ExecutorState.RUNNING)

    def _check(self) -> None:
        """Raises when stop() was called during start()."""
        if self._cancel.is_set():
            raise StartCancelledError()

    def _log_ranks(self, started: job.Job) -> None:
        level = logging.INFO if self.settings.verbose >= 1 else logging.DEBUG
        if logger.isEnabledFor(level):
            host, port = started.rendezvous.address
            phases = ", ".join(f"{name} {s:.2f}s" for name, s in started.start_s.items())
            logger.log(
                level,
                "Horovod job started (%s), rendezvous %s:%d\n%s",
                phases,
                host,
                port,
                started.table(),
            )

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
        return self.run_call(call, calls.check_callbacks(callbacks), "execute")

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        callbacks: Sequence[Callable[[dict], None]] | None = None,
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank.

        Returns:
            Each rank's return value, in world-rank order.

        Raises:
            WorkerFailedError: A rank raised or died; the job has been stopped.
        """
        call = calls.prepare(fn, args, kwargs)
        return self.run_call(call, calls.check_callbacks(callbacks), "run")

    def run_call(
        self,
        call: calls.Call,
        callbacks: list[Callable[[dict], None]],
        action: str = "run",
    ) -> list[Any]:
        """Runs a call prepared with ``calls.prepare`` on every rank (``run()`` uses it).

        Returns:
            Each rank's return value, in world-rank order.
        """
        if self.elastic is not None:
            return self._run_elastic(call, callbacks, action)
        running = self._running(action)
        message = self._dispatcher.message(call)
        refs = [calls.send(actor, message) for actor in running.actors]
        results = self._collect(running, refs, callbacks, message.call_id)
        self._dispatcher.completed(call, message)
        return results

    def _run_elastic(
        self, call: calls.Call, callbacks: list[Callable[[dict], None]], action: str
    ) -> list[Any]:
        if action != "run" or call.args is None:
            raise ExecutorStateError(
                f"{action} is not available on an elastic job: its ranks exist only while "
                f"run() runs (use run(fn), with hvd.elastic.run inside fn)"
            )
        with self._lock:
            state = self.state
            if state is not ExecutorState.RUNNING or self._elastic_run is not None:
                busy = "another run() is in progress" if state is ExecutorState.RUNNING else ""
                raise ExecutorStateError(
                    f"run needs a running elastic executor, this one is {state.value}"
                    + (f": {busy}" if busy else "")
                )
            env, executable = self._elastic_setup
            current = self._elastic_run = elastic.ElasticRun(
                self.settings, self.elastic, self.layout, env, executable
            )
        try:
            return current.run(call.fn, call.args, callbacks)
        except BaseException as err:
            if self._lifecycle.transition([ExecutorState.RUNNING], ExecutorState.STOPPING):
                self._lifecycle.transition([ExecutorState.STOPPING], ExecutorState.FAILED)
            interrupt = _interrupt_in(err)
            if interrupt is not None:
                raise interrupt from None
            raise
        finally:
            with self._lock:
                self._elastic_run = None

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
        self._refuse_elastic("run_remote")
        running = self._running("run_remote")
        message = self._dispatcher.message(call)
        return [calls.send(actor, message) for actor in running.actors]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Runs ``fn(executable)`` on rank 0 only.

        Returns:
            Rank 0's return value (not a list).

        Raises:
            WorkerFailedError: Rank 0 raised or died; the job has been stopped.
        """
        call = calls.prepare_execute(fn)
        self._refuse_elastic("execute_single")
        running = self._running("execute_single")
        message = self._dispatcher.message(call, all_ranks=False)
        ref = calls.send(running.actors[0], message)
        return self._collect(running, [ref], [], message.call_id)[0]

    def _collect(
        self,
        running: job.Job,
        refs: list[ray.ObjectRef],
        callbacks: list[Callable[[dict], None]],
        call_id: int,
    ) -> list[Any]:
        with self._lock:
            self._calls_in_flight += 1
        started = time.monotonic()
        try:
            if not callbacks:
                # ray.get returns as soon as any of the refs holds an error.
                return ray.get(refs)
            return logs.collect(running.actors[0], refs, callbacks, call_id)
        except ray.exceptions.RayError:
            self._fail(running, refs, time.monotonic() - started)
        except BaseException as err:
            # Ctrl-C on the driver, or a callback raised: the ranks are mid-call and
            # cannot be left half done.
            self._abort(running)
            interrupt = _interrupt_in(err)
            if interrupt is not None:
                raise interrupt from None
            raise
        finally:
            with self._lock:
                self._calls_in_flight -= 1

    def _fail(self, running: job.Job, refs: list[ray.ObjectRef], elapsed_s: float) -> None:
        """Works out who caused a failure (see failures.py), stops the job, and raises."""
        members = running.members
        snapshot, first = failures.probe(
            running.actors,
            [m.node.where for m in members],
            [m.node.node_id for m in members],
            refs,
            running.rendezvous.joined_ranks(),
            elapsed_s,
            self.settings.timeout_s,
        )
        self._abort(running)
        for ref in refs:
            # Read every outcome, so Ray does not log the rest as unhandled errors.
            failures.error_of(ref)
        verdict = failures.attribute(snapshot)
        raise failures.error_for(verdict, self.settings.timeout_s) from first

    def _abort(self, running: job.Job) -> None:
        """Stops a job whose call did not complete, at once; the executor ends FAILED."""
        if not self._lifecycle.transition([ExecutorState.RUNNING], ExecutorState.STOPPING):
            return
        try:
            job.release(running.held, grace_s=0)
        finally:
            self._lifecycle.transition([ExecutorState.STOPPING], ExecutorState.FAILED)

    # ------------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Stops the job: workers (a grace period, then killed), rendezvous, placement.

        Idempotent; safe in any state, including after a failure. During ``start()`` (from
        another thread), makes ``start()`` give up at its next wait, release what it took
        and raise; returns once it has.
        """
        lifecycle = self._lifecycle
        if lifecycle.transition([ExecutorState.CREATED], ExecutorState.STOPPED):
            return
        if lifecycle.state is ExecutorState.STARTING:
            self._cancel.set()
            if not lifecycle.wait_for(FINAL | {ExecutorState.RUNNING}, STOP_CANCEL_S):
                logger.warning("start() did not give up within %gs of stop()", STOP_CANCEL_S)
                return
        if self.elastic is not None:
            self._stop_elastic()
            return
        with self._lock:
            running = self._job
            busy = self._calls_in_flight > 0
        if not lifecycle.transition([ExecutorState.RUNNING], ExecutorState.STOPPING):
            return
        try:
            job.release(running.held, grace_s=0 if busy else STOP_GRACE_S)
        finally:
            lifecycle.transition([ExecutorState.STOPPING], ExecutorState.STOPPED)
        logger.debug("Horovod job stopped")

    def _stop_elastic(self) -> None:
        """An elastic job holds nothing between runs; a run in progress is ended."""
        with self._lock:
            # Under the lock run() checks: no new run can begin once this moved.
            moved = self._lifecycle.transition([ExecutorState.RUNNING], ExecutorState.STOPPING)
            current = self._elastic_run
        try:
            if current is not None:
                current.stop()  # its run() then raises in the caller's thread
                if not current.ended.wait(STOP_CANCEL_S):
                    logger.warning("the elastic run did not end within %gs", STOP_CANCEL_S)
        finally:
            if moved:
                self._lifecycle.transition([ExecutorState.STOPPING], ExecutorState.STOPPED)

    shutdown = stop

    def __enter__(self) -> RayExecutor:
        if self.state is ExecutorState.CREATED:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _refuse_elastic(self, action: str) -> None:
        if self.elastic is not None:
            raise ExecutorStateError(
                f"{action} is not available on an elastic job: its ranks exist only while "
                f"run() runs (use run(fn), with hvd.elastic.run inside fn)"
            )

    def _running(self, action: str) -> job.Job:
        self._refuse_elastic(action)
        with self._lock:
            state, running = self.state, self._job
        if state is ExecutorState.RUNNING and running is not None:
            return running
        if state is ExecutorState.CREATED:
            hint = "call start() first (or use `with RayExecutor(...) as executor:`)"
        elif state is ExecutorState.FAILED:
            hint = "the job failed and was stopped; create a new RayExecutor"
        else:
            hint = "the job was stopped; create a new RayExecutor"
        raise ExecutorStateError(
            f"{action} needs a running executor, this one is {state.value}: {hint}"
        )


# ------------------------------------------------------------------------------ helpers


def _interrupt_in(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind ``err``, if it is one.

    Ctrl-C landing just as a Ray wait returns surfaces as CPython's SystemError
    ("returned a result with an exception set") caused by the KeyboardInterrupt.
    """
    if isinstance(err, KeyboardInterrupt):
        return err
    if isinstance(err, SystemError) and isinstance(err.__cause__, KeyboardInterrupt):
        return err.__cause__
    return None
