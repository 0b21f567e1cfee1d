"""One rank session holds a rank's state: installed, given back, and nowhere else."""

from __future__ import annotations

import ast
import pathlib

import pytest

from horovod_ray.rank import datasets, logs, report, session

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

RANK = pathlib.Path(__file__).resolve().parents[2] / "horovod_ray" / "rank"


def test_an_installed_session_is_the_one_each_concern_reads_and_the_last_comes_back():
    outer = session.current()
    inner = session.RankSession(channel=[], local=True, shards={"train": "iterator"})
    with session.installed(inner):
        assert session.current() is inner
        assert datasets.get_dataset_shard("train") == "iterator"
        report.use_tune_session("a trial")
        assert report.tune_session() == "a trial"
    assert session.current() is outer
    assert outer.tune is None and outer.shards is None


def test_a_session_of_its_own_is_not_anothers():
    """A local run's session inside a rank: the rank's channel gets nothing it posts."""

    class Channel(list):
        put = list.append

    rank, local = Channel(), Channel()
    with session.installed(session.RankSession(channel=rank)):
        with session.installed(session.RankSession(channel=local)):
            logs.post({"loss": 1.0})
        logs.post({"loss": 2.0})
    assert local == [{"loss": 1.0}] and rank == [{"loss": 2.0}]


def test_no_rank_module_keeps_rank_state_in_a_global_of_its_own():
    """The rank's state is the session's; ``priority``'s once-a-process note is the
    driver's half (the niced ranks' hint), and ``session`` holds the one it installs."""
    holders = {}
    for path in sorted(RANK.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = [n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names]
        if names:
            holders[path.stem] = names
    assert holders == {"priority": ["_noted"], "session": ["_session"]}


def test_a_local_runs_session_is_its_threads_and_the_others_keep_the_processs():
    """A rank's control thread answers for the rank (its log channel, its timeline) while
    the rank's own call thread runs a local run."""
    import threading

    process = session.current()
    seen = []
    with session.installed(session.RankSession(local=True)) as local:
        other = threading.Thread(target=lambda: seen.append(session.current()))
        other.start()
        other.join()
        assert session.current() is local
    assert seen == [process] and session.current() is process
