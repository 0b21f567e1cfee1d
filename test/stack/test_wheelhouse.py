"""The wheelhouse's label on the patched horovod, and what the install check says of a
build (no Ray). The wheelhouse on fresh machines: test/deploy (``make test-deploy``)."""

from __future__ import annotations

import base64
import hashlib
import zipfile

import pytest

from horovod_ray.stack.check_install import build_line
from horovod_ray.stack.wheelhouse import is_patched, local_label, pins, retag

pytestmark = pytest.mark.unit

INFO = "horovod-0.28.1.dist-info"


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel(folder, metadata: bytes = b"Name: horovod\nVersion: 0.28.1\nSummary: x\n"):
    """A small wheel laid out as pip's are: a module, its dist-info, a RECORD of both."""
    files = {"horovod/__init__.py": b"__version__ = '0.28.1'\n", f"{INFO}/METADATA": metadata,
             "horovod/lib.so": b"\x7fELF", "horovod-0.28.1.data/scripts/horovodrun": b"#!",
             f"{INFO}/WHEEL": b"Wheel-Version: 1.0\nTag: cp311-cp311-linux_x86_64\n"}  # fmt: skip
    record = "".join(f"{path},{_hash(data)},{len(data)}\n" for path, data in files.items())
    record += f"{INFO}/RECORD,,\n"
    path = folder / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in {**files, f"{INFO}/RECORD": record.encode()}.items():
            entry = zipfile.ZipInfo(name, date_time=(2026, 12, 1, 0, 0, 0))
            entry.external_attr = (0o755 if name.endswith((".so", "run")) else 0o644) << 16
            wheel.writestr(entry, data)
    return path


@pytest.mark.parametrize(
    ("frameworks", "label"),
    [
        ({"tf": "2.21.0", "torch": "2.13.0+cpu"}, "hr97154199.tf221.torch213"),
        ({"tf": "2.15.1"}, "hr97154199.tf215"),
        ({"torch": "2.14.1"}, "hr97154199.torch214"),
    ],
)
def test_the_label_names_the_build_and_its_frameworks(frameworks, label):
    assert local_label("97154199991287e9", frameworks) == label


def test_a_key_that_is_not_hex_is_refused():
    with pytest.raises(ValueError, match="8 or more hex digits"):
        local_label("patched", {})


def test_retag_labels_the_wheel_with_a_valid_record(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    label = "hr97154199.tf221.torch213"
    made = retag(_wheel(tmp_path), label, out)
    assert made.name == f"horovod-0.28.1+{label}-cp311-cp311-linux_x86_64.whl"
    info = f"horovod-0.28.1+{label}.dist-info"
    with zipfile.ZipFile(made) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(f"{info}/METADATA")
        record = wheel.read(f"{info}/RECORD").decode().splitlines()
        module = wheel.read("horovod/__init__.py")
    data = f"horovod-0.28.1+{label}.data/scripts/horovodrun"
    assert names == {
        "horovod/__init__.py", "horovod/lib.so", data,
        f"{info}/METADATA", f"{info}/WHEEL", f"{info}/RECORD",
    }  # fmt: skip
    assert f"Version: 0.28.1+{label}\n".encode() in metadata
    assert module == b"__version__ = '0.28.1'\n"
    rows = {line.split(",")[0]: line.split(",", 1)[1] for line in record}
    assert set(rows) == names
    assert rows[f"{info}/METADATA"] == f"{_hash(metadata)},{len(metadata)}"
    assert rows["horovod/__init__.py"] == f"{_hash(module)},{len(module)}"
    with zipfile.ZipFile(made) as wheel:  # modes and times kept: the extension stays 0755
        modes = {i.filename: (i.external_attr >> 16, i.date_time) for i in wheel.infolist()}
    assert modes["horovod/lib.so"] == (0o755, (2026, 12, 1, 0, 0, 0))
    assert modes["horovod/__init__.py"][0] == 0o644
    again = tmp_path / "again"
    again.mkdir()
    assert retag(_wheel(tmp_path), label, again).read_bytes() == made.read_bytes()


def test_a_labelled_wheel_is_not_labelled_again(tmp_path):
    first = retag(_wheel(tmp_path), "hr1234abcd", tmp_path)
    with pytest.raises(ValueError, match="not a plain release"):
        retag(first, "hr1234abcd", tmp_path)


def test_a_labelled_version_is_the_patched_one():
    assert is_patched("0.28.1+hr97154199.tf221.torch213")
    assert not is_patched("0.28.1")


@pytest.mark.parametrize(
    ("version", "patched", "said"),
    [
        ("0.28.1+hr97154199.tf221.torch213", True, "patches (a wheelhouse's)"),
        ("0.28.1", True, "patches (make install)"),
        ("0.28.1", False, "horovod 0.28.1 is a stock build, without horovod_ray's patches"),
    ],
)
def test_the_install_check_names_the_build(version, patched, said):
    line = build_line(version, patched)
    assert said in line
    if not patched:  # with the fix
        assert "--find-links WHEELHOUSE" in line and "make install" in line


def test_pins_are_each_wheels_exact_version():
    names = [
        "horovod-0.28.1+hr97154199.tf221.torch213-cp311-cp311-linux_x86_64.whl",
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "Typing_Extensions-4.15.0-py3-none-any.whl",
        "constraints.txt",
    ]
    assert pins(names) == (
        "horovod==0.28.1+hr97154199.tf221.torch213\ntorch==2.13.0+cpu\ntyping-extensions==4.15.0\n"
    )
