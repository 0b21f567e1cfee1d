"""deploy/'s manifests, checked as far as a machine without Kubernetes or a cloud can.

* The cluster launcher's YAML goes through what ``ray up`` does to it first (Ray's own
  ``prepare_config`` and ``validate_config`` against its schema).
* KubeRay's RayCluster and RayJob: every pod template and the ConfigMap round-trip through
  the Kubernetes client's own models (a misspelt or misplaced field does not come back),
  the KubeRay fields are the ones its v1 API defines, and Ray's autoscaler reads each
  cluster as it would on Kubernetes (``_derive_autoscaling_config_from_ray_cr``, whose
  result it validates): its head holds no CPU for ranks, and the RayJob's
  ``--num-hosts``/``--slots-per-host`` fit its workers.
* The RayJob's entrypoint runs under ``ray job submit`` on a local Ray cluster of the nodes
  Ray reads off the RayJob, with the ConfigMap's script where the pods mount it.
* One image, one Ray version, one wheelhouse everywhere: the Dockerfile's, the manifests'
  and the Makefile's.

(The image itself is built and run by ``make test-image``, test/deploy/test_image.py.)
"""

from __future__ import annotations

import copy
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import ray
import yaml

from horovod_ray.__version__ import __version__
from test import conftest

DEPLOY = conftest.ROOT / "deploy"
RAYJOB = DEPLOY / "kuberay" / "rayjob.yaml"
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
LAUNCHER = DEPLOY / "cluster-launcher" / "aws.yaml"
# The default line's image, as `make image` tags it, in a registry the user names.
IMAGE = f"registry.example.com/horovod-ray:{__version__}-tf2.21"
WHEELHOUSE = "build/wheelhouse-tf2.21"  # `make wheels`' folder on the default line
RAY_IMAGE = f"rayproject/ray:{ray.__version__}-py311"

# The KubeRay v1 fields these manifests may use (ray-operator/apis/ray/v1 in KubeRay).
RAYJOB_FIELDS = {
    "entrypoint", "runtimeEnvYAML", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished",
    "activeDeadlineSeconds", "rayClusterSpec", "submissionMode", "entrypointNumCpus",
}  # fmt: skip
CLUSTER_FIELDS = {"rayVersion", "headGroupSpec", "workerGroupSpecs", "enableInTreeAutoscaling"}
HEAD_FIELDS = {"rayStartParams", "template", "serviceType"}
WORKER_FIELDS = {
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "rayStartParams",
    "template",
}


def _documents(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text())}


def _clusters() -> dict[str, dict]:
    """Each manifest's RayCluster spec, by the kind of its document."""
    return {
        "RayCluster": _documents(RAYCLUSTER)["RayCluster"]["spec"],
        "RayJob": _documents(RAYJOB)["RayJob"]["spec"]["rayClusterSpec"],
    }


def _ray_reads(spec: dict) -> dict[str, dict]:
    """Ray's autoscaler's node types for a RayCluster spec, as it reads one on Kubernetes."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    cr = {"metadata": {"name": "horovod-ray", "namespace": "default"}, "spec": spec}
    return _derive_autoscaling_config_from_ray_cr(copy.deepcopy(cr))["available_node_types"]


def _entrypoint() -> list[str]:
    return shlex.split(_documents(RAYJOB)["RayJob"]["spec"]["entrypoint"])


def _flag(argv: list[str], name: str) -> int:
    return int(argv[argv.index(name) + 1])


@pytest.mark.unit
def test_launcher_config_is_what_ray_up_accepts() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(LAUNCHER.read_text())
    validate_config(prepare_config(copy.deepcopy(config)))
    # Ray's schema catches a misspelt field: the check is not a formality.
    misspelt = copy.deepcopy(config)
    misspelt["available_node_types"]["ranks"]["min_worker"] = 2
    with pytest.raises(Exception, match="min_worker"):
        validate_config(prepare_config(misspelt))

    assert config["docker"]["image"] == RAY_IMAGE
    assert config["available_node_types"]["head"]["resources"] == {"CPU": 0}
    # The setup commands install the wheelhouse, at its pins, from where file_mounts puts it.
    ((mount, source),) = config["file_mounts"].items()
    assert source == WHEELHOUSE
    pip = shlex.split(config["setup_commands"][0])
    assert pip[:5] == ["pip", "install", "--no-index", "--find-links", mount]
    assert pip[5:7] == ["-c", f"{mount}/constraints.txt"]
    extras = set(re.fullmatch(r"horovod-ray\[(.*)\]", pip[7]).group(1).split(","))
    assert extras <= set(importlib.metadata.metadata("horovod-ray").get_all("Provides-Extra"))
    assert config["setup_commands"][1] == "python -m horovod_ray.stack.check_install --require-fix"


@pytest.mark.unit
def test_kuberay_fields_are_kuberay_v1s() -> None:
    job = _documents(RAYJOB)["RayJob"]
    assert job["apiVersion"] == "ray.io/v1" and set(job["spec"]) <= RAYJOB_FIELDS
    assert _documents(RAYCLUSTER)["RayCluster"]["apiVersion"] == "ray.io/v1"
    for spec in _clusters().values():
        assert set(spec) <= CLUSTER_FIELDS and spec["rayVersion"] == ray.__version__
        assert set(spec["headGroupSpec"]) <= HEAD_FIELDS
        for group in spec["workerGroupSpecs"]:
            assert set(group) <= WORKER_FIELDS
        for params in [spec["headGroupSpec"]["rayStartParams"]] + [
            g["rayStartParams"] for g in spec["workerGroupSpecs"]
        ]:
            assert all(isinstance(v, str) for v in params.values())  # a map of strings


def _round_trip(data: dict, model: str) -> Any:
    from kubernetes.client import ApiClient

    client = ApiClient()
    return client.sanitize_for_serialization(client._ApiClient__deserialize(data, model))


@pytest.mark.unit
def test_every_rayjob_pod_mounts_the_script() -> None:
    """The entrypoint runs on the head, and `horovod-ray run` starts the script on each
    rank's pod: every pod mounts the ConfigMap where the entrypoint looks for it."""
    documents = _documents(RAYJOB)
    script = next(a for a in _entrypoint() if a.endswith(".py"))
    folder, name = script.rsplit("/", 1)
    assert name in documents["ConfigMap"]["data"]
    spec = documents["RayJob"]["spec"]["rayClusterSpec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        volumes = {
            v["name"] for v in pod["volumes"]
            if v.get("configMap", {}).get("name") == documents["ConfigMap"]["metadata"]["name"]
        }  # fmt: skip
        mounts = [m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] in volumes]
        assert [m["mountPath"] for m in mounts] == [folder], group


@pytest.mark.unit
def test_pod_templates_and_configmap_are_kubernetes_objects() -> None:
    for spec in _clusters().values():
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for group in groups:
            assert _round_trip(group["template"], "V1PodTemplateSpec") == group["template"]
            for container in group["template"]["spec"]["containers"]:
                assert container["image"] == IMAGE
    config_map = _documents(RAYJOB)["ConfigMap"]
    assert _round_trip(config_map, "V1ConfigMap") == config_map
    # The round trip drops what the models do not know, so it catches a misplaced field.
    template = copy.deepcopy(_clusters()["RayJob"]["headGroupSpec"]["template"])
    template["spec"]["containers"][0]["volumeMount"] = []
    assert _round_trip(template, "V1PodTemplateSpec") != template


@pytest.mark.unit
def test_ray_reads_the_clusters_the_jobs_fit() -> None:
    argv = _entrypoint()
    hosts, slots = _flag(argv, "--num-hosts"), _flag(argv, "--slots-per-host")
    readings = {kind: _ray_reads(spec) for kind, spec in _clusters().items()}
    # The long-lived cluster and the job's are the same cluster.
    assert readings["RayCluster"] == readings["RayJob"]
    nodes = readings["RayJob"]
    assert nodes["headgroup"]["resources"]["CPU"] == 0  # ranks go on workers only
    ranks = nodes["ranks"]
    assert ranks["min_workers"] == ranks["max_workers"] >= hosts
    assert ranks["resources"]["CPU"] >= slots
    # The same fit for raycluster.yaml's own example command.
    example = RAYCLUSTER.read_text().split("horovod-ray run", 1)[1].split("\n", 1)[0].split()
    assert (_flag(example, "--num-hosts"), _flag(example, "--slots-per-host")) == (hosts, slots)


@pytest.mark.unit
def test_dockerfile_and_makefile_name_the_same_image_and_wheelhouse() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={RAY_IMAGE}\n" in dockerfile
    assert f"-t {IMAGE.split('/')[1]} {WHEELHOUSE}" in dockerfile
    # The default line's names, whatever make this runs under (make test-2023 passes
    # TF=2.15 down in MAKEFLAGS) and whatever the environment sets.
    ours = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "TF", "GPU", "IMAGE"}
    ours |= {"BASE_IMAGE", "WHEELHOUSE", "CONTAINER", "CONTAINER_FLAGS"}
    make = subprocess.run(
        ["make", "-s", "-C", str(conftest.ROOT), "--no-print-directory", "TF=2.21", "GPU=0",
         "print-image"],
        env={k: v for k, v in os.environ.items() if k not in ours},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"IMAGE={IMAGE.split('/')[1]} BASE_IMAGE={RAY_IMAGE} WHEELHOUSE={WHEELHOUSE}" in make


@pytest.fixture
def manifest_cluster() -> Iterator[str]:
    """A local Ray cluster of the nodes Ray reads off the RayJob (a head without CPUs, then
    each worker pod with its CPUs), its dashboard up; yields the dashboard's address."""
    from ray.cluster_utils import Cluster

    nodes = _ray_reads(_clusters()["RayJob"])
    conftest._shutdown()
    # The job's entrypoint finds `horovod-ray` and `python` on the PATH Ray's nodes inherit.
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{path}"
    cluster = Cluster()
    conftest._current.update(kind=("manifest",), cluster=cluster)  # stopped by _shutdown
    try:
        cluster.add_node(
            num_cpus=nodes["headgroup"]["resources"]["CPU"],
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=0,
        )
        for _ in range(nodes["ranks"]["min_workers"]):
            cluster.add_node(num_cpus=nodes["ranks"]["resources"]["CPU"])
        cluster.wait_for_nodes()
    except BaseException:
        conftest._shutdown()
        raise
    finally:
        os.environ["PATH"] = path
    try:
        yield "http://" + cluster.head_node.address_info["webui_url"]
    finally:
        conftest._shutdown()


@pytest.mark.timeout(300)
def test_rayjob_entrypoint_runs_under_ray_job_submit(manifest_cluster: str, tmp_path) -> None:
    documents = _documents(RAYJOB)
    mount = documents["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (volume_mount,) = mount["containers"][0]["volumeMounts"]
    for name, text in documents["ConfigMap"]["data"].items():
        (tmp_path / name).write_text(text)
    entrypoint = [a.replace(volume_mount["mountPath"], str(tmp_path)) for a in _entrypoint()]
    result = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address",
         manifest_cluster, "--", *entrypoint],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    check_trained(output)


def check_trained(output: str) -> None:
    """The RayJob's job succeeded: every rank of its size trained, to the same small loss."""
    assert "succeeded" in output, output[-5000:]
    size = _flag(_entrypoint(), "--num-hosts") * _flag(_entrypoint(), "--slots-per-host")
    rows = re.findall(rf"rank (\d+) of {size} on \S+: final loss ([\d.]+)", output)
    assert sorted(int(rank) for rank, _ in rows) == list(range(size)), output[-5000:]
    losses = {loss for _, loss in rows}
    assert len(losses) == 1 and float(losses.pop()) < 0.01, rows  # averaged, and it learnt
