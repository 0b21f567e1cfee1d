"""The benchmarks' pure parts (no Ray)."""

from __future__ import annotations

import pytest

from bench.train_drain import redone

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("begun", "again"),
    [
        ([(0, 3), (1, 3), (2, 3), (3, 2), (4, 2)], 0),  # went on from its commit
        ([(0, 3), (1, 3), (2, 3), (2, 2), (3, 2)], 1),  # rolled back one step
        ([(0, 3), (1, 3), (2, 3), (3, 3), (1, 2)], 3),  # resumed from an older checkpoint
    ],
)
def test_redone_counts_the_steps_the_smaller_world_did_again(begun, again):
    assert redone(begun) == again
