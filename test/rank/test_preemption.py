"""The preemption notice's pure parts and its folder (no Ray): what the driver writes,
what a rank reads, how long a static job waits. The real drains: test/job/test_multinode.py
(static jobs, run() and the command line) and test/job/test_elastic.py."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

import horovod_ray
from horovod_ray.job import draining
from horovod_ray.rank import preemption, session

pytestmark = pytest.mark.unit


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A rank's notice folder, and a session of its own (no notice remembered)."""
    monkeypatch.setenv(preemption.PREEMPTION_DIR_ENV, str(tmp_path))
    with session.installed(session.RankSession()):
        yield tmp_path


def test_no_notice_is_none_and_the_rank_is_marked_as_asking(folder):
    assert preemption.state() == (False, False)
    assert horovod_ray.get_preemption_info() is None
    assert preemption.state() == (True, False)


def test_the_latest_notice_is_given_as_ray_trains_preemption_info(folder):
    preemption.deliver(1, preemption.notice(1, 1_000, {"b": [1]}, restart=True))
    preemption.deliver(2, preemption.notice(2, 900, {"b": [1], "a": [3, 2]}, restart=True))
    info = horovod_ray.get_preemption_info()
    assert type(info).__name__ == "PreemptionInfo"
    assert info.deadline_ms == 900
    assert info.preempted_node_to_ranks == {"a": [2, 3], "b": [1]}
    assert info.preempted_ranks == [1, 2, 3]
    assert preemption.stops_after_checkpoint()
    assert not list(folder.glob("*.tmp"))


def test_an_elastic_jobs_notice_does_not_stop_the_rank(folder):
    preemption.deliver(1, preemption.notice(1, None, {"a": [0]}, restart=False))
    assert horovod_ray.get_preemption_info().deadline_ms is None
    assert not preemption.stops_after_checkpoint()


def test_a_notice_rank_0_holds_is_waited_for(folder, monkeypatch):
    """Rank 0's number came first (a broadcast): the rank waits for its own copy."""
    monkeypatch.setattr(preemption, "_agree", lambda version: 1)
    text = preemption.notice(1, 5, {"a": [0]}, restart=True)
    threading.Timer(0.2, preemption.deliver, args=(1, text)).start()
    assert horovod_ray.get_preemption_info().deadline_ms == 5


def test_a_notice_that_never_comes_is_an_error(folder, monkeypatch):
    monkeypatch.setattr(preemption, "_agree", lambda version: 3)
    monkeypatch.setattr(preemption, "NOTICE_WAIT_S", 0.1)
    with pytest.raises(horovod_ray.HorovodRayError, match="notice 3, which did not reach"):
        horovod_ray.get_preemption_info()


def test_outside_a_job_it_says_where_it_answers(monkeypatch):
    monkeypatch.delenv(preemption.PREEMPTION_DIR_ENV, raising=False)
    monkeypatch.delenv("HOROVOD_RAY_JOB_ID", raising=False)
    with pytest.raises(horovod_ray.HorovodRayError, match="on a rank of a horovod_ray job"):
        horovod_ray.get_preemption_info()


def test_the_notice_text_is_sorted_json():
    text = preemption.notice(4, None, {"b": [2, 1], "a": [0]}, restart=False)
    assert json.loads(text) == {
        "version": 4,
        "deadline_ms": None,
        "nodes": {"a": [0], "b": [1, 2]},
        "restart": False,
    }


@pytest.mark.parametrize(
    ("leaving", "wait_s"),
    [
        ({"a": 120.0}, 115.0),  # up to the deadline, less the margin
        ({"a": 120.0, "b": 30.0}, 25.0),  # the nearest
        ({"a": 3.0}, 0.0),  # no time left
        ({"a": math.inf}, draining.JUST_IN_TIME_NO_DEADLINE_S),
    ],
)
def test_a_static_job_waits_for_the_checkpoint_within_the_deadline(leaving, wait_s):
    assert draining.just_in_time_s(leaving) == wait_s


def test_the_deadline_is_given_in_ms_since_the_epoch():
    assert draining.deadline_ms({"a": 30.0, "b": 10.5}, now_s=1_000.0) == 1_010_500
    assert draining.deadline_ms({"a": math.inf}, now_s=1_000.0) is None


def test_unstopped_rank_0_goes_on_after_its_checkpoint(folder, monkeypatch):
    """A call that no drain is watched in (run_remote) never stops rank 0: past the
    deadline it returns, and later reports do not wait again."""
    monkeypatch.setattr(preemption, "UNSTOPPED_S", 0.05)
    preemption.deliver(1, preemption.notice(1, 1_000, {"a": [1]}, restart=True))
    horovod_ray.get_preemption_info()
    assert preemption.stops_after_checkpoint()
    preemption.saved_then_wait()
    assert preemption.state() == (True, True)
    assert not preemption.stops_after_checkpoint()


class _Ref:
    def __init__(self, value=None) -> None:
        self.value = value


class _Method:
    def __init__(self, calls: list, answer=None) -> None:
        self.calls, self.answer = calls, answer

    def remote(self, *args):
        self.calls.append(args)
        return _Ref(self.answer() if self.answer else None)


class _Actor:
    """A rank's actor as Grace uses it: it records the notices it is told, and answers
    rank 0's state as ``state`` says then."""

    def __init__(self, state=(False, False)) -> None:
        self.told: list = []
        self.state = state
        self.preempt = _Method(self.told)
        self.preemption_state = _Method([], lambda: self.state)


class _Watch:
    def __init__(self) -> None:
        self.leaving: dict[str, float] = {}

    def draining(self) -> dict[str, float]:
        return dict(self.leaving)


@pytest.fixture
def grace(monkeypatch):
    """A Grace over two fake ranks on nodes a and b, its Ray calls answered at once."""
    monkeypatch.setattr(draining.ray, "wait", lambda refs, **_: (list(refs), []))
    monkeypatch.setattr(draining.ray, "get", lambda ref: ref.value)
    monkeypatch.setattr(draining.probe, "error_of", lambda ref: None)
    monkeypatch.setattr(draining, "ASK_RANK0_EVERY_S", 0.0)
    watch, actors = _Watch(), [_Actor(), _Actor()]

    def make(keeps: bool = True) -> draining.Grace:
        return draining.Grace(watch, actors, ["a", "b"], keeps)

    return make, watch, actors


def test_grace_does_nothing_until_a_node_drains(grace):
    make, _, actors = grace
    make().check()
    assert actors[0].told == actors[1].told == []


def test_a_job_without_storage_stops_at_once_untold(grace):
    make, watch, actors = grace
    watch.leaving = {"b": 60.0}
    with pytest.raises(draining.LeavingError):
        make(keeps=False).check()
    assert actors[0].told == actors[1].told == []


def test_every_rank_is_told_and_the_job_stops_once_rank_0_saved(grace):
    make, watch, actors = grace
    job = make()
    watch.leaving = {"b": 60.0}
    actors[0].state = (True, False)
    job.check()  # told; rank 0 asked and has not saved yet: the ranks go on
    job.check()
    (told,) = actors[1].told
    assert actors[0].told == [told]
    number, text = told
    notice = json.loads(text)
    assert (number, notice["nodes"], notice["restart"]) == (1, {"b": [1]}, True)
    assert notice["deadline_ms"] / 1000 == pytest.approx(time.time() + 60, abs=5)
    watch.leaving = {"b": 60.0, "a": math.inf}  # a second node drains: notice 2
    job.check()
    assert [n for n, _ in actors[1].told] == [1, 2]
    assert json.loads(actors[1].told[1][1])["nodes"] == {"a": [0], "b": [1]}
    actors[0].state = (True, True)
    job.check()  # the answer asked for in the last pass
    with pytest.raises(draining.LeavingError):
        job.check()


def test_a_function_that_never_asks_is_stopped_once_rank_0_answers(grace):
    make, watch, _ = grace
    job = make()
    watch.leaving = {"b": 60.0}
    job.check()  # rank 0's answer is asked for
    with pytest.raises(draining.LeavingError):
        job.check()


def test_the_wait_ends_at_the_deadline(grace, caplog):
    make, watch, actors = grace
    actors[0].state = (True, False)  # asked, and never saves
    watch.leaving = {"b": draining.UPLOAD_MARGIN_S + 0.3}  # 0.3 s to wait
    job = make()
    job.check()
    job.check()
    time.sleep(0.4)
    with pytest.raises(draining.LeavingError):
        job.check()
    assert "committed no checkpoint reported after it in time" in caplog.text


def test_an_elastic_runs_notices_name_every_draining_node_that_held_ranks():
    notices = draining.Notices()
    notices.add("idle", [], 1_000)  # held no rank: no notice
    assert notices.since(0) == []
    notices.add("a", [2], 2_000)
    notices.add("b", [0, 1], None)
    (first, second) = notices.since(0)
    assert [first[0], second[0]] == [1, 2] and notices.since(1) == [second]
    assert json.loads(second[1]) == {
        "version": 2,
        "deadline_ms": 2_000,
        "nodes": {"a": [2], "b": [0, 1]},
        "restart": False,
    }


@pytest.mark.parametrize(("delete_local", "kept"), [(None, False), (False, True), (True, False)])
def test_the_just_in_time_checkpoint_keeps_a_folder_the_caller_keeps(
    folder, monkeypatch, tmp_path, delete_local, kept
):
    """Rank 0's checkpoint on a static job's notice: its folder goes once committed (the
    process is stopped before the caller could remove it), but not with
    ``delete_local_checkpoint_after_upload=False``."""
    from pathlib import Path

    from ray.train import Checkpoint

    from horovod_ray.checkpoints import spec, store
    from horovod_ray.rank import report

    storage = spec.create(str(tmp_path / "store"), "run")
    for key, value in storage.to_env(None).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setattr(preemption, "UNSTOPPED_S", 0.0)
    assert session.current().waited == 0  # no notice was waited for yet (the fixture's)
    preemption.deliver(1, preemption.notice(1, 1_000, {"a": [1]}, restart=True))
    horovod_ray.get_preemption_info()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "weights").write_text("1")
    try:
        report.report(
            {"step": 1},
            Checkpoint.from_directory(str(mine)),
            delete_local_checkpoint_after_upload=delete_local,
        )
    finally:
        report.close_uploader()
    (entry,) = store.list_entries(storage)
    assert entry.committed
    assert Path(storage.run_path, "checkpoint_000001", "weights").read_text() == "1"
    assert mine.exists() is kept
