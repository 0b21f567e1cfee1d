"""horovodrun's flags in ``horovod-ray run``: each one's behaviour, checked against
horovodrun's own parser (no Ray)."""

from __future__ import annotations

import logging
import sys

import pytest
from horovod.runner import launch
from horovod.runner.common.util import config_parser

from horovod_ray.cli import flags, translate
from horovod_ray.cli.main import main
from horovod_ray.cli.parser import build_parser

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

TUNING = [
    ["--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--cache-capacity", "0"],
    ["--hierarchical-allreduce", "--no-hierarchical-allgather", "--torus-allreduce"],
    ["--autotune", "--autotune-log-file", "trials.csv", "--autotune-warmup-samples", "2"],
    ["--autotune", "--autotune-steps-per-sample", "5", "--autotune-bayes-opt-max-samples", "9"],
    ["--autotune", "--autotune-gaussian-process-noise", "0.5"],
    ["--timeline-filename", "timeline.json", "--timeline-mark-cycles"],
    ["--no-stall-check"],
    ["--stall-check-warning-time-seconds", "30", "--stall-check-shutdown-time-seconds", "90"],
    ["--mpi-threads-disable", "--num-nccl-streams", "2", "--thread-affinity", "1", "--tcp"],
    ["--log-level", "DEBUG", "--log-without-timestamp"],
    ["--log-hide-timestamp"],  # horovodrun's deprecated names: they used to exit 2 here
    ["--no-log-hide-timestamp"],
    ["--gloo", "--disable-cache", "--network-interface", "lo", "--network-interface", "eth0"],
    [],
]


def _ours(flags: list[str]) -> dict[str, str]:
    args = build_parser().parse_args(["run", "-np", "2", *flags, "python", "train.py"])
    return translate.resolve(args)


def _horovodruns(flags: list[str], monkeypatch) -> dict[str, str]:
    monkeypatch.setattr(sys, "argv", ["horovodrun", "-np", "2", *flags, "python", "train.py"])
    env = config_parser.set_env_from_args({}, launch.parse_args())
    env.pop(config_parser.HOROVOD_GLOO_TIMEOUT_SECONDS, None)  # the job's own setting
    return env


@pytest.mark.parametrize("flags", TUNING, ids=lambda flags: " ".join(flags[:2]) or "none")
def test_tuning_flags_set_what_horovodrun_sets(flags, monkeypatch):
    assert _ours(flags) == _horovodruns(flags, monkeypatch)


def test_the_values_reach_the_variables():
    env = _ours(TUNING[0] + TUNING[5] + TUNING[9])
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["HOROVOD_CYCLE_TIME"] == "2.5"
    assert env["HOROVOD_TIMELINE"] == "timeline.json"
    assert env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1"
    assert env["HOROVOD_LOG_LEVEL"] == "DEBUG"
    assert env["HOROVOD_LOG_HIDE_TIME"] == "1"


def test_the_older_interface_flag_adds_to_the_list():
    args = build_parser().parse_args(
        ["run", "-np", "1", "--network-interfaces", "ib0", "--network-interface", "lo", "x"]
    )
    translate.resolve(args)
    assert args.nics == "ib0,lo"


def test_a_config_file_sets_what_the_command_line_does_not(tmp_path, monkeypatch):
    config = tmp_path / "horovod.yaml"
    config.write_text(
        "params:\n  fusion_threshold_mb: 16\n  cycle_time_ms: 4\n"
        "stall_check:\n  enabled: false\n"
        "library_options:\n  gloo_timeout_seconds: 45\n"
    )
    flags = ["--config-file", str(config), "--cycle-time-ms", "7"]
    args = build_parser().parse_args(["run", "-np", "2", *flags, "python", "train.py"])
    env = translate.resolve(args)
    assert env == _horovodruns(flags, monkeypatch)
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(16 * 1024 * 1024)
    assert env["HOROVOD_CYCLE_TIME"] == "7.0"  # the command line wins
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1"
    assert args.gloo_timeout_seconds == 45  # the job's Gloo timeout, from the file


@pytest.mark.parametrize("flag", sorted(flags.REFUSED))
def test_a_refused_flag_names_itself_and_the_way_out(flag, capsys):
    values = {"--blacklist-cooldown-range": ["60", "300"]}.get(flag, ["x"])
    if flag in ("--mpi", "--jsrun"):
        values = []
    assert main(["run", "-np", "2", flag, *values, "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"horovod-ray run: error: {flag}: {flags.REFUSED[flag]}" in err


@pytest.mark.parametrize(
    "flags, text",
    [
        (["--fusion-threshold-mb", "-1"], "--fusion-threshold-mb: fusion_threshold_mb=-1"),
        (["--autotune-gaussian-process-noise", "2"], "must be in [0, 1]"),
        (["--log-level", "LOUD"], "--log-level: one of TRACE"),
        (["--config-file", "/nonexistent.yaml"], "--config-file: cannot read"),
    ],
)
def test_a_bad_value_is_refused_before_ray_starts(flags, text, capsys):
    assert main(["run", "-np", "2", *flags, "python", "train.py"]) == 2
    assert text in capsys.readouterr().err


def test_ssh_flags_are_taken_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="horovod_ray.cli.translate"):
        _ours(["-p", "2222", "-i", "/root/.ssh/id_rsa"])
    assert [r.getMessage() for r in caplog.records] == [
        "--ssh-port is ignored: Ray starts the ranks, no SSH is used",
        "--ssh-identity-file is ignored: Ray starts the ranks, no SSH is used",
    ]


def test_version_prints_horovods(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["run", "-v"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == version("horovod")


@pytest.mark.parametrize(
    "flags, hosts",
    [
        (["-H", "10.0.0.1:2,node-b:1"], [("10.0.0.1", 2), ("node-b", 1)]),
        # -np takes the hosts' slots in order, as horovodrun fills them.
        (["-np", "3", "-H", "a:2,b:2,c:2"], [("a", 2), ("b", 1)]),
        (["-np", "1", "-H", "localhost:4"], [("localhost", 1)]),
        (["-np", "2"], None),
    ],
)
def test_a_host_list_becomes_hosts_and_ranks(flags, hosts):
    args = build_parser().parse_args(["run", *flags, "python", "train.py"])
    assert translate.host_list(args) == hosts


def test_a_hostfile_reads_as_horovodruns(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.0.0.1 slots=2\n\nnode-b slots=4\n")
    args = build_parser().parse_args(["run", "--hostfile", str(hostfile), "python"])
    assert translate.host_list(args) == [("10.0.0.1", 2), ("node-b", 4)]


@pytest.mark.parametrize(
    "flags, text",
    [
        (["-H", "a:2", "--hostfile", "x"], "give one of them"),
        (["-H", "a"], "Invalid host input"),
        (["-np", "5", "-H", "a:2,b:2"], "-np 5 is more than the hosts' 4 slots"),
        (["-H", "a:2,a:1"], "-H/--hosts: hosts names a host twice"),
        (["-H", "a:2", "--num-hosts", "2"], "give -H/--hostfile or --num-hosts, not both"),
        (["--hostfile", "/nonexistent"], "--hostfile: cannot read /nonexistent"),
    ],
)
def test_a_bad_host_list_is_refused_before_ray_starts(flags, text, capsys):
    assert main(["run", *flags, "python", "train.py"]) == 2
    assert text in capsys.readouterr().err


def _elastic(flags: list[str]) -> dict | None:
    args = build_parser().parse_args(["run", *flags, "python", "train.py"])
    return translate.elastic_options(args)


def test_the_elastic_flags_make_an_elastic_job_as_horovodruns(tmp_path, monkeypatch):
    from horovod.runner.elastic.discovery import FixedHosts, HostDiscoveryScript

    assert _elastic(["-np", "4"]) is None
    options = _elastic(
        ["-np", "4", "--max-np", "8", "--reset-limit", "3", "--blacklist-cooldown-range",
         "10", "100", "--elastic-timeout", "60", "--min-np", "2"]
    )  # fmt: skip
    assert options == {
        "min_workers": 2, "max_workers": 8, "reset_limit": 3, "cooldown_range": (10, 100),
        "elastic_timeout": 60, "override_discovery": True,  # every Ray node with room
    }  # fmt: skip
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "90")
    script = _elastic(["-np", "3", "--host-discovery-script", "./hosts.sh"])
    assert (script["min_workers"], script["elastic_timeout"]) == (3, 90)  # -np, the variable
    assert isinstance(script["override_discovery"], HostDiscoveryScript)
    fixed = _elastic(["-np", "2", "--min-np", "1", "-H", "a:2,b:3"])["override_discovery"]
    assert isinstance(fixed, FixedHosts)  # every slot of the hosts, not cut to -np
    assert fixed.find_available_hosts_and_slots() == {"a": 2, "b": 3}


@pytest.mark.parametrize(
    "flags, text",
    [
        (["-np", "2", "--max-np", "4"], "--max-np is for elastic jobs: give --min-np N too"),
        (["-np", "2", "--reset-limit", "1"], "--reset-limit is for elastic jobs"),
        (["--host-discovery-script", "d.sh"], "--min-np: give the fewest ranks"),
        (["--min-np", "2", "--num-hosts", "2"], "--num-hosts: an elastic job sizes itself"),
        (["--min-np", "2", "-H", "a:2", "--host-discovery-script", "d.sh"], "give one of them"),
        (["--min-np", "4", "--max-np", "2"], "--max-np: max_workers=2 is below min_workers=4"),
        (["--min-np", "2", "--max-restarts", "1"], "--max-restarts: an elastic job recovers"),
        (["-np", "2", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
    ],
)
def test_elastic_flags_that_do_not_fit_exit_2_naming_the_flag(flags, text, capsys):
    assert main(["run", *flags, "python", "train.py"]) == 2
    assert text in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, text",
    [
        (["--num-to-keep", "1"], "--num-to-keep: checkpoint_config is given but storage_path"),
        (["--storage-path", "/tmp/runs", "--name", "a/b"], "--name: name must be a folder name"),
        (["--storage-path", "/tmp/runs", "--num-to-keep", "0"], "--num-to-keep: checkpoint_"),
        (["--storage-path", "nope://x"], "--storage-path: storage_path 'nope://x' is not a URI"),
    ],
)
def test_checkpoint_flags_that_do_not_fit_exit_2_naming_the_flag(flags, text, capsys):
    assert main(["run", "-np", "2", *flags, "python", "train.py"]) == 2
    assert text in capsys.readouterr().err
