"""``get_preemption_info()``: Ray Train's notice that a node of the job is being drained
(a spot node about to be preempted, a node taken back), on a Horovod rank.

The driver reads Ray's draining nodes while the ranks run. When one of the job's nodes
drains, it writes a numbered notice into every rank's notice folder (:func:`deliver`, on
the rank's control thread; a ``horovod-ray run`` command reads its actor's folder, named
by ``PREEMPTION_DIR_ENV``). ``get_preemption_info()`` gives every rank rank 0's latest
notice: it broadcasts rank 0's number over horovod, so it is a collective that every rank
calls at the same point, as Ray Train's is a barrier, and its answer is the same on every
rank, safe to branch on before the next collective.

A static job cannot leave a node. Its notice says it will be stopped (``restart``): rank 0's
next ``report()`` with a checkpoint, on seeing it, is committed before ``report`` would
return, and then does not return. The driver, waiting for that (up to the drain's
deadline), stops the job at once, and ``run(max_restarts=...)`` starts it again from that
checkpoint on the nodes that stay: no step is done twice. An elastic job leaves the node at
its next ``commit()``; its notice only informs, and stays for the rest of the run.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Mapping

from horovod_ray.checkpoints.leftovers import owned, sweep_stale
from horovod_ray.errors import HorovodRayError
from horovod_ray.rank import session

logger = logging.getLogger(__name__)

# The rank's notice folder, set in the rank's environment when its actor starts.
PREEMPTION_DIR_ENV = "HOROVOD_RAY_PREEMPTION_DIR"
# A folder's name: this prefix, the process id, "-" and the job's id (swept once the
# process is gone, as the timeline's files are).
PREFIX = "horovod_ray-preemption-"
ASKED = "asked"  # written by the rank's first get_preemption_info()
SAVED = "saved"  # rank 0's just-in-time checkpoint is committed
# How long a rank waits for a notice rank 0 already holds (the driver writes it to every
# rank, one after the other).
NOTICE_WAIT_S = 30.0
_BROADCAST_NAME = "horovod_ray.preemption_notice"

# How long rank 0, its just-in-time checkpoint committed, waits past the drain's deadline
# (from then, with none) for the driver to stop the job; a call no drain is watched in
# (run_remote) then goes on.
UNSTOPPED_S = 90.0


def open_folder() -> str:
    """Makes this rank's notice folder and names it in the environment (the actor's setup);
    removed as the process exits, or, left by a killed one, by the next rank's sweep."""
    sweep_stale((PREFIX,))
    job_id = os.environ.get("HOROVOD_RAY_JOB_ID", "job")
    folder = tempfile.mkdtemp(prefix=f"{owned(PREFIX)}{job_id}-")
    atexit.register(shutil.rmtree, folder, True)
    os.environ[PREEMPTION_DIR_ENV] = folder
    return folder


def notice(
    version: int, deadline_ms: int | None, node_ranks: Mapping[str, list[int]], restart: bool
) -> str:
    """A notice as the driver writes it. Pure.

    Args:
        version: Its number: 1 for the job's first, one more each time more nodes drain.
        deadline_ms: The nearest deadline of the draining nodes (ms since the epoch), or
            None where none was given.
        node_ranks: Each draining node's id -> the world ranks on it.
        restart: Whether the job is stopped for it (a static job).
    """
    return json.dumps(
        {
            "version": version,
            "deadline_ms": deadline_ms,
            "nodes": {node: sorted(ranks) for node, ranks in sorted(node_ranks.items())},
            "restart": restart,
        }
    )


def deliver(version: int, text: str) -> None:
    """Writes notice ``version`` into this rank's folder (the driver calls it on the rank's
    control thread)."""
    folder = os.environ.get(PREEMPTION_DIR_ENV)
    if folder is None:
        return
    path = os.path.join(folder, f"notice-{version:06d}.json")
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(path + ".tmp", path)


def state() -> tuple[bool, bool]:
    """Whether this rank's function asked for the notice, and whether rank 0 committed its
    just-in-time checkpoint (read by the driver, on the control thread)."""
    folder = os.environ.get(PREEMPTION_DIR_ENV)
    if folder is None:
        return False, False
    return (
        os.path.exists(os.path.join(folder, ASKED)),
        os.path.exists(os.path.join(folder, SAVED)),
    )


def get_preemption_info() -> Any:
    """Whether a node of the job is being drained (as ``ray.train.get_preemption_info``):
    None until then, after that Ray Train v2's ``PreemptionInfo`` with the nearest deadline
    (``deadline_ms``, None where none was given) and the world ranks on each draining node
    (``preempted_node_to_ranks``).

    The answer is rank 0's, the same on every rank: once horovod is initialised this is a
    broadcast from rank 0, so every rank calls it at the same point (before
    ``hvd.init()``, each rank answers for itself; not in ``execute_single``, which runs on
    rank 0 alone and would wait for the others). In a static job with a storage path,
    rank 0's next ``report()`` with a checkpoint after a notice is committed and does not
    return: the job stops and ``run(max_restarts=...)`` resumes it from that checkpoint on
    the nodes that stay. Outside a Ray job (``run(..., local=True)``): None.

    Raises:
        HorovodRayError: Not on a rank of a horovod_ray job, or rank 0 holds a notice that
            never reached this rank.
    """
    folder = os.environ.get(PREEMPTION_DIR_ENV)
    if folder is None:
        if "HOROVOD_RAY_JOB_ID" in os.environ:
            return None  # a job of one in the caller's process: nothing drains under it
        raise HorovodRayError(
            "get_preemption_info() answers on a rank of a horovod_ray job: inside the "
            "function run(), RayExecutor.run/execute or a Tune trial runs, or a command of "
            "horovod-ray run"
        )
    _mark_asked(folder)
    version = _agree(_latest(folder))
    if version == 0:
        return None
    now = session.current()
    if now.notice is None or now.notice["version"] != version:
        now.notice = _read(folder, version)
    agreed = now.notice
    # Ray Train v2's class (ray.train exports it under v2 only); here: it is slow to import.
    from ray.train.v2.api.preemption import PreemptionInfo

    return PreemptionInfo(agreed["deadline_ms"], {n: list(r) for n, r in agreed["nodes"].items()})


def stops_after_checkpoint() -> bool:
    """Whether this rank saw a notice of a job that is stopped for it (a static job's),
    and has not already waited for that in vain."""
    now = session.current()
    agreed = now.notice
    return agreed is not None and bool(agreed["restart"]) and agreed["version"] != now.waited


def saved_then_wait() -> None:
    """Says rank 0's just-in-time checkpoint is committed, then waits to be stopped: the
    driver stops the job now and a restart resumes from it, so no step is done twice.
    Unstopped past the deadline and ``UNSTOPPED_S`` (a call that no drain is watched in),
    it returns, and training goes on."""
    now = session.current()
    folder = os.environ[PREEMPTION_DIR_ENV]
    open(os.path.join(folder, SAVED), "w").close()
    logger.warning(
        "rank 0: the checkpoint reported after the preemption notice is committed; the job "
        "stops here and starts again from it"
    )
    sys.stdout.flush()
    deadline_ms = now.notice["deadline_ms"]
    left_s = 0.0 if deadline_ms is None else max(0.0, deadline_ms / 1000 - time.time())
    threading.Event().wait(left_s + UNSTOPPED_S)
    now.waited = now.notice["version"]
    logger.warning(
        "rank 0: the job was not stopped after its just-in-time checkpoint (a call that no "
        "drain is watched in, such as run_remote's); training goes on"
    )


def _mark_asked(folder: str) -> None:
    now = session.current()
    if not now.asked:
        open(os.path.join(folder, ASKED), "w").close()
        now.asked = True


def _latest(folder: str) -> int:
    """The number of the latest notice in ``folder`` (0: none)."""
    numbers = [
        int(name[7:13])
        for name in os.listdir(folder)
        if name.startswith("notice-") and name.endswith(".json")
    ]
    return max(numbers, default=0)


def _read(folder: str, version: int) -> dict[str, Any]:
    """Notice ``version``, waiting up to NOTICE_WAIT_S for it to reach this rank.

    Raises:
        HorovodRayError: It did not.
    """
    path = os.path.join(folder, f"notice-{version:06d}.json")
    deadline = time.monotonic() + NOTICE_WAIT_S
    while True:
        try:
            with open(path) as handle:
                return json.load(handle)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise HorovodRayError(
                    f"rank 0 holds preemption notice {version}, which did not reach this "
                    f"rank within {NOTICE_WAIT_S:.0f} s"
                ) from None
            time.sleep(0.05)


def _agree(version: int) -> int:
    """Rank 0's ``version`` on every rank: broadcast over the horovod this process
    initialised (torch's or TensorFlow's); this rank's own where none is, or alone."""
    for name in ("horovod.torch", "horovod.tensorflow"):
        module = sys.modules.get(name)
        if module is None or not _running(module):
            continue
        if module.size() == 1:
            return version
        if name == "horovod.torch":
            import torch

            tensor = torch.tensor([version], dtype=torch.int64)
            return int(module.broadcast(tensor, 0, name=_BROADCAST_NAME)[0])
        import tensorflow as tf

        tensor = tf.constant([version], dtype=tf.int64)
        return int(module.broadcast(tensor, 0, name=_BROADCAST_NAME).numpy()[0])
    return version


def _running(module: Any) -> bool:
    try:
        return bool(module.is_initialized())
    except Exception:  # noqa: BLE001 - a framework whose horovod cannot answer
        return False
