"""The job's Gloo rendezvous server: horovod's HTTP key-value store, locked down.

Horovod's Gloo controller finds its peers through an HTTP store: every rank publishes
its addresses under a scope (``global``, ``local_<host>``, ``cross_<local rank>``) and
reads the others'. horovod's own server (``horovod.runner.http.http_server``) listens on
every interface, serves anyone, and starts a thread per request. This one:

* binds one address only (loopback when the whole job is on the driver's node);
* answers only the job's worker nodes (403 at once to any other source address);
* answers only requests that carry the job's secret, made fresh when the job's server
  starts (403 otherwise). horovod's C++ client builds its URLs as
  ``http://ADDR:PORT/<scope>/<key>``; handing the workers ``ADDR = host:port/<secret>``
  makes every request ``http://host:port/<secret>:PORT/<scope>/<key>``, so the secret
  travels in the path without changing horovod;
* rejects malformed requests (bad paths, missing or oversized bodies) with 4xx, and
  reads no more than a 16 KiB head before the secret is checked; serves at most
  ``MAX_CONNECTIONS`` connections at once, and logs each kind of refusal once a minute
  per source (see http_front.py);
* answers batched requests (``POST <scope>/_mset``, ``POST <scope>/_mget``) for this
  repository's horovod build (patches/horovod-0.28.1-rendezvous-batched.patch): a rank
  publishes all its pair addresses in one request and waits for all of its peers' in
  another, which the server holds until every key is there. Gloo's own sequence polls
  every peer's key every 10 ms and reads every peer's whole address list: O(N^2)
  requests and O(N^3) bytes per scope, against O(N) and O(N^2) here;
* serves from one event loop with the largest listen backlog the kernel allows, so that
  all ranks may connect at once (see http_front.py);
* remembers which ranks ever joined the global scope, so a stuck start can name the
  missing ranks;
* closes its socket and ends its thread on :meth:`RendezvousServer.stop`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
from typing import Any, Iterable, Sequence

from horovod_ray.errors import RendezvousError
from horovod_ray.rank.assignment import RankInfo
from horovod_ray.rendezvous.http_front import (
    BACKLOG,
    HEAD_LIMIT_BYTES,
    MAX_BATCH_BYTES,
    MAX_BODY_BYTES,
    Hooks,
    HttpFront,
    Trace,
)
from horovod_ray.rendezvous.store import GLOBAL_SCOPE, Store, hold_for
from horovod_ray.rendezvous.wire import pack_batch, pack_fields, unpack_batch, unpack_fields

__all__ = [
    "BATCH_ENV",
    "GLOBAL_SCOPE",
    "MAX_BATCH_BYTES",
    "MAX_BODY_BYTES",
    "Hooks",
    "Listening",
    "RendezvousServer",
    "pack_batch",
    "pack_fields",
    "unpack_batch",
    "unpack_fields",
    "worker_env",
]

logger = logging.getLogger(__name__)

# Longest start(), init() and stop() wait for the server's event loop (which may be busy
# for seconds answering thousands of ranks).
LOOP_ANSWER_S = 60.0
# Tells the workers' horovod that this server answers batched requests.
BATCH_ENV = "HOROVOD_GLOO_RENDEZVOUS_BATCH"


def worker_env(server: Listening) -> dict[str, str]:
    """The variables that point a rank's horovod at a started rendezvous server."""
    return {
        # host:port/<secret>: see the module docstring for why the secret rides here.
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": server.worker_address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server.address[1]),
        BATCH_ENV: "1",
    }


def scope_sizes(slots: Iterable[tuple[str, int, int, int, int]]) -> dict[str, int]:
    """Members of each scope the ranks meet in, as horovod's scope names go.

    Args:
        slots: (host, local rank, size, local size, cross size) of each rank.
    """
    sizes = {}
    for host, local_rank, size, local_size, cross_size in slots:
        sizes[GLOBAL_SCOPE] = size
        sizes[f"local_{host}"] = local_size
        sizes[f"cross_{local_rank}"] = cross_size
    return sizes


class Listening:
    """Where the workers reach a started rendezvous server: its (host, port), and the
    secret its requests' paths carry. A server sets both when it starts, and ``_address``
    back to None when it stops."""

    _address: tuple[str, int] | None = None
    _secret = ""

    @property
    def worker_address(self) -> str:
        """HOROVOD_GLOO_RENDEZVOUS_ADDR for the workers: ``host:port/<secret>``."""
        host, port = self.address
        return f"{host}:{port}/{self._secret}"

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the workers connect to."""
        if self._address is None:
            raise RendezvousError("the rendezvous server is not running")
        return self._address


class RendezvousServer(Listening):
    """One job's rendezvous server.

    Args:
        bind_address: The single address to listen on.
        allowed_sources: Source addresses allowed to talk to it (the workers' node IPs).
        verbose: >= 2 logs every scope change at INFO (else DEBUG).
        hooks: Scopes a driver answers itself (an elastic job's driver), or None.
        trace: Called with (method, scope, key, status, answer bytes) for each request
            answered, on the server's thread; for benchmarks and tests.
        gloo_timeout_s: The ranks' Gloo timeout (``timeout_s``): batched reads are held in
            equal parts of it (store.hold_for), so that a rank whose peer never comes fails
            when its timeout ends. None: BATCH_HOLD_S.
    """

    def __init__(
        self,
        bind_address: str,
        allowed_sources: Iterable[str],
        verbose: int = 0,
        hooks: Hooks | None = None,
        trace: Trace | None = None,
        gloo_timeout_s: float | None = None,
    ):
        self._bind_address = bind_address
        self._allowed = tuple(allowed_sources)
        self._hooks = hooks
        self._trace = trace
        self._store = Store(verbose=verbose >= 2, hold_s=hold_for(gloo_timeout_s))
        self._stop_lock = threading.Lock()
        self._front: HttpFront | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listening: asyncio.base_events.Server | None = None

    def start(self, ranks: Sequence[RankInfo]) -> tuple[str, int]:
        """Binds, starts serving, and registers the job's scopes.

        Args:
            ranks: The job's ranks; their scope sizes let the store clear a scope once
                every member has finished with it (so ``hvd.init`` may run again).

        Returns:
            (host, port) it listens on; the workers need :attr:`worker_address` too.

        Raises:
            RendezvousError: The address could not be bound, or the server not started.
        """
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((self._bind_address, 0))
            listener.listen(BACKLOG)
        except OSError as err:
            listener.close()
            raise RendezvousError(
                f"could not start the rendezvous server on {self._bind_address}: {err}"
            ) from err
        host, port = listener.getsockname()[:2]
        # Made per server, never at import; only the workers' environment carries it.
        self._secret = secrets.token_urlsafe(32)
        self._store.register(
            scope_sizes(
                (r.node_id, r.local_rank, r.world_size, r.local_size, r.cross_size) for r in ranks
            )
        )
        front = HttpFront(
            self._store, f"/{self._secret}:{port}", self._allowed, self._hooks, self._trace
        )
        loop = asyncio.new_event_loop()
        ready: dict[str, Any] = {}
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            try:
                ready["server"] = loop.run_until_complete(
                    asyncio.start_server(
                        front.handle, sock=listener, limit=HEAD_LIMIT_BYTES, backlog=BACKLOG
                    )
                )
            except BaseException as err:  # noqa: BLE001 - handed to start()
                ready["error"] = err
                started.set()
                return
            started.set()
            loop.run_forever()

        thread = threading.Thread(target=serve, name="horovod_ray-rendezvous", daemon=True)
        thread.start()
        if not started.wait(LOOP_ANSWER_S) or "error" in ready:
            listener.close()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(LOOP_ANSWER_S)
            if not loop.is_running():
                loop.close()
            raise RendezvousError(
                f"the rendezvous server did not start: {ready.get('error', 'no answer')}"
            )
        self._listening = ready["server"]
        self._front, self._loop, self._thread = front, loop, thread
        self._address = (host, port)
        logger.debug("rendezvous server listening on %s:%d", host, port)
        return self._address

    def allow(self, address: str) -> None:
        """Lets one more source address in (a node that joined an elastic job)."""
        front = self._front
        if front is not None and address not in front.allowed_sources:
            front.allow(address)

    def init(self, host_alloc_plan: Sequence[Any]) -> None:
        """A new world (elastic jobs): clears the store and sets the new scope sizes."""
        sizes = scope_sizes(
            (s.hostname, s.local_rank, s.size, s.local_size, s.cross_size) for s in host_alloc_plan
        )
        self._on_loop(self._store.register, sizes)

    def joined_ranks(self) -> set[int]:
        """World ranks that have ever published their address in the global scope."""
        return self._store.joined()

    def held_reads(self) -> int:
        """Batched reads the server holds now, waiting for their keys."""
        return self._on_loop(self._store.held)

    def _on_loop(self, call, *args):
        """Runs a store call on the server's thread (the store's only writer)."""
        loop = self._loop
        if loop is None:
            return call(*args)

        async def run():
            return call(*args)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(LOOP_ANSWER_S)

    def stop(self) -> None:
        """Stops serving and closes the socket; requests in flight are dropped. Safe to
        call more than once."""
        with self._stop_lock:
            loop, thread, front, listening = self._loop, self._thread, self._front, self._listening
            self._loop = self._thread = self._front = self._listening = self._address = None
        if loop is None:
            return

        async def close() -> None:
            listening.close()
            self._store.release_waiters()
            await front.cancel_all()

        try:
            asyncio.run_coroutine_threadsafe(close(), loop).result(LOOP_ANSWER_S)
        except Exception:  # noqa: BLE001 - the loop is stopped below all the same
            logger.warning("rendezvous server did not close cleanly", exc_info=True)
        finally:
            listening.close()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(LOOP_ANSWER_S)
            if not loop.is_running():
                loop.close()
