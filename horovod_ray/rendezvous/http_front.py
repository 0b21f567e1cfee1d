"""The inside of the rendezvous server: horovod's key-value store behind one event loop.

horovod's own server (``horovod.runner.http.http_server``) starts a thread per request.
When a whole job's ranks knock at once, its accept loop waits on each new thread's start
while thousands of rank threads hold the CPUs: at 2048 simulated ranks three quarters of
the accept loop's time went there, and the listen queue held ~2,000 connections. Here one
asyncio loop accepts, parses and answers every request, and a batched read that waits
for its keys is a future, not a parked thread. Only the elastic driver's hooks, which
block on the driver's barrier, get a thread each, as before.

The keys themselves live in ``store.Store``.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import logging
import re
import socket
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from horovod_ray.rendezvous.store import GLOBAL_SCOPE, Store
from horovod_ray.rendezvous.wire import cut_parts, pack_fields, unpack_batch

logger = logging.getLogger("horovod_ray.rendezvous.server")

# Gloo stores short addresses; anything near this size is not a Gloo client.
MAX_BODY_BYTES = 1 << 20
# A batched request carries one ~150-byte address per peer: 16 MiB is ~100k ranks.
MAX_BATCH_BYTES = 16 << 20
# Connections the listening socket queues: as many as the kernel allows
# (net.core.somaxconn, 4096 on current Linux), so that a whole job's ranks may knock at
# once; an unused slot costs nothing. With the stdlib's 5, a 32-rank start lost tens of
# seconds to SYN retransmits.
BACKLOG = socket.SOMAXCONN
# Longest a client may take to send its request line, headers and body.
REQUEST_READ_S = 10.0
# Longest a client may take to send its head: a few hundred bytes that horovod's client
# writes at once. Until the secret in it is checked, a connection holds no more than this.
HEAD_READ_S = 10.0
# The request head's limit. Nothing is read past it before the secret is checked: a
# connection's reader pauses its socket once it holds twice this, so a flood of
# megabyte heads costs each connection tens of kB for an instant (431), not megabytes
# for seconds. Batched bodies, read after the check, still arrive in full.
HEAD_LIMIT_BYTES = 16 << 10
# A source outside the job is answered 403 at once; what it already sent is read (at
# most this much, for at most STRANGER_READ_S) and dropped, so that closing does not reset
# the connection before the 403 is read.
STRANGER_DRAIN_BYTES = 64 << 10
STRANGER_READ_S = 1.0
# Connections served at once; past it a new one is closed unanswered. A whole job's ranks
# knock at once (2048 simulated ones in bench/cases/scale.py) and fit; a flood does not take
# the driver's file descriptors or memory with it.
MAX_CONNECTIONS = 4096
# A refusal is logged at WARNING once per source and reason in this many seconds; the
# next WARNING counts the ones in between.
REFUSAL_LOG_S = 60.0
_PATH = re.compile(r"^/([A-Za-z0-9_.:\-]{1,256})/([A-Za-z0-9_.:\-]{1,256})$")
_BATCH_KEYS = ("_mset", "_mget")
_KNOWN_METHODS = {"GET", "PUT", "DELETE", "POST", "HEAD"}

# (method, scope, key, status, bytes of the answer's body), for each answered request.
Trace = Callable[[str, str, str, int, int], None]


class Hooks(Protocol):
    """Scopes that a job's driver answers itself (horovod's elastic driver)."""

    scopes: frozenset[str]

    def get(self, scope: str, key: str) -> bytes | None:
        """The value for a GET; may block (each call has a thread of its own)."""

    def put(self, scope: str, key: str, value: bytes) -> None:
        """Sees a PUT before the store keeps it; may block."""


_ANSWER = b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"


class Refusals:
    """Logs refused requests without letting a flood of them flood the log: a WARNING
    the first time a (source, reason) is seen in :data:`REFUSAL_LOG_S`, which counts the
    refusals held back since the last one; DEBUG for the rest.

    Args:
        clock: Seconds, monotonic (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # (source, reason) -> (when its last WARNING was logged, refusals held back since)
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def note(self, source: str, reason: str) -> None:
        now = self._clock()
        logged_at, held = self._seen.get((source, reason), (None, 0))
        if logged_at is not None and now - logged_at < REFUSAL_LOG_S:
            self._seen[source, reason] = (logged_at, held + 1)
            logger.debug("rendezvous: refused a request from %s (%s)", source, reason)
            return
        if len(self._seen) > 1024:  # a flood from many sources: forget the old ones
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < REFUSAL_LOG_S}
        self._seen[source, reason] = (now, 0)
        more = f"; {held} more since the last warning" if held else ""
        logger.warning("rendezvous: refused a request from %s (%s)%s", source, reason, more)


class _RefusedError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class HttpFront:
    """Parses one request per connection (horovod's client opens one per request),
    checks it, and answers from the store.

    Args:
        store: The keys.
        path_prefix: ``/<secret>:<port>``, which every request's path must start with.
        allowed_sources: Source addresses let in; replaced whole by :meth:`allow`.
        hooks: Scopes a driver answers itself, or None.
        trace: Called for each answered request, or None.
    """

    def __init__(
        self,
        store: Store,
        path_prefix: str,
        allowed_sources: Iterable[str],
        hooks: Hooks | None = None,
        trace: Trace | None = None,
    ) -> None:
        self.store = store
        self.allowed_sources = frozenset(allowed_sources)
        self.refusals = Refusals()
        self._open = 0  # connections being served; only the loop's thread touches it
        self._prefix = path_prefix.encode()
        self._hooks = hooks
        self._trace = trace

    def allow(self, address: str) -> None:
        self.allowed_sources = self.allowed_sources | {address}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = writer.get_extra_info("peername")[0]
        if self._open >= MAX_CONNECTIONS:
            self.refusals.note(source, f"over {MAX_CONNECTIONS} connections at once")
            writer.transport.abort()
            return
        self._open += 1
        try:
            if source not in self.allowed_sources:
                # Known at accept: a stranger's request is not parsed, only answered.
                self.refusals.note(source, "not a worker node")
                await self._refuse_stranger(reader, writer)
            else:
                await self._serve(reader, writer, source)
        finally:
            self._open -= 1

    async def _refuse_stranger(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            writer.write(_ANSWER % (403, b"Forbidden", 0))
            writer.write_eof()
            await asyncio.wait_for(_drain(reader, STRANGER_DRAIN_BYTES), STRANGER_READ_S)
        except (TimeoutError, OSError, RuntimeError):
            pass
        except asyncio.CancelledError:
            writer.transport.abort()
        finally:
            writer.close()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str
    ) -> None:
        method, scope, key = "", "", ""
        try:
            try:
                method, scope, key, body = await asyncio.wait_for(
                    self._read(reader, source), REQUEST_READ_S
                )
                status, answer = await self._answer(method, scope, key, body)
            except _RefusedError as refused:
                status, answer = refused.status, b""
            except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
                raise
            except Exception as err:  # noqa: BLE001 - a driver hook failed: the client hears 500
                # A stopped elastic run breaks the driver's barrier under every waiting rank.
                broken = isinstance(err, threading.BrokenBarrierError)
                logger.log(
                    logging.DEBUG if broken else logging.WARNING,
                    "rendezvous: %s %s/%s failed",
                    method,
                    scope,
                    key,
                    exc_info=True,
                )
                status, answer = 500, b""
            reason = http.HTTPStatus(status).phrase
            writer.write(_ANSWER % (status, reason.encode(), len(answer)))
            writer.write(answer)
            await writer.drain()
            if self._trace is not None:
                self._trace(method, scope, key, status, len(answer))
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            logger.debug("rendezvous: a request was cut short", exc_info=True)
        except asyncio.CancelledError:
            # The server is stopping: drop the connection now, unsent bytes and all.
            writer.transport.abort()
        finally:
            writer.close()

    @staticmethod
    async def cancel_all() -> None:
        """Ends every request in flight, on this loop, and drops its connection."""
        this = asyncio.current_task()
        while pending := asyncio.all_tasks() - {this}:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        # Closed transports let go of their sockets on the loop's next turns.
        for _ in range(2):
            await asyncio.sleep(0)

    async def _read(self, reader: asyncio.StreamReader, source: str) -> tuple:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_READ_S)
        except asyncio.LimitOverrunError as err:
            self.refusals.note(source, "a request head over the limit")
            raise _RefusedError(431) from err
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            raise _RefusedError(400)
        method = parts[0].decode("latin-1")
        if method not in _KNOWN_METHODS:
            raise _RefusedError(501)
        target = parts[1]
        if not hmac.compare_digest(target[: len(self._prefix)], self._prefix):
            self.refusals.note(source, "without the job secret")
            raise _RefusedError(403)
        match = _PATH.match(target[len(self._prefix) :].decode("latin-1"))
        if match is None:
            raise _RefusedError(400)
        scope, key = match.groups()
        if method == "HEAD" or (method == "POST" and key not in _BATCH_KEYS):
            raise _RefusedError(405)
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = value.strip()
        limit = MAX_BATCH_BYTES if method == "POST" else MAX_BODY_BYTES
        if length is None or not length.isdigit():
            if method in ("PUT", "POST"):
                raise _RefusedError(411)
            return method, scope, key, b""
        if int(length) > limit:
            raise _RefusedError(413)
        return method, scope, key, await reader.readexactly(int(length))

    async def _answer(self, method: str, scope: str, key: str, body: bytes) -> tuple[int, bytes]:
        store = self.store
        hooked = self._hooks is not None and scope in self._hooks.scopes
        if method == "GET":
            value = await _in_thread(self._hooks.get, scope, key) if hooked else None
            value = store.get(scope, key) if value is None else value
            return (404, b"") if value is None else (200, value)
        if method == "PUT":
            if hooked:
                await _in_thread(self._hooks.put, scope, key, body)
            # Noted before the answer: a rank that got its 200 has joined for everyone.
            if scope == GLOBAL_SCOPE and key.isdigit():
                store.note_join(int(key))
            store.put(scope, (key,), (body,))
            return 200, b""
        if method == "DELETE":
            store.delete(scope, key)
            return 200, b""
        try:
            keys, values = unpack_batch(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise _RefusedError(400) from err
        if key == "_mset":
            if len(values) != len(keys):
                raise _RefusedError(400)
            if scope == GLOBAL_SCOPE:
                for name in keys:
                    if name.isdigit():
                        store.note_join(int(name))
            store.put(scope, keys, values)
            return 200, b""
        if len(values) > 1 or (values and len(values[0]) != 8 * len(keys)):
            raise _RefusedError(400)
        found = await store.get_many(scope, keys)
        if found is None:
            return 404, b""
        if values:
            try:
                found = cut_parts(found, values[0])
            except ValueError as err:
                raise _RefusedError(400) from err
        return 200, pack_fields(found)


async def _drain(reader: asyncio.StreamReader, most: int) -> None:
    """Reads and drops what a client sent, up to ``most`` bytes or its end."""
    drained = 0
    while drained < most and (data := await reader.read(4096)):
        drained += len(data)


async def _in_thread(call: Callable[..., Any], *args: Any) -> Any:
    """Runs a call that may block on a thread of its own (a pool could deadlock: the
    elastic driver's barrier holds one call per rank until all ranks have called)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            outcome = (call(*args), None)
        except BaseException as err:  # noqa: BLE001 - handed to the loop
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:  # the server stopped meanwhile: nobody waits for it
            pass

    threading.Thread(target=run, name="horovod_ray-rendezvous-hook", daemon=True).start()
    return await future


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
