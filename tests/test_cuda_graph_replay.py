"""``Graph.replay`` on the CPU (a stand-in launch): when a step after a participant's
``replay_before`` raises — another participant's ``replay_before``, or ``cuGraphLaunch`` — every
participant that began is told (``replay_failed``: the loopback closes its device-gate window),
and none is told the replay was done."""
from __future__ import annotations

from typing import Any

import pytest

from lowgrad.cuda import graph


class Participant:
    def __init__(self, log: list[str], name: str, fail_before: bool = False) -> None:
        self.log, self.name, self.fail_before = log, name, fail_before

    def replay_check(self, template: Any) -> Any:
        return template

    def replay_before(self, stream: int) -> None:
        if self.fail_before:
            raise RuntimeError(f"{self.name}: replay_before failed")
        self.log.append(f"{self.name}.before")

    def replay_launch(self, stream: int) -> int:
        return stream

    def replay_done(self, applied: Any, stream: int) -> None:
        self.log.append(f"{self.name}.done")

    def replay_failed(self, stream: int) -> None:
        self.log.append(f"{self.name}.failed")


def captured(*participants: Participant) -> graph.Graph:
    g = object.__new__(graph.Graph)  # no GPU: only what replay touches
    g._exec, g._exec_handle, g._keep = object(), 1, set()
    g._participants = {p: None for p in participants}
    return g


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    result = [0]
    monkeypatch.setattr(graph, "_graph_launch", lambda exec_handle, stream: result[0])
    monkeypatch.setattr(graph._cuda, "fail", lambda call, err: RuntimeError(f"{call} failed: error {err}"))
    return result


def test_a_replay_tells_every_participant_it_was_done(launch: list[int]) -> None:
    log: list[str] = []
    captured(Participant(log, "a"), Participant(log, "b")).replay(0)
    assert log == ["a.before", "b.before", "a.done", "b.done"]


def test_a_failed_launch_tells_the_participants_that_began(launch: list[int]) -> None:
    log: list[str] = []
    launch[0] = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(RuntimeError, match="cuGraphLaunch failed: error 700"):
        captured(Participant(log, "a"), Participant(log, "b")).replay(0)
    assert log == ["a.before", "b.before", "a.failed", "b.failed"]


def test_a_failed_replay_before_tells_only_those_before_it(launch: list[int]) -> None:
    log: list[str] = []
    with pytest.raises(RuntimeError, match="b: replay_before failed"):
        captured(Participant(log, "a"), Participant(log, "b", fail_before=True), Participant(log, "c")).replay(0)
    assert log == ["a.before", "a.failed"]
