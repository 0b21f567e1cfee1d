"""``horovod-ray run`` as an elastic job: horovodrun's ``--min-np``, ``--max-np`` and
``--host-discovery-script``, both halves.

Each slot that horovod's elastic driver starts runs :func:`run_in_slot` in its actor: the
command starts as a static rank's does (``command.start_on_rank``, under the same guard),
and its lines go to the driver through the slot's log channel, which the slot's own
driver thread polls. The slot waits until each batch is taken, so a rank holds one batch
at most (the driver, unlike a static job's, queues what every slot sent while its own
output is blocked). A command that exits non-zero fails its slot: horovod's
driver then leaves that node out for a while and the survivors reset
(``hvd.elastic.run``), as under horovodrun; a slot the driver lets go is killed, and its
guard ends the command's tree.

On the driver, :func:`run_elastic` runs that through ``RayExecutor.run`` and writes the
lines with horovodrun's prefix, the rank being the one the slot started as (horovodrun's
elastic launcher prefixes the same way).
"""

from __future__ import annotations

import os
from typing import Any

from horovod_ray.cli import command
from horovod_ray.cli.output import Output
from horovod_ray.rank import logs

# The event of a batch of a slot's output lines, among the run's callback items.
OUTPUT_EVENT = "output"


class CommandFailedError(RuntimeError):
    """A slot's command exited non-zero (or was killed): its slot fails."""


def run_in_slot(
    argv: list[str],
    caller_env: dict[str, str],
    extra_env: dict[str, str],
    caller_cwd: str,
    shipped_cwd: bool,
) -> int:
    """Runs the command in this elastic slot to its end, relaying its lines (in the actor).

    Returns:
        0, once the command exited 0.

    Raises:
        CommandFailedError: It exited otherwise.
    """
    command.start_on_rank(argv, caller_env, extra_env, caller_cwd, shipped_cwd)
    rank = int(os.environ["HOROVOD_RANK"])
    while True:
        lines, done = command.poll_on_rank(command.POLL_S)
        if lines:
            logs.post_and_wait({"event": OUTPUT_EVENT, "rank": rank, "lines": lines})
        if done is not None:
            # The driver asks for the next batch only once it has written the last one:
            # this empty one taken, every line is out, also when the slot now fails.
            logs.post_and_wait({"event": OUTPUT_EVENT, "rank": rank, "lines": []})
            if done.returncode:
                raise CommandFailedError(f"{argv[0]} {done.describe()}")
            return 0


def run_elastic(
    executor: Any,
    output: Output,
    argv: list[str],
    caller_env: dict[str, str],
    extra_env: dict[str, str],
    caller_cwd: str,
    shipped_cwd: bool,
) -> None:
    """Runs the command elastically on a started elastic ``RayExecutor`` until every rank
    of the last world has exited 0.

    Raises:
        ElasticLimitError, WorkerFailedError: As ``RayExecutor.run`` does.
    """

    def deliver(item: dict) -> None:
        if item.get("event") == OUTPUT_EVENT:
            output.write(item["rank"], item["lines"])

    output.open(executor.elastic.max_workers or executor.elastic.min_workers)
    executor.run(
        run_in_slot,
        args=(argv, caller_env, extra_env, caller_cwd, shipped_cwd),
        callbacks=[deliver],
    )
