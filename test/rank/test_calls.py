"""The call protocol's two halves against each other, without Ray."""

from __future__ import annotations

import threading

import pytest

from horovod_ray import ConfigError
from horovod_ray.rank.calls import Dispatcher, RankCalls, invoke, prepare, prepare_execute

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def deliver(rank: RankCalls, message, executable=None):
    """What Worker.call / Worker.again do with a message."""
    if message.again:
        _, function, args = rank.repeat()
    else:
        function, args = rank.resolve(message.call_id, message.key, message.fn, message.args)
    return invoke(function, args, executable)


def add(a, b=0):
    return a + b


def test_a_function_goes_whole_once_then_as_its_key():
    dispatcher, rank = Dispatcher(), RankCalls()
    call = prepare(add, [1], {"b": 2})
    first = dispatcher.message(call)
    assert (first.call_id, first.key, first.fn is not None) == (1, 1, True)
    assert deliver(rank, first) == 3
    other = prepare(add, [5])
    second = dispatcher.message(other)
    assert (second.key, second.fn) == (1, None)  # same function: key only
    assert deliver(rank, second) == 5


def test_a_completed_call_repeated_with_nothing_between_goes_without_arguments():
    dispatcher, rank = Dispatcher(), RankCalls()
    call = prepare(add, [1])
    first = dispatcher.message(call)
    deliver(rank, first)
    # Not yet reported complete: the repeat still carries its arguments.
    assert not dispatcher.message(call).again
    dispatcher.completed(call, dispatcher.message(call))  # call 3, completed
    repeat = dispatcher.message(call)
    assert repeat.again and repeat.call_id == 4
    # Other arguments, or a call in between, end the repeat.
    assert not dispatcher.message(prepare(add, [2])).again
    dispatcher.completed(call, dispatcher.message(call))
    dispatcher.message(prepare_execute(len), all_ranks=False)
    assert not dispatcher.message(call).again


def test_the_rank_repeats_its_last_call_with_fresh_arguments_and_the_next_id():
    rank, dispatcher = RankCalls(), Dispatcher()

    def append(items):
        items.append(1)
        return len(items)

    call = prepare(append, [[]])
    assert deliver(rank, dispatcher.message(call)) == 1
    for expected_id in (2, 3):
        call_id, function, args = rank.repeat()
        assert call_id == expected_id
        assert invoke(function, args, None) == 1  # the list is unpickled anew each time


def test_the_cache_is_bounded_by_count_and_by_bytes():
    rank, by_count = RankCalls(), Dispatcher(cache_size=1)
    assert deliver(rank, by_count.message(prepare(add, [1]))) == 1
    uncached = by_count.message(prepare(len, [[1, 2]]))
    assert uncached.key is None and uncached.fn is not None
    assert deliver(rank, uncached) == 2
    cached = by_count.message(prepare(add, [3]))
    assert cached.fn is None and deliver(rank, cached) == 3  # the first one stays cached
    small = prepare(add)
    rank, by_bytes = RankCalls(), Dispatcher(cache_bytes=len(small.fn) + 10)
    assert by_bytes.message(small).key == 1
    rank.resolve(1, 1, small.fn, small.args)
    assert by_bytes.message(prepare(lambda: None)).key is None  # past the byte bound
    assert deliver(rank, by_bytes.message(prepare(add, [4]))) == 4


def test_execute_calls_pass_the_executable():
    rank, dispatcher = RankCalls(), Dispatcher()
    assert deliver(rank, dispatcher.message(prepare_execute(lambda ex: ex * 2)), 21) == 42


def test_call_ids_are_unique_across_threads():
    dispatcher = Dispatcher()
    call = prepare(add, [1])
    ids = []

    def many():
        ids.extend(dispatcher.message(call).call_id for _ in range(200))

    threads = [threading.Thread(target=many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(ids) == list(range(1, 801))


def _holds_a_lock():
    lock = threading.Lock()
    return lambda: lock


@pytest.mark.parametrize(
    "make, parameter",
    [
        (lambda: prepare(5), "fn"),
        (lambda: prepare(add, "ab"), "args"),
        (lambda: prepare(add, [threading.Lock()]), "args"),
        (lambda: prepare(add, kwargs=[1]), "kwargs"),
        (lambda: prepare(_holds_a_lock(), fn_name="train_fn"), "train_fn"),
    ],
)
def test_prepare_names_what_is_wrong(make, parameter):
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.parameter == parameter
