"""A static job that hung (horovod's stall inspector, Gloo's timeout) as pure functions:
reports and ranks in, who was missing and the caller's error out. No Ray."""

from __future__ import annotations

import pickle

import pytest

from horovod_ray import HangError, WorkerFailedError
from horovod_ray.failures.attribution import RankView, Seen, Snapshot
from horovod_ray.failures.hangs import (
    collectives_stopped,
    gloo_timed_out,
    hang_error,
    stall_report,
    stalled,
)

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

A, D = Seen.ALIVE, Seen.DIED

# --------------------------------------------------------------------- a stalled job

SHUT = "UnknownError: Horovod has been shut down. This was caused by an exception ..."
# What horovod 0.28.1's stall inspector writes on rank 0's stderr (patched: see patches/).
REPORT = """\
[2026-12-01 04:30:01.1: W horovod/common/stall_inspector.cc:105] One or more tensors were \
submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for \
remainder of ranks for more than 1 seconds. This may indicate ...
Missing ranks:
2: [HorovodAllreduce_Const_0]
[2026-12-01 04:30:04.1: E horovod/common/stall_inspector.cc:105] One or more tensors ...
Missing ranks:
1: [HorovodAllgather_y_0]
2!: [HorovodAllreduce_Const_0, HorovodAllgather_y_0]
One or more rank (marked by "!") is stalled for longer than 3 seconds. Will shutdown.
"""

# Ranks out of step (rank 0 in an allreduce, rank 1 in a broadcast), looked at when rank
# 0's collective was past the shutdown time and rank 1's not yet (seen in CI).
OUT_OF_STEP = "Missing ranks:\n0: [broadcast.noname.1]\n1!: [allreduce.noname.1]\n"


def test_the_stall_report_is_read_from_its_last_occurrence():
    assert stall_report(REPORT) == {
        1: (False, "HorovodAllgather_y_0"),
        2: (True, "HorovodAllreduce_Const_0, HorovodAllgather_y_0"),
    }
    assert stall_report("no report here") == {}


def _stall_views(raised: list[str | None], running: list[bool], seen: str = "aaa"):
    states = {"a": A, "d": D}
    return Snapshot(
        tuple(
            RankView("n", f"on node n, rank {r}", text, states[seen[r]], running=run)
            for r, (text, run) in enumerate(zip(raised, running, strict=True))
        )
    )


@pytest.mark.parametrize(
    "raised, running, seen, report, missing, waiting",
    [
        # The report names who was past the shutdown time; rank 1, only behind rank 0 in
        # a collective rank 2 never entered either, waited.
        ([SHUT, SHUT, None], [False, False, True], "aaa", REPORT, (2,), (0, 1)),
        # Rank 1 had not raised yet when looked at: the report still says who was missing.
        ([SHUT, None, None], [False, True, True], "aaa", REPORT, (2,), (0, 1)),
        # No report (stderr not a file): the live ranks still in the call.
        ([SHUT, SHUT, None], [False, False, True], "aaa", "", (2,), (0, 1)),
        # Rank 2 waited in another collective than the others, entered too recently to be
        # in the report: every rank raised.
        ([SHUT, SHUT, SHUT], [False, False, False], "aaa", REPORT, (2,), (0, 1)),
        # Out of step: each missed the other's collective, rank 1 first past the time.
        ([SHUT, SHUT], [False, False], "aa", OUT_OF_STEP, (0, 1), ()),
        # Ranks 0 and 1 in one collective, rank 2 in another: all of them missing.
        ([SHUT] * 3, [False] * 3, "aaa", "Missing ranks:\n0: [B]\n1: [B]\n2!: [A]", (0, 1, 2), ()),
    ],
)
def test_a_shut_down_with_ranks_still_in_the_call_is_a_stall(
    raised, running, seen, report, missing, waiting
):
    stall = stalled(_stall_views(raised, running, seen), stall_report(report))
    assert (stall.missing, stall.waiting) == (missing, waiting)


def test_a_shortened_line_of_the_report_still_names_its_last_collective():
    """horovod writes six names and " ..." at most: rank 1 misses f as rank 2 does, so
    rank 1 did not enter f and rank 2 is not out of step with it; it entered b1, which
    rank 0 misses."""
    report = stall_report("Missing ranks:\n0: [b1]\n1!: [a, b, c, d, e, f ...]\n2: [f]\n")
    stall = stalled(_stall_views([SHUT] * 3, [False] * 3), report)
    assert (stall.missing, stall.waiting) == ((0, 1), (2,))


def test_names_a_shortened_line_left_out_are_not_taken_as_entered():
    """Rank 2 misses eight gradients, six of them written: whether it entered g7, which
    sorts after them, the report does not say, so rank 1, behind in g7, waited."""
    gradients = ", ".join(f"g{i}" for i in range(6))
    report = stall_report(f"Missing ranks:\n1: [g7]\n2!: [{gradients} ...]\n")
    stall = stalled(_stall_views([SHUT, SHUT, None], [False, False, True]), report)
    assert (stall.missing, stall.waiting) == ((2,), (0, 1))
    # A name before its last written one is one it entered: rank 1 is out of step (this
    # half guards against a rule that would take nothing of a shortened line as known).
    report = stall_report("Missing ranks:\n1: [a]\n2!: [b, c, d, e, f, g ...]\n")
    stall = stalled(_stall_views([SHUT] * 3, [False] * 3), report)
    assert (stall.missing, stall.waiting) == ((1, 2), (0,))


@pytest.mark.parametrize(
    "raised, running, seen",
    [
        (["ValueError: bad", None, None], [False, True, True], "aaa"),  # a user's error
        ([SHUT, "ValueError: bad", None], [False, False, True], "aaa"),  # not all shut down
        ([SHUT, SHUT, None], [False, False, False], "aad"),  # a rank was lost
    ],
)
def test_other_failures_are_no_stall(raised, running, seen):
    assert stalled(_stall_views(raised, running, seen), stall_report(REPORT)) is None


def test_a_shut_down_without_a_report_or_a_rank_in_the_call_is_no_stall():
    """horovod shut down for another reason (a rank ended early) leaves no report."""
    assert stalled(_stall_views([SHUT, SHUT, SHUT], [False] * 3), {}) is None


def test_a_hang_error_names_missing_and_waiting_ranks_with_stacks_and_collectives():
    views = _stall_views([SHUT, SHUT, None], [False, False, True])
    stall = stalled(views, stall_report(REPORT))
    stack = 'Thread "MainThread" (1):\n  File "train.py", line 7, in step\n    time.sleep(60)\n'
    error = hang_error(stall, views, 3, {2: stack})
    assert isinstance(error, HangError) and isinstance(error, WorkerFailedError)
    assert (error.missing, error.waiting, list(error.failures)) == ((2,), (0, 1), [2])
    text = str(error)
    assert text.startswith(
        "Horovod job hung: rank(s) 2 did not reach a collective that rank(s) 0, 1 waited "
        "in for more than stall_timeout_s=3s; the job was stopped."
    )
    assert "[HorovodAllreduce_Const_0, HorovodAllgather_y_0]" in text
    assert "on node n, rank 2; its Python stacks then:" in text and "time.sleep(60)" in text
    assert pickle.loads(pickle.dumps(error)).missing == (2,)  # crosses processes intact


def test_ranks_that_each_miss_the_others_collective_are_named_so():
    views = _stall_views([SHUT, SHUT], [False, False], "aa")
    report = stall_report("Missing ranks:\n0!: [HorovodBroadcast_0]\n1!: [HorovodAllreduce]\n")
    error = hang_error(stalled(views, report), views, 2, {})
    assert (error.missing, error.waiting) == ((0, 1), ())
    assert "rank(s) 0, 1 waited in different collectives, each missing from the others'" in str(
        error
    )
    assert "not read: it was not in the call any more" in error.failures[0]


# What each rank's stderr says when Gloo gave up on a silent network (seen on the simulated
# hosts, test/hosts: the rank that timed out closed its pairs; a peer can see them close).
_LOG = "[2026-12-01 08:01:22.5: E horovod/common/operations.cc:697] [{r}]: "
TIMED_OUT = _LOG + "Horovod background loop uncaught exception: {text}\n"
APPLICATION = "Application timeout caused pair closure"
CLOSED = "[gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.213.8.3]:41234"
WAITED = "[gloo/transport/tcp/unbound_buffer.cc:136] Timed out waiting 10000ms for send operation"


def _stderr(*texts: str) -> list[str]:
    return [
        f"noise\n{TIMED_OUT.format(r=r, text=t)}" if t else "noise\n" for r, t in enumerate(texts)
    ]


def test_every_rank_timed_out_in_gloo_is_a_hang_with_no_rank_missing():
    views = _stall_views([SHUT, SHUT, SHUT], [False] * 3)
    error = gloo_timed_out(views, _stderr(APPLICATION, CLOSED, WAITED), 10)
    assert isinstance(error, HangError)
    assert (error.missing, error.waiting, sorted(error.failures)) == ((), (0, 1, 2), [0, 1, 2])
    assert str(error).startswith(
        "Horovod job hung: every rank waited inside a collective for its peers' data for "
        "timeout_s=10s and none came"
    )
    assert f"--- rank 1: waited on node n, rank 1; Gloo: {CLOSED}" in str(error)


# What a collective raises when Gloo's error reaches it in flight (seen in CI on the
# simulated hosts): the rank's own error says it, not horovod's shut-down text.
RAISED_WAIT = (
    "tensorflow.python.framework.errors_impl.UnknownError: {{function_node "
    "__wrapped__HorovodAllreduce_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
    "[/b/horovod-0.28.1/third_party/compatible17_gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
    "Timed out waiting 10000ms for recv operation to complete [Op:HorovodAllreduce] name: loop"
)


def test_ranks_whose_collective_raised_gloos_timeout_are_a_hang_too():
    raised = f"Traceback:\n  File x\n{RAISED_WAIT}\n"
    views = _stall_views([raised, SHUT, raised], [False] * 3)
    error = gloo_timed_out(views, _stderr("", CLOSED, ""), 10)
    assert isinstance(error, HangError)
    assert (error.missing, error.waiting) == ((), (0, 1, 2))
    assert error.failures[0] == (
        "waited on node n, rank 0; Gloo: [/b/horovod-0.28.1/third_party/compatible17_gloo/"
        "gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation "
        "to complete [Op:HorovodAllreduce] name: loop"
    )
    assert error.failures[1] == f"waited on node n, rank 1; Gloo: {CLOSED}"


@pytest.mark.parametrize(
    "raised, stopped",
    [(SHUT, True), (RAISED_WAIT, True), (f"x\n{CLOSED}", True), ("ValueError: x", False)],
)
def test_collectives_stopped_reads_horovods_and_gloos_words(raised, stopped):
    assert collectives_stopped(raised) is stopped


@pytest.mark.parametrize(
    "raised, seen, texts",
    [
        ([SHUT, SHUT, SHUT], "aaa", (CLOSED, CLOSED, CLOSED)),  # a peer died: nobody timed out
        ([SHUT, SHUT, SHUT], "aad", (APPLICATION,) * 3),  # a rank was lost
        ([SHUT, SHUT, "ValueError: x"], "aaa", (APPLICATION,) * 3),  # a rank's own error
        ([SHUT, SHUT, SHUT], "aaa", (APPLICATION, APPLICATION, "")),  # one stderr unread
        ([SHUT, SHUT, SHUT], "aaa", (APPLICATION, APPLICATION, "Something else")),
    ],
)
def test_other_shut_downs_are_no_gloo_timeout(raised, seen, texts):
    assert gloo_timed_out(_stall_views(raised, [False] * 3, seen), _stderr(*texts), 10) is None
