"""The ranks' resources kept out of Ray Data's budget through Ray's own coordinator: the
private hook ``data/budget`` uses, checked against the Ray installed, so that this fails
the day Ray changes it."""

from __future__ import annotations

import logging

import pytest

from horovod_ray.data.budget import RankReservation
from test.conftest import start_local_ray
from test.data.ray_data import reserved_cpus


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    start_local_ray(4)


def test_the_ranks_are_registered_with_ray_datas_coordinator_until_closed(caplog):
    with caplog.at_level(logging.WARNING, logger="horovod_ray.data.budget"):
        reservation = RankReservation({"CPU": 1.0}, 2)
    assert not caplog.records  # Ray took it: no "could not keep ... out" warning
    try:
        assert reserved_cpus(reservation.requester_id) == 2
    finally:
        reservation.close()
    assert reserved_cpus(reservation.requester_id) == 0
    reservation.close()  # once


def test_ranks_with_gpus_are_registered_too(caplog):
    """Ray's ScalingConfig refuses GPUs without use_gpu=True: a GPU job's ranks once
    went unregistered, with only a warning."""
    with caplog.at_level(logging.WARNING, logger="horovod_ray.data.budget"):
        reservation = RankReservation({"CPU": 1.0, "GPU": 1.0}, 2)
    try:
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    finally:
        reservation.close()
