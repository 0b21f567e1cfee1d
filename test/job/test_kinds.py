"""Each kind of job implements its protocol whole (``job/kinds``): what only a job that
holds its ranks answers is ``HeldJob``'s, and an elastic job has no stand-ins for it."""

from __future__ import annotations

import ast
import inspect

import pytest

from horovod_ray.job import elastic, kinds, static

pytestmark = pytest.mark.unit


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_a_static_job_answers_everything_a_held_job_does():
    wanted = _members(kinds.JobKind) | _members(kinds.HeldJob)
    assert wanted <= set(dir(static.StaticJob)), wanted - set(dir(static.StaticJob))


def test_an_elastic_job_answers_every_job_question_and_stands_in_for_none_other():
    assert _members(kinds.JobKind) <= set(dir(elastic.ElasticJob))
    held_only = _members(kinds.HeldJob) - _members(kinds.JobKind)
    assert held_only == {"send", "stacks", "ranks", "rendezvous_address", "placement_group"}
    assert not held_only & set(dir(elastic.ElasticJob))
    tree = ast.parse(inspect.getsource(elastic))
    raised = [
        ast.unparse(node.exc) for node in ast.walk(tree) if isinstance(node, ast.Raise) and node.exc
    ]
    assert not [text for text in raised if text.startswith("AssertionError")], raised
