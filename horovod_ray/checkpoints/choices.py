"""The records of a run's folder and the choices made over them, without a filesystem:
which checkpoint is the latest, which number comes next, which are kept, what a named
checkpoint's folder may be called, which half-written files are stale (see ``store``
for the folder's layout). Pure functions over :class:`Entry` records.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable

from horovod_ray.checkpoints.metrics import flatten

_NAME = re.compile(r"^checkpoint_(\d{6,})(\.json)?$")
METRICS_FILE = "metrics.json"
# A JSON file being written: its name, a random part, this suffix (see files.write_json).
PARTIAL_SUFFIX = ".partial"
# A committed checkpoint whose validation (``report(validation=...)``) has not ended: the
# status Ray Train's ``ReportedCheckpoint`` gives it (see ``validation``).
PENDING_VALIDATION = "PENDING_VALIDATION"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint number found in a run's folder.

    Attributes:
        index: Its number (``checkpoint_000003``: 3).
        committed: Its marker is there: the upload finished.
        metrics: The metrics reported with it (from the marker; {} when not committed).
        named: Its folder's name when its marker names one (``checkpoint_dir_name``);
            None: ``checkpoint_`` and its number.
        validation: Its validation's record when one was asked for: ``status`` (Ray
            Train's ``ReportedCheckpointStatus`` name), ``request`` (``fn_kwargs``,
            ``timeout_s``) and, once it failed, ``error``; {} when none was.
        time: When its marker was written (tells it from a marker written later under
            the same number); None when not committed.
    """

    index: int
    committed: bool
    metrics: dict = dataclasses.field(default_factory=dict)
    named: str | None = None
    validation: dict = dataclasses.field(default_factory=dict)
    time: float | None = None

    @property
    def folder(self) -> str:
        return self.named or folder_name(self.index)

    @property
    def status(self) -> str:
        """Ray Train's status for it: ``COMMITTED`` without a validation, else its
        validation's (``PENDING_VALIDATION``, ``VALIDATED``, ...)."""
        return self.validation.get("status") or "COMMITTED"


def folder_name(index: int) -> str:
    return f"checkpoint_{index:06d}"


def marker_name(index: int) -> str:
    """Checkpoint ``index``'s commit marker's name in the run's folder."""
    return f"{folder_name(index)}.json"


def dir_name_problem(name: Any) -> str | None:
    """What is wrong with ``name`` as a checkpoint's folder in a run's folder, or None.
    Pure.

    Example: ``"epoch_3"`` is fine; ``"a/b"``, ``".."``, ``"checkpoint_000003"`` (a
    numbered checkpoint's) and ``"metrics.json"`` are not.
    """
    if not isinstance(name, str) or not name:
        return f"must be a folder name (str), got {name!r}"
    if "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        return f"must be one folder name, not a path or a hidden name, got {name!r}"
    if _NAME.match(name.lower()) or name.lower().endswith((".json", PARTIAL_SUFFIX)):
        return (
            f"{name!r} is a name the run's folder keeps for its own files: choose another "
            f"(e.g. epoch_3)"
        )
    return None


def index_of(path: str | None) -> int | None:
    """The number of the checkpoint at ``path`` (a run's ``checkpoint_000003``), or None."""
    match = _NAME.match((path or "").rstrip("/").rpartition("/")[2])
    return None if match is None or match.group(2) else int(match.group(1))


def latest(entries: Iterable[Entry]) -> Entry | None:
    """The committed checkpoint with the highest number: the one to resume from."""
    committed = [entry for entry in entries if entry.committed]
    return max(committed, key=lambda entry: entry.index, default=None)


def next_index(entries: Iterable[Entry]) -> int:
    """The number for the next checkpoint: past every folder there, finished or not."""
    return max((entry.index for entry in entries), default=0) + 1


def ranked(entries: Iterable[Entry], attribute: str | None, order: str) -> list[Entry]:
    """Committed checkpoints best first: by ``attribute`` (``order`` "max" or "min"; ones
    without that metric, or with a value that is not a number, last), else newest first.
    A nested metric is named by its path joined with "/" (``"val/loss"``), as Ray Train
    flattens them."""
    committed = [entry for entry in entries if entry.committed]
    if attribute is None:
        return sorted(committed, key=lambda entry: -entry.index)

    def key(entry: Entry) -> tuple[int, float, int]:
        value = score(entry.metrics, attribute)
        if value is None:
            return (1, 0.0, -entry.index)
        return (0, -value if order == "max" else value, -entry.index)

    return sorted(committed, key=key)


def score(metrics: dict, attribute: str) -> float | None:
    """A checkpoint's ``metrics``' ``attribute`` (a nested one by its "/" path), None
    unless it is a number."""
    value = flatten(metrics).get(attribute)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        return None
    return value


def to_remove(
    entries: Iterable[Entry],
    num_to_keep: int | None,
    attribute: str | None,
    order: str,
    stale_below: int,
    protected: int | None = None,
) -> list[int]:
    """Which checkpoint numbers to remove after a commit, or once a job has ended.

    Kept: the ``num_to_keep`` best, the latest whatever its score (a restart resumes
    from it, as Ray Train keeps it), ``protected`` (the one the job started from, which
    its ranks may still read), and those pending validation (a validation reads it, and
    its metrics may rank it among the best, as Ray Train keeps them). Removed too:
    unfinished folders numbered below ``stale_below`` (uploads of earlier jobs, cut off
    when they failed; one numbered higher may be an upload still under way).

    Example: numbers 1..4 committed with loss 0.5, 0.2, 0.9, 0.7, num_to_keep 2, "loss"
    by "min": 2 and 1 are the best, 4 is the latest, so 3 goes.
    """
    entries = list(entries)
    removed = [e.index for e in entries if not e.committed and e.index < stale_below]
    if num_to_keep is None:
        return removed
    best = ranked(entries, attribute, order)
    keep = {entry.index for entry in best[:num_to_keep]}
    newest = latest(entries)
    if newest is not None:
        keep.add(newest.index)
    keep.add(protected)
    keep.update(entry.index for entry in best if entry.status == PENDING_VALIDATION)
    return removed + sorted(entry.index for entry in best if entry.index not in keep)


def stale_partials(names: Iterable[str], stale_below: int | None) -> list[str]:
    """Which of a run folder's ``names`` are JSON files a process left half-written (it
    was killed while writing one: see ``store``).

    While a job runs (``stale_below`` its first number), only markers of checkpoints
    numbered below it: any other may be this job's, still being written. Once the job
    has ended (``stale_below`` None), every one.

    Example: with ``stale_below`` 4, ``checkpoint_000002.json.ab12.partial`` goes;
    ``checkpoint_000005.json.cd34.partial`` and ``metrics.json.ef56.partial`` stay.
    """
    stale = []
    for name in names:
        if not name.endswith(PARTIAL_SUFFIX):
            continue
        target = name[: -len(PARTIAL_SUFFIX)].rpartition(".")[0]  # less the random part
        match = _NAME.match(target)
        if target != METRICS_FILE and (match is None or not match.group(2)):
            continue  # not a name files.write_json makes: not ours
        if stale_below is None or (match is not None and int(match.group(1)) < stale_below):
            stale.append(name)
    return stale


def parse_name(name: str) -> tuple[int, bool] | None:
    """A numbered checkpoint's folder (``checkpoint_000003``: 3, False) or marker
    (``checkpoint_000003.json``: 3, True); None for any other name."""
    match = _NAME.match(name)
    return None if match is None else (int(match.group(1)), bool(match.group(2)))
