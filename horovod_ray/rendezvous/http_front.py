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
import contextlib
import hmac
import http
import logging
import re
import socket
import threading
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
STRANGER_READ_S = 1.0
# The request head's limit, and the buffer a connection's reader fills before it pauses
# the socket: a batched body of 4096 ranks (550 kB) then arrives in one go, not in
# 32 kB steps.
STREAM_LIMIT_BYTES = 1 << 20
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
        self._prefix = path_prefix.encode()
        self._hooks = hooks
        self._trace = trace

    def allow(self, address: str) -> None:
        self.allowed_sources = self.allowed_sources | {address}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method, scope, key = "", "", ""
        try:
            source = writer.get_extra_info("peername")[0]
            try:
                # Known at accept: a stranger's request is not parsed, only its head
                # taken off the wire (closing on unread bytes would reset the
                # connection before it read its 403), for a second at the most.
                if source not in self.allowed_sources:
                    logger.warning(
                        "rendezvous: refused a request from %s (not a worker node)", source
                    )
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), STRANGER_READ_S)
                    raise _RefusedError(403)
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
            writer.write(
                b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                % (status, reason.encode(), len(answer))
            )
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
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as err:
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
            logger.warning("rendezvous: refused a request from %s without the job secret", source)
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
