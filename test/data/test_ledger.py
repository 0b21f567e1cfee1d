"""Where an ordered split's epoch stands (``data/ledger``): pure, tables of worlds."""

from __future__ import annotations

import pytest

from horovod_ray.data.ledger import Ledger, cut, merged, whole
from horovod_ray.errors import ConfigError

pytestmark = pytest.mark.unit


def _rows(ranges) -> list[int]:
    return [row for start, end in ranges for row in range(start, end)]


@pytest.mark.parametrize(
    ("ranges", "begin", "end", "expected"),
    [
        (((0, 10),), 2, 5, ((2, 5),)),
        (((0, 3), (5, 6), (8, 10)), 2, 5, ((2, 3), (5, 6), (8, 9))),
        (((0, 3), (5, 6)), 4, 9, ()),
        ((), 0, 3, ()),
    ],
)
def test_a_cut_takes_rows_of_the_concatenation(ranges, begin, end, expected):
    assert cut(ranges, begin, end) == expected


def test_merged_joins_touching_ranges_in_order():
    assert merged([(5, 6), (0, 3), (3, 4), (8, 8)]) == ((0, 4), (5, 6))


def test_the_docstrings_example_ten_rows_from_three_ranks_to_two():
    first = Ledger(10, 0, whole(10), 3)
    assert [first.part(r) for r in range(3)] == [((0, 3),), ((3, 6),), ((6, 9),)]
    after_two = Ledger(10, 0, whole(10), 3, taken=2)
    second = after_two.resplit(2)
    assert second.rest == ((2, 3), (5, 6), (8, 10))
    assert [second.part(r) for r in range(2)] == [((2, 3), (5, 6)), ((8, 10),)]


@pytest.mark.parametrize(
    ("rows", "worlds"),
    [(1001, [2, 3]), (1001, [4, 2, 3, 1]), (97, [3, 5, 2]), (12, [4, 4, 4]), (50, [1, 7])],
)
def test_every_row_once_across_any_changes_of_world(rows, worlds):
    """Each world reads ``steps`` rows a rank, then the next world takes what is left; at
    the end every row was read once but fewer than the last world's ranks."""
    ledger = Ledger(rows, 0, whole(rows), worlds[0])
    read: list[int] = []
    for index, world in enumerate(worlds):
        ledger = ledger if index == 0 else ledger.resplit(world)
        last = index == len(worlds) - 1
        taken = ledger.share if last else ledger.share // 3
        for rank in range(world):
            read += _rows(ledger.part(rank))[:taken]
        ledger = Ledger(ledger.rows, ledger.epoch, ledger.rest, ledger.world, taken)
    assert len(read) == len(set(read))
    assert set(read) <= set(range(rows)) and rows - len(read) < worlds[-1]
    assert ledger.complete


def test_a_complete_epoch_says_the_next_one_whole():
    done = Ledger(10, 4, whole(10), 3, taken=3)
    assert done.complete
    assert done.as_dict() == {"rows": 10, "epoch": 5, "rest": [[0, 10]], "world": 3, "taken": 0}
    assert done.resplit(2) == Ledger(10, 5, whole(10), 2)


def test_a_position_goes_through_a_dict_and_back():
    ledger = Ledger(10, 1, ((2, 3), (5, 10)), 2, taken=1)
    assert Ledger.from_dict(ledger.as_dict(), 10) == ledger


@pytest.mark.parametrize(
    ("state", "says"),
    [
        ({"epoch": 0}, "takes what state_dict() returned"),
        ({"rows": 10, "epoch": 0, "rest": "x", "world": 2, "taken": 0}, "state_dict()"),
        ({"rows": 11, "epoch": 0, "rest": [[0, 11]], "world": 2, "taken": 0}, "of 11 rows"),
    ],
)
def test_a_position_of_something_else_is_refused(state, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        Ledger.from_dict(state, 10)
