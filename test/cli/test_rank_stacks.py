"""SIGUSR1's stacks for ``horovod-ray run``, the rank's half (py-spy on a real command
tree) and the signal's, without Ray."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from horovod_ray.cli import command, rank_stacks
from horovod_ray.cli.command import RankProcess
from horovod_ray.cli.signals import Signals

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def test_a_ranks_stacks_name_each_process_and_where_python_waits(tmp_path, monkeypatch):
    # sh (no Python stacks) starts a Python that waits in a function of its own.
    program = (
        "import time\n"
        "def waiting_here():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "waiting_here()\n"
    )
    (tmp_path / "wait.py").write_text(program)
    script = f"{sys.executable} wait.py; true"
    process = RankProcess(["sh", "-c", script], dict(os.environ), str(tmp_path))
    monkeypatch.setattr(command, "_process", process)
    try:
        lines, _ = process.poll(30)
        assert lines == [("stdout", "ready\n")]
        text = rank_stacks.stacks_on_rank()
    finally:
        process.end(grace_s=2)
    shell, python = re.split(r"^(?=pid \d+: )", text, flags=re.M)[1:]
    assert shell.startswith("pid ") and "sh -c" in shell and "no Python stacks" in shell
    assert re.search(r"^pid \d+: .*wait\.py$", python, re.M)
    assert re.search(r"waiting_here \(wait\.py:4\)", python)


def test_without_a_command_a_rank_says_so(monkeypatch):
    monkeypatch.setattr(command, "_process", None)
    assert rank_stacks.stacks_on_rank() == "no command runs on this rank"


def test_a_process_py_spy_may_not_read_says_what_allows_it(monkeypatch, tmp_path):
    tool = tmp_path / "py-spy"
    tool.write_text("#!/bin/sh\necho 'Error: Permission denied (os error 13)' >&2\nexit 1\n")
    tool.chmod(0o755)
    text = rank_stacks.process_stacks(os.getpid(), str(tool))
    assert text.startswith("no stacks: py-spy may not read this process")
    assert "CAP_SYS_PTRACE" in text and "(Permission denied (os error 13))" in text


def test_sigusr1_asks_for_stacks_once_and_an_elastic_run_says_why_not(capfd):
    before = signal.getsignal(signal.SIGUSR1)
    with Signals() as signals:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # the handler runs in this thread at the next instruction
        assert signals.take_stacks_request()
        assert not signals.take_stacks_request()
        signals.no_stacks_note = "no stacks for this run"
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert not signals.take_stacks_request()
    assert "no stacks for this run" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) is before
