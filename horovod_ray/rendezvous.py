"""The job's Gloo rendezvous server: horovod's HTTP key-value store, locked down.

Horovod's Gloo controller finds its peers through an HTTP store
(``horovod.runner.http.http_server``): every rank PUTs its address under a scope
(``global``, ``local_<host>``, ``cross_<local rank>``) and GETs the others'. horovod's own
server listens on every interface and serves anyone. This one, built on the same classes:

* binds one address only (loopback when the whole job is on the driver's node);
* answers only the job's worker nodes (403 to any other source address);
* answers only requests that carry the job's secret, made fresh when the job's server
  starts (403 otherwise). horovod's C++ client builds its URLs as
  ``http://ADDR:PORT/<scope>/<key>``; handing the workers ``ADDR = host:port/<secret>``
  makes every request ``http://host:port/<secret>:PORT/<scope>/<key>``, so the secret
  travels in the path without changing horovod;
* rejects malformed requests (bad paths, missing or oversized bodies) with 4xx;
* remembers which ranks ever joined the global scope, so a stuck start can name the
  missing ranks;
* closes its socket and joins its thread on :meth:`RendezvousServer.stop`.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import threading
from typing import Any, Iterable, Sequence

import ray
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_ray.errors import RendezvousError
from horovod_ray.ranks import RankInfo

logger = logging.getLogger(__name__)

# Longest the driver waits for the in-cluster rendezvous actor to answer a question.
ACTOR_ANSWER_S = 5.0
# Gloo stores short addresses; anything near this size is not a Gloo client.
MAX_BODY_BYTES = 1 << 20
_PATH = re.compile(r"^/([A-Za-z0-9_.:\-]{1,256})/([A-Za-z0-9_.:\-]{1,256})$")
GLOBAL_SCOPE = "global"


class _Handler(RendezvousHandler):
    """Checks source address, path and body before horovod's store logic runs."""

    server: _Server

    def _admit(self, needs_body: bool = False) -> bool:
        source = self.client_address[0]
        if source not in self.server.allowed_sources:
            logger.warning("rendezvous: refused a request from %s (not a worker node)", source)
            self.send_status_code(403)
            return False
        prefix = self.server.path_prefix
        presented = self.path[: len(prefix)]
        if not hmac.compare_digest(presented.encode(), prefix.encode()):
            logger.warning("rendezvous: refused a request from %s without the job secret", source)
            self.send_status_code(403)
            return False
        # From here on horovod's handler sees the plain /<scope>/<key> path.
        self.path = self.path[len(prefix) :]
        if _PATH.match(self.path) is None:
            self.send_status_code(400)
            return False
        if needs_body:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.send_status_code(411)
                return False
            if int(length) > MAX_BODY_BYTES:
                self.send_status_code(413)
                self.close_connection = True
                return False
        return True

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        if self._admit():
            super().do_GET()

    def do_PUT(self) -> None:  # noqa: N802
        if self._admit(needs_body=True):
            scope, key = _PATH.match(self.path).groups()
            # Noted before the answer: a rank that got its 200 has joined for everyone.
            if scope == GLOBAL_SCOPE:
                self.server.note_join(key)
            super().do_PUT()

    def do_DELETE(self) -> None:  # noqa: N802
        if self._admit():
            super().do_DELETE()

    def do_POST(self) -> None:  # noqa: N802
        self.send_status_code(405)

    def do_HEAD(self) -> None:  # noqa: N802
        self.send_status_code(405)

    def send_error(self, code, message=None, explain=None) -> None:
        # Unknown methods and unparsable request lines land here: answer without a body.
        self.send_status_code(code)
        self.close_connection = True


class _Server(RendezvousHTTPServer):
    # Request threads must never keep the driver alive or block stop().
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        allowed_sources: Iterable[str],
        verbose: bool,
        handler: type[_Handler] = _Handler,
    ) -> None:
        super().__init__(address, handler, verbose)
        # Replaced whole (never mutated) when an elastic job's new node is let in.
        self.allowed_sources = frozenset(allowed_sources)
        # Made per server, never at import; only the workers' environment carries it.
        self.secret = secrets.token_urlsafe(32)
        self.path_prefix = f"/{self.secret}:{self.server_address[1]}"
        self.joined_lock = threading.Lock()
        self.joined: set[str] = set()

    def note_join(self, key: str) -> None:
        with self.joined_lock:
            self.joined.add(key)

    def handle_error(self, request, client_address) -> None:
        # A client that hangs up mid-request is not worth a traceback on the driver.
        logger.debug("rendezvous: request from %s failed", client_address, exc_info=True)


class RendezvousServer:
    """One job's rendezvous server.

    Args:
        bind_address: The single address to listen on.
        allowed_sources: Source addresses allowed to talk to it (the workers' node IPs).
        verbose: >= 2 makes horovod's store log every scope change.
    """

    def __init__(
        self,
        bind_address: str,
        allowed_sources: Iterable[str],
        verbose: int = 0,
        store: type[RendezvousHandler] | None = None,
    ):
        self._bind_address = bind_address
        self._allowed = tuple(allowed_sources)
        self._verbose = verbose
        # horovod's store logic: the static one, or the elastic driver's (rank_and_size).
        self._handler = _Handler if store is None else type("_Handler", (_Handler, store), {})
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def worker_address(self) -> str:
        """HOROVOD_GLOO_RENDEZVOUS_ADDR for the workers: ``host:port/<secret>``."""
        host, port = self.address
        return f"{host}:{port}/{self._server.secret}"

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the workers connect to."""
        if self._server is None:
            raise RendezvousError("the rendezvous server is not running")
        host, port = self._server.server_address[:2]
        return host, port

    def start(self, ranks: Sequence[RankInfo]) -> tuple[str, int]:
        """Binds, starts serving, and registers the job's scopes.

        Args:
            ranks: The job's ranks; their scope sizes let the store clear a scope once
                every member has finished with it (so ``hvd.init`` may run again).

        Returns:
            (host, port) it listens on; the workers need :attr:`worker_address` too.

        Raises:
            RendezvousError: The address could not be bound.
        """
        try:
            server = _Server(
                (self._bind_address, 0), self._allowed, self._verbose >= 2, self._handler
            )
        except OSError as err:
            raise RendezvousError(
                f"could not start the rendezvous server on {self._bind_address}: {err}"
            ) from err
        for info in ranks:
            server.scope_size[GLOBAL_SCOPE] = info.world_size
            server.scope_size[f"local_{info.node_id}"] = info.local_size
            server.scope_size[f"cross_{info.local_rank}"] = info.cross_size
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="horovod_ray-rendezvous",
            daemon=True,
        )
        thread.start()
        self._server, self._thread = server, thread
        logger.debug("rendezvous server listening on %s:%d", *self.address)
        return self.address

    def allow(self, address: str) -> None:
        """Lets one more source address in (a node that joined an elastic job)."""
        server = self._server
        if server is not None and address not in server.allowed_sources:
            server.allowed_sources = server.allowed_sources | {address}

    def init(self, host_alloc_plan: Sequence[Any]) -> None:
        """A new world (elastic jobs): clears the store and sets the new scope sizes."""
        if self._server is not None:
            self._server.init(host_alloc_plan)

    def joined_ranks(self) -> set[int]:
        """World ranks that have ever published their address in the global scope."""
        if self._server is None:
            return set()
        with self._server.joined_lock:
            return {int(key) for key in self._server.joined if key.isdigit()}

    def stop(self) -> None:
        """Stops serving and closes the socket. Safe to call more than once."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join()


class _RendezvousHost:
    """Runs a job's RendezvousServer inside the cluster (see ClusterRendezvous)."""

    def __init__(self, bind_address: str, allowed_sources: Sequence[str], verbose: int) -> None:
        self._server = RendezvousServer(bind_address, allowed_sources, verbose)

    def start(self, ranks: Sequence[RankInfo]) -> tuple[tuple[str, int], str]:
        address = self._server.start(ranks)
        return address, self._server.worker_address

    def joined_ranks(self) -> set[int]:
        return self._server.joined_ranks()

    def stop(self) -> None:
        self._server.stop()


class ClusterRendezvous:
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
    """

    def __init__(
        self,
        node_id: str,
        bind_address: str,
        allowed_sources: Iterable[str],
        verbose: int = 0,
        timeout_s: float = 60,
    ) -> None:
        self._node_id = node_id
        self._args = (bind_address, tuple(allowed_sources), verbose)
        self._timeout_s = timeout_s
        self._actor: Any = None
        self._address: tuple[str, int] | None = None
        self._worker_address = ""

    @property
    def worker_address(self) -> str:
        """HOROVOD_GLOO_RENDEZVOUS_ADDR for the workers: ``host:port/<secret>``."""
        if self._address is None:
            raise RendezvousError("the rendezvous server is not running")
        return self._worker_address

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the workers connect to."""
        if self._address is None:
            raise RendezvousError("the rendezvous server is not running")
        return self._address

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
            self._address, self._worker_address = ray.get(
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
