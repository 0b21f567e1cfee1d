"""A job's RendezvousServer run in a small actor on a cluster node, for a driver that the
workers cannot reach (Ray Client): same interface as the server, same lock-down."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_ray.errors import RendezvousError
from horovod_ray.rank.assignment import RankInfo
from horovod_ray.rendezvous.server import Listening, RendezvousServer

logger = logging.getLogger("horovod_ray.rendezvous.server")

# Longest the driver waits for the in-cluster rendezvous actor to answer a question.
ACTOR_ANSWER_S = 5.0


class _RendezvousHost:
    """Runs a job's RendezvousServer inside the cluster (see ClusterRendezvous)."""

    def __init__(
        self,
        bind_address: str,
        allowed_sources: Sequence[str],
        verbose: int,
        gloo_timeout_s: float | None,
    ) -> None:
        self._server = RendezvousServer(
            bind_address, allowed_sources, verbose, gloo_timeout_s=gloo_timeout_s
        )

    def start(self, ranks: Sequence[RankInfo]) -> tuple[tuple[str, int], str]:
        """(host, port) and the secret: the last part of the workers' address."""
        address = self._server.start(ranks)
        return address, self._server.worker_address.rpartition("/")[2]

    def joined_ranks(self) -> set[int]:
        return self._server.joined_ranks()

    def stop(self) -> None:
        self._server.stop()


class ClusterRendezvous(Listening):
    """A RendezvousServer that runs in a small actor on a cluster node.

    For a driver outside the cluster (Ray Client), which the workers cannot reach: the
    server then listens on ``node_id``'s address with the same lock-down (one address,
    the job's secret, the workers' nodes only) and closes at :meth:`stop`, which also ends
    the actor. Same interface as :class:`RendezvousServer`.

    Args:
        node_id: The Ray node to run on (rank 0's).
        bind_address: The single address to listen on, on that node.
        allowed_sources: Source addresses allowed to talk to it (the workers' node IPs).
        verbose: >= 2 makes horovod's store log every scope change.
        timeout_s: Longest wait for the actor to start or answer.
        gloo_timeout_s: The ranks' Gloo timeout (see RendezvousServer).
    """

    def __init__(
        self,
        node_id: str,
        bind_address: str,
        allowed_sources: Iterable[str],
        verbose: int = 0,
        timeout_s: float = 60,
        gloo_timeout_s: float | None = None,
    ) -> None:
        self._node_id = node_id
        self._args = (bind_address, tuple(allowed_sources), verbose, gloo_timeout_s)
        self._timeout_s = timeout_s
        self._actor: Any = None

    def start(self, ranks: Sequence[RankInfo]) -> tuple[str, int]:
        """Starts the actor on its node, and the server in it (see RendezvousServer.start).

        Raises:
            RendezvousError: The actor or its server could not start.
        """
        host = ray.remote(_RendezvousHost).options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self._node_id, soft=False),
        )
        self._actor = host.remote(*self._args)
        try:
            self._address, self._secret = ray.get(
                self._actor.start.remote(list(ranks)), timeout=self._timeout_s
            )
        except ray.exceptions.RayTaskError as err:
            cause = err.as_instanceof_cause()
            if isinstance(cause, RendezvousError):
                raise RendezvousError(str(cause).splitlines()[-1]) from err
            raise RendezvousError(f"the rendezvous actor failed to start: {err}") from err
        except ray.exceptions.RayActorError as err:
            raise RendezvousError(
                f"the rendezvous actor on node {self._node_id[:12]} died while starting: {err}"
            ) from err
        except (ray.exceptions.RayError, TimeoutError) as err:
            raise RendezvousError(
                f"the rendezvous actor on node {self._node_id[:12]} did not start within "
                f"{self._timeout_s:g}s: {err}"
            ) from err
        logger.debug("rendezvous server listening on %s:%d (in the cluster)", *self._address)
        return self._address

    def joined_ranks(self) -> set[int] | None:
        """As RendezvousServer.joined_ranks; None when the actor cannot answer."""
        if self._actor is None:
            return None
        try:
            return ray.get(self._actor.joined_ranks.remote(), timeout=ACTOR_ANSWER_S)
        except (ray.exceptions.RayError, TimeoutError):
            return None

    def stop(self) -> None:
        """Closes the server's socket, then ends the actor. Safe to call more than once."""
        actor, self._actor, self._address = self._actor, None, None
        if actor is None:
            return
        try:
            ray.get(actor.stop.remote(), timeout=ACTOR_ANSWER_S)
        except Exception:  # noqa: BLE001 - gone, or the client lost: kill it all the same
            logger.debug("rendezvous actor did not stop cleanly", exc_info=True)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            logger.debug("kill of the rendezvous actor failed", exc_info=True)
