"""horovod.torch on today's PyTorch, on 2 real ranks of one job.

Stock horovod 0.28.1 does not build against PyTorch 2.1 or later
(patches/horovod-0.28.1-torch-cxx-standard.patch). Every rank trains on data of its own
(test/torch_training.py); the results are compared with each other and with plain PyTorch.
The GPU line (``make test GPU=1``) runs this module too: its NCCL build on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

import horovod_ray
from horovod_ray import RayExecutor
from test import torch_training
from test.conftest import run_fresh_python, same_on_every_rank, start_local_ray

pytestmark = [pytest.mark.timeout(300), pytest.mark.gpu_line]


@pytest.fixture(scope="module")
def executor():
    start_local_ray(4)
    with RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2) as executor:
        yield executor


@pytest.mark.parametrize(
    ("passes", "fp16", "compiled"),
    [(1, False, False), (2, False, False), (1, True, False), (1, False, True)],
    ids=["sgd", "two-passes", "fp16", "torch-compile"],
)
def test_distributed_optimizer_takes_plain_torchs_averaged_step(executor, passes, fp16, compiled):
    results = executor.run(torch_training.optimizer_step, args=(passes, fp16, compiled))
    start = same_on_every_rank(results, "start")  # rank 0's broadcast weights
    weights = same_on_every_rank(results, "weights")
    expected = results[0]["expected"]
    assert weights != start
    tolerance = 2e-3 if fp16 else 1e-5
    assert weights == pytest.approx(expected, abs=tolerance)


def test_adasum_on_a_gloo_cpu_build_is_an_error_naming_it(executor):
    """Adasum on CPUs needs MPI (docs/pytorch.rst): the first step says so on every rank."""
    said = executor.run(torch_training.adasum_step)
    assert said == ["HorovodInternalError: No Adasum operation enabled"] * 2


def test_the_loss_falls_and_the_ranks_agree(executor):
    results = executor.run(torch_training.losses)
    assert results[0] == results[1]
    assert results[0][-1] < 0.1 * results[0][0]


def test_collectives_and_their_in_place_and_async_forms(executor):
    rank0, rank1 = executor.run(torch_training.collectives)
    for out in (rank0, rank1):
        assert out["allreduce_sum"] == [3.0] * 3
        assert out["allreduce_average"] == [1.5] * 3
        assert out["allreduce_"] == [3.0] * 3
        assert out["allreduce_async_max"] == [2.0] * 3
        assert out["allreduce_async_min"] == [1.0] * 3
        assert out["grouped_allreduce"] == [[3.0] * 3, [30.0] * 3]
        assert out["grouped_allreduce_"] == [[3.0] * 3, [30.0] * 3]
        assert out["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert out["allgather_async"] == out["allgather"]
        assert out["broadcast"] == [2.0] * 3
        assert out["broadcast_"] == [1.0] * 3
        assert out["broadcast_async"] == [2.0] * 3
        assert out["broadcast_object"] == {"from": 1}
        assert out["allgather_object"] == [("rank", 0), ("rank", 1)]
    assert rank0["alltoall"] == [0.0, 10.0]
    assert rank1["alltoall"] == [1.0, 11.0]


def test_join_lets_uneven_ranks_finish_through_run(ray_4cpu):
    rank0, rank1 = horovod_ray.run(torch_training.uneven_then_join, num_slots=2, timeout_s=60)
    assert rank0["sums"] == [3.0]
    assert rank1["sums"] == [3.0, 2.0]  # rank 0 had joined: its share is zero
    assert rank0["join"] == rank1["join"] == 1  # rank 1 joined last
    assert rank0["after"] == rank1["after"] == 2.0


def test_a_small_allreduce_adds_in_rank_order_on_every_rank(ray_4cpu):
    """Under 1 MB per peer each rank sends its buffer to every other and adds the buffers in
    rank order; stock horovod's Gloo ring adds each segment in an order of its own, and
    gives [0, 0, 0, 0, 1, 0] here."""
    ranks = horovod_ray.run(
        torch_training.small_allreduces, num_slots=3, cpus_per_slot=0.5, timeout_s=60
    )
    for rank in ranks:
        assert rank["order"] == rank["rank_order"] == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
        assert rank["ops"] == {"sum": 9.0, "min": 2.0, "max": 4.0, "product": 24.0, "average": 3.0}
        assert rank["integers"] == [6 * i for i in range(7)]
        assert rank["large"] == [9.0]


def test_sync_batch_norm_on_cpu_normalises_over_every_ranks_batch(executor):
    """Stock horovod raises "SyncBatchNorm expected input tensor to be on GPU" here."""
    for rank in executor.run(torch_training.sync_batch_norm):
        assert rank["gaps"] == pytest.approx(dict.fromkeys(rank["gaps"], 0.0), abs=1e-5)
        assert min(rank["sizes"]) > 0.1


def test_a_rank_waiting_for_a_collective_sleeps(executor):
    """Rank 0 waits about a second for rank 1: its waiting thread must not spin. Stock
    horovod's wait (a loop of poll and yield) spends about as much CPU as it waits, on 2
    cores a large part of it; this sleeps on a condition variable (a few milliseconds)."""
    rank0, rank1 = executor.run(torch_training.waiting_cpu)
    assert rank0["sum"] == rank1["sum"] == 2.0
    assert rank0["wall_s"] > 0.5
    assert rank0["cpu_s"] < 0.1 * rank0["wall_s"]


def test_a_caller_waiting_on_a_collective_does_not_wait_for_the_cycle(ray_4cpu):
    """Under a 3-second cycle, four collectives waited on one after another: stock horovod
    takes up to a cycle for each (about 9 seconds or more), the patched one milliseconds.
    The bound is a whole cycle for all four, so a slow machine cannot fail it."""
    ranks = horovod_ray.run(
        torch_training.collectives_under_a_long_cycle,
        num_slots=2,
        env={"HOROVOD_CYCLE_TIME": "3000"},
        timeout_s=60,
    )
    for rank in ranks:
        assert rank["sums"] == [2.0] * 4
        assert rank["seconds"] < 3.0


def test_a_wait_that_raises_stops_counting_as_a_waiting_caller(ray_4cpu):
    """A handle cleared by ``hvd.shutdown()`` while a thread waits on it: the wait raises,
    and the thread is no longer counted as waiting. Counted still, it kept horovod's
    background loop cycling every millisecond after the restart (idle CPU 0.02 s to
    0.28 s per 3 s, a 100 ms cycle's latency down to 1.7 ms)."""
    ranks = horovod_ray.run(torch_training.waiter_cleared_by_shutdown, num_slots=2, timeout_s=60)
    for rank in ranks:
        assert rank["during"] == 1
        assert rank["raised"] == [
            "ValueError: Handle 1 was cleared while it was waited on (horovod was reset)."
        ]
        assert rank["after"] == 0
        assert rank["sum"] == 2.0


@pytest.mark.unit
@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="the build tree is found by its TF line"
)
def test_the_cycle_patch_links_under_cxx14(tmp_path):
    """horovod's common code is also compiled as C++14 (its framework extensions' older
    standards): a static constexpr member bound to a reference needs a definition there,
    which the waiting caller's patch once lacked (an undefined reference at link time)."""
    from bench.cases.scale import horovod_tree

    source, _ = horovod_tree()
    compiler = os.environ.get("CXX") or shutil.which("c++") or "g++"
    objects = tmp_path / "tensor_queue.o"
    subprocess.run(
        [compiler, "-std=c++14", "-O0", "-c", "-I", str(source)]
        + [str(source / "horovod/common/tensor_queue.cc"), "-o", str(objects)],
        check=True,
        timeout=120,
    )
    undefined = subprocess.run(
        ["nm", "-C", "-u", str(objects)], capture_output=True, text=True, check=True
    ).stdout
    assert "CycleWaker" in (source / "horovod/common/tensor_queue.h").read_text()
    assert "CycleWaker" not in undefined


def test_gloos_io_thread_does_not_spin_on_a_busy_connection(ray_4cpu):
    """A 1 MB allreduce costs horovod's threads 0.4-0.5 ms of CPU on each rank on a quiet
    machine, up to 1.15 on a busy one (the least of 4 batches; a single batch of 400 took
    up to 1.9 there, and failed a bound of 1.0 now and then); with Gloo's I/O thread
    spinning while a send held the connection, one rank's took 1.6-2.6 on a quiet one."""
    for rank in horovod_ray.run(torch_training.horovods_threads_cpu, num_slots=2, timeout_s=60):
        assert rank["values"] == [1.0]
        assert rank["cpu_ms"] < 1.3


def _both_frameworks() -> list:
    """Rank 0 imports horovod.torch first, rank 1 horovod.tensorflow first; both then use
    each framework."""
    import os

    if os.environ["HOROVOD_RANK"] == "0":
        import horovod.torch as hvd  # noqa: I001 (the order is the test)
        import horovod.tensorflow as hvd_tf
    else:
        import horovod.tensorflow as hvd_tf
        import horovod.torch as hvd
    import tensorflow as tf
    import torch

    hvd.init()
    total = float(hvd.allreduce(torch.tensor(1.0), op=hvd.Sum))
    return [total, float(tf.reduce_sum(tf.ones(2))), hvd_tf.__name__]


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="this line has no TensorFlow (GPU)"
)
def test_tensorflow_and_torch_import_in_either_order_beside_each_other(executor):
    assert executor.run(_both_frameworks) == [[2.0, 2.0, "horovod.tensorflow"]] * 2


@pytest.mark.unit
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="this line has no PyTorch (the 2023 line)"
)
def test_horovod_was_built_with_torch_and_gloo():
    # In a fresh interpreter: horovod.torch loads its extension or raises.
    out = run_fresh_python(
        "import horovod.torch as hvd\nprint(hvd.gloo_built(), hvd.mpi_built())\n", timeout_s=120
    )
    assert out.split() == ["True", "False"]


@pytest.mark.unit
def test_the_install_check_sees_sync_batch_norm_on_cpus(monkeypatch, tmp_path):
    """The patched horovod's file, then a stock one's (GPU-only)."""
    from horovod_ray.stack import build

    assert build.sync_batch_norm_on_cpu()
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "sync_batch_norm.py").write_text(
        "mean, invstd = torch.batch_norm_stats(input, eps)\n"
    )
    monkeypatch.setattr(build, "_horovod_dir", lambda: str(tmp_path))
    assert not build.sync_batch_norm_on_cpu()


@pytest.mark.unit
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="this line has no PyTorch (the 2023 line)"
)
@pytest.mark.parametrize("check", ["torch_waits_without_spinning", "torch_wait_starts_the_cycle"])
def test_the_install_check_sees_the_torch_extensions_fixes(check, monkeypatch, tmp_path):
    """The patched horovod's torch extension, then a stock one's."""
    from horovod_ray.stack import build

    assert getattr(build, check)()
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "mpi_lib_v2.cpython-311-x86_64-linux-gnu.so").write_bytes(
        b"\x7fELF Handle was not created or has been cleared."
    )
    monkeypatch.setattr(build, "_horovod_dir", lambda: str(tmp_path))
    assert not getattr(build, check)()


@pytest.mark.unit
@pytest.mark.parametrize(
    "marker",
    [
        b"_ZN7horovod6common10CycleWaker14WakeIfEnqueuedEv",
        b"_ZN7horovod6common10CycleWaker11CallerWaitsEv",
    ],
    ids=["woke-once", "counted-a-raised-wait"],
)
def test_the_earlier_cycle_patches_are_not_taken_for_the_fixed_one(monkeypatch, tmp_path, marker):
    """The first's caller woke the cycle once, so a collective a cycle took before every
    rank had queued it could wait out a whole cycle (test_a_caller_waiting_on_a_collective
    ...); the second's wait that raised stayed counted (test_a_wait_that_raises...)."""
    from horovod_ray.stack import build

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "mpi_lib_v2.cpython-311-x86_64-linux-gnu.so").write_bytes(
        b"\x7fELF " + marker
    )
    monkeypatch.setattr(build, "_horovod_dir", lambda: str(tmp_path))
    assert not build.torch_wait_starts_the_cycle()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("check", "stock_marker"),
    [
        ("exchange_allreduce", b"HOROVOD_GLOO_TIMEOUT_SECONDS"),
        ("gloo_loop_waits_for_busy_pairs", b"pthread_mutex_trylock"),
        ("reducescatter_waits_for_its_sends", b"ReduceScatterHalvingDoubling"),
        ("core_counters", b"horovod_process_set_ranks"),
    ],
)
def test_the_install_check_sees_the_core_fixes(check, stock_marker, monkeypatch, tmp_path):
    """The patched horovod's extension, then a stock one's."""
    from horovod_ray.stack import build

    assert getattr(build, check)()
    stock = tmp_path / "mpi_lib.so"
    stock.write_bytes(b"\x7fELF " + stock_marker)
    monkeypatch.setattr(build, "_extension", lambda: str(stock))
    assert not getattr(build, check)()


@pytest.mark.unit
@pytest.mark.parametrize(("has_torch", "code"), [(True, 0), (False, 1)])
def test_the_install_check_fails_when_torch_is_there_but_horovod_lacks_it(
    monkeypatch, capsys, has_torch, code
):
    """``make install``'s check: PyTorch installed and horovod built without its extension
    is an error naming the rebuild (the probes of horovod's extensions answered here, so no
    framework is imported)."""
    from horovod_ray.stack import check_install

    if importlib.util.find_spec("torch") is None:
        pytest.skip("this line has no PyTorch (the 2023 line)")
    built = {"gloo": True, "nccl": 0, "cuda": False}
    monkeypatch.setattr(
        check_install,
        "_probe",
        lambda framework: built if framework != "torch" or has_torch else {"error": "no ext"},
    )
    assert check_install._full_check(require_fix=True) == code
    out, err = capsys.readouterr()
    if has_torch:
        assert "horovod has PyTorch (horovod.torch)" in out
        assert "horovod has SyncBatchNorm on CPUs" in out
    else:
        assert "PyTorch is installed but horovod lacks its extension" in err
        assert "HOROVOD_WITH_PYTORCH=1" in err
