"""The local Ray that ``run()`` and ``horovod-ray run`` start when none is running, and
joining a cluster that runs already (:func:`join`).

Only what a one-off job needs, and a faster stop: see docs/benchmarks.rst, B8.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

import ray

from horovod_ray import worker_output

logger = logging.getLogger(__name__)

# Without the dashboard (about 0.7 s of Ray's start). A user who wants it, or Ray's state
# API, calls ray.init() before horovod_ray does. Workers at niceness 0, as horovodrun's
# ranks run, not Ray's default 15: a rank at 15 loses the CPU to anything else on the
# machine, Ray's own daemons included (docs/benchmarks.rst, "Rank priority").
OPTIONS: dict[str, Any] = {"include_dashboard": False, "_system_config": {"worker_niceness": 0}}
# Whether start() ran in this process: only then does the exit hook below act.
_started = False


def start(**options: Any) -> None:
    """Starts a new local Ray instance (never joins one already on the machine), its
    workers at normal priority.

    It is stopped when the interpreter exits, as for any ``ray.init()``, but sooner:
    the autoscaler monitor is stopped first (a second shorter), and instead of Ray's
    fixed 0.5 s sleep for the workers' last lines, the exit waits until they have
    arrived (see :mod:`horovod_ray.worker_output`). That exit hook is the process's: it
    also serves a local Ray started later by a plain ``ray.init()``.
    """
    global _started
    ray.init(address="local", **{**OPTIONS, **options})
    _started = True


def join(address: str | None = None, **options: Any) -> None:
    """Joins the cluster at ``address`` (None: ``RAY_ADDRESS``'s, else the one on this
    machine), as ``ray.init(address=...)`` does, with this machine's Ray token when it has
    one.

    Ray 2.60 turns token authentication on for a cluster that ``ray.init()`` starts, and
    a driver sends the token it finds (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``) only to a cluster found on this machine, not to an address
    given: a second driver was refused ("Authentication token is missing or incorrect").
    With ``RAY_AUTH_MODE`` unset and a token here, this process sends it (a cluster
    without authentication ignores it).

    Raises:
        HorovodRayError: No cluster answered, or it wants a token this process does not
            have; with where to get one.
    """
    from ray.exceptions import AuthenticationError

    from horovod_ray.errors import HorovodRayError

    where = address or os.environ.get("RAY_ADDRESS") or "this machine"
    if os.environ.get(AUTH_MODE_ENV) is None and _token_here():
        _send_the_token()
    try:
        ray.init(address=address, **options)
    except AuthenticationError as err:
        raise HorovodRayError(f"{_NO_TOKEN.format(where=where)} Ray said: {err}") from None
    except ConnectionError as err:
        hint = "" if _token_here() else f" Or: {_NO_TOKEN.format(where=where)}"
        raise HorovodRayError(f"no Ray cluster answered at {where}: {err}.{hint}") from err


AUTH_MODE_ENV = "RAY_AUTH_MODE"
_NO_TOKEN = (
    "Ray's token authentication is on for the cluster at {where} and this process has no "
    "token for it (or not its token): copy the file ~/.ray/auth_token of the machine that "
    "started the cluster (`ray get-auth-token` prints it there) to this machine's "
    "~/.ray/auth_token, or give its path in RAY_AUTH_TOKEN_PATH, or the token itself in "
    "RAY_AUTH_TOKEN (docs/clusters.rst)."
)


def _send_the_token() -> None:
    """Token mode for this process (and those it starts), as Ray sets it for a cluster it
    finds on this machine, without Ray's warning that it turned authentication on (the
    cluster decides that): its C++ side reads the mode when its config is loaded, so the
    environment alone, set after ``import ray``, is not enough."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            _enable_token_auth,
        )
    except ImportError:  # another Ray than 2.60's: the environment, for what it does
        os.environ[AUTH_MODE_ENV] = "token"
        return
    _enable_token_auth()


def _token_here() -> bool:
    """Whether this process has a Ray token to send (as Ray looks for one)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return os.path.isfile(path)


def stop() -> None:
    """Stops the local Ray that ``start`` began."""
    stop_monitor()
    ray.shutdown()


def started_here() -> bool:
    """Whether this process started the Ray it holds (``ray.init()`` without an address,
    also implicitly, as ``ray.data`` does): a local Ray, which no autoscaler grows."""
    node = ray._private.worker._global_node  # noqa: SLF001 - Ray has no public handle
    return ray.is_initialized() and node is not None and node.is_head()


def _at_exit() -> None:
    """Stops the local Ray this process started once the workers' output is all here.

    Ray's own exit hook then finds nothing to do. If some output has not arrived within
    worker_output.FLUSH_TIMEOUT_S, Ray's hook stops it as usual, after its 0.5 s sleep.
    """
    node = ray._private.worker._global_node  # noqa: SLF001 - Ray has no public handle
    if not _started or node is None or not node.is_head() or not ray.is_initialized():
        return  # nothing started here, a Ray this process joined, or Ray Client
    flushed = False
    try:
        flushed = worker_output.flush(node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 - at exit, Ray's own hook is the fallback
        logger.debug("waiting for the workers' last lines failed", exc_info=True)
    finally:
        stop_monitor(node)
    if flushed:
        ray.shutdown()


# Registered on import, which comes after Ray's own hook is registered (on Ray's import),
# so that it runs just before Ray's: atexit runs hooks last registered first. A user's
# hook registered later still finds Ray running.
atexit.register(_at_exit)


def stop_monitor(node: Any = None) -> None:
    """Ends the autoscaler monitor of a Ray head this process started, ahead of its stop.

    ``ray.shutdown()`` (and ``Cluster.shutdown()``) stop the GCS before the monitor. The
    monitor's SIGTERM handler then writes its exit to the GCS that is gone, and hangs
    until Ray kills it a second later. A Ray about to stop has no use for its monitor, so
    it is killed at once. ``node`` is a ``ray._private.node.Node`` (a
    ``Cluster.head_node``); by default, the Ray that ``ray.init`` started in this
    process. Nothing happens when this process joined a Ray it did not start.
    """
    if node is None:
        node = ray._private.worker._global_node  # noqa: SLF001 - Ray has no public handle
    if node is not None and node.is_head():
        node.kill_monitor(check_alive=False)
