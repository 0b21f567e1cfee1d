"""One rank's bring-up, the same path for static and elastic jobs.

    spawn the actor on its node -> node facts -> interface choice -> environment -> setup

A static job walks it for all its ranks at once: each actor goes to its placement-group
bundle, and ranks are numbered (``assignment.assign_ranks``) once every actor has reported
its node. An elastic job walks it once for each slot horovod's driver starts: the actor
is pinned to the slot's node, and the driver numbers the ranks. Everything else is here,
once: the cancellable wait, the rule for a job that stays on the driver's machine, the
environment a rank gets, the kill.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Callable, Hashable, Iterable, Mapping

import ray

from horovod_ray.job.layouts import WorkerLayout
from horovod_ray.rank.assignment import RankInfo, visible_gpus
from horovod_ray.rank.worker import RemoteWorker
from horovod_ray.rendezvous.server import worker_env
from horovod_ray.rendezvous.store import gloo_seconds
from horovod_ray.settings import STALL_SHUTDOWN_ENV, STALL_WARNING_ENV, Settings

logger = logging.getLogger(__name__)

# How often a wait gives its caller a chance to give up.
POLL_S = 0.1
LOOPBACK = "127.0.0.1"
# The largest allreduce (times the ranks but one, in bytes) that horovod's Gloo sends in
# one message to each rank, and the patch's default for it.
EXCHANGE_BYTES_ENV = "HOROVOD_GLOO_EXCHANGE_ALLREDUCE_BYTES"
EXCHANGE_BYTES_DEFAULT = 1 << 20


def spawn(layout: WorkerLayout, strategy: Any) -> Any:
    """Starts one rank's actor where ``strategy`` (a Ray scheduling strategy) puts it."""
    return RemoteWorker.options(
        num_cpus=layout.cpus_per_worker, num_gpus=layout.gpus, scheduling_strategy=strategy
    ).remote()


def wait_all(refs: list[ray.ObjectRef], timeout_s: float, check: Callable[[], None]) -> list:
    """ray.wait for all of ``refs``, calling ``check`` every ~0.1 s; returns those not ready.

    Whatever ``check`` raises ends the wait: stop() cancelling a start, horovod's driver
    letting an elastic slot go.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        check()
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, POLL_S))
    return pending


def get_one(ref: ray.ObjectRef, timeout_s: float, check: Callable[[], None]) -> Any:
    """The value of one actor call, waited for as :func:`wait_all` does.

    Raises:
        TimeoutError: No answer within ``timeout_s``.
    """
    if wait_all([ref], timeout_s, check):
        raise TimeoutError(f"no answer from the worker within {timeout_s:g}s")
    return ray.get(ref)


def is_local(node_ips: Iterable[str], host_ip: str) -> bool:
    """Whether a job stays on the driver's machine: every node it may use has its address.

    Such a job binds its rendezvous and Gloo to loopback, so that nothing leaves the
    machine (a local Ray, simulated nodes). A static job asks it of its ranks' nodes, an
    elastic one of every node with room for a rank (it then stays on that machine).
    """
    ips = set(node_ips)
    return bool(ips) and ips == {host_ip}


def bind_address(local: bool, host_ip: str) -> str:
    """The address the rendezvous server listens on."""
    return LOOPBACK if local else host_ip


def common_env(rendezvous: Any, settings: Settings, elastic: bool) -> dict[str, str]:
    """The variables every rank of a job shares: rendezvous, controller, Gloo timeout,
    the exchange allreduce's limit, stall check (:func:`stall_env`).

    Every rank must take the same path for an allreduce of a given size, or the ranks wait
    on each other until Gloo's timeout: the exchange allreduce's limit
    (patches/horovod-0.28.1-gloo-exchange-allreduce.patch) is the driver's, or horovod's
    default, on every rank, never what a node's environment gives its processes (a host
    that joins an elastic job late, started without it).
    """
    env = {
        **worker_env(rendezvous),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(gloo_seconds(settings.timeout_s)),
        EXCHANGE_BYTES_ENV: os.environ.get(EXCHANGE_BYTES_ENV, str(EXCHANGE_BYTES_DEFAULT)),
        **stall_env(settings.stall_timeout_s),
    }
    if elastic:
        env["HOROVOD_ELASTIC"] = "1"
    return env


def stall_env(stall_timeout_s: float) -> dict[str, str]:
    """horovod's stall inspector set to shut the job down after ``stall_timeout_s``.

    It looks every warning period, so a stall is found within the timeout plus one
    period: a tenth of the timeout, at least 1 s and at most horovod's own 60 s (whose
    warnings it then keeps). Nothing for 0 (horovod's defaults: warnings, no shutdown).
    """
    if not stall_timeout_s:
        return {}
    period = min(60, max(1, math.ceil(stall_timeout_s / 10)))
    return {
        STALL_WARNING_ENV: str(period),
        STALL_SHUTDOWN_ENV: str(max(period, math.ceil(stall_timeout_s))),
    }


def rank_env(
    rank: RankInfo, common: Mapping[str, str], iface: str, extra: Mapping[str, str]
) -> dict[str, str]:
    """One rank's whole environment: shared part, identity (GPUs too), interface, extras.

    As horovodrun (and horovod.ray), NCCL's sockets use Gloo's interface unless the
    extras name others.
    """
    nics = {"HOROVOD_GLOO_IFACE": iface, "NCCL_SOCKET_IFNAME": iface}
    return {**common, **rank.env(), **nics, **extra}


def setup(
    actor: Any,
    env: Mapping[str, str],
    rank: RankInfo,
    executable: bytes | None,
    niceness: int | None,
):
    """Starts the actor's setup: environment, niceness, log channel, ``executable_cls``."""
    return actor.setup.remote(dict(env), rank.world_rank == 0, executable, niceness)


def kill(actors: Iterable[Any]) -> None:
    """Kills actors at once; one already gone is fine."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone is fine
            logger.debug("kill of a worker failed", exc_info=True)


class NodeGpus:
    """The GPUs of each node's live ranks, for ranks that start one by one (elastic).

    Every rank sees all the GPUs of its node's ranks in ``CUDA_VISIBLE_DEVICES`` (peers'
    GPUs too, as in a static job), so that horovod's idiom ``gpus[hvd.local_rank()]``
    works. An elastic slot knows its local rank and its node's local size from horovod's
    driver but starts alone: it adds its GPUs here and waits until the node has that
    many live ranks. Its own GPU then goes at index ``local_rank`` of its list: ranks
    that join survivors after a reset (whose lists were fixed when they started) still
    each take a GPU of their own.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._gpus: dict[str, dict[Hashable, tuple[str, ...]]] = {}

    def add(self, node_id: str, key: Hashable, gpu_ids: tuple[str, ...]) -> None:
        with self._changed:
            self._gpus.setdefault(node_id, {})[key] = gpu_ids
            self._changed.notify_all()

    def remove(self, node_id: str, key: Hashable) -> None:
        with self._changed:
            self._gpus.get(node_id, {}).pop(key, None)

    def visible(
        self,
        node_id: str,
        key: Hashable,
        local_rank: int,
        local_size: int,
        timeout_s: float,
        check: Callable[[], None],
    ) -> tuple[str, ...]:
        """The GPUs rank ``key`` sees once ``local_size`` ranks of its node are here (or
        ``timeout_s`` passed: then those that are): the others' sorted, its own at index
        ``local_rank``. ``check`` is called as :func:`wait_all` calls it."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            ranks = self._gpus.setdefault(node_id, {})
            while len(ranks) < local_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                check()
                self._changed.wait(min(left, POLL_S))
            own = ranks.get(key, ())
            others = visible_gpus(ids for k, ids in ranks.items() if k != key)
            others = tuple(gpu for gpu in others if gpu not in own)
            at = min(local_rank, len(others))
            return (*others[:at], *own, *others[at:])
