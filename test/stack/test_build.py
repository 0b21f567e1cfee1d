"""The install checks without a real build: which extension answers them (TensorFlow's,
else PyTorch's, as in a PyTorch-only or the GPU line's horovod), and what ``make install``'s
check says of NCCL and CUDA (horovod's own probes answered here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from horovod_ray.errors import HorovodRayError
from horovod_ray.stack import build, check_install

# Pure logic without Ray; also on the GPU line, whose build takes the PyTorch-only paths.
pytestmark = [pytest.mark.unit, pytest.mark.gpu_line]


@pytest.fixture
def fake_horovod(tmp_path, monkeypatch):
    """An installed horovod's package folder whose extensions the test writes: a file
    holding the bytes a build leaves in its library."""
    package = tmp_path / "horovod"
    package.mkdir()
    monkeypatch.setattr(build, "_horovod_dir", lambda: str(package))
    for cached in (build._extension, build._gloo_problem):
        cached.cache_clear()
    yield package
    for cached in (build._extension, build._gloo_problem):
        cached.cache_clear()


def _extension(package, framework: str, name: str, content: bytes) -> None:
    (package / framework).mkdir()
    (package / framework / name).write_bytes(b"\0ELF..." + content + b"...")


def test_a_pytorch_only_horovod_with_gloo_passes_the_executors_check(fake_horovod):
    # horovod built with HOROVOD_WITHOUT_TENSORFLOW=1: only the torch extension exists.
    _extension(
        fake_horovod, "torch", "mpi_lib_v2.cpython-311-x86_64-linux-gnu.so", b"GlooController"
    )
    build.require_gloo()
    assert build._extension().endswith("mpi_lib_v2.cpython-311-x86_64-linux-gnu.so")


def test_tensorflows_extension_answers_first(fake_horovod):
    _extension(fake_horovod, "tensorflow", "mpi_lib.cpython-311-x86_64-linux-gnu.so", b"x")
    _extension(fake_horovod, "torch", "mpi_lib_v2.so", b"GlooController")
    with pytest.raises(HorovodRayError, match="horovod was built without Gloo"):
        build.require_gloo()


def test_a_horovod_without_any_framework_extension_names_both(fake_horovod):
    with pytest.raises(HorovodRayError) as info:
        build.require_gloo()
    assert "horovod was built without TensorFlow or PyTorch support" in str(info.value)
    assert "make install" in str(info.value)


@pytest.mark.parametrize(
    ("code", "version"), [(23007, "2.30.7"), (22707, "2.27.7"), (2804, "2.8.4"), (2708, "2.7.8")]
)
def test_nccl_version_codes_read_as_releases(code, version):
    # NCCL_VERSION_CODE is X*10000+Y*100+Z from 2.9, X*1000+Y*100+Z before.
    assert build.nccl_version(code) == version


def _probes(monkeypatch, nccl: int, gpu_build: bool, line: str = "torch") -> None:
    """What the probe of each framework's extension finds: the GPU line's framework's as
    given (built for CUDA 13.0 with no GPU in sight), the other's missing."""
    gpu = {"gloo": True, "nccl": nccl, "cuda": gpu_build, "framework_cuda": "13.0", "gpus": 0}
    other = {"error": "not installed"}
    monkeypatch.setattr(
        check_install, "_probe", lambda framework: gpu if framework == line else other
    )


@pytest.mark.parametrize(("line", "name"), [("torch", "PyTorch"), ("tensorflow", "TensorFlow")])
def test_the_gpu_lines_check_reports_nccl_and_cuda(monkeypatch, capsys, line, name):
    _probes(monkeypatch, nccl=23007, gpu_build=True, line=line)
    assert check_install._gpu_check(gpu=line) == 0
    assert (
        f"horovod has NCCL 2.30.7 and CUDA ({name}'s CUDA 13.0, 0 GPU(s) visible here)"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize(("line", "make"), [("torch", "GPU=1"), ("tensorflow", "GPU=tf")])
@pytest.mark.parametrize(
    ("nccl", "gpu_build", "missing"), [(0, False, "NCCL"), (23007, False, "CUDA")]
)
def test_the_gpu_lines_check_fails_without_nccl_or_cuda(
    monkeypatch, capsys, nccl, gpu_build, missing, line, make
):
    _probes(monkeypatch, nccl=nccl, gpu_build=gpu_build, line=line)
    assert check_install._gpu_check(gpu=line) == 1
    err = capsys.readouterr().err
    assert f"horovod lacks {missing}" in err and f"make install {make}" in err


def test_the_probe_reads_the_installed_build_and_names_what_does_not_load():
    check_install._probe.cache_clear()
    try:
        frameworks = [check_install._probe(f) for f in ("torch", "tensorflow")]
        loaded = [built for built in frameworks if "error" not in built]
        assert loaded and all(built["gloo"] is True for built in loaded)
        assert check_install._probe("no_such_framework") == {
            "error": "no_such_framework is not installed"
        }
    finally:
        check_install._probe.cache_clear()


@pytest.mark.parametrize(
    ("torch", "message"),
    [
        (
            {"error": "importing horovod.torch failed: OSError: libcudart.so.13"},
            "horovod lacks PyTorch (importing horovod.torch failed: OSError: "
            "libcudart.so.13); build the GPU line",
        ),
        ({"gloo": False, "nccl": 23007, "cuda": True}, "horovod lacks Gloo; build the GPU line"),
    ],
)
def test_the_gpu_lines_full_check_names_what_is_missing(monkeypatch, capsys, torch, message):
    monkeypatch.setattr(check_install, "_probe", lambda framework: torch)
    assert check_install._full_check(require_fix=True, gpu="torch") == 1
    assert message in capsys.readouterr().err


def test_the_tensorflow_gpu_lines_full_check_requires_tensorflow(monkeypatch, capsys):
    # The TensorFlow GPU line has no PyTorch: it is TensorFlow's extension that must load.
    broken = {"error": "importing horovod.tensorflow failed: OSError: libcudart.so.12"}
    monkeypatch.setattr(check_install, "_probe", lambda framework: broken)
    assert check_install.main(["--require-fix", "--gpu", "tensorflow"]) == 1
    err = capsys.readouterr().err
    assert "horovod lacks TensorFlow (importing horovod.tensorflow failed" in err
    assert "make install GPU=tf" in err


def test_the_check_refuses_an_unknown_gpu_line(capsys):
    with pytest.raises(SystemExit):
        check_install.main(["--gpu", "mxnet"])
    assert "argument --gpu: invalid choice: 'mxnet'" in capsys.readouterr().err


def test_a_cpu_build_is_reported_as_such_and_passes(monkeypatch, capsys):
    _probes(monkeypatch, nccl=0, gpu_build=False)
    assert check_install._gpu_check(gpu=None) == 0
    assert "horovod has no NCCL (a CPU build" in capsys.readouterr().out


def test_a_check_without_a_line_names_the_framework_built_with_nccl(monkeypatch, capsys):
    # A hand-built horovod with NCCL, checked without --gpu: its CUDA is the framework's
    # whose extension has NCCL, here TensorFlow's.
    _probes(monkeypatch, nccl=23203, gpu_build=True, line="tensorflow")
    assert check_install._gpu_check(gpu=None) == 0
    assert "NCCL 2.32.3 and CUDA (TensorFlow's CUDA 13.0" in capsys.readouterr().out


def test_installed_version_takes_the_first_installed_of_the_names():
    assert build.installed_version("no-such-distribution", "pytest") == pytest.__version__
    assert build.installed_version("no-such-distribution") is None


def _makefile_flags(line: str) -> list[str]:
    """The Makefile's HOROVOD_FLAGS for a CPU line (``2.21``: the default, ``2.15``)."""
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    block = re.search(
        rf"^else ifeq \(\$\(TF\),{re.escape(line)}\)\n(.*?)^else", makefile, re.M | re.S
    )
    torch = re.search(r"^HOROVOD_TORCH := (.*)$", block[1], re.M)[1]
    flags = re.search(r"^HOROVOD_FLAGS := ((?:.*\\\n)*.*)$", makefile, re.M)[1]
    return flags.replace("\\\n", " ").replace("$(HOROVOD_TORCH)", torch).split()


@pytest.mark.parametrize(("torch", "line"), [(True, "2.21"), (False, "2.15")])
def test_the_no_gloo_hint_rebuilds_the_lines_own_horovod(monkeypatch, capsys, torch, line):
    """With PyTorch installed (the default line) the hint keeps horovod.torch: the line's
    own build flags, not the 2023 line's HOROVOD_WITHOUT_PYTORCH=1."""
    monkeypatch.setattr(check_install, "_probe", lambda framework: {"gloo": False})
    monkeypatch.setattr(check_install, "torch_installed", lambda: torch)
    assert check_install.main(["--require-fix"]) == 1
    err = capsys.readouterr().err
    assert "horovod lacks Gloo; reinstall horovod with Gloo" in err
    flags = _makefile_flags(line)
    assert ("HOROVOD_WITH_PYTORCH=1" in flags) is torch
    for flag in flags:
        assert flag in err, flag
    other = "HOROVOD_WITHOUT_PYTORCH=1" if torch else "HOROVOD_WITH_PYTORCH=1"
    assert other not in err


def test_the_executors_check_names_the_lines_own_build(fake_horovod, monkeypatch):
    _extension(fake_horovod, "tensorflow", "mpi_lib.cpython-311-x86_64-linux-gnu.so", b"x")
    monkeypatch.setattr(build, "torch_installed", lambda: True)
    with pytest.raises(HorovodRayError) as info:
        build.require_gloo()
    assert "HOROVOD_WITH_PYTORCH=1" in str(info.value)
    assert "HOROVOD_WITHOUT_PYTORCH=1" not in str(info.value)
