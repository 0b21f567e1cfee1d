"""Errors form one hierarchy and survive pickling (they cross Ray process boundaries)."""

from __future__ import annotations

import pickle

import pytest

from horovod_ray import (
    ConfigError,
    ElasticLimitError,
    ExecutorStateError,
    HorovodRayError,
    PlacementTimeoutError,
    RendezvousError,
    WorkerFailedError,
)


def test_hierarchy():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(PlacementTimeoutError, TimeoutError)
    for cls in (
        ConfigError,
        PlacementTimeoutError,
        RendezvousError,
        ExecutorStateError,
        ElasticLimitError,
    ):
        assert issubclass(cls, HorovodRayError)
    assert issubclass(WorkerFailedError, HorovodRayError)


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("num_workers", "num_workers must be > 0, got 0"),
        PlacementTimeoutError("no room"),
        RendezvousError("ranks [1] never joined"),
        ExecutorStateError("call start() first"),
        WorkerFailedError({1: "raised on node x:\nValueError: boom", 0: "process died"}),
        ElasticLimitError("reset_limit", 2, 4, "more than reset_limit=1 resets"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_their_text_and_fields(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.__dict__ == error.__dict__


def test_worker_failed_error_names_ranks_in_order():
    error = WorkerFailedError({2: "process died on node b", 0: "raised on node a: boom"})
    assert list(error.failures) == [0, 2]
    assert str(error).startswith("Horovod ranks 0, 2 failed")
    assert "boom" in str(error) and "process died on node b" in str(error)
    assert str(WorkerFailedError({1: "x"})).startswith("Horovod rank 1 failed")
