"""The wheelhouse of ``make wheels`` on machines that never saw the checkout
(``make test-deploy``, which builds it and names it in HOROVOD_RAY_WHEELHOUSE).

A fresh virtualenv outside the checkout, from the wheelhouse alone (``--no-index``, no pip
configuration: nothing else is looked at), passes the install check with the labelled
patched horovod. Then a Ray cluster of two simulated hosts (test/hosts/simhosts.py), head
and worker, whose ``ray start``, ranks and driver all run from that virtualenv in a folder
of their own, with an empty folder mounted over the checkout, runs a PyTorch job and a
TensorFlow job with a rank on each host: every rank's horovod and horovod_ray come from the
virtualenv, and no file it mapped, no folder on its path, is in the checkout. (The
horovod.torch extension's RUNPATH names the build machine's torch folder; it loads all the
same, torch having loaded its libraries first: this test runs where that folder is hidden.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from test.conftest import doc_blocks
from test.hosts.simhosts import REPO, SimHosts, sweep_stale, unavailable_reason

WHEELHOUSE = os.environ.get("HOROVOD_RAY_WHEELHOUSE")

pytestmark = [
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        WHEELHOUSE is None, reason="make test-deploy builds the wheelhouse and names it"
    ),
]

# What each rank says of itself: run by the driver on the simulated head, pickled by value
# (defined in its __main__), so the ranks import nothing of the test's.
DRIVER = """
import json, os, sys
import ray
import horovod_ray

def where(hvd, value):
    import os, horovod, ray
    with open("/proc/self/maps") as maps:  # every file this process has mapped
        fields = [line.split(maxsplit=5) for line in maps]
        mapped = sorted({f[5].strip().removesuffix(" (deleted)") for f in fields if len(f) == 6
                         and f[5].startswith("/")})
    return {"rank": hvd.rank(), "sum": value, "node": ray.get_runtime_context().get_node_id(),
            "files": [horovod.__file__, horovod_ray.__file__, sys.executable],
            "path": [p for p in sys.path if p] + [os.getcwd()], "mapped": mapped,
            "repo_seen": os.path.isdir(REPO) and bool(os.listdir(REPO))}

def torch_rank():
    import horovod.torch as hvd
    import torch
    hvd.init()
    return where(hvd, hvd.allreduce(torch.tensor(float(hvd.rank() + 1)), op=hvd.Sum).item())

def tensorflow_rank():
    import horovod.tensorflow as hvd
    import tensorflow as tf
    hvd.init()
    return where(hvd, float(hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)))

REPO = sys.argv[2]  # the checkout's path, which the hosts must not see
ray.init(address=sys.argv[1], log_to_driver=False)
results = {fn.__name__: horovod_ray.run(fn, num_hosts=2, num_slots=1)
           for fn in (torch_rank, tensorflow_rank)}
print("RESULT " + json.dumps({"results": results, "driver": horovod_ray.__file__,
                              "driver_saw_repo": bool(os.listdir(REPO))}))
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Iterator[Path]:
    """A virtualenv made from the wheelhouse alone by docs/deploying.rst's commands (its
    ``make wheels`` is make test-deploy's own), in a folder outside the checkout; removed
    afterwards (it holds 2.8 GB)."""
    root = tmp_path_factory.mktemp("fresh-node")
    (block,) = [b for b in doc_blocks("bash") if b.startswith("make wheels\n")]
    script = block.removeprefix("make wheels\n").replace("/opt/horovod-ray", str(root / "venv"))
    script = script.replace("build/wheelhouse-tf2.21", WHEELHOUSE)
    python = Path(sys.base_prefix, "bin")  # the machine's python3.11, not this virtualenv's
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PATH=f"{python}:/usr/bin:/bin")
    try:
        installed = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            env=env, cwd=root, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
        assert "built with horovod_ray's patches (a wheelhouse's)" in installed.stdout
        assert "horovod 0.28.1+hr" in installed.stdout
        yield root / "venv"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _outside_the_checkout(path: str) -> bool:
    return not Path(path).resolve().is_relative_to(REPO)


def test_a_fresh_virtualenv_from_the_wheelhouse_passes_the_install_check(venv):
    """The install check passed in the fixture (docs/deploying.rst's last command); horovod
    and horovod_ray are the virtualenv's."""
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import horovod, horovod_ray; "
         "print(horovod.__file__); print(horovod_ray.__file__)"],
        cwd=venv.parent, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()  # fmt: skip
    assert len(where) == 2 and all(path.startswith(str(venv)) for path in where), where


def test_a_cluster_from_the_wheelhouse_runs_torch_and_tensorflow_across_hosts(venv):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    sweep_stale()
    with SimHosts(subnet="10.213.9", venv_bin=venv / "bin", in_repo=False) as sim:
        head, worker = sim.add_host("w1"), sim.add_host("w2")
        sim.start_ray(head, 1, head=True, dashboard=False)
        sim.start_ray(worker, 1)
        sim.wait_for_nodes()
        out = sim.python(head, ["-c", DRIVER, sim.gcs_address, str(REPO)], timeout_s=600)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, out.stdout[-3000:] + out.stderr[-3000:]
        outcome = json.loads(lines[-1][len("RESULT ") :])
    assert not sim.leftovers()
    assert outcome["driver"].startswith(str(venv)) and not outcome["driver_saw_repo"]
    for name, ranks in outcome["results"].items():
        assert [r["rank"] for r in ranks] == [0, 1], name
        assert [r["sum"] for r in ranks] == [3.0, 3.0], name
        assert len({r["node"] for r in ranks}) == 2, name  # one rank on each host
        for rank in ranks:
            assert all(path.startswith(str(venv)) for path in rank["files"]), rank["files"]
            assert all(_outside_the_checkout(p) for p in rank["path"]), rank["path"]
            assert all(_outside_the_checkout(p) for p in rank["mapped"]), rank["mapped"]
            assert not rank["repo_seen"]  # an empty folder over the checkout
