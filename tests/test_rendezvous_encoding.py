"""Rendezvous variables that cannot be used as they are (bytes that are not UTF-8, a host name
longer than DNS allows, an empty address, an out-of-range port) are a ValueError naming the
variable, raised before the unique id is made and before any socket is opened; the corrected
environment then works."""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from lowgrad.launch import tcp_rendezvous as tcp
from lowgrad.launch.rendezvous import unique_id_from_env
from lowgrad.launch.tcp_rendezvous import MAX_HOST_BYTES, check_host, exchange_unique_id

UID = bytes(range(128))
SECRET = b"\xffhunter2\xfe"
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOWGRAD_MASTER_PORT", "NCCL_COMM_ID",
            "LOWGRAD_RENDEZVOUS_TOKEN", "LOWGRAD_RENDEZVOUS_BIND", "TORCHELASTIC_USE_AGENT_STORE",
            "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any socket the rendezvous would open, or name it would resolve, fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a socket was used: {args}")
    for name in ("socket", "create_connection", "getaddrinfo"):
        monkeypatch.setattr(tcp.socket, name, refuse)
    yield


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[bytes, bytes]]:
    """The process environment of rank 0 of 2 under torchrun on 127.0.0.1; entries written to the
    returned dict go to ``os.environb`` (restored afterwards)."""
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    base = {b"RANK": b"0", b"WORLD_SIZE": b"2", b"LOCAL_RANK": b"0", b"MASTER_ADDR": b"127.0.0.1",
            b"MASTER_PORT": str(free_port()).encode()}
    for k, v in base.items():
        monkeypatch.setitem(os.environb, k, v)

    class Env(dict[bytes, bytes]):
        def __setitem__(self, k: bytes, v: bytes) -> None:
            monkeypatch.setitem(os.environb, k, v)
    yield Env()


def refused(match: str) -> str:
    """unique_id_from_env on the process environment raises ValueError matching ``match`` without
    making the id; the message."""
    made: list[int] = []

    def make_id() -> bytes:
        made.append(1)
        return UID
    for rank in (b"0", b"1"):
        os.environb[b"RANK"] = rank
        with pytest.raises(ValueError, match=match) as info:
            unique_id_from_env(make_id, 5)
    os.environb[b"RANK"] = b"0"
    assert made == []
    return str(info.value)


@pytest.mark.parametrize("name", [b"MASTER_ADDR", b"LOWGRAD_RENDEZVOUS_BIND"])
@pytest.mark.parametrize("value,why", [(b"\xffhost", "not UTF-8"), (b"rank0.\xe9", "not UTF-8"),
                                       (b"a" * 64 + b".example", "too long"),
                                       (b"a..b", "label empty"),
                                       (b"a." * 127 + b"bc", f"256 bytes long.*at most {MAX_HOST_BYTES}")])
def test_unusable_host_names_are_value_errors_naming_the_variable(environ: dict[bytes, bytes], no_sockets: None,
                                                                  name: bytes, value: bytes, why: str) -> None:
    environ[name] = value
    refused(f"{name.decode()}.*{why}")


def test_empty_master_addr(environ: dict[bytes, bytes], no_sockets: None) -> None:
    environ[b"MASTER_ADDR"] = b""
    refused("MASTER_ADDR is empty")


def test_a_token_that_is_not_utf8_is_named_and_not_shown(environ: dict[bytes, bytes], no_sockets: None) -> None:
    environ[b"LOWGRAD_RENDEZVOUS_TOKEN"] = SECRET
    message = refused("LOWGRAD_RENDEZVOUS_TOKEN cannot be encoded as UTF-8")
    assert "hunter2" not in message


@pytest.mark.parametrize("env,match", [({b"MASTER_PORT": b"70000"}, r"MASTER_PORT must be in \[1, 65535\]"),
                                       ({b"MASTER_PORT": b"0"}, r"MASTER_PORT must be in \[1, 65535\]"),
                                       ({b"LOWGRAD_MASTER_PORT": b"-3"}, r"LOWGRAD_MASTER_PORT must be in"),
                                       ({b"MASTER_PORT": b"\xff"}, "MASTER_PORT must be an integer"),
                                       ({b"MASTER_PORT": b"65535", b"TORCHELASTIC_USE_AGENT_STORE": b"True"},
                                        "MASTER_PORT is 65535")])
def test_unusable_ports_name_the_variable(environ: dict[bytes, bytes], no_sockets: None, env: dict[bytes, bytes],
                                          match: str) -> None:
    for k, v in env.items():
        environ[k] = v
    refused(match)


def test_the_longest_dns_name_is_accepted() -> None:
    longest = ".".join(["a" * 63] * 3 + ["b" * 61])
    assert len(longest) == MAX_HOST_BYTES
    assert check_host("MASTER_ADDR", longest) == longest
    assert check_host("MASTER_ADDR", longest + ".") == longest + "."  # a final dot is not counted
    with pytest.raises(ValueError, match="254 bytes long"):
        check_host("MASTER_ADDR", longest + "b")
    for fine in ("127.0.0.1", "::1", "fe80::1%lo", "node-01.cluster", "b\u00fccher.example"):
        assert check_host("MASTER_ADDR", fine) == fine
    with pytest.raises(TypeError, match="MASTER_ADDR must be a str"):
        check_host("MASTER_ADDR", b"127.0.0.1")


def test_exchange_checks_its_own_arguments_before_any_socket(no_sockets: None) -> None:
    for kw, match in (({"addr": "\udcff"}, "addr=.*not UTF-8"), ({"bind": "x." * 150}, "bind is 299 bytes long"),
                      ({"token": "\udcff"}, "token cannot be encoded")):
        args: dict[str, Any] = {"rank": 0, "world": 2, "addr": "127.0.0.1", "port": 1, "uid": UID, "timeout": 1, **kw}
        with pytest.raises(ValueError, match=match):
            exchange_unique_id(**args)
    with pytest.raises(TypeError, match="addr must be a str"):
        exchange_unique_id(1, 2, 5, 1, None, 1)  # type: ignore[arg-type]


def test_the_corrected_environment_then_delivers_the_id(environ: dict[bytes, bytes]) -> None:
    environ[b"MASTER_ADDR"] = b"\xff"
    environ[b"LOWGRAD_RENDEZVOUS_TOKEN"] = SECRET
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        unique_id_from_env(lambda: UID, 5)
    environ[b"MASTER_ADDR"] = b"127.0.0.1"
    with pytest.raises(ValueError, match="LOWGRAD_RENDEZVOUS_TOKEN"):
        unique_id_from_env(lambda: UID, 5)
    environ[b"LOWGRAD_RENDEZVOUS_TOKEN"] = b"t0ken"
    env = {k: os.environ[k] for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOWGRAD_RENDEZVOUS_TOKEN")}
    got: dict[int, bytes] = {}
    client = threading.Thread(target=lambda: got.__setitem__(1, unique_id_from_env(
        lambda: b"\x00" * 128, 20, {**env, "RANK": "1"})))
    client.start()
    got[0] = unique_id_from_env(lambda: UID, 20, {**env, "RANK": "0"})
    client.join(20)
    assert got == {0: UID, 1: UID}
