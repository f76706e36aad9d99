"""The authenticated TCP exchange that carries rank 0's 128-byte unique id to the other ranks:
rank 0 serves it on one port, the others fetch it, both ends prove a shared token with
HMAC-SHA256 (``docs/rendezvous.md``). :mod:`lowgrad.launch.rendezvous` calls it when the
launcher offers nothing better.

Protocol: rank 0 speaks first: magic and a fresh nonce. The client answers with magic, rank,
world, its own nonce and HMAC(token, "client" | server nonce | those fields). Rank 0 replies with
a status, the id (zeros unless accepted) and HMAC(token, "server" | client nonce | server nonce |
rank, world | id), which the client checks: both ends prove they hold the token, and a recorded
exchange cannot be replayed. Without a token the key is empty (integrity, no authentication).
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import secrets
import selectors
import socket
import struct
import time
import warnings
from typing import Any

from lowgrad.base.errors import CommTimeoutError
from lowgrad.base.integers import integer
from lowgrad.base.timeouts import DEFAULT_TIMEOUT, check_timeout

_MAGIC = b"LGRDV\x00\x02\x00"
_NONCE = 32
_MAC = 32
_ID_BYTES = 128
_SERVER_HELLO = struct.Struct(f"<8s{_NONCE}s")
_CLIENT_HELLO = struct.Struct(f"<8sii{_NONCE}s{_MAC}s")
_REPLY = struct.Struct(f"<B{_ID_BYTES}s{_MAC}s")
_OK, _BAD_AUTH, _BAD_WORLD, _BAD_RANK, _TAKEN = range(5)
HANDSHAKE_TIMEOUT = 10.0  # seconds one connection may take from accept to reply
_MAX_PENDING = 256  # connections in handshake at once; more are closed at accept
_KEEP_DROPS = 8  # reasons of dropped connections quoted in rank 0's timeout error
MAX_HOST_BYTES = 253  # the longest DNS name (RFC 1035), its final dot not counted


def exchange_unique_id(rank: int, world: int, addr: str, port: int, uid: bytes | None,
                       timeout: float = DEFAULT_TIMEOUT, *, token: str | bytes | None = None,
                       bind: str | None = None, handshake_timeout: float = HANDSHAKE_TIMEOUT) -> bytes:
    """Deliver rank 0's 128-byte ``uid`` to every rank over TCP and return it.

    Rank 0 listens on ``bind`` (default ``addr``, which must then be an address of this host)
    at ``port`` and serves connections concurrently, each within ``handshake_timeout`` seconds;
    a bad hello (garbage, wrong world, out-of-range or already-served rank, failed
    authentication) is dropped and rank 0 keeps waiting. It returns once ranks ``1 .. world-1``
    were each served once (the first to authenticate wins a rank). The others connect to
    ``addr:port``, retrying until rank 0 listens. ``token`` (a shared secret) authenticates both
    ends with HMAC-SHA256; without one any client reaching the port gets the id. After
    ``timeout`` seconds (absolute, from the call) rank 0 raises CommTimeoutError naming the
    missing ranks, a client CommTimeoutError; a rejected client raises ValueError (world, rank)
    or PermissionError (token). Every argument is checked before a socket is opened: ``addr``
    and ``bind`` as :func:`check_host` does, ``token`` as :func:`token_key` does.
    """
    rank, world, port = integer("rank", rank), integer("world", world), integer("port", port)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside [0, world={world})")
    if not 0 < port < 65536 and world > 1:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    timeout, handshake_timeout = check_timeout(timeout), check_timeout(handshake_timeout, HANDSHAKE_TIMEOUT)
    if rank == 0 and not (isinstance(uid, (bytes, bytearray)) and len(uid) == _ID_BYTES):
        raise ValueError(f"rank 0 must pass its {_ID_BYTES}-byte unique id")
    if rank != 0 and uid is not None:
        raise ValueError(f"only rank 0 passes a unique id (rank {rank} got one)")
    key = token_key("token", token)
    addr = check_host("addr", addr)
    bind = None if bind is None else check_host("bind", bind)
    deadline = time.monotonic() + timeout
    if rank != 0:
        return _fetch_id(rank, world, addr, port, key, deadline, timeout, handshake_timeout)
    if world > 1:
        _serve_id(world, addr if bind is None else bind, port, bytes(uid), key,  # type: ignore[arg-type]
                  deadline, timeout, handshake_timeout)
    return bytes(uid)  # type: ignore[arg-type]


def check_host(what: str, host: Any) -> str:
    """``host`` (a host name or address, named ``what`` in errors: a parameter or a variable
    such as ``MASTER_ADDR``), checked as the socket layer will encode it, so that a bad one is a
    ValueError here and not a UnicodeError from ``getaddrinfo``: it must be a non-empty str that
    IDNA encodes (no undecodable bytes, labels of 1 to 63 bytes) into at most
    :data:`MAX_HOST_BYTES` bytes. TypeError for a non-str."""
    if not isinstance(host, str):
        raise TypeError(f"{what} must be a str (a host name or address), got {type(host).__name__}")
    if not host:
        raise ValueError(f"{what} is empty; set it to rank 0's host name or address")
    if any("\udc80" <= ch <= "\udcff" for ch in host):  # how os.environ holds bytes that are not UTF-8
        raise ValueError(f"{what}={host!r} holds bytes that are not UTF-8; set it to rank 0's host name or address")
    try:
        encoded = host.encode("idna")
    except UnicodeError as exc:
        raise ValueError(f"{what}={host!r} is not a usable host name ({exc})") from None
    if (n := len(encoded.removesuffix(b"."))) > MAX_HOST_BYTES:
        raise ValueError(f"{what} is {n} bytes long ({host[:40]!r}...); a host name has at most {MAX_HOST_BYTES}")
    return host


def token_key(what: str, token: Any) -> bytes:
    """The HMAC key of ``token`` (named ``what`` in errors; its value is never shown): a str as
    UTF-8, bytes as they are, None as no key. ValueError for a str that UTF-8 cannot encode (bytes
    of the environment that are not UTF-8), TypeError for another type."""
    if token is None:
        return b""
    if isinstance(token, str):
        try:
            return token.encode()
        except UnicodeEncodeError:
            raise ValueError(f"{what} cannot be encoded as UTF-8 (it holds bytes that are not UTF-8, or lone "
                             "surrogates); use a token of UTF-8 text, e.g. secrets.token_hex(32)") from None
    if isinstance(token, (bytes, bytearray)):
        return bytes(token)
    raise TypeError(f"{what} must be str, bytes or None, got {type(token).__name__}")


def _client_mac(key: bytes, server_nonce: bytes, fields: bytes) -> bytes:
    return hmac.new(key, b"client" + server_nonce + fields, hashlib.sha256).digest()


def _server_mac(key: bytes, client_nonce: bytes, server_nonce: bytes, rank: int, world: int, uid: bytes) -> bytes:
    return hmac.new(key, b"server" + client_nonce + server_nonce + struct.pack("<ii", rank, world) + uid,
                    hashlib.sha256).digest()


def _listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to that belongs to this machine."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"rendezvous: cannot resolve the rank-0 address {host!r}: {exc}") from None
    socks: list[socket.socket] = []
    foreign: list[str] = []
    for family, sockaddr in dict.fromkeys((i[0], i[4]) for i in infos):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # an address family this host does not support
            foreign.append(str(sockaddr[0]))
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(sockaddr)
            s.listen(backlog)
            s.setblocking(False)
        except OSError as exc:
            s.close()
            if exc.errno == errno.EADDRNOTAVAIL:
                foreign.append(str(sockaddr[0]))
                continue
            for t in socks:
                t.close()
            raise OSError(exc.errno, f"rendezvous: rank 0 cannot listen on {sockaddr[0]} port {port}: "
                                     f"{exc.strerror}") from None
        socks.append(s)
    if not socks:
        raise ValueError(f"rendezvous: {host!r} resolves to {foreign}, not an address of this machine; run rank 0 "
                         "on the MASTER_ADDR host, or set LOWGRAD_RENDEZVOUS_BIND to a local address")
    return socks


class _Conn:
    """One accepted connection of rank 0's rendezvous: bytes to send, bytes received, deadline."""

    __slots__ = ("deadline", "inbuf", "nonce", "out", "peer", "rank", "replied", "sock")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.nonce = secrets.token_bytes(_NONCE)
        self.inbuf = b""
        self.out = _SERVER_HELLO.pack(_MAGIC, self.nonce)
        self.rank = 0  # the rank this connection was granted, once replied
        self.replied = False


def _serve_id(world: int, host: str, port: int, uid: bytes, key: bytes, deadline: float, timeout: float,
              handshake: float) -> None:
    listeners = _listen(host, port, max(world, 16))
    where = ", ".join(str(s.getsockname()[0]) for s in listeners)
    loopback = all(ipaddress.ip_address(str(s.getsockname()[0]).split("%")[0]).is_loopback for s in listeners)
    if not key and not loopback:
        warnings.warn(f"rendezvous: rank 0 serves the NCCL unique id on {where} port {port} without "
                      "LOWGRAD_RENDEZVOUS_TOKEN: any host that reaches this port can take a rank",
                      RuntimeWarning, stacklevel=3)
    sel = selectors.DefaultSelector()
    conns: dict[socket.socket, _Conn] = {}
    claimed: dict[int, _Conn] = {}
    served: set[int] = set()
    drops: list[str] = []
    ndrops = 0

    def note(c: _Conn, why: str) -> None:
        nonlocal ndrops
        ndrops += 1
        if len(drops) < _KEEP_DROPS:
            drops.append(f"{c.peer}: {why}")

    def drop(c: _Conn, why: str | None) -> None:
        sel.unregister(c.sock)
        c.sock.close()
        del conns[c.sock]
        if claimed.get(c.rank) is c and c.rank not in served:
            del claimed[c.rank]
        if why is not None:
            note(c, why)

    def update(c: _Conn) -> None:
        sel.modify(c.sock, (0 if c.replied else selectors.EVENT_READ) | (selectors.EVENT_WRITE if c.out else 0), c)

    def answer(c: _Conn) -> None:
        magic, r, w, cnonce, mac = _CLIENT_HELLO.unpack(c.inbuf)
        if magic != _MAGIC:
            return drop(c, "not a lowgrad rendezvous hello")
        status, why = _OK, ""
        if not hmac.compare_digest(mac, _client_mac(key, c.nonce, c.inbuf[:-_MAC])):
            status, why = _BAD_AUTH, f"failed authentication (claimed rank {r})"
        elif w != world:
            status, why = _BAD_WORLD, f"rank {r} with world {w}, expected world {world}"
        elif not 0 < r < world:
            status, why = _BAD_RANK, f"rank {r} outside [1, {world})"
        elif r in claimed:
            status, why = _TAKEN, f"rank {r} already taken by {claimed[r].peer}"
        if status == _OK:
            claimed[r], c.rank = c, r
            c.out = _REPLY.pack(_OK, uid, _server_mac(key, cnonce, c.nonce, r, world, uid))
        else:
            c.out = _REPLY.pack(status, bytes(_ID_BYTES), bytes(_MAC))
            note(c, why)
        c.replied = True
        update(c)

    try:
        for s in listeners:
            sel.register(s, selectors.EVENT_READ, None)
        while len(served) < world - 1:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(1, world)) - served)
                told = f"; dropped {ndrops} connection(s): " + "; ".join(drops) if ndrops else ""
                hint = (" (rank 0 listens on loopback only: ranks on other hosts need a MASTER_ADDR that "
                        "reaches rank 0, or LOWGRAD_RENDEZVOUS_BIND)") if loopback else ""
                raise CommTimeoutError(f"rendezvous: rank 0 waited {timeout:g} s on {where} port {port}; "
                                       f"rank(s) {missing} never joined{told}{hint}")
            for c in [c for c in conns.values() if c.deadline <= now]:
                drop(c, f"no complete exchange within {handshake:g} s" if claimed.get(c.rank) is c
                     or not c.replied else None)
            wake = min([deadline, *(c.deadline for c in conns.values())])
            for skey, events in sel.select(min(wake - now, 60.0)):
                if skey.data is None:
                    _accept(skey.fileobj, sel, conns, min(deadline, time.monotonic() + handshake))  # type: ignore[arg-type]
                    continue
                c = skey.data
                try:
                    if events & selectors.EVENT_WRITE:
                        c.out = c.out[c.sock.send(c.out):]
                    if events & selectors.EVENT_READ and not c.replied:
                        chunk = c.sock.recv(_CLIENT_HELLO.size - len(c.inbuf))
                        if not chunk:
                            drop(c, "closed before a complete hello")
                            continue
                        c.inbuf += chunk
                        if len(c.inbuf) == _CLIENT_HELLO.size:
                            answer(c)
                            continue
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    drop(c, f"connection error: {exc}")
                    continue
                if c.replied and not c.out:
                    if claimed.get(c.rank) is c:
                        served.add(c.rank)
                    drop(c, None)
                else:
                    update(c)
    finally:
        for c in list(conns.values()):
            c.sock.close()
        for s in listeners:
            s.close()
        sel.close()


def _accept(listener: socket.socket, sel: selectors.BaseSelector, conns: dict[socket.socket, _Conn],
            deadline: float) -> None:
    try:
        sock, addr = listener.accept()
    except OSError:  # the client gave up already, or out of descriptors: the next event retries
        return
    if len(conns) >= _MAX_PENDING:
        sock.close()
        return
    sock.setblocking(False)
    c = _Conn(sock, f"{addr[0]}:{addr[1]}", deadline)
    conns[sock] = c
    sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes from a blocking socket, or TimeoutError at ``deadline`` (monotonic seconds)."""
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the server answered {len(buf)} of {n} bytes before the handshake deadline "
                               "(rank 0 overloaded, or another service on this port)")
        sock.settimeout(min(left, 60.0))
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            continue  # the loop re-checks the deadline
        if not chunk:
            raise ConnectionError("rank 0 closed the connection")
        buf += chunk
    return buf


def _fetch_id(rank: int, world: int, addr: str, port: int, key: bytes, deadline: float, timeout: float,
              handshake: float) -> bytes:
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeoutError(f"rendezvous: rank {rank} could not get the unique id from rank 0 at "
                                   f"{addr}:{port} within {timeout:g} s ({last})")
        until = min(deadline, time.monotonic() + handshake)
        try:
            with socket.create_connection((addr, port), timeout=min(left, handshake, 60.0)) as s:
                magic, snonce = _SERVER_HELLO.unpack(_recv_exact(s, _SERVER_HELLO.size, until))
                if magic != _MAGIC:
                    raise ValueError(f"rendezvous: {addr}:{port} is not a lowgrad rank 0 (another service on "
                                     "this port, or another lowgrad version)")
                cnonce = secrets.token_bytes(_NONCE)
                fields = _CLIENT_HELLO.pack(_MAGIC, rank, world, cnonce, bytes(_MAC))[:-_MAC]
                s.sendall(fields + _client_mac(key, snonce, fields))
                status, uid, mac = _REPLY.unpack(_recv_exact(s, _REPLY.size, until))
        except OSError as exc:  # refused, reset, or rank 0 too slow: retry until the deadline
            last = exc
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
            continue
        if status == _OK:
            if not hmac.compare_digest(mac, _server_mac(key, cnonce, snonce, rank, world, uid)):
                raise PermissionError(f"rendezvous: the server at {addr}:{port} did not prove it holds "
                                      "LOWGRAD_RENDEZVOUS_TOKEN (tokens differ, or it is not this job's rank 0)")
            return uid
        kind, why = _REFUSALS.get(status, (ValueError, f"unknown status {status}"))
        raise kind(f"rendezvous: rank 0 at {addr}:{port} refused rank {rank} of world {world}: {why}")


_REFUSALS: dict[int, tuple[type[Exception], str]] = {
    _BAD_AUTH: (PermissionError, ("authentication failed (LOWGRAD_RENDEZVOUS_TOKEN differs, or is set on only "
                                  "some ranks)")),
    _BAD_WORLD: (ValueError, "rank 0 expects another world size"),
    _BAD_RANK: (ValueError, "rank out of range"),
    _TAKEN: (ValueError, ("another process already joined as this rank (a duplicate RANK, or a client that "
                          "took it first: set LOWGRAD_RENDEZVOUS_TOKEN)")),
}
