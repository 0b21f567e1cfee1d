"""``horovod-ray run`` end to end: real Ray, real Horovod, unmodified scripts."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray

import horovod_ray
from test.conftest import live_placement_groups, start_local_ray, wait_until

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "plain_horovod.py")
VENV_BIN = Path(sys.executable).parent
LINE = re.compile(r"(?<=[\r\n])")


@pytest.fixture(scope="module")
def address() -> str:
    """The running Ray the CLI joins (--address), so that each test skips Ray's start."""
    start_local_ray(4)
    return ray.get_runtime_context().gcs_address


def _cli(*args: str, text: bool = True, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "horovod_ray", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=text,
        **popen,
    )


def _run(*args: str, timeout: float = 120, **popen) -> tuple[int, str, str]:
    # Bytes, decoded here: text mode would turn each \r into \n.
    process = _cli(*args, text=False, **popen)
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out.decode(), err.decode()


# TensorFlow's own start-up log lines (absl's format: severity, date, time, thread id, file),
# whose times and thread ids differ from run to run.
ABSL_LINE = re.compile(r"\[\d+\]<stderr>:([IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ |WARNING: All log)")


def _prefixed(text: str) -> list[str]:
    """The relayed lines (a \\r ends a line too), sorted: ranks interleave freely; without
    TensorFlow's timestamped log lines (TensorFlow 2.21 writes one at import)."""
    return sorted(
        line
        for line in LINE.split(text)
        if re.match(r"\[\d+\]<std", line) and not ABSL_LINE.match(line)
    )


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _ray_processes_under(root: Path) -> list[int]:
    """Live processes whose command line names ``root`` (a Ray temp dir of one test)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        command = " ".join(process.info["cmdline"] or [])
        if str(root) in command and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process.pid)
    return found


def test_same_lines_as_horovodrun(tmp_path):
    """A fresh local Ray started and stopped by the CLI; output as horovodrun's, byte for byte."""
    env = {**os.environ, "FOO": "from-caller", "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [sys.executable, SCRIPT, "allreduce"]
    # The CLI's own Ray keeps its files, and so its processes' names, under ray_root (short:
    # Ray's socket paths must fit 107 bytes).
    ray_root = Path(tempfile.mkdtemp(prefix="hr-cli-"))
    try:
        cli_env = {**env, "RAY_TMPDIR": str(ray_root)}
        code, out, err = _run("-np", "2", *command, cwd=tmp_path, env=cli_env, timeout=180)
        assert code == 0, err[-3000:]
        assert any(ray_root.iterdir())
        deadline = time.monotonic() + 20
        while _ray_processes_under(ray_root) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ray_processes_under(ray_root) == []  # the local Ray it started is gone
    finally:
        shutil.rmtree(ray_root, ignore_errors=True)
    reference = subprocess.run(
        [str(VENV_BIN / "horovodrun"), "--gloo", "-np", "2", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=180,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert _prefixed(out) == _prefixed(reference.stdout.decode())
    assert _prefixed(err) == _prefixed(reference.stderr.decode())
    assert f"[1]<stdout>:rank 1 FOO=from-caller cwd={tmp_path}\n" in out
    assert "[0]<stdout>:rank 0 of 2: local 0, sum 3.0\n" in out
    assert "[1]<stderr>:rank 1 says hello on stderr\n" in err
    assert "[0]<stdout>:rank 0 progress 1/2\r[0]<stdout>:rank 0 progress 2/2\n" in out


# What may differ between the two launchers' ranks: the rendezvous server's address (ours
# carries the job's secret), the node's name (horovodrun's -H name, here the Ray node id),
# and ours alone: the one-round-trip rendezvous (docs/clusters.rst, "Large jobs"), the attempt
# (--max-restarts) and the job's name, id and metrics (docs/observability.rst).
LAUNCHER_OWN = ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_HOSTNAME")
OURS_ONLY = (
    "HOROVOD_GLOO_RENDEZVOUS_BATCH",
    "HOROVOD_RAY_ATTEMPT",
    "HOROVOD_RAY_JOB_ID",
    "HOROVOD_RAY_JOB_NAME",
    "HOROVOD_RAY_METRICS",
    "HOROVOD_RAY_PREEMPTION_DIR",
)
PARITY = [
    ["-H", "localhost:2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
     "--cache-capacity", "512", "--hierarchical-allreduce", "--no-stall-check",
     "--log-level", "DEBUG", "--log-without-timestamp", "--network-interfaces", "lo",
     "--gloo-timeout-seconds", "45", "--timeline-filename", "timeline.json",
     "--timeline-mark-cycles", "--autotune", "--autotune-log-file", "at.csv"],
    ["--config-file", "horovod.yaml", "--cycle-time-ms", "7", "--prefix-output-with-timestamp"],
]  # fmt: skip
# horovodrun's --prefix-output-with-timestamp: time.asctime() before each line's prefix.
STAMP = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"


def _rank_envs(out: str, stamped: bool) -> dict[int, dict[str, str]]:
    stamp = STAMP if stamped else ""
    envs: dict[int, dict[str, str]] = {}
    for rank, name, value in re.findall(rf"^{stamp}\[(\d+)\]<stdout>:(\w+)=(.*)$", out, re.M):
        envs.setdefault(int(rank), {})[name] = value
    return envs


@pytest.mark.parametrize("flags", PARITY, ids=lambda flags: " ".join(flags[:2]) or "none")
def test_each_rank_gets_the_environment_horovodrun_gives(address, tmp_path, flags):
    """The same command line under horovodrun and ``horovod-ray run``: every HOROVOD_* and
    NCCL_* variable of every rank matches, but for the launcher's own address and name."""
    (tmp_path / "horovod.yaml").write_text(
        "params:\n  fusion_threshold_mb: 16\n  cycle_time_ms: 4\n"
        "stall_check:\n  warning_time_seconds: 30\n"
    )
    command = ["-np", "2", *flags, sys.executable, SCRIPT, "env"]
    code, out, err = _run("--address", address, *command, cwd=tmp_path)
    assert code == 0, err[-3000:]
    reference = subprocess.run(
        [str(VENV_BIN / "horovodrun"), "--gloo", *command],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    stamped = "--prefix-output-with-timestamp" in flags
    ours, theirs = _rank_envs(out, stamped), _rank_envs(reference.stdout, stamped)
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for rank in ours:
        for name in LAUNCHER_OWN:
            assert ours[rank].pop(name) and theirs[rank].pop(name)
        for name in OURS_ONLY:
            ours[rank].pop(name)
        if "--timeline-filename" in flags:
            # Rank 0's file on its node, which the job brings to timeline.json as it stops.
            assert theirs[rank].pop("HOROVOD_TIMELINE") == "timeline.json"
            assert ours[rank].pop("HOROVOD_RAY_TIMELINE") == "1"
            local = os.path.join(tempfile.gettempdir(), "horovod_ray-timeline-")
            assert ours[rank].pop("HOROVOD_TIMELINE").startswith(local)
        if "--gloo-timeout-seconds" not in flags:
            # Our default (docs/cli.rst), where horovodrun sets nothing and Gloo waits 30 s.
            assert ours[rank].pop("HOROVOD_GLOO_TIMEOUT_SECONDS") == "120"
        for name, default in (
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "60"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "600"),
        ):
            if name not in theirs[rank]:
                # Our hang detection (--stall-timeout-seconds), where horovodrun only warns.
                assert ours[rank].pop(name) == default
        assert ours[rank] == theirs[rank]


def test_env_flag_and_output_files(address, tmp_path):
    """Also horovodrun's host list (the driver's node, by name) and a tuning flag, whose
    HOROVOD_TIMELINE makes rank 0 write horovod's timeline."""
    logs, timeline = tmp_path / "logs", tmp_path / "timeline.json"
    code, out, err = _run(
        "-H", "localhost:2", "--address", address, "--env", "FOO=from-flag",
        "--output-filename", str(logs), "--timeline-filename", str(timeline),
        sys.executable, SCRIPT, "allreduce",
        cwd=tmp_path,
    )  # fmt: skip
    assert code == 0, err[-3000:]
    assert timeline.read_text().startswith("[")
    assert "[0]<stdout>:rank 0 FOO=from-flag" in out
    assert sorted(p.name for p in logs.iterdir()) == ["rank.0", "rank.1"]
    for rank in (0, 1):
        stdout = (logs / f"rank.{rank}" / "stdout").read_bytes().decode()
        assert f"[{rank}]<stdout>:rank {rank} of 2: local {rank}, sum 3.0\n" in stdout
        assert stdout == "".join(line for line in LINE.split(out) if line.startswith(f"[{rank}]"))
        stderr = (logs / f"rank.{rank}" / "stderr").read_text()
        assert f"[{rank}]<stderr>:rank {rank} says hello on stderr\n" in stderr


def test_a_host_that_is_no_node_exits_2_naming_it(address):
    code, _, err = _run("--address", address, "-H", "10.255.255.1:1", sys.executable, SCRIPT)
    assert code == 2, err[-3000:]
    assert "-H/--hosts: host '10.255.255.1' is no node of this Ray cluster" in err


def test_failing_rank_sets_the_status_and_stops_the_others(address, tmp_path):
    code, out, err = _run(
        "-np", "2", "--address", address, sys.executable, SCRIPT, "fail", str(tmp_path), "1", "3"
    )  # fmt: skip
    assert code == 3
    assert re.search(r"rank 1 on \S+ \([\d.]+\) exited with status 3; the other ranks", err)
    pids = [int(pid) for pid in re.findall(r"<stdout>:pid (\d+)", out)]
    assert len(pids) == 2 and _alive(pids) == []


def test_killed_rank_reports_the_signal(address, tmp_path):
    code, _, err = _run(
        "-np", "2", "--address", address, sys.executable, SCRIPT, "fail", str(tmp_path), "0",
        "KILL",
    )  # fmt: skip
    assert code == 128 + signal.SIGKILL, err[-2000:]
    assert re.search(r"rank 0 on \S+ \([\d.]+\) was killed by SIGKILL \(status 137\)", err)


def test_a_command_that_cannot_start_on_its_node_exits_127(address, tmp_path):
    """Found on the driver's machine, so it passes the check before Ray, but it cannot
    start: its interpreter is missing (on another node, it could be the program)."""
    program = tmp_path / "tool"
    program.write_text("#!/no/such/interpreter\n")
    program.chmod(0o755)
    code, _, err = _run("-np", "2", "--address", address, str(program))
    assert code == 127, err[-2000:]
    assert f"cannot run '{program}'" in err
    assert re.search(r"rank \d on \S+ \([\d.]+\) exited with status 127", err)


def test_a_failed_job_runs_again_with_max_restarts(address, tmp_path):
    logs = tmp_path / "logs"
    code, out, err = _run(
        "-np", "2", "--address", address, "--max-restarts", "2", "--output-filename",
        str(logs), sys.executable, SCRIPT, "attempt",
    )  # fmt: skip
    assert code == 0, err[-3000:]
    assert re.search(
        r"horovod-ray run: attempt 0 failed \(rank 1 on \S+ \([\d.]+\) exited with status 3; "
        r"the other ranks were stopped\); restarting in 1s \(2 restarts left\)",
        err,
    ), err[-2000:]
    assert sorted(line for line in out.splitlines() if "attempt 1" in line) == [
        "[0]<stdout>:rank 0 in attempt 1",
        "[1]<stdout>:rank 1 in attempt 1",
    ]
    assert "attempt 2" not in out
    # Each rank's file holds both attempts: a restart writes on.
    assert (logs / "rank.1" / "stdout").read_text().splitlines() == [
        "[1]<stdout>:rank 1 in attempt 0",
        "[1]<stdout>:rank 1 in attempt 1",
    ]


def test_a_python_command_checkpoints_and_its_restart_resumes(address, tmp_path):
    """The function test_checkpoints runs with run() and Tune, unchanged in a script."""
    script = str(Path(__file__).parent.parent / "scripts" / "checkpointed.py")
    code, out, err = _run(
        "-np", "2", "--address", address, "--max-restarts", "1", "--storage-path",
        str(tmp_path), "--name", "cli", "--num-to-keep", "1", sys.executable, script,
        json.dumps({"steps": 4, "die_at": 2}),
    )  # fmt: skip
    assert code == 0, err[-3000:]
    assert "attempt 0 failed (rank 1 on" in err
    assert sorted(line for line in out.splitlines() if "resumed" in line) == [
        "[0]<stdout>:rank 0 resumed from 2, state 16.0",
        "[1]<stdout>:rank 1 resumed from 2, state 16.0",
    ]
    result = horovod_ray.Result.from_path(f"{tmp_path}/cli")
    assert [metrics["step"] for _, metrics in result.best_checkpoints] == [4]  # --num-to-keep 1


def test_lines_arrive_while_the_rank_runs(address, tmp_path):
    process = _cli("-np", "2", "--address", address, sys.executable, SCRIPT, "live", str(tmp_path))
    ready = {process.stdout.readline() for _ in range(2)}  # before the ranks may go on
    assert ready == {"[0]<stdout>:rank 0 ready\n", "[1]<stdout>:rank 1 ready\n"}
    (tmp_path / "go").touch()
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err[-2000:]
    assert sorted(out.splitlines()) == ["[0]<stdout>:rank 0 done", "[1]<stdout>:rank 1 done"]


# The CLI, reporting how much its private memory grew (sampled: Ray's shared object store
# is in RSS too, but is not what would grow).
MEASURED_CLI = """
import sys, threading
from horovod_ray.cli.main import main

def private_kb():
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("RssAnon:")).split()[1])

first = peak = private_kb()
def sample():
    global peak
    while True:
        peak = max(peak, private_kb())
        threading.Event().wait(0.02)

threading.Thread(target=sample, daemon=True).start()
code = main(sys.argv[1:])
print(f"driver grew {peak - first} kB", file=sys.stderr)
sys.exit(code)
"""


def test_a_rank_that_prints_faster_than_it_is_read_waits_for_the_reader(address):
    """200 MB printed as fast as a rank can while nobody reads the CLI's output for a
    while: the rank blocks in its writes (as under horovodrun), its actor's and the
    driver's memory stay bounded, and every line arrives, in order."""
    process = subprocess.Popen(
        [sys.executable, "-c", MEASURED_CLI, "run", "--address", address, "-np", "1",
         sys.executable, SCRIPT, "flood", "200"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        time.sleep(4)  # the driver blocks in its writes; without a bound, the actor queues
        expected = 0
        for line in process.stdout:
            if line.startswith(b"[0]<stdout>:"):
                assert int(line[12:21]) == expected
                expected += 1
        err = process.stderr.read().decode()
        assert process.wait(timeout=60) == 0, err[-3000:]
    finally:
        process.kill()
    assert expected == 200 * 1000
    grew = dict(re.findall(r"(actor|driver) grew (\d+) kB", err))
    assert int(grew["actor"]) < 64 * 1024, err
    assert int(grew["driver"]) < 64 * 1024, err


def test_ctrl_c_while_the_job_waits_for_room_stops_it(address):
    """Nine ranks cannot fit the four CPUs: the start waits, and Ctrl-C ends the wait."""
    before = {g.placement_group_id for g in live_placement_groups()}
    process = _cli("-np", "9", "--address", address, "sleep", "60", start_new_session=True)
    # Its placement group listed and not placed: the start waits.
    if not wait_until(
        lambda: [g for g in live_placement_groups() if g.placement_group_id not in before], 60
    ):
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the command line's group was never listed: {process.communicate()[1]}")
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130, err[-2000:]
    assert "stopped by SIGINT" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_end_every_rank_tree(address, signum, status):
    process = _cli(
        "-np", "2", "--address", address, sys.executable, SCRIPT, "wait",
        start_new_session=True,
    )  # fmt: skip
    pids: list[int] = []
    while len(pids) < 4:
        line = process.stdout.readline()
        assert line, process.stderr.read()[-3000:]
        pids += [int(pid) for pid in re.findall(r"\d+", line.split("pids", 1)[-1])]
    assert len(_alive(pids)) == 4
    if signum == signal.SIGINT:
        os.killpg(process.pid, signum)  # Ctrl-C reaches the terminal's whole group
    else:
        process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == status, err[-3000:]
    assert f"stopped by {signum.name}" in err
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(pids) == []


def test_sigusr1_prints_every_ranks_stacks_and_the_run_goes_on(address, tmp_path):
    process = _cli("-np", "2", "--address", address, sys.executable, SCRIPT, "live", str(tmp_path))
    # Whatever happens below, the ranks are let go within a minute.
    release = threading.Timer(60, (tmp_path / "go").touch)
    release.start()
    try:
        for _ in range(2):
            assert "ready" in process.stdout.readline()
        process.send_signal(signal.SIGUSR1)
        stacks: dict[str, list[str]] = {"0": [], "1": []}
        # py-spy prints the innermost call first, the script's module last.
        while not all(any("<module>" in line for line in lines) for lines in stacks.values()):
            line = process.stderr.readline()
            assert line, "stderr closed before both ranks' stacks came"
            if match := re.match(r"\[(\d)\]<stacks>:(.*)", line):
                stacks[match.group(1)].append(match.group(2))
        (tmp_path / "go").touch()
        out, err = process.communicate(timeout=60)
    finally:
        release.cancel()
    assert process.returncode == 0, err[-3000:]  # the run went on to its end
    assert sorted(re.findall(r"^\[\d\]<stdout>:(rank \d done)", out, re.M)) == [
        "rank 0 done",
        "rank 1 done",
    ]
    for lines in stacks.values():
        command_line = f"{sys.executable} {SCRIPT} live "
        assert re.fullmatch(rf"pid \d+: {re.escape(command_line)}.*", lines[0])
        calls = [re.match(r" *(\S+) \(plain_horovod\.py:\d+\)", line) for line in lines]
        assert [call.group(1) for call in calls if call][:2] == ["_wait_for", "live"]


def test_rank_process_dies_with_a_killed_actor(address):
    """An actor killed outright (no exit handlers) still takes its command's tree along."""
    from horovod_ray import RayExecutor
    from horovod_ray.cli.command import poll_on_rank, start_on_rank

    executor = RayExecutor(num_workers=1)
    executor.start()
    try:
        tree = ["sh", "-c", "sleep 120 & echo $!; wait"]
        (where,) = executor.run(start_on_rank, args=(tree, dict(os.environ), {}, "/", False))
        (([(_, sleep_pid)], _),) = executor.run(poll_on_rank, args=(10,))
        pids = [where.pid, *[p.pid for p in psutil.Process(where.pid).children(recursive=True)]]
        assert int(sleep_pid) in pids and len(pids) == 3  # the guard, sh, sleep
        (actor_pid,) = executor.run(os.getpid)
        os.kill(actor_pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(pids) == []
    finally:
        executor.stop()


def test_python_m_and_console_script_show_help():
    for command in ([sys.executable, "-m", "horovod_ray"], [str(VENV_BIN / "horovod-ray")]):
        result = subprocess.run([*command, "run", "--help"], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        for flag in ("-np", "--output-filename", "--gloo-timeout-seconds", "--working-dir"):
            assert flag in result.stdout


def test_horovodruns_gloo_flag_is_taken_and_no_flag_is_abbreviated(capsys):
    """``horovod-ray run --gloo -np 2 python train.py``, horovodrun's documented command
    with the binary renamed, once exited 2: argparse read --gloo as an abbreviation of
    --gloo-timeout-seconds."""
    from horovod_ray.cli.main import main
    from horovod_ray.cli.parser import build_parser

    args = build_parser().parse_args(["run", "--gloo", "-np", "2", "python", "train.py"])
    assert (args.use_gloo, args.num_proc, args.command) == (True, 2, ["python", "train.py"])
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["run", "--gloo-timeout", "5", "-np", "2", "python"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --gloo-timeout" in capsys.readouterr().err
    # An MPI launch is refused before Ray starts, naming the flag and the way out.
    for flag in ("--mpi", "--jsrun"):
        assert main(["run", flag, "-np", "2", "python", "train.py"]) == 2
        assert f"{flag}: horovod-ray runs every job with Gloo" in capsys.readouterr().err
