"""The package's entry points on a cluster with Ray's token authentication on, as
``ray.init()`` starts one in Ray 2.60 (the rest of the suite turns it off): with the
cluster's token they work, without it they say where to get it, in one line.

The cluster is a Ray head started by a process of this test's, with a home folder of its
own, where Ray writes the token (``~/.ray/auth_token``).
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

HEAD = """
import sys
import ray

ray.init(num_cpus=4, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""
PLAIN = (
    "import horovod.torch as hvd, torch\nhvd.init()\nprint(float(hvd.allreduce(torch.ones(1))))\n"
)
DRIVER = """
import horovod_ray

def total():
    import horovod.torch as hvd
    import torch

    hvd.init()
    return float(hvd.allreduce(torch.ones(1), op=hvd.Sum))

try:
    print(horovod_ray.run(total, num_slots=2))
except horovod_ray.HorovodRayError as error:
    print("refused:", error)
"""


def _env(home: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    return {**env, "HOME": str(home), **more}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The head's address and the home folder that holds its token."""
    home = tmp_path_factory.mktemp("head-home")
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(home),
    )
    try:
        address = head.stdout.readline().strip()
        assert address, "the head did not start"
        assert (home / ".ray" / "auth_token").exists()  # Ray's token authentication is on
        yield address, home
    finally:
        head.stdin.close()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "horovod_ray", *args]


def test_the_entry_points_work_with_the_clusters_token(cluster, tmp_path):
    address, home = cluster
    env = _env(home)
    # The two jobs side by side (2 of the head's 4 CPUs each), then status, once both
    # have ended.
    argvs = (
        _cli("run", "--address", address, "-np", "2", sys.executable, "-c", PLAIN),
        [sys.executable, "-c", DRIVER],
    )
    with concurrent.futures.ThreadPoolExecutor(len(argvs)) as pool:
        ran, driver = pool.map(_run, argvs, [env, {**env, "RAY_ADDRESS": address}])
    status = _run(_cli("status", "--address", address), env)
    assert (status.returncode, status.stdout.strip()) == (
        0, "no horovod_ray jobs running (--all: also ended ones)"
    ), status.stderr  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert sorted(ran.stdout.split()) == ["[0]<stdout>:1.0", "[1]<stdout>:1.0"]
    assert driver.stdout.splitlines()[-1] == "[2.0, 2.0]", driver.stderr[-2000:]


def test_without_the_token_each_says_where_to_get_it(cluster, tmp_path):
    address, _ = cluster
    # A home without the token: another machine's user. Ray retries a refused
    # connection once a second, 20 times by default: once here. The three entry points
    # are refused side by side (each mostly waits on Ray's retries).
    env = _env(tmp_path, RAY_NUM_REDIS_GET_RETRIES="1")
    argvs = (
        _cli("status", "--address", address),
        _cli("run", "--address", address, "-np", "2", sys.executable, "-c", PLAIN),
        [sys.executable, "-c", DRIVER],
    )
    with concurrent.futures.ThreadPoolExecutor(len(argvs)) as pool:
        status, run, driver = pool.map(_run, argvs, [env, env, {**env, "RAY_ADDRESS": address}])
    for done in (status, run):
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr
        assert f"no Ray cluster answered at {address}" in done.stderr
        assert "token authentication is on for the cluster at " + address in done.stderr
        assert "RAY_AUTH_TOKEN" in done.stderr
    assert driver.stdout.startswith("refused: no Ray cluster answered at"), driver.stderr
    assert "RAY_AUTH_TOKEN" in driver.stdout
