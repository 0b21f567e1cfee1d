"""Jobs across simulated hosts with their own addresses, interfaces and host names.

See conftest.py for the hosts. h2 and h3 resolve their own names to 127.0.1.1: with a
stock horovod 0.28.1 every collective between them aborts (its process-set Gloo context
ignores HOROVOD_GLOO_IFACE), so the jobs below that span them pass only with the fix in
patches/ (or stop at start with the hostname error, never mid-collective).
"""

from __future__ import annotations

import ast
import ipaddress
import re
import shlex
import subprocess
import sys

import pytest

from horovod_ray.stack.build import gloo_iface_fixed
from test.conftest import doc_blocks
from test.hosts.simhosts import REPO, SimHosts, unavailable_reason

pytestmark = pytest.mark.timeout(600)


def _host_of(sim: SimHosts, hostname: str):
    return next(h for h in sim.hosts.values() if h.hostname == hostname)


def _check_pairs_on_interfaces(sim: SimHosts, result: dict, second: bool = False) -> None:
    """Every Gloo pair runs between the two ranks' hosts' own addresses.

    On the hosts' Ray network, or with ``second`` on the second network.
    """
    facts = {f["rank"]: f for f in result["facts"]}
    assert result["pairs"], "found no connection between ranks"
    for rank, local_ip, peer, peer_ip in result["pairs"]:
        for r, ip in ((rank, local_ip), (peer, peer_ip)):
            host = _host_of(sim, facts[r]["hostname"])
            expected = sim.second_network[host.name] if second else host.address
            same_host = facts[rank]["hostname"] == facts[peer]["hostname"]
            if same_host:
                assert ip == expected or ipaddress.ip_address(ip).is_loopback
            else:
                assert ip == expected, (r, ip, host)
    # Every rank reached every other one across hosts.
    cross = {
        frozenset((a, b))
        for a, _, b, _ in result["pairs"]
        if facts[a]["hostname"] != facts[b]["hostname"]
    }
    ranks = sorted(facts)
    expected = {
        frozenset((a, b))
        for a in ranks
        for b in ranks
        if a < b and facts[a]["hostname"] != facts[b]["hostname"]
    }
    assert cross == expected


def test_three_hosts_one_rank_each_names_on_loopback_too(cluster: SimHosts) -> None:
    result = cluster.scenario(cluster.head, "spread", num_hosts=3, num_slots=1)
    facts = result["facts"]
    assert [f["rank"] for f in facts] == [0, 1, 2]
    assert {f["hostname"] for f in facts} == {"h1.sim", "h2.sim", "h3.sim"}
    assert all(f["sum"] == 6.0 and f["size"] == 3 for f in facts)
    assert all((f["local_rank"], f["local_size"], f["cross_size"]) == (0, 1, 3) for f in facts)
    assert sorted(f["cross_rank"] for f in facts) == [0, 1, 2]
    # Without nics: the interface that holds the node's address, whatever its name.
    for f in facts:
        assert f["iface"] == _host_of(cluster, f["hostname"]).iface
    _check_pairs_on_interfaces(cluster, result)
    # h2 and h3 both resolve their names to 127.0.1.1: with a stock horovod their ranks'
    # collectives would abort (or the start would refuse them); with the fix they meet on
    # their own addresses.
    assert gloo_iface_fixed(), "horovod lacks the Gloo interface fix: run `make install`"
    names = {f["rank"]: f["hostname"] for f in facts}
    between = [p for p in result["pairs"] if {names[p[0]], names[p[2]]} == {"h2.sim", "h3.sim"}]
    assert between, "no Gloo connection between the two hosts named on loopback"
    # The driver is on h1: the rendezvous listens there, on its cluster address.
    assert result["rendezvous"][0] == cluster.head.address
    assert result["after"] == {"alive_actors": [], "live_groups": []}


def test_two_hosts_two_ranks_each(cluster: SimHosts) -> None:
    result = cluster.scenario(cluster.head, "spread", num_hosts=2, num_slots=2)
    facts = result["facts"]
    assert all(f["sum"] == 10.0 and f["size"] == 4 for f in facts)
    by_host: dict[str, list[dict]] = {}
    for f in facts:
        by_host.setdefault(f["hostname"], []).append(f)
    assert len(by_host) == 2
    for index, members in enumerate(sorted(by_host.values(), key=lambda m: m[0]["rank"])):
        assert sorted(f["local_rank"] for f in members) == [0, 1]
        assert all(f["local_size"] == 2 and f["cross_size"] == 2 for f in members)
        assert all(f["cross_rank"] == index for f in members)
    # Ranks of one host are consecutive world ranks.
    assert sorted(sorted(f["rank"] for f in members) for members in by_host.values()) == [
        [0, 1],
        [2, 3],
    ]
    _check_pairs_on_interfaces(cluster, result)


def test_named_hosts_take_their_ranks_in_the_order_given(cluster: SimHosts) -> None:
    """horovodrun's host list: h3 by its name first, then h2 by its address; the ranks go
    there in that order (world ranks 0 on h3, 1 and 2 on h2), and nowhere else."""
    h2 = _host_of(cluster, "h2.sim")
    hosts = [["h3.sim", 1], [h2.address, 2]]
    result = cluster.scenario(cluster.head, "spread", named_hosts=hosts)
    facts = result["facts"]
    assert [(f["rank"], f["hostname"]) for f in facts] == [
        (0, "h3.sim"),
        (1, "h2.sim"),
        (2, "h2.sim"),
    ]
    assert all(f["sum"] == 6.0 and f["size"] == 3 for f in facts)
    assert [f["local_rank"] for f in facts] == [0, 0, 1]
    assert result["after"] == {"alive_actors": [], "live_groups": []}


def test_nics_list_spans_hosts_with_different_interface_names(cluster: SimHosts) -> None:
    # The second network, which Ray does not use: ib1 on h2, ib0 on h1 and h3. Each node
    # takes the first of nics it has, and Gloo's connections run there.
    result = cluster.scenario(
        cluster.head, "spread", num_hosts=3, num_slots=1, nics=["ib1", "ib0", "eth0"]
    )
    for f in result["facts"]:
        assert f["iface"] == ("ib1" if f["hostname"] == "h2.sim" else "ib0")
        assert f["sum"] == 6.0
    _check_pairs_on_interfaces(cluster, result, second=True)


def test_node_without_any_of_nics_fails_start_naming_it(cluster: SimHosts) -> None:
    result = cluster.scenario(cluster.head, "expect_error", num_hosts=3, nics=["ens5"])
    error = result["error"]
    assert error is not None and error["type"] == "ConfigError"
    assert error["parameter"] == "nics"
    # Both hosts without ens5 are candidates for the first node found; each message names
    # one node, its address and the interfaces it has.
    # One error names every node without ens5, with the interfaces each has.
    for name in ("h1", "h3"):
        assert f"node {cluster.hosts[name].address} (" in error["text"]
    assert f"node {cluster.hosts['h2'].address} (" not in error["text"]
    assert "['eth0', 'ib0', 'lo']" in error["text"]
    assert result["after"] == result["before"] == {"alive_actors": [], "live_groups": []}


def test_rendezvous_answers_only_job_nodes_with_the_secret(cluster: SimHosts) -> None:
    result = cluster.scenario(cluster.head, "refusals", outsider="h2")
    answers = result["answers"]
    assert answers["job node, secret"] in ("200", "404"), answers  # a real store answer
    assert answers["job node, no secret"] == "403"
    assert answers["other Ray node, secret"] == "403"
    assert answers["not a Ray node, secret"] == "403"
    assert result["rendezvous"][0] == cluster.head.address


def test_ray_client_from_a_machine_outside_the_cluster(cluster: SimHosts) -> None:
    stranger = cluster.hosts["h4"]
    result = cluster.scenario(
        stranger,
        "client",
        ray_address=f"ray://{cluster.head.address}:10001",
        storage=str(cluster.root / "tune"),
        timeout_s=420,
    )
    assert result["connected"] is True
    assert [f["sum"] for f in result["run"]] == [3.0, 3.0]
    # The rendezvous runs inside the cluster, on rank 0's node, never on the client.
    ray_ips = {h.address for h in cluster.hosts.values() if h.ray_node}
    assert result["rendezvous"][0] in ray_ips
    assert result["sizes"] == ["2", "2"]
    assert result["single"] == "rank 0"
    assert result["logged"] == [{"hello": 1}]
    assert result["tune_errors"] == 0 and result["tune_loss"] == 0.5
    assert result["after"] == {"alive_actors": [], "live_groups": []}


def test_clusters_page_snippet_runs_a_rank_on_each_of_two_hosts(cluster: SimHosts) -> None:
    """docs/clusters.rst's driver on a node of the cluster; "auto" reads RAY_ADDRESS (set
    here, as a Ray Job's driver has it: "auto" alone could find another Ray on this
    machine)."""
    snippet = next(b for b in doc_blocks("python") if 'ray.init(address="auto")' in b)
    code = f"import os\nos.environ['RAY_ADDRESS'] = {cluster.gcs_address!r}\n{snippet}"
    out = cluster.python(cluster.hosts["h1"], ["-c", code]).stdout
    names = ast.literal_eval(out.strip().splitlines()[-1])
    assert len(names) == 2 and len(set(names)) == 2
    assert set(names) <= {"h1.sim", "h2.sim", "h3.sim"}


def test_readme_ray_client_snippet(cluster: SimHosts) -> None:
    snippet = next(b for b in doc_blocks("python") if "ray://HEAD" in b)
    snippet = snippet.replace("HEAD", cluster.head.address)
    out = cluster.python(cluster.hosts["h4"], ["-c", snippet]).stdout
    names = ast.literal_eval(out.strip().splitlines()[-1])
    assert len(names) == 2 and len(set(names)) == 2
    assert set(names) <= {"h1.sim", "h2.sim", "h3.sim"}


def test_readme_ray_job_submit_runs_the_digits_example(cluster: SimHosts) -> None:
    """The docs' ``ray job submit``, from a machine outside the cluster."""
    line = next(b for b in doc_blocks("bash") if "ray job submit" in b).strip()
    submit = shlex.split(line.replace("HEAD", cluster.head.address))
    submit[0] = str(REPO / ".venv" / "bin" / "ray")
    result = subprocess.run(
        cluster.hosts["h4"].command(submit),
        env=cluster._env(),
        capture_output=True,
        text=True,
        timeout=420,
        cwd=REPO,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "succeeded" in output, output[-3000:]
    accuracy = float(re.search(r"final held-out accuracy: ([\d.]+)", output).group(1))
    assert accuracy > 0.5  # two epochs; the full run's accuracy is test_readme's
    assert len(re.findall(r"^rank \d: trained on", output, re.MULTILINE)) == 2


def test_command_line_across_hosts(cluster: SimHosts, tmp_path) -> None:
    """horovod-ray run from the head over three hosts; with --working-dir every rank
    starts in Ray's copy of that directory."""
    script = tmp_path / "where.py"
    script.write_text(
        "import os, socket\n"
        "import horovod.torch as hvd\n"
        "hvd.init()\n"
        "print(hvd.rank(), hvd.size(), socket.gethostname(), os.environ['HOROVOD_GLOO_IFACE'],"
        " os.getcwd())\n"
    )
    command = [
        "-m", "horovod_ray", "run", "--address", cluster.gcs_address, "--num-hosts", "3",
        "--working-dir", str(tmp_path), sys.executable, "where.py",
    ]  # fmt: skip
    result = cluster.python(cluster.head, command, timeout_s=300)
    rows = re.findall(r"^\[(\d)\]<stdout>:(\d) 3 (\S+) (\S+) (\S+)$", result.stdout, re.M)
    assert sorted(int(prefix) for prefix, *_ in rows) == [0, 1, 2], result.stdout
    assert all(prefix == rank for prefix, rank, *_ in rows)
    by_host = {host: (iface, cwd) for _, _, host, iface, cwd in rows}
    assert sorted(by_host) == ["h1.sim", "h2.sim", "h3.sim"]
    assert by_host["h2.sim"][0] == "ens5" and by_host["h1.sim"][0] == "eth0"
    assert all(cwd != str(tmp_path) and "working_dir" in cwd for _, cwd in by_host.values())


# The tests that crash a host come last: each later test would start it again first.


def test_host_lost_mid_job_names_its_rank(cluster: SimHosts) -> None:
    result = cluster.scenario(cluster.head, "node_lost", victim="h3")
    assert len(result["victim_ranks"]) == 1
    assert result["error"]["failures"] == result["victim_ranks"], result["error"]["text"]
    assert result["state"] == "failed"


def test_a_silent_partition_is_a_hang_named_within_glos_timeout(cluster: SimHosts) -> None:
    """Gloo's network stops carrying anything to h3 mid-job (its switch port goes down: no
    connection is reset) while Ray's stays up: every rank waits inside a collective, and
    the job fails with a HangError that says so, within Gloo's timeout and a bound."""
    result = cluster.scenario(
        cluster.head,
        "partition",
        gloo_timeout_s=10,
        cut=cluster.port_command("br1", "h3", up=False),
        heal=cluster.port_command("br1", "h3", up=True),
    )
    error = result["error"]
    assert error["type"] == "HangError", error["text"][-3000:]
    assert (error["missing"], error["waiting"]) == ([], [0, 1, 2])
    assert "every rank waited inside a collective for its peers' data" in error["text"]
    assert error["text"].count("; Gloo: ") == 3
    assert result["seconds"] < 10 + 15, result["seconds"]  # the timeout, then the probe
    assert result["state"] == "failed"
    assert result["after"] == {"alive_actors": [], "live_groups": []}


def test_elastic_job_loses_a_host_and_goes_on(cluster: SimHosts) -> None:
    """Across real addresses (not loopback): rendezvous on the driver's address, each
    host's own interface, the driver reaching each rank's notification port."""
    result = cluster.scenario(cluster.head, "elastic_host_lost", victim="h3", timeout_s=600)
    assert result["error"] is None, result["error"]
    sizes = [size for _, size, _ in result["history"]]
    steps = [step for step, _, _ in result["history"]]
    assert steps == list(range(len(steps)))
    assert sizes[0] == 6 and sizes[-1] == 4
    assert all(total == size for _, size, total in result["history"])
    assert result["sizes"][0] == 6 and result["sizes"][-1] == 4
    assert result["ranks"] == [0, 1, 2, 3]


def test_harness_leaves_nothing_behind() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    hosts = SimHosts(subnet="10.213.9")
    with hosts:
        host = hosts.add_host("x1", iface="ens5")
        out = hosts.python(host, ["-c", "import socket; print(socket.gethostname())"])
        assert out.stdout.strip() == "x1.sim"
        sleeper = subprocess.Popen(host.command(["sleep", "600"]))
        assert hosts.leftovers()
    assert sleeper.wait(timeout=20) != 0  # ended by the harness
    assert hosts.leftovers() == []
