"""deploy/Dockerfile, built and run here (``make test-image``, which builds the wheelhouse
and names it in HOROVOD_RAY_WHEELHOUSE).

Ray's image cannot be pulled here (no container registry is reachable), so the image is
built on a stand-in for it: Debian 12 from Debian's packages (debootstrap), with what the
Dockerfile relies on in Ray's image: Python 3.11, a user ``ray`` whose ``pip`` and
``python`` (a virtualenv, where Ray's image has conda's) come first on its PATH, in
``/home/ray``. ``make image`` builds on it as on Ray's image. The container then runs, with
no network but its loopback, the RayJob of deploy/kuberay as KubeRay would: a Ray cluster
of the nodes Ray's autoscaler reads off the RayJob (a head without CPUs, then each worker
pod), the ConfigMap's script where the pods mount it, and the RayJob's entrypoint under
``ray job submit``. What this does not show: that Ray's real image takes the install the
same way (its conda Python, the packages it already has).
"""

from __future__ import annotations

import os
import resource
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from test import conftest
from test.deploy.test_manifests import RAYJOB, _documents, _entrypoint, _ray_reads, check_trained

WHEELHOUSE = os.environ.get("HOROVOD_RAY_WHEELHOUSE")
MIRROR = "http://deb.debian.org/debian"

pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        WHEELHOUSE is None or shutil.which("podman") is None,
        reason="make test-image installs podman, builds the wheelhouse and names it",
    ),
]


def _podman() -> list[str]:
    # crun, podman's default runtime, refuses a machine whose cgroups are half v1, half v2
    # (as here); runc runs there.
    return ["podman", *(["--runtime", "runc"] if shutil.which("runc") else [])]


def _limits() -> list[str]:
    """Limits for the container no higher than this process's: podman's defaults are, and
    raising them needs a capability that a sandboxed root may lack."""

    def hard(limit: int, most: int) -> int:
        value = resource.getrlimit(limit)[1]
        return most if value == resource.RLIM_INFINITY else min(value, most)

    nofile = hard(resource.RLIMIT_NOFILE, 65536)
    nproc = hard(resource.RLIMIT_NPROC, int(Path("/proc/sys/kernel/pid_max").read_text()))
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def _run(argv: list[str], timeout_s: float = 900, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    assert result.returncode == 0, (argv, (result.stdout + result.stderr)[-5000:])
    return result


@pytest.fixture(scope="module")
def base_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The stand-in for Ray's image, imported into podman; removed afterwards."""
    root = tmp_path_factory.mktemp("base") / "root"
    tag = f"localhost/horovod-ray-test-base:{uuid.uuid4().hex[:8]}"
    try:
        _run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
              "bookworm", str(root), MIRROR])  # fmt: skip
        _run(["chroot", str(root), "useradd", "--create-home", "--uid", "1000", "ray"])
        _run(["chroot", str(root), "su", "ray", "-c", "python3 -m venv /home/ray/venv"])
        changes = [
            "USER ray", "WORKDIR /home/ray", "ENV HOME=/home/ray",
            "ENV PATH=/home/ray/venv/bin:/usr/local/bin:/usr/bin:/bin",
        ]  # fmt: skip
        tarball = root.with_suffix(".tar")
        _run(["tar", "-C", str(root), "-cf", str(tarball), "."])
        _run(["podman", "import", *[a for c in changes for a in ("--change", c)],
              str(tarball), tag])  # fmt: skip
        yield tag
    finally:
        subprocess.run(["podman", "rmi", "--force", tag], capture_output=True)
        _unmount_under(root)  # debootstrap's /proc and /sys, if it was cut off
        shutil.rmtree(root.parent, ignore_errors=True)


def _unmount_under(root: Path) -> None:
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in sorted(points, reverse=True):  # the deepest first
        if point.startswith(f"{root}/"):
            subprocess.run(["umount", "--lazy", point], capture_output=True)


@pytest.fixture(scope="module")
def image(base_image: str) -> Iterator[str]:
    """`make image` on the stand-in base, from the wheelhouse; removed afterwards."""
    tag = f"localhost/horovod-ray-test:{uuid.uuid4().hex[:8]}"
    flags = ["--network", "none", *_limits()]
    try:
        _run(["make", "-C", str(conftest.ROOT), "--no-print-directory", "image",
              f"WHEELHOUSE={WHEELHOUSE}", f"BASE_IMAGE={base_image}", f"IMAGE={tag}",
              f"CONTAINER={shlex.join(_podman())}", f"CONTAINER_FLAGS={shlex.join(flags)}"],
             timeout_s=1200)  # fmt: skip
        yield tag
    finally:
        subprocess.run(["podman", "rmi", "--force", tag], capture_output=True)


def _in_container(image: str, script: str, volumes: dict[Path, str] | None = None) -> str:
    mounts = [a for host, inside in (volumes or {}).items() for a in ("-v", f"{host}:{inside}:ro")]
    argv = [*_podman(), "run", "--rm", "--network", "none", "--shm-size", "1g", *_limits(),
            *mounts, image, "bash", "-c", script]  # fmt: skip
    result = _run(argv, timeout_s=600)
    return result.stdout + result.stderr


def test_the_image_holds_the_patched_horovod(image: str) -> None:
    out = _in_container(image, "python -m horovod_ray.stack.check_install --require-fix; "
                        "python -c 'import horovod, horovod_ray; print(horovod.__file__, "
                        "horovod_ray.__file__)'")  # fmt: skip
    assert "built with horovod_ray's patches (a wheelhouse's)" in out, out
    assert out.split()[-2].startswith("/home/ray/venv/") and out.split()[-1].startswith(
        "/home/ray/venv/"
    ), out


def test_the_image_runs_the_rayjob(image: str, tmp_path: Path) -> None:
    documents = _documents(RAYJOB)
    head = documents["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (mount,) = head["containers"][0]["volumeMounts"]
    for name, text in documents["ConfigMap"]["data"].items():
        (tmp_path / name).write_text(text)
    tmp_path.chmod(0o755)  # read by the image's user, as a ConfigMap's files are
    nodes = _ray_reads(documents["RayJob"]["spec"]["rayClusterSpec"])
    workers = nodes["ranks"]
    script = "\n".join(
        [
            "set -e",
            "ray start --head --disable-usage-stats --dashboard-host 127.0.0.1"
            f" --num-cpus {nodes['headgroup']['resources']['CPU']}",
            *[
                f"ray start --address 127.0.0.1:6379 --num-cpus {workers['resources']['CPU']}"
                for _ in range(workers["min_workers"])
            ],
            "ray job submit --address http://127.0.0.1:8265 -- " + shlex.join(_entrypoint()),
        ]
    )
    check_trained(_in_container(image, script, {tmp_path: mount["mountPath"]}))
