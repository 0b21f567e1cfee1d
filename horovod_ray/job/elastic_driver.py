"""Every use of horovod's elastic driver, whose API is private: one file to port.

horovod's :class:`~horovod.runner.elastic.driver.ElasticDriver` decides an elastic job's
world: it asks a discovery object (``discovery.NodeDiscovery``) which hosts have how
many slots, numbers the ranks of each world (this is where elastic ranks are numbered),
starts a slot through a callback, and after a failure or a change of hosts lets the
survivors reset. Here a host is a Ray node id. What crosses into the rest of the package
is converted at this edge: a slot becomes a :class:`~horovod_ray.rank.assignment.RankInfo`, the
driver's end a few plain facts, its message text one flag.
"""

from __future__ import annotations

import threading
from typing import Callable

from horovod.runner.common.util import codec
from horovod.runner.common.util import timeout as horovod_timeout
from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.elastic.constants import RESET_LIMIT_EXCEEDED_MESSAGE
from horovod.runner.elastic.driver import ElasticDriver
from horovod.runner.elastic.rendezvous import GET_RANK_AND_SIZE, PUT_WORKER_ADDRESSES
from horovod.runner.elastic.worker import HostUpdateResult

from horovod_ray.rank.assignment import RankInfo
from horovod_ray.rendezvous.server import RendezvousServer

# What horovod's driver says when it stops for too many resets; its text is the only
# signal (the driver keeps no flag). The constant ends in the limit's "{}".
_RESET_LIMIT_TEXT = RESET_LIMIT_EXCEEDED_MESSAGE.split("{}")[0].rstrip(": ")


def reset_limit_hit(message: str) -> bool:
    """Whether horovod's driver stopped because the job passed its reset limit."""
    return _RESET_LIMIT_TEXT in message


def rank_info(slot: SlotInfo, visible_gpus: tuple[str, ...] = ()) -> RankInfo:
    """The rank horovod's driver gave a slot, as the package's one rank record."""
    return RankInfo(
        world_rank=slot.rank,
        world_size=slot.size,
        local_rank=slot.local_rank,
        local_size=slot.local_size,
        cross_rank=slot.cross_rank,
        cross_size=slot.cross_size,
        node_id=slot.hostname,
        visible_gpus=visible_gpus,
    )


# How often the driver tells rank 0 again of hosts that allow another world, and how long
# its stop waits for a telling under way (to a rank on a node gone silent, a connect can
# hang for minutes: the daemon thread then ends with it).
RETELL_S = 2.0
RETELL_JOIN_S = 10.0


class Driver(ElasticDriver):
    """horovod's driver, remembering why it gave up, able to stop at once, and telling
    rank 0 of a change of hosts until the world has followed it.

    horovod's registry catches what ``resume()`` raises (too few slots for too long, no
    host of the last world left) and stops without a message; this keeps the reason.

    horovod tells rank 0 once per change of hosts, and rank 0 drops what it was told while
    it resets (``State.on_reset``: the new world was planned from the hosts known then).
    A change that comes after the plan but before rank 0's reset ends (the new ranks still
    starting) was lost, and the job kept its world. So every ``RETELL_S`` the driver tells
    it again while the hosts would give another world than the current one (horovod's own
    test); what rank 0 hears during a reset it drops, as before, so no extra reset comes of it.
    """

    timed_out_waiting = False
    gave_up: str | None = None
    _retell_thread: threading.Thread | None = None

    def start(self, num_proc, create_worker_fn):
        self._retell_thread = threading.Thread(
            target=self._retell, name="horovod_ray-retell", daemon=True
        )
        self._retell_thread.start()
        super().start(num_proc, create_worker_fn)

    def stop(self, error_message=None):
        super().stop(error_message)  # sets the shutdown event that ends _retell's wait
        if self._retell_thread is not None:
            self._retell_thread.join(RETELL_JOIN_S)

    def _retell(self) -> None:
        # Told as a change of both kinds: the ranks then sync their state after the reset
        # (always safe; they skip it only when hosts were removed and none added).
        while not self._shutdown.wait(RETELL_S):
            if self.host_assignments:
                self._notify_workers_host_changes(
                    self._host_manager.current_hosts, HostUpdateResult.mixed
                )

    def wait_for_available_slots(self, min_num_proc, min_hosts=1):
        try:
            return super().wait_for_available_slots(min_num_proc, min_hosts)
        except horovod_timeout.TimeoutException:
            self.timed_out_waiting = True
            raise

    def resume(self):
        try:
            super().resume()
        except Exception as err:
            self.gave_up = str(err)
            raise

    def available_slots(self) -> int:
        """Slots on the hosts horovod still counts (failed hosts are left out)."""
        return self._host_manager.current_hosts.count_available_slots()

    def world_rank(self, slot: SlotInfo) -> int:
        """The rank the driver gives ``slot``'s host and local rank in the current world."""
        return self.get_slot_info(slot.hostname, slot.local_rank).rank

    def stop_now(self) -> None:
        """Stops, and wakes whatever waits inside the driver (a wait for slots, ranks
        waiting at the reset barrier), so that no thread outlives the run."""
        if not self.finished():
            self.stop()
        with self._wait_hosts_cond:
            self._wait_hosts_cond.notify_all()
        barrier = self._worker_registry._barrier  # None before the first world
        if barrier is not None:
            barrier.abort()


class Store:
    """The rendezvous as horovod's driver sees it: ``init(plan)`` per world, ``stop()``.

    Each world reaches ``on_world`` as rank records, in the driver's rank order.
    """

    def __init__(self, on_world: Callable[[list[RankInfo]], None]) -> None:
        self._on_world = on_world
        # Set once the server exists: the server's store needs the driver, which needs this.
        self.server: RendezvousServer | None = None

    def init(self, host_alloc_plan: list[SlotInfo]) -> None:
        self.server.init(host_alloc_plan)
        self._on_world([rank_info(slot) for slot in host_alloc_plan])

    def stop(self) -> None:
        # The driver calls this more than once; the server's own stop() waits for the end.
        pass


class DriverHooks:
    """The two scopes horovod's elastic driver answers itself in the rendezvous store.

    A reset rank GETs ``rank_and_size/<host>:<slot>``: the driver records it ready
    (blocking on its barrier until the world's ranks all have) and answers its new
    ranks. A rank PUTs its notification server's addresses to ``worker_addresses``.
    """

    scopes = frozenset({GET_RANK_AND_SIZE, PUT_WORKER_ADDRESSES})

    def __init__(self, driver: ElasticDriver) -> None:
        self._driver = driver

    def get(self, scope: str, key: str) -> bytes | None:
        if scope != GET_RANK_AND_SIZE:
            return None
        host, slot = _host_slot(key)
        self._driver.record_ready(host, slot)
        return self._driver.get_slot_info(host, slot).to_response_string().encode("ascii")

    def put(self, scope: str, key: str, value: bytes) -> None:
        if scope == PUT_WORKER_ADDRESSES:
            host, slot = _host_slot(key)
            addresses, secret_key = codec.loads_base64(value)
            self._driver.register_worker_server(host, slot, addresses, secret_key)


def _host_slot(key: str) -> tuple[str, int]:
    host, _, slot = key.rpartition(":")
    return host, int(slot)
