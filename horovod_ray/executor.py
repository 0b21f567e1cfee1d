"""RayExecutor: one Horovod job on Ray, from placement to teardown."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import cloudpickle
import ray
from ray.util.client import ray as ray_client
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from horovod_ray import network, placement
from horovod_ray._stack import require_gloo
from horovod_ray.errors import (
    ConfigError,
    ExecutorStateError,
    HorovodRayError,
    PlacementTimeoutError,
    RendezvousError,
    StartCancelledError,
    WorkerFailedError,
    _describe_failures,
)
from horovod_ray.lifecycle import FINAL, ExecutorState, Lifecycle
from horovod_ray.ranks import RankInfo, WorkerRecord, assign_ranks
from horovod_ray.rendezvous import ClusterRendezvous, RendezvousServer
from horovod_ray.settings import Settings, WorkerLayout, create_settings
from horovod_ray.worker import FnArg, RemoteWorker

logger = logging.getLogger(__name__)

# Seconds idle workers get to exit on their own at stop() before they are killed.
STOP_GRACE_S = 5.0
# Seconds to wait for Ray to confirm that killed workers are gone.
STOP_CONFIRM_S = 10.0
# How often start()'s waits look whether stop() was called.
CANCEL_POLL_S = 0.1
# Longest stop() waits for a cancelled start() to release what it took.
STOP_CANCEL_S = 30.0
# After a failure, seconds a rank gets to answer a ping before it is taken as lost.
LIVENESS_TIMEOUT_S = 5.0
# After a rank is found lost, seconds before ranks that raised are asked again.
LOST_RECHECK_S = 1.0
# Distinct functions each job keeps unpickled on its ranks (see RayExecutor._fn_arg).
FN_CACHE_SIZE = 256
# Longest a driver-side wait for rank 0's log() dicts lasts before it is renewed.
LOG_POLL_S = 5.0

# Environment variables the executor sets itself; extra_env_vars may not override them.
MANAGED_ENV = frozenset(
    {
        "HOROVOD_RANK",
        "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_LOCAL_SIZE",
        "HOROVOD_CROSS_RANK",
        "HOROVOD_CROSS_SIZE",
        "HOROVOD_HOSTNAME",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR",
        "HOROVOD_GLOO_RENDEZVOUS_PORT",
        "HOROVOD_CONTROLLER",
        "HOROVOD_CPU_OPERATIONS",
        "HOROVOD_GLOO_IFACE",
        "HOROVOD_GLOO_TIMEOUT_SECONDS",
    }
)


@dataclasses.dataclass
class _Runtime:
    """What a running job holds, in world-rank order; published only after start succeeds."""

    workers: list[Any]
    ranks: list[RankInfo]
    nodes: list[dict[str, Any]]
    rendezvous: RendezvousServer | ClusterRendezvous
    group: PlacementGroup | None
    owns_group: bool


class _Resources:
    """What start() has taken so far, so that a failure can give it back in reverse."""

    def __init__(self) -> None:
        self.group: PlacementGroup | None = None
        self.owns_group = False
        self.workers: list[Any] = []
        self.rendezvous: RendezvousServer | ClusterRendezvous | None = None


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
        # Set by stop() while start() runs: start() then gives up at its next wait.
        self._cancel = threading.Event()
        self._lock = threading.RLock()
        self._runtime: _Runtime | None = None
        self._calls_in_flight = 0
        self._call_id = 0
        self._fn_keys: dict[bytes, int] = {}
        # (function key, call id) of the last execute() that completed on every rank.
        self._last_execute: tuple[int, int] | None = None

    # ----------------------------------------------------------------- introspection

    @property
    def state(self) -> ExecutorState:
        """The current lifecycle state."""
        return self._lifecycle.state

    @property
    def num_workers(self) -> int:
        """Number of ranks of the running job."""
        return len(self._running("num_workers").workers)

    @property
    def ranks(self) -> list[RankInfo]:
        """Each rank's identity, in world-rank order."""
        return list(self._running("ranks").ranks)

    @property
    def rendezvous_address(self) -> tuple[str, int]:
        """(host, port) of the job's Gloo rendezvous server."""
        return self._running("rendezvous_address").rendezvous.address

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The placement group the ranks run in."""
        return self._running("placement_group").group

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
        args = _as_tuple("executable_args", executable_args)
        kwargs = _as_kwargs("executable_kwargs", executable_kwargs)
        executable = (
            None
            if executable_cls is None
            else _pickle("executable_cls", (executable_cls, args, kwargs))
        )
        env = _check_env(extra_env_vars)
        require_gloo()
        if not ray.is_initialized():
            raise HorovodRayError(
                "Ray is not initialised: call ray.init() (or ray.init(address=...) for a "
                "cluster) before RayExecutor.start(); horovod_ray.run() does it for you"
            )
        group = placement.current_group(self.layout)
        if group is None:
            self.layout.require_counts()
            plan = placement.plan_new_group(self.layout)
        else:
            plan = placement.plan_existing_group(self.layout, group.bundle_specs)
        if not self._lifecycle.transition([ExecutorState.CREATED], ExecutorState.STARTING):
            raise ExecutorStateError("start() raced with another start() or stop()")

        taken = _Resources()
        try:
            runtime = self._start(plan, group, taken, executable, env)
            self._check_cancel()
        except BaseException as err:
            _release(taken, grace_s=0)
            cancelled = self._cancel.is_set()
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
            self._runtime = runtime
        self._lifecycle.transition([ExecutorState.STARTING], ExecutorState.RUNNING)
        self._log_ranks(runtime)

    def _check_cancel(self) -> None:
        """Raises when stop() was called during start()."""
        if self._cancel.is_set():
            raise StartCancelledError()

    def _wait(self, refs: list[ray.ObjectRef], timeout_s: float) -> list[ray.ObjectRef]:
        """ray.wait for all of ``refs`` that stop() can cut short; returns those not ready."""
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            self._check_cancel()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, pending = ray.wait(
                pending, num_returns=len(pending), timeout=min(left, CANCEL_POLL_S)
            )
        return pending

    def _start(
        self,
        plan: placement.PlacementPlan,
        group: PlacementGroup | None,
        taken: _Resources,
        executable: bytes | None,
        extra_env: dict[str, str],
    ) -> _Runtime:
        timeout_s = self.settings.placement_group_timeout_s
        if plan.bundles:
            group = placement.reserve(plan, timeout_s, check=self._check_cancel)
            taken.group, taken.owns_group = group, True
        else:
            taken.group = group

        for bundle_index in plan.worker_bundles:
            options: dict[str, Any] = {
                "num_cpus": self.layout.cpus_per_worker,
                "num_gpus": self.layout.gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle_index
                ),
            }
            taken.workers.append(RemoteWorker.options(**options).remote())

        # The first answer from each actor also tells us it was scheduled.
        info_refs = [worker.node_info.remote() for worker in taken.workers]
        not_ready = self._wait(info_refs, timeout_s)
        if not_ready:
            raise PlacementTimeoutError(
                f"{len(not_ready)} of {len(info_refs)} workers were not scheduled within "
                f"placement_group_timeout_s={timeout_s:g}s inside the placement group "
                f"(bundles {group.bundle_specs}); give the group more room or fewer workers"
            )
        nodes = _get_all(info_refs, what="report its node")

        infos = assign_ranks([WorkerRecord(n["node_id"], n["gpu_ids"]) for n in nodes])
        order = sorted(range(len(infos)), key=lambda i: infos[i].world_rank)
        workers = [taken.workers[i] for i in order]
        ranks = [infos[i] for i in order]
        nodes = [nodes[i] for i in order]

        # A Ray Client driver is outside the cluster, out of the workers' reach: its
        # rendezvous server then runs on rank 0's node instead of the driver's.
        client = ray_client.is_connected()
        host_ip = nodes[0]["node_ip"] if client else ray.util.get_node_ip_address()
        local_job = all(node["node_ip"] == host_ip for node in nodes)
        # Decided for every node before the rendezvous server starts: a node that cannot
        # take part fails the start with nothing more taken.
        ifaces = [network.gloo_iface(node, self.settings.nics, local_job) for node in nodes]
        network.check_hostnames(nodes, local_job)
        bind_address = "127.0.0.1" if local_job else host_ip
        allowed = {bind_address} | {node["node_ip"] for node in nodes}
        if client:
            rendezvous = ClusterRendezvous(
                nodes[0]["node_id"], bind_address, allowed, self.settings.verbose, timeout_s
            )
        else:
            rendezvous = RendezvousServer(bind_address, allowed, self.settings.verbose)
        taken.rendezvous = rendezvous
        _, port = rendezvous.start(ranks)

        common = {
            # host:port/<secret>: see rendezvous.py for why the secret rides here.
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous.worker_address,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_TIMEOUT_SECONDS": str(math.ceil(self.settings.timeout_s)),
        }
        setups = []
        for worker, rank, iface in zip(workers, ranks, ifaces, strict=True):
            env = {**common, **rank.env(), "HOROVOD_GLOO_IFACE": iface}
            env.update(extra_env)
            setups.append(worker.setup.remote(env, rank.world_rank == 0, executable))
        self._wait(setups, math.inf)
        _get_all(setups, what="set up its environment or build executable_cls", nodes=nodes)
        return _Runtime(workers, ranks, nodes, rendezvous, group, taken.owns_group)

    def _log_ranks(self, runtime: _Runtime) -> None:
        level = logging.INFO if self.settings.verbose >= 1 else logging.DEBUG
        if not logger.isEnabledFor(level):
            return
        lines = ["rank  local  cross  node              ip               gpus"]
        for rank, node in zip(runtime.ranks, runtime.nodes, strict=True):
            lines.append(
                f"{rank.world_rank:>4}  {rank.local_rank:>2}/{rank.local_size:<2}  "
                f"{rank.cross_rank:>2}/{rank.cross_size:<2}  {rank.node_id[:16]:<16}  "
                f"{node['node_ip']:<15}  {','.join(rank.visible_gpus) or '-'}"
            )
        host, port = runtime.rendezvous.address
        logger.log(
            level,
            "Horovod job started: %d ranks, rendezvous %s:%d\n%s",
            len(runtime.ranks),
            host,
            port,
            "\n".join(lines),
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
        payload = _pickle_fn("fn", fn)
        callbacks = _check_callbacks(callbacks)
        runtime = self._running("execute")
        with self._lock:
            fn_arg = self._fn_arg(payload)
            call_id = self._next_call_id()
            key = _key_of(fn_arg)
            repeat = key is not None and self._last_execute == (key, call_id - 1)
        if repeat:
            refs = [w.execute_again.remote() for w in runtime.workers]
        else:
            refs = [w.execute.remote(fn_arg, call_id) for w in runtime.workers]
        results = self._collect(runtime, refs, callbacks, call_id)
        if key is not None:
            with self._lock:
                self._last_execute = (key, call_id)
        return results

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
        payload = _pickle_fn("fn", fn)
        call_args = _pickle_args(_as_tuple("args", args), _as_kwargs("kwargs", kwargs))
        callbacks = _check_callbacks(callbacks)
        runtime = self._running("run")
        call_id = self._next_call_id()
        fn_arg = self._fn_arg(payload)
        refs = [w.run.remote(fn_arg, call_args, call_id) for w in runtime.workers]
        return self._collect(runtime, refs, callbacks, call_id)

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
        payload = _pickle_fn("fn", fn)
        call_args = _pickle_args(_as_tuple("args", args), _as_kwargs("kwargs", kwargs))
        runtime = self._running("run_remote")
        call_id = self._next_call_id()
        fn_arg = self._fn_arg(payload)
        return [w.run.remote(fn_arg, call_args, call_id) for w in runtime.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Runs ``fn(executable)`` on rank 0 only.

        Returns:
            Rank 0's return value (not a list).

        Raises:
            WorkerFailedError: Rank 0 raised or died; the job has been stopped.
        """
        payload = _pickle_fn("fn", fn)
        runtime = self._running("execute_single")
        call_id = self._next_call_id()
        ref = runtime.workers[0].execute.remote(payload, call_id)
        return self._collect(runtime, [ref], [], call_id)[0]

    def _fn_arg(self, payload: bytes) -> FnArg:
        """What to send for a function that goes to every rank.

        A function sent before goes as its small integer key, and the ranks keep what they
        unpickled (docs/benchmarks.rst, "Fixes found by measuring"). The first time it
        goes as (key, payload); past FN_CACHE_SIZE functions, as bare payloads, uncached.

        An execute() that repeats the function of the execute() just before it, with no
        call in between, sends nothing at all (Worker.execute_again): the first argument
        of a Ray actor call is what costs most, about 75 us per rank here (B3).
        """
        with self._lock:
            key = self._fn_keys.get(payload)
            if key is not None:
                return key
            if len(self._fn_keys) >= FN_CACHE_SIZE:
                return payload
            key = self._fn_keys[payload] = len(self._fn_keys) + 1
            return (key, payload)

    def _next_call_id(self) -> int:
        with self._lock:
            self._call_id += 1
            return self._call_id

    def _collect(
        self,
        runtime: _Runtime,
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
            return self._collect_with_logs(runtime, refs, callbacks, call_id)
        except ray.exceptions.RayError:
            self._fail(runtime, refs, time.monotonic() - started)
        except BaseException as err:
            # Ctrl-C on the driver, or a callback raised: the ranks are mid-call and
            # cannot be left half done.
            self._abort(runtime)
            interrupt = _interrupt_in(err)
            if interrupt is not None:
                raise interrupt from None
            raise
        finally:
            with self._lock:
                self._calls_in_flight -= 1

    def _collect_with_logs(
        self,
        runtime: _Runtime,
        refs: list[ray.ObjectRef],
        callbacks: list[Callable[[dict], None]],
        call_id: int,
    ) -> list[Any]:
        rank0 = runtime.workers[0]
        poll = rank0.next_logs.remote(call_id, LOG_POLL_S)
        pending = list(refs)
        while pending:
            ready, _ = ray.wait([poll, *pending], num_returns=1)
            if ready[0] == poll:
                items, finished = ray.get(poll)
                _deliver(callbacks, items)
                poll = rank0.next_logs.remote(call_id, 0 if finished else LOG_POLL_S)
                continue
            pending = [ref for ref in pending if ref != ready[0]]
            ray.get(ready[0])  # raises at once when that rank failed
        # Every rank has returned, so rank 0 has queued all it will log for this call:
        # the poll in flight answers at once, and one more without waiting takes the rest.
        items, finished = ray.get(poll)
        _deliver(callbacks, items)
        if not finished:
            _deliver(callbacks, ray.get(rank0.next_logs.remote(call_id, 0))[0])
        return ray.get(refs)

    def _fail(self, runtime: _Runtime, refs: list[ray.ObjectRef], elapsed_s: float) -> None:
        """Works out which ranks caused a failure, stops the job, and raises.

        A rank that loses a peer fails too, often before Ray reports the peer's death
        (Gloo sees the closed socket first). So every rank is pinged: live ranks answer at
        once, even mid-collective; dead ones fail the ping; ranks on a lost node stay
        silent. Dead and silent ranks are the cause when there are any; otherwise it is
        the ranks that raised. When a node is gone (see _followers), ranks that died on
        other nodes are taken as consequences: horovod may abort a process whose Gloo
        peer vanished.
        """
        # Calls go to ranks 0..len(refs)-1 in order: a ref's index is its world rank.
        raised: dict[int, BaseException] = {}
        lost: dict[int, str] = {}
        unreachable: set[int] = set()
        # What had failed when the first failure was seen: the candidates for the cause.
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            rank, err = refs.index(ref), _error_of(ref)
            if isinstance(err, ray.exceptions.RayActorError):
                _note_lost(rank, err, runtime.nodes[rank], lost, unreachable)
            elif err is not None:
                raised[rank] = err
        n = len(runtime.workers)
        self._find_lost(runtime, [r for r in range(n) if r not in lost], lost, unreachable, refs)
        if lost and len(lost) < n:
            # A lost node's processes do not all die at the same instant: a rank there may
            # still answer, or raise because its peer went first. Ask once more.
            time.sleep(LOST_RECHECK_S)
            self._find_lost(
                runtime, [r for r in range(n) if r not in lost], lost, unreachable, refs
            )
        followers = _followers(runtime.nodes, lost, unreachable)
        for rank in followers:
            del lost[rank]
        for rank in lost:
            raised.pop(rank, None)
        missing = sorted(set(range(len(runtime.workers))) - runtime.rendezvous.joined_ranks())
        self._abort(runtime)
        for ref in refs:
            # Read every outcome, so Ray does not log the rest as unhandled errors.
            _error_of(ref)

        first = next(iter(raised.values()), None)
        # Ranks that joined the rendezvous failed (raised, or crashed: horovod aborts the
        # process on a Gloo timeout) while live ranks never joined: a rendezvous timeout.
        stuck = [rank for rank in missing if rank not in raised and rank not in lost]
        failed = set(raised) | set(lost)
        if stuck and not failed & set(missing) and elapsed_s >= self.settings.timeout_s:
            noun = "rank" if len(stuck) == 1 else "ranks"
            seen = {**{r: _describe(e, runtime.nodes[r]) for r, e in raised.items()}, **lost}
            raise RendezvousError(
                f"{noun} {', '.join(map(str, stuck))} never joined the Gloo rendezvous within "
                f"timeout_s={self.settings.timeout_s:g}s (does every rank call hvd.init()?); "
                f"the job was stopped. The ranks that waited:\n"
                + "\n".join(f"--- rank {r}: {text}" for r, text in sorted(seen.items()))
            ) from first
        if lost:
            failures = dict(lost)
            message = _describe_failures(failures)
            if raised or followers:
                message += (
                    f"\nRanks {', '.join(map(str, sorted(set(raised) | followers)))} failed "
                    f"after losing their peers (not the cause)."
                )
        else:
            failures = {rank: _describe(err, runtime.nodes[rank]) for rank, err in raised.items()}
            message = None
        raise WorkerFailedError(failures, message) from first

    @staticmethod
    def _find_lost(
        runtime: _Runtime,
        ranks: list[int],
        lost: dict[int, str],
        unreachable: set[int],
        refs: list[ray.ObjectRef],
    ) -> None:
        """Adds to ``lost`` those of ``ranks`` whose process died or that stay silent.

        Silent ones, and those Ray calls unavailable, also go into ``unreachable``.
        """
        pings = {rank: runtime.workers[rank].ping.remote() for rank in ranks}
        _, silent = ray.wait(
            list(pings.values()), num_returns=len(pings), timeout=LIVENESS_TIMEOUT_S
        )
        for rank, ping in pings.items():
            node = runtime.nodes[rank]
            # The call's own outcome first: a rank whose call died is lost whatever else.
            outcome = _error_of(refs[rank]) if rank < len(refs) else None
            if isinstance(outcome, ray.exceptions.RayActorError):
                err = outcome
            elif ping in silent:
                lost[rank] = (
                    f"did not answer within {LIVENESS_TIMEOUT_S:g}s on node "
                    f"{node['node_id'][:12]} ({node['node_ip']}): the node was lost or the "
                    f"process hung"
                )
                unreachable.add(rank)
                continue
            elif (err := _error_of(ping)) is None:
                continue
            _note_lost(rank, err, node, lost, unreachable)

    def _abort(self, runtime: _Runtime) -> None:
        """Stops a job whose call did not complete, at once; the executor ends FAILED."""
        if not self._lifecycle.transition([ExecutorState.RUNNING], ExecutorState.STOPPING):
            return
        try:
            _release(runtime, grace_s=0)
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
        with self._lock:
            runtime = self._runtime
            busy = self._calls_in_flight > 0
        if not lifecycle.transition([ExecutorState.RUNNING], ExecutorState.STOPPING):
            return
        try:
            _release(runtime, grace_s=0 if busy else STOP_GRACE_S)
        finally:
            lifecycle.transition([ExecutorState.STOPPING], ExecutorState.STOPPED)
        logger.debug("Horovod job stopped")

    shutdown = stop

    def __enter__(self) -> RayExecutor:
        if self.state is ExecutorState.CREATED:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _running(self, action: str) -> _Runtime:
        with self._lock:
            state, runtime = self.state, self._runtime
        if state is ExecutorState.RUNNING and runtime is not None:
            return runtime
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


def _release(held: _Resources | _Runtime, grace_s: float) -> None:
    """Gives back what a job holds, newest first; never raises for an already-dead part."""
    workers, rendezvous = held.workers, held.rendezvous
    if workers:
        exits = [worker.exit.remote() for worker in workers]
        if grace_s > 0:
            ray.wait(exits, num_returns=len(exits), timeout=grace_s)
        for worker in workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone is fine
                logger.debug("kill of a worker failed", exc_info=True)
        # Returns once Ray has seen every worker die, so the resources are really free.
        ray.wait(exits, num_returns=len(exits), timeout=STOP_CONFIRM_S)
    if rendezvous is not None:
        rendezvous.stop()
    if held.group is not None and held.owns_group:
        ray.util.remove_placement_group(held.group)


def _note_lost(
    rank: int,
    err: BaseException,
    node: Mapping[str, Any],
    lost: dict[int, str],
    unreachable: set[int],
) -> None:
    lost[rank] = _describe(err, node)
    if isinstance(err, ray.exceptions.ActorUnavailableError):
        unreachable.add(rank)


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


def _followers(
    nodes: Sequence[Mapping[str, Any]], lost: Mapping[int, str], unreachable: set[int]
) -> set[int]:
    """The lost ranks that died because another node was lost, not as a cause.

    A node is gone when one of its ranks cannot be reached. Without such proof, a node is
    taken as gone when all of its ranks are lost while some other node still has a live
    rank (Ray reports the ranks of a removed node as dead, not unreachable). Proof wins:
    a node with one rank whose process died, next to an unreachable node, is a rank that
    horovod aborted after losing its peer, not a second lost node. Lost ranks on the
    nodes that are not gone followed. Without a gone node, every lost rank is a cause.
    """
    gone = {nodes[rank]["node_id"] for rank in unreachable}
    if not gone:
        ranks_on: dict[str, list[int]] = {}
        for rank, node in enumerate(nodes):
            ranks_on.setdefault(node["node_id"], []).append(rank)
        gone = {node for node, ranks in ranks_on.items() if all(r in lost for r in ranks)}
        if len(gone) == len(ranks_on):
            gone = set()  # nothing survived: no node to tell apart
    if not gone:
        return set()
    return {rank for rank in lost if nodes[rank]["node_id"] not in gone}


def _key_of(fn_arg: FnArg) -> int | None:
    """The cache key a function travels under, None when it goes uncached."""
    if isinstance(fn_arg, int):
        return fn_arg
    if isinstance(fn_arg, tuple):
        return fn_arg[0]
    return None


def _error_of(ref: ray.ObjectRef) -> BaseException | None:
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        return None
    except ray.exceptions.RayError as err:
        return err
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _describe(err: BaseException, node: Mapping[str, Any]) -> str:
    where = f"on node {node['node_id'][:12]} ({node['node_ip']}, pid {node['pid']})"
    text = _ANSI.sub("", str(err))  # Ray colours its traceback headers
    if isinstance(err, ray.exceptions.RayActorError):
        return f"process died {where}: {text}"
    return f"raised {where}:\n{text}"


def _get_all(
    refs: list[ray.ObjectRef], what: str, nodes: Sequence[Mapping[str, Any]] | None = None
) -> list[Any]:
    try:
        return ray.get(refs)
    except ray.exceptions.RayError as first:
        failures = {}
        for index, ref in enumerate(refs):
            err = _error_of(ref)
            if err is not None:
                where = _describe(err, nodes[index]) if nodes else str(err)
                failures[index] = f"failed to {what}: {where}"
        raise WorkerFailedError(failures) from first


def _deliver(callbacks: Iterable[Callable[[dict], None]], items: Iterable[dict]) -> None:
    for item in items:
        for callback in callbacks:
            callback(item)


def _pickle_fn(name: str, fn: object) -> bytes:
    if not callable(fn):
        raise ConfigError(name, f"{name} must be callable, got {type(fn).__name__} {fn!r}")
    return _pickle(name, fn)


def _pickle_args(args: tuple, kwargs: dict) -> bytes:
    return _pickle("args", (args, kwargs))


def _pickle(name: str, value: object) -> bytes:
    # Pickled once here rather than once per rank by Ray.
    try:
        return cloudpickle.dumps(value)
    except Exception as err:
        raise ConfigError(
            name, f"{name} cannot be pickled to send to the workers: {type(err).__name__}: {err}"
        ) from err


def _as_tuple(name: str, value: Sequence[Any] | None) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(name, f"{name} must be a list or tuple, got {type(value).__name__}")
    return tuple(value)


def _as_kwargs(name: str, value: Mapping[str, Any] | None) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(name, f"{name} must be a dict with str keys, got {value!r}")
    return dict(value)


def _check_env(env: Mapping[str, object] | None) -> dict[str, str]:
    """Checks ``extra_env_vars``; numbers and booleans become ``str(value)``, as upstream."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ConfigError(
            "extra_env_vars", f"extra_env_vars must be a dict of str to str, got {env!r}"
        )
    checked = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise ConfigError(
                "extra_env_vars",
                f"extra_env_vars keys must be variable names, got {key!r}",
            )
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(
                "extra_env_vars",
                f"extra_env_vars values must be str, int, float or bool, got {key!r}: "
                f"{value!r} ({type(value).__name__})",
            )
        if key in MANAGED_ENV:
            raise ConfigError(
                "extra_env_vars",
                f"extra_env_vars may not set {key}: the executor sets it (use "
                f"create_settings for timeouts and interfaces)",
            )
        checked[key] = str(value)
    return checked


def _check_callbacks(callbacks: object) -> list[Callable[[dict], None]]:
    if callbacks is None:
        return []
    if callable(callbacks):
        return [callbacks]
    if not isinstance(callbacks, (list, tuple)) or not all(callable(c) for c in callbacks):
        raise ConfigError("callbacks", f"callbacks must be a list of callables, got {callbacks!r}")
    return list(callbacks)
