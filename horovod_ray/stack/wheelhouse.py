"""``python -m horovod_ray.stack.wheelhouse retag WHEEL --key KEY --out DIR``: the patched
horovod's wheel as ``make wheels`` puts it in a wheelhouse (docs/deploying.rst).
``python -m horovod_ray.stack.wheelhouse pins DIR``: the wheelhouse's ``constraints.txt``,
every wheel's exact version, which an install onto an image that already has packages
(Ray's) takes with ``-c``, so that it gets the versions the line was tested with.

``make install`` builds horovod 0.28.1 from source with this repository's patches, against
the line's TensorFlow and PyTorch; its wheel says ``0.28.1`` like the stock release. In a
wheelhouse it gets a PEP 440 local version that says what it is,
``0.28.1+hr<build>.tf221.torch213``: ``hr`` and the first 8 characters of the build's
key (a hash of the patches, the pinned frameworks, the build flags, Python and the
compiler: the Makefile's ``HOROVOD_KEY``), then each framework it was built against. pip
and the install check (``check_install``) read it back; ``horovod==0.28.1`` still matches it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import io
import re
import sys
import zipfile
from pathlib import Path
from typing import Mapping

# Where each framework's version is read, and its short name in the label.
FRAMEWORKS = (("tf", ("tensorflow-cpu", "tensorflow")), ("torch", ("torch",)))


def local_label(key: str, frameworks: Mapping[str, str]) -> str:
    """The local version label of a patched build. Pure.

    Args:
        key: The build's key (hex); its first 8 characters are kept.
        frameworks: Short name (``tf``, ``torch``) -> the version built against, in order.
    """
    if not re.fullmatch(r"[0-9a-f]{8,}", key):
        raise ValueError(f"the build's key must be 8 or more hex digits, got {key!r}")
    parts = [f"hr{key[:8]}"]
    for short, version in frameworks.items():
        major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
        parts.append(f"{short}{major}{minor}")
    return ".".join(parts)


def installed_frameworks() -> dict[str, str]:
    """The frameworks of this environment, as ``local_label`` takes them."""
    found = {}
    for short, names in FRAMEWORKS:
        for name in names:
            try:
                found[short] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def is_patched(version: str) -> bool:
    """Whether a horovod version is one ``make wheels`` labelled. Pure."""
    return "+hr" in version


def retag(wheel: Path, label: str, out: Path) -> Path:
    """Writes ``wheel`` into ``out`` with ``+label`` added to its version: the file's name,
    its ``.dist-info`` folder, ``METADATA``'s ``Version`` and the ``RECORD`` lines that
    name them (with the new ``METADATA``'s hash and size). Returns the new wheel's path.

    Raises:
        ValueError: ``wheel`` already has a local version, or is not a wheel.
    """
    name, version, rest = wheel.name.split("-", 2)
    if "+" in version or not wheel.name.endswith(".whl"):
        raise ValueError(f"{wheel.name} is not a plain release's wheel")
    new_version = f"{version}+{label}"
    # The dist-info folder and the .data folder (where a wheel has one) carry the version.
    folders = {
        f"{name}-{version}.{kind}": f"{name}-{new_version}.{kind}" for kind in ("dist-info", "data")
    }
    old_info, new_info = f"{name}-{version}.dist-info", f"{name}-{new_version}.dist-info"
    target = out / f"{name}-{new_version}-{rest}"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w") as written:
        metadata = source.read(f"{old_info}/METADATA").decode()
        metadata = re.sub(r"(?m)^Version: .*$", f"Version: {new_version}", metadata, count=1)
        record = source.read(f"{old_info}/RECORD").decode()
        changed = {
            f"{new_info}/METADATA": metadata.encode(),
            f"{new_info}/RECORD": _record(record, folders, metadata.encode()),
        }
        # Each entry keeps its mode (the extensions' 0755) and time: the same build
        # labelled twice gives the same bytes.
        for item in sorted(source.infolist(), key=lambda i: i.filename.endswith("/RECORD")):
            path = _moved(item.filename, folders)
            entry = zipfile.ZipInfo(path, date_time=item.date_time)
            entry.external_attr, entry.compress_type = item.external_attr, zipfile.ZIP_DEFLATED
            written.writestr(entry, changed.get(path) or source.read(item.filename))
    return target


def _moved(path: str, folders: Mapping[str, str]) -> str:
    top, slash, inner = path.partition("/")
    return folders[top] + slash + inner if slash and top in folders else path


def _record(record: str, folders: Mapping[str, str], metadata: bytes) -> bytes:
    """RECORD with the versioned folders renamed and METADATA's new hash and size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(metadata).digest()).rstrip(b"=").decode()
    lines = io.StringIO()
    for line in record.splitlines():
        path, _, rest = line.partition(",")
        path = _moved(path, folders)
        if path.endswith(".dist-info/METADATA"):
            rest = f"sha256={digest},{len(metadata)}"
        lines.write(f"{path},{rest}\n")
    return lines.getvalue().encode()


PINS_FILE = "constraints.txt"


def pins(wheel_names: list[str]) -> str:
    """``name==version`` of each wheel, one a line, sorted: pip's constraints. Pure.

    Example: ``["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]`` gives
    ``"torch==2.13.0+cpu\n"``.
    """
    lines = set()
    for name in wheel_names:
        if name.endswith(".whl"):
            project, version = name.split("-")[:2]
            lines.add(f"{re.sub(r'[-_.]+', '-', project).lower()}=={version}")
    return "".join(f"{line}\n" for line in sorted(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m horovod_ray.stack.wheelhouse")
    commands = parser.add_subparsers(dest="command", required=True)
    tag = commands.add_parser("retag", help="the patched horovod wheel, labelled, into --out")
    tag.add_argument("wheel", type=Path)
    tag.add_argument("--key", required=True, help="the build's key (the Makefile's HOROVOD_KEY)")
    tag.add_argument("--out", type=Path, required=True)
    pinned = commands.add_parser("pins", help=f"write the wheelhouse's {PINS_FILE}")
    pinned.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pins":
        names = sorted(path.name for path in args.folder.iterdir())
        (args.folder / PINS_FILE).write_text(pins(names))
        return 0
    label = local_label(args.key, installed_frameworks())
    print(retag(args.wheel, label, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
