"""The rendezvous server: one address, workers only, malformed requests refused, closed on stop."""

from __future__ import annotations

import http.client
import socket
import threading

import pytest

from horovod_ray import RendezvousError
from horovod_ray.network import local_interfaces
from horovod_ray.ranks import WorkerRecord, assign_ranks
from horovod_ray.rendezvous import MAX_BODY_BYTES, RendezvousServer

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
    from horovod_ray import rendezvous

    note_join = rendezvous._Server.note_join

    def slow_note_join(self, key: str) -> None:
        threading.Event().wait(0.3)
        note_join(self, key)

    monkeypatch.setattr(rendezvous._Server, "note_join", slow_note_join)
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
    assert _request(server, "GET", "/global/0") == (200, b"x")


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

    from horovod_ray.rendezvous import ClusterRendezvous

    node_id = ray.get_runtime_context().get_node_id()
    server = ClusterRendezvous(node_id, "127.0.0.1", {"127.0.0.1"}, timeout_s=60)
    assert server.joined_ranks() is None  # not started: nobody can say who joined
    server.start(RANKS)
    try:
        assert _request(server, "PUT", "/global/1", body=b"addr-of-1")[0] == 200
        assert _request(server, "GET", "/global/1") == (200, b"addr-of-1")
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

    from horovod_ray.rendezvous import ClusterRendezvous

    node_id = ray.get_runtime_context().get_node_id()
    # 198.51.100.0/24 is reserved for documentation: no interface here holds it (only
    # bound, never sent to).
    server = ClusterRendezvous(node_id, "198.51.100.7", {"198.51.100.7"}, timeout_s=60)
    with pytest.raises(RendezvousError, match="could not start the rendezvous server"):
        server.start(RANKS)
    server.stop()  # what start() took is given back as release() would
