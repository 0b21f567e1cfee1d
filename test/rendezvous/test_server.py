"""The rendezvous server: one address, workers only, malformed requests refused, closed on stop."""

from __future__ import annotations

import http.client
import logging
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from horovod_ray import RendezvousError
from horovod_ray.rank.assignment import WorkerRecord, assign_ranks
from horovod_ray.rank.network import local_interfaces
from horovod_ray.rendezvous.http_front import HEAD_LIMIT_BYTES, REFUSAL_LOG_S, Refusals
from horovod_ray.rendezvous.server import (
    MAX_BATCH_BYTES,
    MAX_BODY_BYTES,
    RendezvousServer,
    pack_batch,
    pack_fields,
    unpack_fields,
)
from horovod_ray.rendezvous.store import BATCH_HOLD_S, hold_for

RANKS = assign_ranks([WorkerRecord("node-a"), WorkerRecord("node-a")])


@pytest.fixture
def server():
    server = RendezvousServer("127.0.0.1", {"127.0.0.1"})
    server.start(RANKS)
    yield server
    server.stop()


def _request(server, method, path, body=None, source="127.0.0.1", headers=None, secret=True):
    """Sends a request as a worker would: with the job's secret in front of the path."""
    host, port = server.address
    if secret:
        path = "/" + server.worker_address.split("/", 1)[1] + f":{port}" + path
    conn = http.client.HTTPConnection(host, port, timeout=5, source_address=(source, 0))
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_store_round_trip_and_join_tracking(server):
    assert _request(server, "GET", "/global/0") == (404, b"")
    assert _request(server, "PUT", "/global/0", body=b"addr-of-0")[0] == 200
    assert _request(server, "GET", "/global/0") == (200, b"addr-of-0")
    assert server.joined_ranks() == {0}


def test_a_join_is_noted_before_the_rank_hears_back(server, monkeypatch):
    """CI once asked right after a 200 and found no rank joined: the handler answered
    first and noted the join after. A slow note now holds the answer back instead."""
    from horovod_ray.rendezvous.store import Store

    note_join = Store.note_join

    def slow_note_join(self, rank: int) -> None:
        threading.Event().wait(0.3)
        note_join(self, rank)

    monkeypatch.setattr(Store, "note_join", slow_note_join)
    assert _request(server, "PUT", "/global/1", body=b"addr-of-1")[0] == 200
    assert server.joined_ranks() == {1}


def test_other_source_address_gets_403_and_changes_nothing(server):
    assert _request(server, "PUT", "/global/1", body=b"evil", source="127.0.0.2")[0] == 403
    assert _request(server, "GET", "/global/1", source="127.0.0.2")[0] == 403
    assert _request(server, "DELETE", "/global/1", source="127.0.0.2")[0] == 403
    assert _request(server, "GET", "/global/1") == (404, b"")
    assert server.joined_ranks() == set()


@pytest.mark.parametrize(
    "method,path,body,headers,status",
    [
        ("GET", "/global", None, None, 400),
        ("GET", "/a/b/c", None, None, 400),
        ("GET", "/../etc/passwd", None, None, 400),
        ("GET", "/" + "s" * 300 + "/k", None, None, 400),
        ("PUT", "/global/0", None, {"Content-Length": "abc"}, 411),
        ("PUT", "/global/0", None, {"Content-Length": str(MAX_BODY_BYTES + 1)}, 413),
        ("POST", "/global/0", b"x", None, 405),
        ("POST", "/global/_mget", None, {"Content-Length": str(MAX_BATCH_BYTES + 1)}, 413),
        ("POST", "/global/_mget", b"\x00\x00\x00\x09abc", None, 400),
        ("POST", "/global/_mset", pack_batch(["key-without-value"]), None, 400),
        ("POST", "/global/_mget", pack_batch(["k"], [b"a", b"b"]), None, 400),
        ("POST", "/global/_mget", pack_fields([b"\xff"]), None, 400),
        ("PATCH", "/global/0", b"x", None, 501),
    ],
)
def test_malformed_requests_get_4xx_and_the_server_keeps_serving(
    server, method, path, body, headers, status
):
    assert _request(server, method, path, body=body, headers=headers)[0] == status
    assert _request(server, "PUT", "/global/1", body=b"ok")[0] == 200
    assert _request(server, "GET", "/global/1") == (200, b"ok")


def test_requests_without_the_secret_get_403(server):
    assert _request(server, "PUT", "/global/0", body=b"x")[0] == 200
    assert _request(server, "GET", "/global/0", secret=False)[0] == 403
    assert _request(server, "PUT", "/global/0", body=b"evil", secret=False)[0] == 403
    evil = pack_batch(["rank_5"], [b"evil"])
    assert _request(server, "POST", "/global/_mset", body=evil, secret=False)[0] == 403
    assert _request(server, "POST", "/global/_mset", body=evil, source="127.0.0.2")[0] == 403
    asked = pack_batch(["rank_0"])
    assert _request(server, "POST", "/global/_mget", body=asked, secret=False)[0] == 403
    assert _request(server, "POST", "/global/_mget", body=asked, source="127.0.0.2")[0] == 403
    assert _request(server, "GET", "/global/0") == (200, b"x")
    assert server.joined_ranks() == {0}  # rank 5's refused batch did not count


def test_fields_round_trip_and_truncation_is_refused():
    fields = [b"", b"rank_0", bytes(range(256)) * 3]
    assert unpack_fields(pack_fields(fields)) == fields
    for cut in (1, 5, len(pack_fields(fields)) - 1):
        with pytest.raises(ValueError, match="truncated"):
            unpack_fields(pack_fields(fields)[:cut])


def test_batched_set_then_get_answers_the_values_in_the_order_asked(server):
    # Rank 1 of 3: its host name, and its address list (one 5-byte address per peer).
    body = pack_batch(["rank_1", "1"], [b"host-b", b"for-0for-2"])
    assert _request(server, "POST", "/global/_mset", body=body) == (200, b"")
    status, answer = _request(server, "POST", "/global/_mget", body=pack_batch(["1", "rank_1"]))
    assert (status, unpack_fields(answer)) == (200, [b"for-0for-2", b"host-b"])
    # The per-key API sees the same store, and the batch counted as rank 1's join.
    assert _request(server, "GET", "/global/1") == (200, b"for-0for-2")
    assert server.joined_ranks() == {1}


def _cuts(*parts: tuple[int, int]) -> bytes:
    return struct.pack(f">{2 * len(parts)}I", *(n for part in parts for n in part))


def test_a_batched_get_answers_only_the_part_each_key_was_asked_for(server):
    """Rank 2 reads from rank 1's list only the address rank 1 has for it: part 1 of 2.
    That makes a scope's reads O(N^2) bytes instead of O(N^3)."""
    body = pack_batch(["rank_1", "1"], [b"host-b", b"for-0for-2"])
    assert _request(server, "POST", "/global/_mset", body=body)[0] == 200
    asked = pack_batch(["rank_1", "1"], [_cuts((0, 0), (1, 2))])
    status, answer = _request(server, "POST", "/global/_mget", body=asked)
    assert (status, unpack_fields(answer)) == (200, [b"host-b", b"for-2"])
    for bad in (_cuts((0, 0), (2, 2)), _cuts((0, 0), (0, 3)), _cuts((0, 0))):
        asked = pack_batch(["rank_1", "1"], [bad])
        assert _request(server, "POST", "/global/_mget", body=asked)[0] == 400


def test_a_batched_get_is_held_until_its_last_key_arrives(server):
    """One request per rank, not a poll every 10 ms: the answer leaves the moment the
    last key is set, whether by a batch or by a plain PUT."""
    answers = []
    asked = pack_batch(["a", "b"])
    reader = threading.Thread(
        target=lambda: answers.append(_request(server, "POST", "/global/_mget", body=asked))
    )
    reader.start()
    assert _request(server, "POST", "/global/_mset", body=pack_batch(["a"], [b"1"]))[0] == 200
    reader.join(0.5)
    assert reader.is_alive()  # still held: "b" is missing
    assert _request(server, "PUT", "/global/b", body=b"2")[0] == 200
    reader.join(5)
    assert not reader.is_alive()
    assert [(s, unpack_fields(body)) for s, body in answers] == [(200, [b"1", b"2"])]


def test_a_batched_get_is_held_no_longer_than_the_gloo_timeout_and_leaves_no_waiter():
    """horovod's client looks at its clock only when an answer comes: a read held for the
    server's 10 s made a rank whose peer never came fail up to 10 s after a timeout_s of 5
    (at 12 s in all, where the docs say timeout_s). _request gives up after 5 s."""
    server = RendezvousServer("127.0.0.1", {"127.0.0.1"}, gloo_timeout_s=0.2)
    server.start(RANKS)
    try:
        asked = pack_batch(["never", "set"])
        assert _request(server, "POST", "/global/_mget", body=asked) == (404, b"")
        assert server.held_reads() == 0
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("timeout_s", "hold_s"),
    [(5, 5), (5.5, 6), (11, 5.5), (15, 7.5), (120, BATCH_HOLD_S), (None, BATCH_HOLD_S)],
)
def test_held_reads_end_when_the_ranks_gloo_timeout_does(timeout_s, hold_s):
    """The ranks wait whole seconds (ceil(timeout_s)); their last hold ends with them."""
    assert hold_for(timeout_s) == hold_s


def test_stop_answers_held_batched_gets_at_once():
    server = RendezvousServer("127.0.0.1", {"127.0.0.1"})
    server.start(RANKS)
    answers = []
    reader = threading.Thread(
        target=lambda: answers.append(
            _request(server, "POST", "/global/_mget", body=pack_batch(["k"]))
        )
    )
    try:
        reader.start()
        threading.Event().wait(0.2)
    finally:
        server.stop()
    reader.join(1.5)  # well before the 10 s hold would have ended
    assert not reader.is_alive()
    assert answers in ([(404, b"")], [])  # answered, or its connection closed by stop


def test_a_batched_get_may_name_a_key_twice(server):
    answers = []
    asked = pack_batch(["k", "k"])
    reader = threading.Thread(
        target=lambda: answers.append(_request(server, "POST", "/global/_mget", body=asked))
    )
    reader.start()
    assert _request(server, "PUT", "/global/k", body=b"v")[0] == 200
    reader.join(5)  # not held until the end of its hold: the one key counts once
    assert [(s, unpack_fields(body)) for s, body in answers] == [(200, [b"v", b"v"])]


def test_stop_drops_connections_that_have_sent_nothing_yet():
    """horovod's client has no read timeout: a connection left open by stop() would hold
    its rank until the process ends."""
    server = RendezvousServer("127.0.0.1", {"127.0.0.1"})
    server.start(RANKS)
    idle = [socket.create_connection(server.address, timeout=5) for _ in range(3)]
    try:
        threading.Event().wait(0.2)
        server.stop()
        for sock in idle:
            assert sock.recv(100) == b""  # closed by the server, not timed out
    finally:
        for sock in idle:
            sock.close()


def test_listens_with_a_backlog_for_a_whole_job_at_once(server):
    """With the stdlib's backlog of 5, ranks knocking at once were dropped and waited
    out SYN retransmits (1 s, 3 s, 7 s...): 57 s for hvd.init of 32 ranks."""
    port = server.address[1]
    # For a listening socket, ss's Send-Q column is its accept queue's limit: what
    # listen() asked for, capped by net.core.somaxconn.
    listening = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(listening[2]) == min(socket.SOMAXCONN, somaxconn) > 100


def test_each_server_has_its_own_secret(server):
    other = RendezvousServer("127.0.0.1", {"127.0.0.1"})
    other.start(RANKS)
    try:
        assert other.worker_address.split("/")[1] != server.worker_address.split("/")[1]
        assert len(server.worker_address.split("/")[1]) >= 32
    finally:
        other.stop()


def test_garbage_request_line_does_not_stop_the_server(server):
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(b"\x00\x01 not http at all\r\n\r\n")
        reply = sock.recv(100)
    # Unparsable requests are HTTP/0.9 to http.server: closed without a status line.
    assert reply == b"" or reply.split()[1] == b"400"
    assert _request(server, "GET", "/global/0")[0] == 404


def test_binds_only_the_given_address(server):
    _, port = server.address
    others = [
        addr
        for addrs in local_interfaces().values()
        for addr in addrs
        if not addr.startswith("127.")
    ]
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((others[0], port), timeout=5).close()


def test_stop_closes_the_socket_and_joins_the_thread():
    before = threading.active_count()
    server = RendezvousServer("127.0.0.1", {"127.0.0.1"})
    address = server.start(RANKS)
    assert threading.active_count() == before + 1
    server.stop()
    server.stop()  # idempotent
    assert threading.active_count() == before
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5).close()


def test_scopes_clear_once_every_member_finished(server):
    for rank in ("0", "1"):
        _request(server, "PUT", f"/global/{rank}", body=b"a")
    _request(server, "DELETE", "/global/0")
    assert _request(server, "GET", "/global/1")[0] == 200
    _request(server, "DELETE", "/global/1")
    # Both members finished: a later hvd.init() starts from an empty scope.
    assert _request(server, "GET", "/global/1")[0] == 404
    assert server.joined_ranks() == {0, 1}


def test_cluster_rendezvous_serves_from_an_actor_and_is_gone_after_stop(ray_4cpu, no_leaks):
    """What Ray Client jobs use (the driver is out of the workers' reach), on local Ray."""
    import ray

    from horovod_ray.rendezvous.cluster import ClusterRendezvous

    node_id = ray.get_runtime_context().get_node_id()
    server = ClusterRendezvous(
        node_id, "127.0.0.1", {"127.0.0.1"}, timeout_s=60, gloo_timeout_s=0.2
    )
    assert server.joined_ranks() is None  # not started: nobody can say who joined
    server.start(RANKS)
    try:
        assert _request(server, "PUT", "/global/1", body=b"addr-of-1")[0] == 200
        assert _request(server, "GET", "/global/1") == (200, b"addr-of-1")
        # The ranks' Gloo timeout reached the actor's server: a read held 1 s comes back
        # within _request's 5 s (the default hold, 10 s, would not).
        assert _request(server, "POST", "/global/_mget", body=pack_batch(["never"])) == (404, b"")
        assert _request(server, "GET", "/global/1", secret=False)[0] == 403
        assert _request(server, "GET", "/global/1", source="127.0.0.2")[0] == 403
        assert server.joined_ranks() == {1}  # asked of the actor
    finally:
        server.stop()
    server.stop()  # again: nothing left to do
    with pytest.raises(RendezvousError):
        server.address  # noqa: B018


def test_cluster_rendezvous_that_cannot_bind_says_so_and_leaves_no_actor(ray_4cpu, no_leaks):
    import ray

    from horovod_ray.rendezvous.cluster import ClusterRendezvous

    node_id = ray.get_runtime_context().get_node_id()
    # 198.51.100.0/24 is reserved for documentation: no interface here holds it (only
    # bound, never sent to).
    server = ClusterRendezvous(node_id, "198.51.100.7", {"198.51.100.7"}, timeout_s=60)
    with pytest.raises(RendezvousError, match="could not start the rendezvous server"):
        server.start(RANKS)
    server.stop()  # what start() took is given back as release() would


def test_verbose_2_logs_each_scope_change_at_info(caplog):
    """``verbose`` reaches the store (horovod's server logged scope changes at >= 2)."""
    import logging

    for verbose, level in ((2, logging.INFO), (0, logging.DEBUG)):
        caplog.clear()
        server = RendezvousServer("127.0.0.1", {"127.0.0.1"}, verbose=verbose)
        with caplog.at_level(logging.DEBUG, logger="horovod_ray.rendezvous.server"):
            server.start(RANKS)
            try:
                for rank in ("0", "1"):
                    _request(server, "DELETE", f"/global/{rank}")
            finally:
                server.stop()
        cleared = [r for r in caplog.records if "scope global cleared" in r.getMessage()]
        assert [r.levelno for r in cleared] == [level]


def test_refusals_are_logged_once_per_source_and_reason_in_each_interval(caplog):
    now = [0.0]
    refusals = Refusals(clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="horovod_ray.rendezvous.server"):
        for _ in range(500):
            refusals.note("10.0.0.9", "without the job secret")
        refusals.note("10.0.0.8", "without the job secret")
        refusals.note("10.0.0.9", "not a worker node")
        now[0] = REFUSAL_LOG_S + 1
        refusals.note("10.0.0.9", "without the job secret")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "rendezvous: refused a request from 10.0.0.9 (without the job secret)",
        "rendezvous: refused a request from 10.0.0.8 (without the job secret)",
        "rendezvous: refused a request from 10.0.0.9 (not a worker node)",
        "rendezvous: refused a request from 10.0.0.9 (without the job secret); "
        "499 more since the last warning",
    ]


def test_a_head_past_the_limit_is_refused_before_the_secret_is_read(server):
    huge = {"X-Padding": "x" * (HEAD_LIMIT_BYTES + 1)}
    assert _request(server, "GET", "/global/0", headers=huge)[0] == 431
    assert _request(server, "PUT", "/global/1", body=b"ok")[0] == 200


def test_past_the_connection_cap_new_connections_are_closed_unanswered(server, monkeypatch):
    from horovod_ray.rendezvous import http_front

    monkeypatch.setattr(http_front, "MAX_CONNECTIONS", 2)
    host, port = server.address
    held = [socket.create_connection((host, port)) for _ in range(2)]  # send nothing
    try:
        time.sleep(0.3)
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
            _request(server, "GET", "/global/0")
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert _request(server, "PUT", "/global/1", body=b"ok")[0] == 200
