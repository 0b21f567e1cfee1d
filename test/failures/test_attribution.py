"""Failure policy as pure functions, for both kinds of job: tables, no Ray."""

from __future__ import annotations

import dataclasses

import pytest

from horovod_ray import (
    ElasticLimitError,
    HorovodRayError,
    RendezvousError,
    WorkerFailedError,
)
from horovod_ray.failures.attribution import (
    ElasticEnd,
    RankView,
    Seen,
    Snapshot,
    attribute,
    elastic_error,
    error_for,
    gone_nodes,
)

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

A, D, U, S = Seen.ALIVE, Seen.DIED, Seen.UNREACHABLE, Seen.SILENT


def snapshot(layout: str, seen: str, raised: str = "", joined: str = "", **kw) -> Snapshot:
    """One letter per rank: ``layout`` its node, ``seen`` its process (a/d/u/s), ``raised``
    x where its call raised, ``joined`` n where it never joined the rendezvous."""
    states = {"a": A, "d": D, "u": U, "s": S}
    views = tuple(
        RankView(
            node_id=node,
            where=f"on node {node}",
            raised="Boom" if raised[i : i + 1] == "x" else None,
            seen=states[seen[i]],
            lost_text=f"lost on {node}" if seen[i] != "a" else "",
            joined=joined[i : i + 1] != "n",
        )
        for i, node in enumerate(layout)
    )
    return Snapshot(views, **kw)


@pytest.mark.parametrize(
    "layout, seen, raised, kind, causes, consequences",
    [
        # One rank raised; the others are fine.
        ("aab", "aaa", ".x.", "raised", {1}, set()),
        # A rank's process died; its peers raised because of it.
        ("aa", "ad", "x.", "lost", {1}, {0}),
        # Node b removed (Ray reports its ranks dead); rank 0 on node a died after it.
        ("aabb", "dadd", "", "lost", {2, 3}, {0}),
        # Node b unreachable while one of its ranks still answered; rank 0 followed.
        ("aabb", "daua", "", "lost", {2}, {0}),
        # A rank hung: silent, the others raised (their collective timed out).
        ("aab", "aas", "xx.", "lost", {2}, {0, 1}),
        # Everything lost: no node to tell apart, every rank a cause.
        ("aabb", "dddd", "", "lost", {0, 1, 2, 3}, set()),
    ],
)
def test_attribute(layout, seen, raised, kind, causes, consequences):
    verdict = attribute(snapshot(layout, seen, raised))
    assert verdict.kind == kind
    assert set(verdict.causes) == causes
    assert verdict.consequences == consequences


def test_a_node_whose_ranks_all_died_but_that_answers_is_not_gone():
    # A host lost (c, unreachable) while the one rank of node a was aborted by horovod:
    # node a answers the probe, so its rank followed c. Had it not, both were lost.
    alive = snapshot("abc", "dau", node_alive={"a": True})
    assert gone_nodes(alive) == {"c"}
    assert set(attribute(alive).causes) == {2}
    dead = snapshot("abc", "dau", node_alive={"a": False})
    assert gone_nodes(dead) == {"a", "c"}
    assert set(attribute(dead).causes) == {0, 2}
    # Two nodes wholly dead, one left: both are causes unless the probe says otherwise.
    assert set(attribute(snapshot("abc", "add")).causes) == {1, 2}
    answered = snapshot("abc", "add", node_alive={"b": True, "c": False})
    assert set(attribute(answered).causes) == {2}
    assert attribute(answered).consequences == {1}


def test_ranks_that_never_joined_the_rendezvous_are_a_rendezvous_timeout():
    # Rank 2 never called hvd.init(); ranks 0 and 1 raised when Gloo gave up on it.
    stuck = snapshot("aab", "aaa", raised="xx.", joined="..n", elapsed_s=61, timeout_s=60)
    verdict = attribute(stuck)
    assert (verdict.kind, verdict.stuck) == ("rendezvous", (2,))
    error = error_for(verdict, 60)
    assert isinstance(error, RendezvousError)
    assert "rank 2 never joined the Gloo rendezvous within timeout_s=60s" in str(error)
    assert "--- rank 0: raised on node a:\nBoom" in str(error)
    # Before the timeout it is the raise that counts; and when a rank that did not join
    # failed on its own, that failure is the cause.
    assert attribute(snapshot("aab", "aaa", "xx.", "..n", elapsed_s=5, timeout_s=60)).kind == (
        "raised"
    )
    assert attribute(snapshot("aab", "aad", "", "..n", elapsed_s=61, timeout_s=60)).kind == "lost"
    # Unknown joins (an in-cluster rendezvous that cannot answer) never make a timeout.
    known = snapshot("aab", "aaa", "xx.", "..n", elapsed_s=61, timeout_s=60)
    unknown = dataclasses.replace(
        known, ranks=tuple(dataclasses.replace(v, joined=None) for v in known.ranks)
    )
    assert attribute(unknown).kind == "raised"


def test_error_for_names_causes_and_lists_consequences_apart():
    error = error_for(attribute(snapshot("aabb", "dadd")), 60)
    assert isinstance(error, WorkerFailedError)
    assert sorted(error.failures) == [2, 3]
    assert "Ranks 0 failed after losing their peers (not the cause)." in str(error)
    raised = error_for(attribute(snapshot("ab", "aa", ".x")), 60)
    assert raised.failures == {1: "raised on node b:\nBoom"}


# ------------------------------------------------------------------------ elastic jobs

ELASTIC = {"min_workers": 2, "reset_limit": 3, "elastic_timeout_s": 30}


@pytest.mark.parametrize(
    "end, error, parameter, text",
    [
        # A clean end: every rank of the final world returned.
        (ElasticEnd(4, final_size=4, num_results=4), None, None, ""),
        # Too few slots for too long wins over whatever else the driver says.
        (
            ElasticEnd(1, timed_out_waiting=True, driver_message="no hosts", final_size=2),
            ElasticLimitError,
            "min_workers",
            "elastic_timeout=30s (wanted 2, the cluster could hold 1)",
        ),
        (
            ElasticEnd(4, driver_message="exceeded", reset_limit_hit=True, final_size=4),
            ElasticLimitError,
            "reset_limit",
            "more than reset_limit=3 resets",
        ),
        (ElasticEnd(4, crashed=RuntimeError("driver bug")), HorovodRayError, None, "driver bug"),
        # The final world's failures, and the driver's reason as rank -1.
        (
            ElasticEnd(
                2,
                driver_message="no host of the last world left",
                exit_failed=True,
                final_size=2,
                last_failures={1: "process died on node b"},
            ),
            WorkerFailedError,
            None,
            "process died on node b",
        ),
        # A rank that returned nothing, though every exit code was 0.
        (ElasticEnd(2, final_size=2, num_results=1), WorkerFailedError, None, "every result"),
    ],
)
def test_how_an_elastic_run_ended_decides_its_error(end, error, parameter, text):
    raised = elastic_error(end, **ELASTIC)
    if error is None:
        assert raised is None
        return
    assert type(raised) is error
    assert text in str(raised)
    if parameter is not None:
        assert raised.limit == parameter
    if end.driver_message and error is WorkerFailedError:
        assert "horovod's elastic driver gave up" in raised.failures[-1]


def test_the_reset_limit_is_read_from_horovods_own_message():
    """horovod's driver says why it stopped only in text: pin the text we look for."""
    from horovod.runner.elastic.constants import RESET_LIMIT_EXCEEDED_MESSAGE

    from horovod_ray.job.elastic_driver import reset_limit_hit

    assert RESET_LIMIT_EXCEEDED_MESSAGE == (
        "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"
    )
    assert reset_limit_hit(RESET_LIMIT_EXCEEDED_MESSAGE.format(3))
    assert not reset_limit_hit("Horovod was shutdown: no hosts available")
    assert not reset_limit_hit("")
