"""A rank's part of an ordered split: Ray's ``DataIterator`` over rows chosen by number, with
its position as a plain dict (``state_dict`` / ``load_state_dict``), so that an epoch goes
on where it stopped after a restart or an elastic job's reset.

The dataset is materialized once per job, its order kept (``data/feed``); every rank holds
it and cuts its own part at the start of each pass, from the ledger (``data/ledger``) and
the world horovod has then: no coordinator, so a rank that joins an elastic job after a
reset cuts its part as the others do.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from ray.data import DataIterator

from horovod_ray.data.ledger import Ledger, whole
from horovod_ray.rank.logs import rank_now, size_now

if TYPE_CHECKING:
    from ray.data import Dataset, MaterializedDataset


class OrderedShard(DataIterator):
    """This rank's part of a dataset split in order (see the module).

    Each pass (``iter_batches()``, ``iter_torch_batches()``, ...) is an epoch: the first
    the whole of epoch 0 (or, after :meth:`load_state_dict`, what that epoch had left),
    each later one the next epoch, split over the ranks there are when it starts.

    Args:
        name: The dataset's name in ``datasets=``.
        dataset: The whole dataset, materialized in order.
        rows: Its rows.
    """

    def __init__(self, name: str, dataset: MaterializedDataset, rows: int) -> None:
        self._name = name
        self._dataset = dataset
        self._rows = rows
        self._lock = threading.Lock()
        self._ledger: Ledger | None = None  # the current pass's; None before the first
        self._loaded: Ledger | None = None  # where the next pass starts, if loaded

    def __getstate__(self) -> dict[str, Any]:
        """What travels to a rank: the dataset and the position, not the lock."""
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the position

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch stands, as a dict to keep in a checkpoint or an elastic state
        (``hvd.elastic.TorchState(..., data=shard.state_dict())``): the epoch
        (``["epoch"]``: the one the next pass reads; once a pass is over, the next one's),
        the rows it has left and how many each rank has read. Rank 0's is everyone's: in
        lockstep every rank has read as many rows."""
        with self._lock:
            ledger = self._loaded or self._ledger
            if ledger is None:
                ledger = Ledger(self._rows, 0, whole(self._rows), size_now())
            return ledger.as_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next pass reads what the epoch of ``state`` (from :meth:`state_dict`, on
        any rank, in any world) had left, split over the ranks there are then.

        Raises:
            ConfigError: ``state`` is not such a dict, or is of a dataset of another size.
        """
        ledger = Ledger.from_dict(state, self._rows)
        with self._lock:
            self._loaded = ledger

    # ------------------------------------------------------------- Ray's DataIterator

    def _to_ref_bundle_iterator(self) -> Any:
        part = self._begin_pass()
        return part.iterator()._to_ref_bundle_iterator()

    def _create_batch_iterator(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return self._counting(super()._create_batch_iterator(*args, **kwargs))

    def stats(self) -> str:
        return self._dataset.stats()

    def schema(self) -> Any:
        return self._dataset.schema()

    def get_context(self) -> Any:
        return self._dataset.context

    def _get_dataset_tag(self) -> dict[str, str | None]:
        return {"dataset": self._name, "split_index": str(rank_now())}

    def __repr__(self) -> str:
        return f"OrderedShard({self._name!r}, rows={self._rows})"

    # ---------------------------------------------------------------------- the pass

    def _begin_pass(self) -> Dataset:
        """The ledger of the pass that starts now, and this rank's rows of it."""
        world, rank = size_now(), rank_now()
        with self._lock:
            if self._loaded is not None:
                ledger, self._loaded = self._loaded.resplit(world), None
            elif self._ledger is None:
                ledger = Ledger(self._rows, 0, whole(self._rows), world)
            else:
                ledger = Ledger(self._rows, self._ledger.epoch + 1, whole(self._rows), world)
            self._ledger = ledger
            ranges = ledger.part(rank)
        return _rows_of(self._dataset, ranges)

    def _counting(self, batches: Any) -> Iterator[Any]:
        for batch in batches:
            with self._lock:
                if self._ledger is not None:
                    self._ledger = _took(self._ledger, _batch_rows(batch))
            yield batch


def _took(ledger: Ledger, rows: int) -> Ledger:
    return Ledger(ledger.rows, ledger.epoch, ledger.rest, ledger.world, ledger.taken + rows)


def _rows_of(dataset: MaterializedDataset, ranges: tuple[tuple[int, int], ...]) -> Dataset:
    """The rows ``ranges`` of ``dataset``, in order."""
    if not ranges:
        return dataset.limit(0)
    pieces = [dataset.split_at_indices([start, end])[1] for start, end in ranges]
    return pieces[0] if len(pieces) == 1 else pieces[0].union(*pieces[1:])


def _batch_rows(batch: Any) -> int:
    """Rows of a batch in any of Ray's formats: a dict of columns, a table, a frame."""
    if isinstance(batch, Mapping):
        return len(next(iter(batch.values()))) if batch else 0
    if hasattr(batch, "num_rows"):
        return int(batch.num_rows)
    return len(batch)
