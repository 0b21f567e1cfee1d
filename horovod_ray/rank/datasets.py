"""``get_dataset_shard(name)``: a rank's part of the job's datasets, as Ray Train's.

The job hands each rank its iterators once its ranks are up (``data/feed``): Ray Data's
own ``DataIterator`` (``iter_batches``, ``iter_torch_batches``, ``iter_tf_batches``,
``to_tf``, ...), over this rank's part of each split dataset, or over the whole of one
that is not split. The seconds the rank's loop waits for its next batch are counted
(:func:`waited_s`, and the metric ``horovod_ray_data_wait_seconds_total``): with the
ranks' waits for each other (``horovod_ray_waited_for_seconds_total``) they tell a rank
that starves for data from one that waits for a slower rank.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from horovod_ray.errors import DatasetNotFoundError
from horovod_ray.rank import metrics as rank_metrics
from horovod_ray.rank import session

if TYPE_CHECKING:
    from ray.data import DataIterator

_lock = threading.Lock()


def get_dataset_shard(name: str) -> DataIterator:
    """This rank's part of the dataset given as ``datasets={name: ...}`` (as
    ``ray.train.get_dataset_shard``).

    Each rank of a split dataset gets the same number of rows per epoch (Ray's
    ``streaming_split(equal=True)``: up to ``world size - 1`` rows of an epoch are left
    out), so every rank takes as many steps. Every call on a rank returns the same
    iterator; each pass over it (``iter_batches()``, ...) is an epoch, which every rank
    must start.

    Raises:
        DatasetNotFoundError: The job has no dataset of that name (or no datasets at
            all); a ``KeyError``, as Ray Train raises.
    """
    shards = session.current().shards
    if shards is None:
        raise DatasetNotFoundError(
            f"get_dataset_shard({name!r}): this job was given no datasets; pass "
            f"datasets={{{name!r}: ray.data.Dataset}} to run(), RayExecutor or "
            "DistributedTrainableCreator (and call it on a rank)"
        )
    if name not in shards:
        raise DatasetNotFoundError(
            f"get_dataset_shard({name!r}): the job's datasets are {sorted(shards)}; "
            "name one of them, or add it to datasets="
        )
    return shards[name]


def give(shards: Mapping[str, DataIterator] | None) -> None:
    """Sets this rank's iterators (None: the job has no datasets); each is timed."""
    if shards is not None:
        for name, iterator in shards.items():
            if not isinstance(iterator.__dict__.get("_create_batch_iterator"), _Timed):
                iterator._create_batch_iterator = _Timed(name, iterator._create_batch_iterator)
        shards = dict(shards)
    session.current().shards = shards


def waited_s() -> dict[str, float]:
    """Seconds this rank has waited for its next batch, by dataset."""
    with _lock:
        return dict(session.current().data_waited)


class _Timed:
    """An iterator's ``_create_batch_iterator``, counting the time each ``next()`` on its
    batches takes. Every way of iterating a ``DataIterator`` (``iter_batches``,
    ``iter_torch_batches``, ``to_tf``, ...) makes its batches with it (a method of Ray's
    marked PublicAPI, with a leading underscore): the iterator's own is wrapped, once. A
    class, not a closure, so that the iterator still pickles."""

    def __init__(self, name: str, make: Callable[..., Any]) -> None:
        self.name, self.make = name, make

    def __call__(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return _timed(self.name, self.make(*args, **kwargs))


def _timed(name: str, batches: Any) -> Iterator[Any]:
    inner = iter(batches)
    try:
        while True:
            began = time.perf_counter()
            try:
                batch = next(inner)
            except StopIteration:
                return
            finally:
                _add(name, time.perf_counter() - began)
            yield batch
    finally:
        close = getattr(inner, "close", None)
        if close is not None:
            close()


def _add(name: str, seconds: float) -> None:
    waited = session.current().data_waited
    with _lock:
        waited[name] = waited.get(name, 0.0) + seconds
    rank_metrics.data_waited(name, seconds)
