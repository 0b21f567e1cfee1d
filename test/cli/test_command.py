"""The command runner's pure parts and the CLI's refusals: no Ray (ray is never initialised)."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import time

import psutil
import pytest
import ray

from horovod_ray.cli.command import (
    Exit,
    RankProcess,
    child_env,
    split_lines,
)
from horovod_ray.cli.main import _check_command, main
from horovod_ray.cli.output import Output, rank_dir_name
from horovod_ray.cli.parser import build_parser

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def test_split_lines_keeps_ends_and_breaks_on_carriage_returns():
    assert split_lines("", "a\nb\rc") == (["a\n", "b\r"], "c")
    assert split_lines("c", "d\n") == (["cd\n"], "")
    assert split_lines("", "") == ([], "")
    assert split_lines("", "\r\n") == (["\r", "\n"], "")
    assert split_lines("ab", "cd") == ([], "abcd")


def test_exit_status_follows_the_shell():
    assert Exit(0, 0.0).status == 0
    assert Exit(3, 0.0).status == 3
    assert Exit(-signal.SIGKILL, 0.0).status == 137
    assert Exit(-signal.SIGTERM, 0.0).describe() == "was killed by SIGTERM (status 143)"
    assert Exit(3, 0.0).describe() == "exited with status 3"


def test_rank_dirs_sort_in_rank_order():
    assert rank_dir_name(0, 1) == "rank.0"
    assert rank_dir_name(3, 10) == "rank.3"
    assert [rank_dir_name(r, 12) for r in (0, 9, 11)] == ["rank.00", "rank.09", "rank.11"]


def test_child_env_layers_caller_then_flags_then_rank(monkeypatch):
    monkeypatch.setenv("HOROVOD_RANK", "1")
    monkeypatch.delenv("HOROVOD_SIZE", raising=False)
    caller = {"PATH": "/bin", "HOROVOD_RANK": "7", "HOROVOD_SIZE": "9", "FOO": "caller"}
    env = child_env(caller, {"FOO": "flag"})
    assert env["PATH"] == "/bin"
    assert env["FOO"] == "flag"
    assert env["HOROVOD_RANK"] == "1"  # the rank's own, never the caller's stale one
    assert "HOROVOD_SIZE" not in env
    assert env["PYTHONUNBUFFERED"] == "1"  # lines come as they are printed
    assert "OLDPWD" not in child_env({"OLDPWD": "/", "BASH_FUNC_x%%": "() {}"}, {})


def test_nccls_interface_is_the_ranks_unless_env_names_one(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    caller = {"NCCL_SOCKET_IFNAME": "docker0"}
    assert child_env(caller, {})["NCCL_SOCKET_IFNAME"] == "eth1"
    assert child_env(caller, {"NCCL_SOCKET_IFNAME": "ib0"})["NCCL_SOCKET_IFNAME"] == "ib0"


def test_the_jobs_stall_timeout_is_a_default_the_caller_and_flags_override(monkeypatch):
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "600")  # the rank's (the job's)
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "60")
    env = child_env({"HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}, {})
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "600"
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "5"  # the caller's own
    flags = {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90"}  # --stall-check-shutdown-time-seconds
    assert child_env({}, flags)["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "90"


def test_output_prefixes_lines_and_mirrors_them_to_files(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    output = Output(out, err, str(tmp_path))
    output.open(2)
    output.write(1, [("stdout", "a\n"), ("stderr", "b\r"), ("stdout", "c\n")])
    output.close()
    assert out.getvalue() == "[1]<stdout>:a\n[1]<stdout>:c\n"
    assert err.getvalue() == "[1]<stderr>:b\r"
    assert (tmp_path / "rank.1" / "stdout").read_bytes() == b"[1]<stdout>:a\n[1]<stdout>:c\n"
    assert (tmp_path / "rank.1" / "stderr").read_bytes() == b"[1]<stderr>:b\r"
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b""


def test_output_files_for_a_rank_that_joins_later(tmp_path):
    """An elastic job's ranks may pass the size its files were opened for."""
    output = Output(io.StringIO(), io.StringIO(), str(tmp_path))
    output.open(2)
    output.write(2, [("stdout", "joined\n")])
    output.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank.0", "rank.1", "rank.2"]
    assert (tmp_path / "rank.2" / "stdout").read_text() == "[2]<stdout>:joined\n"


def test_output_stamps_each_line_as_horovodrun_does(tmp_path):
    out = io.StringIO()
    output = Output(out, io.StringIO(), str(tmp_path), timestamps=True)
    output.open(1)
    output.write(0, [("stdout", "a\n"), ("stdout", "b\n")])
    output.close()
    # time.asctime(), as horovodrun's safe_shell_exec, then the usual prefix.
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    assert re.fullmatch(f"{stamp}\\[0\\]<stdout>:a\n{stamp}\\[0\\]<stdout>:b\n", out.getvalue())
    assert (tmp_path / "rank.0" / "stdout").read_text() == out.getvalue()


def _drain(process: RankProcess, timeout_s: float = 30) -> tuple[list, Exit]:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new, done = process.poll(0.2)
        lines += new
        if done is not None:
            return lines, done
    raise AssertionError(f"no exit within {timeout_s}s; lines so far: {lines}")


def test_rank_process_relays_both_streams_and_the_exit(tmp_path):
    script = "printf 'one\\ntwo\\rthree'; echo err >&2; exit 3"
    process = RankProcess(["sh", "-c", script], {"PATH": os.environ["PATH"]}, str(tmp_path))
    lines, done = _drain(process)
    assert [line for stream, line in lines if stream == "stdout"] == ["one\n", "two\r", "three\n"]
    assert [line for stream, line in lines if stream == "stderr"] == ["err\n"]
    assert done.returncode == 3


def _tree(pid: int) -> list[int]:
    return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]


def test_rank_process_end_takes_the_whole_tree(tmp_path):
    # One grandchild leaves the process group (setsid): the guard finds it all the same.
    script = "sleep 60 & setsid sleep 60 & echo started; wait"
    process = RankProcess(["sh", "-c", script], {"PATH": os.environ["PATH"]}, str(tmp_path))
    lines, _ = process.poll(10)
    assert lines == [("stdout", "started\n")]
    tree = _tree(process.pid)
    assert len(tree) == 4  # the guard, sh, two sleeps
    process.end(grace_s=2)
    _, done = _drain(process)
    assert done.returncode == -signal.SIGTERM
    assert not [pid for pid in tree if _not_zombie(pid)]


def test_what_the_command_leaves_running_ends_with_it(tmp_path):
    # The sleep outlives sh: orphaned, it is adopted by the guard, which ends it.
    script = "sleep 60 & echo $!; exit 4"
    process = RankProcess(["sh", "-c", script], {"PATH": os.environ["PATH"]}, str(tmp_path))
    lines, done = _drain(process)
    assert done.returncode == 4
    (orphan,) = [int(line) for _, line in lines]
    assert not _not_zombie(orphan)


def test_a_command_that_cannot_start_exits_127(tmp_path):
    process = RankProcess(["/no/such/program"], {"PATH": os.environ["PATH"]}, str(tmp_path))
    lines, done = _drain(process)
    assert done.returncode == 127
    assert "cannot run '/no/such/program'" in lines[0][1]


def test_a_command_that_is_not_runnable_exits_126(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("not a program\n")  # no execute permission
    process = RankProcess([str(data)], {"PATH": os.environ["PATH"]}, str(tmp_path))
    lines, done = _drain(process)
    assert done.returncode == 126
    assert "Permission denied" in lines[0][1]


def test_the_command_dies_with_a_guard_killed_outright(tmp_path):
    """Ray kills a dying actor's children with SIGKILL (the guard among them), so the guard
    cannot end the tree: the command must not outlive it (it did, blocked forever, after
    a static job's stop for a drain)."""
    script = "import time; print('started', flush=True); time.sleep(60)"
    process = RankProcess(
        [sys.executable, "-c", script], {"PATH": os.environ["PATH"]}, str(tmp_path)
    )
    lines, _ = process.poll(30)
    assert lines == [("stdout", "started\n")]
    (command,) = psutil.Process(process.pid).children()
    os.kill(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _not_zombie(command.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _not_zombie(command.pid)
    _drain(process)


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def no_ray_init(monkeypatch):
    """Fails the test if the CLI gets as far as starting or joining Ray."""

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "-np", "2"], "give the COMMAND to run"),
        (["run", "-np", "2", "no-such-program-xyz"], "command not found: 'no-such-program-xyz'"),
        (["run", "python3"], "give the job's size"),
        (["run", "-np", "2", "--num-hosts", "2", "python3"], "not both"),
        (["run", "--slots-per-host", "2", "-np", "2", "python3"], "--slots-per-host needs"),
        (["run", "-np", "0", "python3"], "-np: "),
        (["run", "-np", "2", "--cpus-per-worker", "-1", "python3"], "--cpus-per-worker: "),
        (["run", "-np", "2", "--env", "FOO", "python3"], "--env takes NAME=VALUE"),
        (["run", "-np", "2", "--env", "HOROVOD_RANK=3", "python3"], "may not set HOROVOD_RANK"),
        (["run", "-np", "2", "--working-dir", "/no/such/dir", "python3"], "--working-dir"),
        (["run", "-np", "2", "--gloo-timeout-seconds", "0", "python3"], "--gloo-timeout-seconds"),
    ],
)
def test_bad_command_lines_exit_2_before_ray(argv, message, capsys, no_ray_init):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("horovod-ray run: error: ") and message in err, err


@pytest.mark.parametrize("argv", [["run", "-np", "two", "python3"], ["walk"], []])
def test_bad_flags_exit_2(argv, capsys, no_ray_init):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "usage: horovod-ray" in capsys.readouterr().err


def test_command_after_double_dash_keeps_its_own_flags():
    args = build_parser().parse_args(["run", "-np", "2", "--", sys.executable, "-np", "x"])
    assert _check_command(args.command) == [sys.executable, "-np", "x"]
