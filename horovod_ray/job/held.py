"""What a static job holds (its placement group, its actors, its rendezvous), recorded as
it is taken, and given back in one place whatever step the job had reached."""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup

from horovod_ray.job import bringup
from horovod_ray.rendezvous.cluster import ClusterRendezvous
from horovod_ray.rendezvous.server import RendezvousServer

# Seconds to wait for Ray to confirm that killed workers are gone.
STOP_CONFIRM_S = 10.0

Rendezvous = RendezvousServer | ClusterRendezvous


@dataclasses.dataclass
class Held:
    """What a job holds, or what start() has taken so far; given back by :func:`release`."""

    group: PlacementGroup | None = None
    owns_group: bool = False
    actors: list[Any] = dataclasses.field(default_factory=list)
    rendezvous: Rendezvous | None = None


def release(held: Held, grace_s: float) -> None:
    """Gives back what a job holds, newest first; each step runs whatever the last did.

    Idle workers get ``grace_s`` to exit on their own, then are killed; returns once Ray
    has seen them die (so their resources are free), after the rendezvous server is
    closed and a placement group the job created is removed.
    """
    actors, rendezvous = held.actors, held.rendezvous
    try:
        if actors:
            exits = [actor.exit.remote() for actor in actors]
            if grace_s > 0:
                ray.wait(exits, num_returns=len(exits), timeout=grace_s)
            bringup.kill(actors)
            ray.wait(exits, num_returns=len(exits), timeout=STOP_CONFIRM_S)
    finally:
        try:
            if rendezvous is not None:
                rendezvous.stop()
        finally:
            if held.group is not None and held.owns_group:
                ray.util.remove_placement_group(held.group)
