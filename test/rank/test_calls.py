"""The call protocol's two halves against each other, without Ray."""

from __future__ import annotations

import threading
import time

import pytest

from horovod_ray import ConfigError
from horovod_ray.rank import calls
from horovod_ray.rank.calls import Dispatcher, RankCalls, invoke, prepare, prepare_execute

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def deliver(rank: RankCalls, message, executable=None):
    """What Worker.call / Worker.again / Worker.again_next do with a message."""
    if message.bare:
        function, args = rank.repeat(rank.next_repeat_id())
    elif message.again:
        function, args = rank.repeat(message.call_id)
    else:
        if message.repeat_in_flight is not None:
            rank.overtook(*message.repeat_in_flight)
        function, args = rank.resolve(message.call_id, message.key, message.fn, message.args)
    return invoke(function, args, executable)


def _decide(dispatcher: Dispatcher, call, all_ranks: bool = True):
    """What ``dispatcher`` sends for ``call``, sent to no rank."""
    return dispatcher.send(call, [], all_ranks)[0]


def add(a, b=0):
    return a + b


def test_a_function_goes_whole_until_a_call_returned_everywhere_then_as_its_key():
    dispatcher, rank = Dispatcher(), RankCalls()
    call = prepare(add, [1], {"b": 2})
    first = _decide(dispatcher, call)
    assert (first.call_id, first.key, first.fn is not None) == (1, 1, True)
    assert deliver(rank, first) == 3
    other = prepare(add, [5])
    second = _decide(dispatcher, other)
    assert (second.key, second.fn is not None) == (1, True)  # first not returned yet
    assert deliver(rank, second) == 5
    dispatcher.completed(call, first)
    third = _decide(dispatcher, prepare(add, [7]))
    assert (third.key, third.fn) == (1, None)  # same function, known everywhere: key only
    assert deliver(rank, third) == 7


def test_a_call_from_another_thread_that_overtakes_the_first_still_has_its_function():
    """Two threads' calls of one function: the second's message may reach a rank first.
    It used to carry the key alone, and the rank failed with KeyError: 1."""
    dispatcher, rank = Dispatcher(), RankCalls()
    first = _decide(dispatcher, prepare(add, [1]))
    second = _decide(dispatcher, prepare(add, [2]))
    assert deliver(rank, second) == 2
    assert deliver(rank, first) == 1


def test_no_call_sees_what_an_earlier_call_did_to_the_functions_state():
    """A closure, a mutable default and a callable object, called three times each by key
    and by repeat: each call starts from the state the caller sent (as horovod.ray)."""
    captured = []

    def closure():
        captured.append(1)
        return len(captured)

    def default(items=[]):  # noqa: B006 - the state under test
        items.append(1)
        return len(items)

    class Counter:
        def __init__(self):
            self.count = 0

        def __call__(self):
            self.count += 1
            return self.count

    for fn in (closure, default, Counter()):
        dispatcher, rank = Dispatcher(), RankCalls()
        call = prepare(fn)
        seen = []
        for _ in range(3):
            message = _decide(dispatcher, call)
            seen.append(deliver(rank, message))
            dispatcher.completed(call, message)
        assert seen == [1, 1, 1], fn
        assert _decide(dispatcher, prepare(fn)).fn is None  # the key path, then repeats ran
    assert captured == []  # the caller's own objects were never touched


def test_a_completed_call_repeated_with_nothing_between_goes_without_arguments():
    dispatcher, rank = Dispatcher(), RankCalls()
    call = prepare(add, [1])
    first = _decide(dispatcher, call)
    deliver(rank, first)
    # Not yet reported complete: the repeat still carries its arguments.
    assert not _decide(dispatcher, call).again
    dispatcher.completed(call, _decide(dispatcher, call))  # call 3, completed
    repeat = _decide(dispatcher, call)
    assert repeat.again and repeat.call_id == 4
    # Other arguments, or a call in between, end the repeat.
    assert not _decide(dispatcher, prepare(add, [2])).again
    dispatcher.completed(call, _decide(dispatcher, call))
    _decide(dispatcher, prepare_execute(len), all_ranks=False)
    assert not _decide(dispatcher, call).again


def test_a_repeat_with_no_call_in_flight_goes_bare_and_each_rank_numbers_it():
    dispatcher, ranks = Dispatcher(), [RankCalls(), RankCalls()]
    call = prepare(add, [1])
    message = _decide(dispatcher, call)
    for expected_id in (1, 2, 3):
        assert message.call_id == expected_id and message.bare == (expected_id > 1)
        assert [deliver(rank, message) for rank in ranks] == [1, 1]
        dispatcher.completed(call, message)
        message = _decide(dispatcher, call)
    assert [rank.next_repeat_id() for rank in ranks] == [4, 4]
    # An earlier call still in flight (run_remote's, another thread's) keeps the id on.
    dispatcher = Dispatcher()
    _decide(dispatcher, prepare(add, [2]))  # call 1, never reported complete
    dispatcher.completed(call, _decide(dispatcher, call))
    repeat = _decide(dispatcher, call)
    assert repeat.again and not repeat.bare
    # A run_remote repeat goes with its id even with nothing in flight (its method
    # raises as raised).
    dispatcher = Dispatcher()
    dispatcher.completed(call, _decide(dispatcher, call))
    remote = dispatcher.send(call, [], as_raised=True)[0]
    assert remote.again and not remote.bare


def test_a_bare_repeat_that_a_later_call_overtakes_keeps_its_id():
    """Calls from several driver threads may reach a rank in another order than sent."""
    dispatcher, rank = Dispatcher(), RankCalls()
    call = prepare(add, [1])
    first = _decide(dispatcher, call)
    deliver(rank, first)
    dispatcher.completed(call, first)
    bare = _decide(dispatcher, call)
    other = prepare(add, [7])
    later = _decide(dispatcher, other)  # sent while the bare repeat is in flight
    assert bare.bare and (later.call_id, later.repeat_in_flight) == (3, (2, True))
    assert deliver(rank, later) == 7  # arrives first
    assert deliver(rank, bare) == 1
    dispatcher.completed(call, bare)
    dispatcher.completed(other, later)
    again = _decide(dispatcher, other)  # call 4 repeats call 3, not the bare repeat
    assert again.bare and deliver(rank, again) == 7
    # In arrival order the note comes after the repeat ran, and is dropped.
    dispatcher, rank = Dispatcher(), RankCalls()
    first = _decide(dispatcher, call)
    deliver(rank, first)
    dispatcher.completed(call, first)
    bare, later = _decide(dispatcher, call), _decide(dispatcher, other)
    assert (deliver(rank, bare), deliver(rank, later)) == (1, 7)
    assert rank.next_repeat_id() == 4


def test_a_call_past_the_bytes_that_overtakes_a_repeat_leaves_it_its_call(monkeypatch):
    """A call from another thread larger than RECENT_BYTES, reaching a rank before a
    repeat sent ahead of it, used to push the repeated call out: the repeat then failed
    with "no longer holds"."""
    monkeypatch.setattr(calls, "RECENT_BYTES", 2500)
    call, big = prepare(add, [1]), prepare(len, [b"x" * 3000])
    for bare in (False, True):
        dispatcher, rank = Dispatcher(), RankCalls()
        other = prepare(add, [5])
        in_flight = _decide(dispatcher, other)  # call 1 (a repeat goes with its id)
        deliver(rank, in_flight)
        if bare:
            dispatcher.completed(other, in_flight)  # nothing in flight: a bare repeat
        first = _decide(dispatcher, call)  # call 2
        deliver(rank, first)
        dispatcher.completed(call, first)
        repeat = _decide(dispatcher, call)  # call 3 repeats call 2
        assert repeat.again and repeat.bare == bare
        later = _decide(dispatcher, big)  # call 4, sent while the repeat is on its way
        assert (later.call_id, later.repeat_in_flight) == (4, (3, bare))
        assert deliver(rank, later) == 3000  # arrives first, past the bytes alone
        assert deliver(rank, repeat) == 1
        # Once the repeat ran, the bytes bound holds again: the next call lets call 2 go.
        deliver(rank, _decide(dispatcher, prepare(add, [6])))
        with pytest.raises(RuntimeError, match="no longer holds"):
            rank.repeat(3)


def test_a_repeat_named_after_it_ran_and_left_gives_no_id_to_a_later_bare_repeat(monkeypatch):
    """A repeat with its id may be followed by an older call still on its way: that call,
    kept once it arrives, must not make a note of the repeat look pending (a later bare
    repeat was then numbered as it, and failed)."""
    f, g = prepare(len, [b"y" * 300]), prepare(add, [9])
    late, big, small = prepare(add, [1]), prepare(len, [b"x" * 2000]), prepare(add, [5])
    size = {id(c): len(c.fn) + len(c.args) for c in (f, late, big)}
    monkeypatch.setattr(calls, "RECENT_BYTES", size[id(big)] + size[id(late)] + 10)
    dispatcher, rank = Dispatcher(), RankCalls()
    first = _decide(dispatcher, late)  # call 1, slow to reach this rank
    second = _decide(dispatcher, f)  # call 2
    deliver(rank, second)
    dispatcher.completed(f, second)
    repeat = _decide(dispatcher, f)  # call 3 repeats call 2, with its id (call 1 in flight)
    assert repeat.again and not repeat.bare
    after = [_decide(dispatcher, c) for c in (big, small)]  # calls 4 and 5 name call 3
    assert [m.repeat_in_flight for m in after] == [(3, False), (3, False)]
    assert deliver(rank, repeat) == 300
    assert deliver(rank, after[0]) == 2000  # past the bytes: calls 2 and 3 leave
    assert deliver(rank, first) == 1  # older than every call kept, and kept
    assert deliver(rank, after[1]) == 5  # names call 3, which ran here
    for call, message in zip((late, f, big, small), (first, repeat, *after), strict=True):
        dispatcher.completed(call, message)
    sixth = _decide(dispatcher, g)
    assert deliver(rank, sixth) == 9
    dispatcher.completed(g, sixth)
    bare = _decide(dispatcher, g)  # call 7, nothing in flight
    assert bare.bare and deliver(rank, bare) == 9


def test_a_call_to_rank_0_alone_counts_as_in_flight_until_it_completes():
    dispatcher = Dispatcher()
    call, single_call = prepare(add, [1]), prepare_execute(len)
    single = _decide(dispatcher, single_call, all_ranks=False)  # call 1, in flight
    dispatcher.completed(call, _decide(dispatcher, call))  # call 2
    repeat = _decide(dispatcher, call)  # call 3 repeats call 2
    assert repeat.again and not repeat.bare
    dispatcher.completed(single_call, single)
    dispatcher.completed(call, repeat)
    assert _decide(dispatcher, call).bare  # call 4: nothing in flight any more


def test_the_rank_repeats_its_latest_call_with_fresh_arguments():
    rank, dispatcher = RankCalls(), Dispatcher()

    def append(items):
        items.append(1)
        return len(items)

    call = prepare(append, [[]])
    assert deliver(rank, _decide(dispatcher, call)) == 1
    for call_id in (2, 3):
        function, args = rank.repeat(call_id)
        assert invoke(function, args, None) == 1  # the list is unpickled anew each time


def test_a_repeat_finds_its_call_by_id_whatever_ran_after_it():
    """Seen with four threads calling one job: the repeat of call 19 reached a rank after
    calls 20 to 23 of other threads had run there ("latest here: 23")."""
    rank = RankCalls()
    for call_id, value in ((2, 2), (4, 4), (3, 3), (1, 1)):  # in another order than ids
        call = prepare(add, [value])
        rank.resolve(call_id, None, call.fn, call.args)
    function, args = rank.repeat(4)  # call 3, which ran third of four
    assert invoke(function, args, None) == 3


def test_a_rank_keeps_its_recent_calls_within_their_bounds(monkeypatch):
    from horovod_ray.rank import calls

    rank = RankCalls()
    for call_id in range(1, calls.RECENT_CALLS + 2):
        call = prepare(add, [call_id])
        rank.resolve(call_id, None, call.fn, call.args)
    assert invoke(*rank.repeat(calls.RECENT_CALLS + 2), None) == calls.RECENT_CALLS + 1
    with pytest.raises(RuntimeError, match="call 2 repeats call 1, which this rank no longer"):
        rank.repeat(2)  # the oldest was let go
    big = prepare(add, [b"x" * 1000])
    monkeypatch.setattr(calls, "RECENT_BYTES", 2500)
    rank = RankCalls()
    for call_id in (1, 2, 3):
        rank.resolve(call_id, None, big.fn, big.args)
    with pytest.raises(RuntimeError):
        rank.repeat(2)  # past the bytes, only the newest two stay
    assert rank.repeat(4)[1] == big.args


def test_the_cache_is_bounded_by_count_and_by_bytes():
    rank, by_count = RankCalls(), Dispatcher(cache_size=1)
    assert deliver(rank, _decide(by_count, prepare(add, [1]))) == 1
    uncached = _decide(by_count, prepare(len, [[1, 2]]))
    assert uncached.key is None and uncached.fn is not None
    assert deliver(rank, uncached) == 2
    by_count.completed(prepare(add, [1]), _decide(by_count, prepare(add, [2])))
    cached = _decide(by_count, prepare(add, [3]))
    assert cached.fn is None and deliver(rank, cached) == 3  # the first one stays cached
    small = prepare(add)
    rank, by_bytes = RankCalls(), Dispatcher(cache_bytes=len(small.fn) + 10)
    assert _decide(by_bytes, small).key == 1
    rank.resolve(1, 1, small.fn, small.args)
    assert _decide(by_bytes, prepare(lambda: None)).key is None  # past the byte bound
    assert deliver(rank, _decide(by_bytes, prepare(add, [4]))) == 4


def test_execute_calls_pass_the_executable():
    rank, dispatcher = RankCalls(), Dispatcher()
    assert deliver(rank, _decide(dispatcher, prepare_execute(lambda ex: ex * 2)), 21) == 42


def test_call_ids_are_unique_across_threads():
    dispatcher = Dispatcher()
    call = prepare(add, [1])
    ids = []

    def many():
        ids.extend(_decide(dispatcher, call).call_id for _ in range(200))

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


class _RecordingWorker:
    """An actor handle that records what it is sent, in the order it is submitted; a
    repeat's submission takes ``again_delay_s`` (a thread descheduled mid-send)."""

    def __init__(self, log: list, again_delay_s: float = 0.0) -> None:
        log_call = log.append

        class Method:
            def __init__(self, kind: str) -> None:
                self.kind = kind

            def remote(self, *args):
                if self.kind.startswith("again"):
                    time.sleep(again_delay_s)
                log_call((self.kind, args))

        self.call = Method("call")
        self.again = Method("again")
        self.again_next = Method("again_next")


def test_a_repeat_is_never_overtaken_by_a_later_large_call(monkeypatch):
    """Thread A repeats the last call, thread B sends a call large enough to evict every
    older call from a rank's recent ones. B's message used to reach a rank first when A
    was slow to send (sends ran outside the dispatcher's lock) and the rank failed with
    "call 3 repeats call 2, which this rank no longer holds"."""
    monkeypatch.setattr(calls, "RECENT_BYTES", 4096)
    monkeypatch.setattr(calls, "PUT_ABOVE_BYTES", 1 << 30)  # no object store without Ray
    dispatcher, log = Dispatcher(), []
    worker = _RecordingWorker(log, again_delay_s=0.3)
    small = prepare(add, [1])
    first, _ = dispatcher.send(small, [worker])
    dispatcher.completed(small, first)
    repeat = threading.Thread(target=dispatcher.send, args=(small, [worker]))
    repeat.start()
    time.sleep(0.05)  # A holds its message; B's comes next
    dispatcher.send(prepare(add, [b"x" * 8192, b""]), [worker])
    repeat.join()
    assert [(kind, args[:1]) for kind, args in log] == [
        ("call", (1,)),
        ("again_next", ()),  # nothing else in flight: no argument
        ("call", ((3, 2, True),)),  # sent while repeat 2 is in flight: names it
    ]
    assert [len(args) for _, args in log] == [4, 0, 4]  # as_raised only when True
    rank, results = RankCalls(), []
    for kind, args in log:  # what the rank's actor does, in arrival order
        if kind == "again_next":
            function, payload = rank.repeat(rank.next_repeat_id())
        else:
            call_id = args[0][0] if isinstance(args[0], tuple) else args[0]
            function, payload = rank.resolve(call_id, *args[1:4])
        results.append(invoke(function, payload, None))
    assert results == [1, 1, b"x" * 8192]
