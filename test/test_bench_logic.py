"""The benchmarks' pure parts (no Ray)."""

from __future__ import annotations

import pytest

from bench.cases.cloud import static_figures
from bench.peers.train_drain import redone

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("steps", "again"),
    [
        ([(0, 3), (1, 3), (2, 3), (3, 2), (4, 2)], 0),  # went on from its commit
        ([(0, 3), (1, 3), (2, 3), (2, 2), (3, 2)], 1),  # rolled back one step
        ([(0, 3), (1, 3), (2, 3), (3, 3), (1, 2)], 3),  # resumed from an older checkpoint
        ([(0, 2), (1, 3), (2, 3), (3, 3), (2, 2)], 2),  # began on 2 before the drain
        ([(0, 2), (900, 2), (0, 3), (5, 3), (3, 2)], 3),  # grew to 3 (from 0) before it
    ],
)
def test_redone_counts_the_steps_the_smaller_world_did_again(steps, again):
    begun = [(step, size, float(t)) for t, (step, size) in enumerate(steps)]
    assert redone(begun, at=2.5) == again


@pytest.mark.parametrize(
    ("done", "seconds", "again"),
    [
        ([(0, 1, 1.0), (0, 2, 2.0), (0, 3, 3.0), (1, 4, 9.0), (1, 5, 10.0)], 7.0, 0),
        ([(0, 1, 1.0), (0, 2, 2.0), (0, 3, 3.0), (1, 2, 9.0)], 7.0, 2),  # resumed from step 1
        ([(0, 1, 1.0), (0, 2, 2.0), (1, 1, 8.0)], 6.0, 2),  # from no checkpoint
    ],
)
def test_static_figures_time_the_restart_and_count_steps_done_again(done, seconds, again):
    assert static_figures(done, at=2.0) == (seconds, again)


def test_a_default_pass_runs_every_benchmark_with_a_speed_goal():
    """make bench reports B1, B3 and BT's goals (docs/benchmarks.rst); BT was once only
    run when named."""
    from bench.run import _parser

    assert {"b1", "b3", "bt"} <= set(_parser().parse_args([]).only.split(","))
