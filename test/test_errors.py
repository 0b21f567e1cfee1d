"""Errors form one hierarchy and survive pickling (they cross Ray process boundaries)."""

from __future__ import annotations

import pickle
import sys
import threading
import types

import pytest

from horovod_ray import (
    ConfigError,
    ElasticLimitError,
    ExecutorStateError,
    HorovodRayError,
    PlacementTimeoutError,
    RankError,
    RendezvousError,
    WorkerFailedError,
)

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def test_hierarchy():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(PlacementTimeoutError, TimeoutError)
    # horovod.ray raised RuntimeError where these are raised: code catching it still does.
    assert issubclass(WorkerFailedError, RuntimeError)
    assert issubclass(ElasticLimitError, RuntimeError)
    for cls in (
        ConfigError,
        PlacementTimeoutError,
        RendezvousError,
        ExecutorStateError,
        ElasticLimitError,
        RankError,
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
        RankError("ValueError", "Traceback (most recent call last):\nValueError: boom", b"x"),
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


class _LostError(Exception):
    """Defined in this test module: a process without it could not unpickle it."""


def _raised(err: Exception) -> RankError:
    """``err`` raised and caught, as a rank sends it (its traceback from the raising frame)."""
    try:
        raise err
    except Exception as caught:  # noqa: BLE001 - whatever the test raised
        return RankError.of(caught, caught.__traceback__)


def test_rank_error_is_the_traceback_as_text_and_the_exception_still_pickled():
    error = pickle.loads(pickle.dumps(_raised(KeyError("missing column"))))
    assert error.type_name == "KeyError"
    assert error.text.startswith("Traceback (most recent call last):")
    assert "in _raised" in error.text and error.text.endswith("KeyError: 'missing column'")
    assert str(error) == error.text
    original = error.original()
    assert type(original) is KeyError and original.args == ("missing column",)


def test_rank_error_names_a_class_outside_the_builtins_by_its_module():
    error = _raised(_LostError("gone"))
    assert error.type_name == f"{__name__}._LostError"
    assert error.text.endswith(f"{__name__}._LostError: gone")


def test_rank_error_of_an_exception_that_cannot_be_pickled_keeps_its_text():
    class HoldingError(Exception):
        def __init__(self):
            super().__init__("holds a lock")
            self.lock = threading.Lock()

    error = _raised(HoldingError())
    assert error.text.endswith("HoldingError: holds a lock")
    with pytest.raises(HorovodRayError, match="could not be pickled"):
        error.original()


def test_rank_error_whose_class_is_not_here_says_so(monkeypatch):
    # A module only the ranks have: here while pickling, gone when unpickling.
    module = types.ModuleType("only_on_the_ranks")
    module.Lost = type("Lost", (Exception,), {"__module__": module.__name__})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    error = _raised(module.Lost("gone"))
    monkeypatch.delitem(sys.modules, module.__name__)
    assert error.type_name == "only_on_the_ranks.Lost"
    with pytest.raises(HorovodRayError, match="cannot be unpickled here"):
        error.original()
