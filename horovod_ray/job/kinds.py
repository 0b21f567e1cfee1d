"""The two kinds of job behind one ``RayExecutor``, and the protocol they share.

``RayExecutor`` owns the public API, the argument checks and the lifecycle
(``lifecycle.ExecutorState``); what differs between a static and an elastic job is the
kind's, behind :class:`JobKind`:

* ``static.StaticJob`` (``num_workers`` / ``num_hosts``): plans and reserves its
  placement at start, keeps its ranks until stop, takes every call.
* ``elastic.ElasticJob`` (``min_workers``): takes nothing at start; each ``run()``
  lets horovod's elastic driver decide the world; refuses every other call.

What only a job that holds its ranks can answer (their records, their stacks, its
rendezvous and placement group, a call sent without waiting) is :class:`HeldJob`'s; each
kind implements its protocol whole.

Both bring their ranks up the same way (``bringup``) and leave the decision of who
failed to ``failures``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import ray

from horovod_ray.errors import ConfigError, HorovodRayError
from horovod_ray.job.layouts import ElasticLayout, WorkerLayout
from horovod_ray.job.static import StaticJob
from horovod_ray.rank import calls
from horovod_ray.rank.assignment import RankInfo
from horovod_ray.rank.calls import Call
from horovod_ray.settings import Settings, check_env
from horovod_ray.stack.build import require_gloo


class JobKind(Protocol):
    """What ``RayExecutor`` asks of a kind of job. The executor checks the lifecycle
    state before each method (``refuse`` excepted: it holds in any state)."""

    def refuse(self, action: str, call: Call | None) -> None:
        """Raises ExecutorStateError if this kind cannot do ``action`` at all (any state)."""

    def prepare(self) -> None:
        """Checks what needs Ray but takes nothing (CREATED); raises ConfigError and the
        like before any resource is taken."""

    def start(
        self, extra_env: dict[str, str], executable: bytes | None, check: Callable[[], None]
    ) -> None:
        """Takes what the kind holds while running (STARTING), all or nothing; calls
        ``check`` at every wait and gives up with whatever it raises."""

    def started_message(self) -> str | None:
        """What start() logs, None for nothing."""

    def admit(self) -> None:
        """Claims a call (RUNNING); raises ExecutorStateError when the kind is busy."""

    def call(
        self,
        call: Call,
        callbacks: list[Callable[[dict], None]],
        all_ranks: bool = True,
        failing: Callable[[], bool] = lambda: True,
    ) -> list[Any]:
        """Runs an admitted call to its end; each rank's value, in world-rank order. When
        its ranks fail it calls ``failing()`` before it looks at them or releases
        anything: True, and it raises the error ``failures`` decides; False (the job was
        already being stopped), and it need not find out who failed. For anything else
        (Ctrl-C, a callback) the executor stops the job."""

    def stop(self, grace_s: float) -> None:
        """Releases everything; idempotent, from any thread."""

    def give_datasets(self, shards: Any) -> None:
        """Hands the ranks their iterators over the job's datasets (``JobSides``): a
        static job each rank its own, now; an elastic one the same to every rank, as
        each slot is set up."""


class HeldJob(JobKind, Protocol):
    """A kind that holds its ranks from start to stop (``static.StaticJob``), and so can
    answer what they are and run a call without waiting: what ``refuse`` keeps away
    from an elastic job, whose world is horovod's to change."""

    def send(self, call: Call) -> list[ray.ObjectRef]:
        """Starts an admitted call on every rank without waiting."""

    def stacks(self, timeout_s: float) -> dict[int, str]:
        """Every rank's Python stacks, by world rank."""

    @property
    def ranks(self) -> list[RankInfo]: ...

    @property
    def rendezvous_address(self) -> tuple[str, int]: ...

    @property
    def placement_group(self) -> Any: ...


def create(
    settings: Settings,
    layout: WorkerLayout,
    elastic: ElasticLayout | None,
    on_world: Callable[[int, int], None] | None = None,
) -> JobKind:
    """The kind of job the executor's arguments ask for; an elastic one calls
    ``on_world(size, resets)`` each time its world forms or changes."""
    if elastic is None:
        return StaticJob(settings, layout)
    # Only here: horovod's elastic driver is not loaded for static jobs.
    from horovod_ray.job.elastic import ElasticJob

    return ElasticJob(settings, elastic, layout, on_world)


def start_inputs(
    executable_cls: object,
    executable_args: Sequence[Any] | None,
    executable_kwargs: Mapping[str, Any] | None,
    extra_env_vars: Mapping[str, object] | None,
) -> tuple[dict[str, str], bytes | None]:
    """start()'s arguments checked, and what it needs checked before anything is taken:
    the ranks' extra environment and ``executable_cls`` pickled with its arguments."""
    if executable_cls is not None and not callable(executable_cls):
        raise ConfigError(
            "executable_cls", f"executable_cls must be a class, got {executable_cls!r}"
        )
    args = calls.as_tuple("executable_args", executable_args)
    kwargs = calls.as_kwargs("executable_kwargs", executable_kwargs)
    executable = (
        None
        if executable_cls is None
        else calls.pickle_value("executable_cls", (executable_cls, args, kwargs))
    )
    env = check_env(extra_env_vars)
    require_gloo()
    if not ray.is_initialized():
        raise HorovodRayError(
            "Ray is not initialised: call ray.init() (or ray.init(address=...) for a "
            "cluster) before RayExecutor.start(); horovod_ray.run() does it for you"
        )
    return env, executable
