"""The unique-id rendezvous against hostile and broken peers, on real sockets on loopback: idle,
slow-drip and garbage clients, wrong worlds, squatters, wrong tokens, fake servers, missing
ranks, the bind address, and the launcher-environment path in separate processes."""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from lowgrad.base.errors import CommTimeoutError
from lowgrad.launch import tcp_rendezvous as tcp
from lowgrad.launch.rendezvous import unique_id_from_env
from lowgrad.launch.tcp_rendezvous import exchange_unique_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UID = bytes(range(128))
TOKEN = "s3cret-" + "x" * 25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank(threading.Thread):
    """``exchange_unique_id`` in a thread; ``result`` is the id or the exception, ``elapsed`` s."""

    def __init__(self, rank: int, world: int, port: int, timeout: float = 10.0, **kw: Any) -> None:
        super().__init__(daemon=True)
        self.args = (rank, world, "127.0.0.1", port, UID if rank == 0 else None, timeout)
        self.kw = kw
        self.result: Any = None
        self.elapsed = -1.0
        self.start()

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            self.result = exchange_unique_id(*self.args, **self.kw)
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            self.result = exc
        self.elapsed = time.monotonic() - t0

    def get(self, wait: float = 15.0) -> Any:
        self.join(wait)
        assert not self.is_alive(), "rank did not finish"
        return self.result


def connect(port: int, wait: float = 5.0) -> socket.socket:
    """A raw client connection to rank 0, retried until it listens."""
    end = time.monotonic() + wait
    while True:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.settimeout(5)
            return s
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.02)


def recv_all(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def hang_up(conn: socket.socket) -> None:
    """Wait for the client to close (or reset) the connection."""
    try:
        recv_all(conn, 1)
    except OSError:
        pass


def forged_hello(s: socket.socket, rank: int, world: int) -> bytes:
    """Read rank 0's hello and answer as ``rank`` with a made-up MAC; return rank 0's reply."""
    magic, _ = tcp._SERVER_HELLO.unpack(recv_all(s, tcp._SERVER_HELLO.size))
    assert magic == tcp._MAGIC
    s.sendall(tcp._CLIENT_HELLO.pack(magic, rank, world, secrets.token_bytes(32), secrets.token_bytes(32)))
    return recv_all(s, tcp._REPLY.size)


@pytest.mark.timeout(30)
def test_idle_client_does_not_stop_legitimate_ranks():
    port = free_port()
    r0 = Rank(0, 3, port)
    idle = [connect(port) for _ in range(3)]  # connect first, never say anything
    r1, r2 = Rank(1, 3, port), Rank(2, 3, port)
    assert [r.get() for r in (r0, r1, r2)] == [UID] * 3
    assert r0.elapsed < 3.5, r0.elapsed
    for s in idle:
        s.close()


@pytest.mark.timeout(30)
def test_wrong_world_hello_is_dropped_and_rank0_keeps_serving():
    port = free_port()
    r0 = Rank(0, 2, port)
    bad = Rank(1, 3, port)
    with pytest.raises(ValueError, match="another world size"):
        raise bad.get()
    real = Rank(1, 2, port)  # the real rank 1 joins after the bad one
    assert r0.get() == UID and real.get() == UID


@pytest.mark.timeout(30)
def test_out_of_range_rank_is_dropped():
    port = free_port()
    r0 = Rank(0, 2, port)
    s = connect(port)
    magic, snonce = tcp._SERVER_HELLO.unpack(recv_all(s, tcp._SERVER_HELLO.size))
    fields = tcp._CLIENT_HELLO.pack(magic, 5, 2, bytes(32), bytes(32))[:-32]
    s.sendall(fields + tcp._client_mac(b"", snonce, fields))  # a well-formed hello for rank 5 of 2
    status, uid, _ = tcp._REPLY.unpack(recv_all(s, tcp._REPLY.size))
    assert status == tcp._BAD_RANK and uid == bytes(128)
    assert Rank(1, 2, port).get() == UID and r0.get() == UID


@pytest.mark.timeout(30)
def test_slow_drip_client_is_cut_at_its_handshake_deadline():
    port = free_port()
    r0 = Rank(0, 2, port, timeout=20, handshake_timeout=0.5)
    s = connect(port)
    recv_all(s, tcp._SERVER_HELLO.size)
    t0, cut = time.monotonic(), None
    for _ in range(40):  # one byte every 0.1 s: would take 8 s for a whole hello
        try:
            s.sendall(b"\x00")
            s.settimeout(0.1)
            if s.recv(1) == b"":
                cut = time.monotonic() - t0
                break
        except TimeoutError:
            continue
        except OSError:
            cut = time.monotonic() - t0
            break
    s.close()
    assert cut is not None and 0.3 < cut < 2.0, cut
    assert r0.is_alive()  # cutting a client does not stop rank 0
    assert Rank(1, 2, port).get() == UID and r0.get() == UID


@pytest.mark.timeout(30)
def test_overall_timeout_is_absolute_under_slow_drip():
    port = free_port()
    r0 = Rank(0, 2, port, timeout=2.0)  # default 10 s handshake: only the overall deadline cuts
    stop = threading.Event()

    def drip() -> None:
        s = connect(port)
        while not stop.is_set():
            try:
                s.sendall(b"\x01")
            except OSError:
                break
            time.sleep(0.3)
        s.close()

    drippers = [threading.Thread(target=drip, daemon=True) for _ in range(3)]
    for d in drippers:
        d.start()
    err = r0.get()
    stop.set()
    assert isinstance(err, CommTimeoutError) and "rank(s) [1] never joined" in str(err), err
    assert r0.elapsed < 3.5, r0.elapsed


@pytest.mark.timeout(30)
def test_garbage_and_broken_connections_are_dropped():
    port = free_port()
    r0 = Rank(0, 3, port)
    connect(port).close()  # connect and leave
    s = connect(port)
    s.sendall((b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + secrets.token_bytes(80))[:80])  # a hello's size of garbage
    assert len(recv_all(s, 200)) == tcp._SERVER_HELLO.size  # hello, then rank 0 hangs up
    s.close()
    s = connect(port)
    s.sendall(secrets.token_bytes(7))  # a short hello, then close
    s.close()
    s = connect(port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()  # reset
    r1, r2 = Rank(1, 3, port), Rank(2, 3, port)
    assert [r.get() for r in (r0, r1, r2)] == [UID] * 3


@pytest.mark.timeout(30)
def test_squatter_without_token_gets_nothing_and_real_rank_joins():
    port = free_port()
    r0 = Rank(0, 2, port, token=TOKEN)
    s = connect(port)
    status, uid, _ = tcp._REPLY.unpack(forged_hello(s, 1, 2))  # claims rank 1, cannot sign
    s.close()
    assert status == tcp._BAD_AUTH and uid == bytes(128)
    tokenless = Rank(1, 2, port)
    with pytest.raises(PermissionError, match="LOWGRAD_RENDEZVOUS_TOKEN"):
        raise tokenless.get()
    assert Rank(1, 2, port, token=TOKEN).get() == UID
    assert r0.get() == UID


@pytest.mark.timeout(30)
def test_duplicate_rank_first_wins_and_rank0_keeps_serving():
    port = free_port()
    r0 = Rank(0, 3, port)
    assert Rank(1, 3, port).get() == UID
    with pytest.raises(ValueError, match="already joined as this rank"):
        raise Rank(1, 3, port).get()
    assert Rank(2, 3, port).get() == UID
    assert r0.get() == UID


@pytest.mark.timeout(30)
def test_wrong_token_fails_clearly_on_both_sides():
    port = free_port()
    r0 = Rank(0, 2, port, timeout=1.5, token=TOKEN)
    with pytest.raises(PermissionError, match="authentication failed"):
        raise Rank(1, 2, port, token="another").get()
    err = r0.get()
    assert isinstance(err, CommTimeoutError) and "failed authentication (claimed rank 1)" in str(err), err
    port = free_port()
    r0 = Rank(0, 2, port, timeout=1.5)  # a token on one side only is a wrong token too
    with pytest.raises(PermissionError, match="authentication failed"):
        raise Rank(1, 2, port, token=TOKEN).get()
    assert isinstance(r0.get(), CommTimeoutError)


def fake_rank0(port: int, reply: Callable[[bytes, bytes], bytes]) -> threading.Thread:
    """A server on ``port`` that sends a lowgrad hello and answers the first hello with
    ``reply(server_nonce, client_hello)``."""
    srv = socket.create_server(("127.0.0.1", port))

    def serve() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                nonce = secrets.token_bytes(32)
                conn.sendall(tcp._SERVER_HELLO.pack(tcp._MAGIC, nonce))
                conn.sendall(reply(nonce, recv_all(conn, tcp._CLIENT_HELLO.size)))
                hang_up(conn)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(30)
def test_fake_rank0_cannot_feed_a_bogus_id():
    port = free_port()
    fake_rank0(port, lambda n, h: tcp._REPLY.pack(tcp._OK, b"\x66" * 128, secrets.token_bytes(32)))
    with pytest.raises(PermissionError, match="did not prove"):
        raise Rank(1, 2, port, token=TOKEN).get()
    port = free_port()  # a replayed or re-targeted server MAC fails too: it binds the client's nonce
    key = TOKEN.encode()

    def signed_for_other_rank(nonce: bytes, hello: bytes) -> bytes:
        _, _, _, cnonce, _ = tcp._CLIENT_HELLO.unpack(hello)
        return tcp._REPLY.pack(tcp._OK, UID, tcp._server_mac(key, cnonce, nonce, 2, 3, UID))
    fake_rank0(port, signed_for_other_rank)
    with pytest.raises(PermissionError, match="did not prove"):
        raise Rank(1, 3, port, token=TOKEN).get()


@pytest.mark.timeout(30)
def test_silent_or_foreign_server_fails_in_bounded_time():
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):  # accepts (backlog) and never speaks: like a TCPStore
        client = Rank(1, 2, port, timeout=1.5, handshake_timeout=0.4)
        err = client.get()
    assert isinstance(err, CommTimeoutError) and "rank 1 could not get the unique id" in str(err), err
    assert "handshake deadline" in str(err) and client.elapsed < 3.0, (err, client.elapsed)
    port = free_port()
    srv = socket.create_server(("127.0.0.1", port))

    def speak_http() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(64))
                hang_up(conn)
    threading.Thread(target=speak_http, daemon=True).start()
    with pytest.raises(ValueError, match="not a lowgrad rank 0"):
        raise Rank(1, 2, port).get()


@pytest.mark.timeout(30)
def test_missing_ranks_are_named_in_bounded_time():
    port = free_port()
    r0 = Rank(0, 4, port, timeout=1.5)
    assert Rank(2, 4, port).get() == UID
    err = r0.get()
    assert isinstance(err, CommTimeoutError) and "rank(s) [1, 3] never joined" in str(err), err
    assert "listens on loopback only" in str(err)
    assert r0.elapsed < 3.0
    lone = Rank(1, 2, free_port(), timeout=0.8)  # rank 0 never listens
    err = lone.get()
    assert isinstance(err, CommTimeoutError) and "rank 1 could not get the unique id" in str(err), err
    assert lone.elapsed < 2.3


@pytest.mark.timeout(30)
def test_rank0_listens_on_master_addr_only():
    port = free_port()
    r0 = Rank(0, 2, port)
    connect(port).close()  # listening on 127.0.0.1
    with pytest.raises(ConnectionRefusedError):  # another loopback address of this host: not bound
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    assert Rank(1, 2, port).get() == UID and r0.get() == UID


@pytest.mark.timeout(30)
def test_foreign_master_addr_and_busy_port_fail_clearly():
    with pytest.raises(ValueError, match="not an address of this machine"):
        exchange_unique_id(0, 2, "192.0.2.1", free_port(), UID, 2)  # TEST-NET-1, never local
    with socket.create_server(("127.0.0.1", 0)) as busy, pytest.raises(OSError, match="cannot listen on 127.0.0.1"):
        exchange_unique_id(0, 2, "127.0.0.1", busy.getsockname()[1], UID, 2)


@pytest.mark.timeout(30)
def test_non_loopback_bind_without_token_warns():
    port = free_port()
    r1 = Rank(1, 2, port)
    with pytest.warns(RuntimeWarning, match="without LOWGRAD_RENDEZVOUS_TOKEN"):
        got = exchange_unique_id(0, 2, "127.0.0.1", port, UID, 10, bind="0.0.0.0")
    assert got == UID and r1.get() == UID
    for bind, token in (("0.0.0.0", TOKEN), (None, None)):  # with a token, or on loopback: no warning
        port = free_port()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            r1 = Rank(1, 2, port, token=token)
            assert exchange_unique_id(0, 2, "127.0.0.1", port, UID, 10, bind=bind, token=token) == UID
        assert r1.get() == UID


@pytest.mark.timeout(30)
def test_infinite_timeout_waits_without_overflow():
    port = free_port()
    r0 = Rank(0, 2, port, timeout=float("inf"))
    time.sleep(0.2)
    assert Rank(1, 2, port, timeout=float("inf")).get() == UID and r0.get() == UID


def test_bad_arguments_raise_before_any_socket():
    port = free_port()
    for kw, exc in (({"timeout": 0}, ValueError), ({"timeout": float("nan")}, ValueError),
                    ({"timeout": -1}, ValueError), ({"handshake_timeout": 0}, ValueError),
                    ({"token": 5}, TypeError)):
        with pytest.raises(exc):
            exchange_unique_id(0, 2, "127.0.0.1", port, UID, **kw)
    with pytest.raises(TypeError, match="rank"):
        exchange_unique_id(True, 2, "127.0.0.1", port, None)
    with pytest.raises(ValueError, match="outside"):
        exchange_unique_id(2, 2, "127.0.0.1", port, None)
    with pytest.raises(ValueError, match="only rank 0"):
        exchange_unique_id(1, 2, "127.0.0.1", port, UID)
    with pytest.raises(ValueError, match="port"):
        exchange_unique_id(1, 2, "127.0.0.1", 70000, None)
    with socket.create_server(("127.0.0.1", port)):  # nothing above bound the port
        pass


# ---- the launcher environment ---------------------------------------------------------------
def test_nccl_comm_id_skips_the_exchange():
    env = {"RANK": "1", "WORLD_SIZE": "4", "NCCL_COMM_ID": "127.0.0.1:1"}  # no rank 0, no MASTER_*
    assert unique_id_from_env(lambda: UID, 1, env) == UID
    with pytest.raises(ValueError, match="NCCL_COMM_ID and LOWGRAD_RENDEZVOUS_TOKEN"):
        unique_id_from_env(lambda: UID, 1, {**env, "LOWGRAD_RENDEZVOUS_TOKEN": TOKEN})


def test_master_endpoint_checks():
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        unique_id_from_env(lambda: UID, 1, {"RANK": "1", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer"):
        unique_id_from_env(lambda: UID, 1, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                            "MASTER_PORT": "http"})
    assert unique_id_from_env(lambda: UID, 1, {"RANK": "0", "WORLD_SIZE": "1"}) == UID


SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from lowgrad.launch.rendezvous import unique_id_from_env
try:
    print("OK", unique_id_from_env(lambda: bytes(range(128)), timeout=20).hex())
except Exception as e:
    print("ERR", type(e).__name__, e)
"""


def ports_pair() -> int:
    """A port p with p + 1 free too (torchrun's agent store holds p, lowgrad takes p + 1)."""
    for _ in range(50):
        p = free_port()
        try:
            with socket.create_server(("127.0.0.1", p + 1)):
                return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@pytest.mark.timeout(60)
def test_torchrun_environment_processes_agree_on_the_id():
    port, world = ports_pair(), 3
    with socket.create_server(("127.0.0.1", port)):  # torchrun's store on MASTER_PORT
        procs = []
        for rank in (2, 1, 0):  # rank 0 last: the others retry until it listens
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                   "LOWGRAD_RENDEZVOUS_TOKEN": TOKEN}
            env.pop("NCCL_COMM_ID", None)
            procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=ROOT)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            time.sleep(0.1)
        outs = [p.communicate(timeout=40)[0].strip() for p in procs]
    assert outs == ["OK " + UID.hex()] * world, outs
