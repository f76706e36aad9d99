"""CUDA graphs: capture work queued on a stream once, replay it with one launch.

::

    g = lowgrad.Graph(device)
    with g.capture(stream):                     # nothing runs while capturing
        gm.start_micro_step(stream, 1, M)
        ...engine kernels, gm.block_full / gm.notify_block, NCCL...
        gm.end_micro_step(stream)
    for m in range(1, M - 1):
        g.replay(stream)                        # one cuGraphLaunch, the manager's state follows

Capture runs in thread-local mode (other threads keep working; ranks driven by threads each
capture their own stream). While capturing, lowgrad refuses host syncs, allocations, kernel
compiles and pageable copies with :class:`CaptureError` (:mod:`lowgrad.buffers.capture`), so warm up
first: run one eager micro-step (kernels compiled, scratch allocated) before capturing.

A gradient manager used inside a capture records a *template* of the micro-steps it saw (their
kind: first, middle or last of a step of M) and leaves its own state as it was; each replay
checks that the template fits the manager's next micro-step (``ProtocolError`` otherwise, before
anything is launched), launches, and then advances the manager as the eager calls would have.
Fresh noise needs no host work: the SR kernels read the manager's device-side seed counter.

The graph holds every lowgrad allocation its kernels use; replaying after one was closed raises
:class:`ClosedError` instead of touching freed memory. ``close()`` (or garbage collection) frees
the graph.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from lowgrad.base.errors import CaptureError, ClosedError
from lowgrad.buffers import capture, release
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.cuda import driver as _cuda

_CAPTURE_MODE_THREAD_LOCAL = 1
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_graph_launch: Any = None  # cuGraphLaunch through ctypes (lowgrad.cuda.driver.c_function)


class Participant(Protocol):
    """What a graph calls on an object that recorded itself in a capture: a gradient manager
    (through :class:`lowgrad.managers.replay.GraphHooks`; the template is its ``Template``)."""

    def replay_check(self, template: Any) -> Any:
        """Raise if ``template`` cannot replay now; return what :meth:`replay_done` applies."""

    def replay_before(self, stream: int) -> None:
        """Queue on ``stream`` what the replay must wait for."""

    def replay_launch(self, stream: int) -> int:
        """The stream to launch on (called after every ``replay_before``): ``stream`` itself, or
        one that waits for it and makes it wait for the launch again in :meth:`replay_done`."""

    def replay_done(self, applied: Any, stream: int) -> None:
        """The replay was launched on ``stream`` (the launch stream): advance host state,
        re-record events."""

    def replay_failed(self, stream: int) -> None:
        """After this participant's :meth:`replay_before`, a later step of the replay raised
        (another participant, or the launch): undo what :meth:`replay_before` began that only
        :meth:`replay_done` would end."""

    def capture_closing(self, stream: int) -> None:
        """The capture of ``stream`` is about to end: join any side stream back into it."""

    def capture_ended(self, graph: Graph, failed: bool) -> Any:
        """The capture ended: restore host state; return the template (or raise)."""


def is_capturing(handle: int) -> bool:
    """Whether the raw stream ``handle`` is being captured (by anyone)."""
    drv = _cuda.driver()
    status = _cuda.check("cuStreamIsCapturing", drv.cuStreamIsCapturing(drv.CUstream(handle)))
    return int(status) != 0


def capture_of(stream: StreamLike) -> Graph | None:
    """The lowgrad Graph capturing ``stream`` on this thread, None when nothing captures it;
    CaptureError when it is captured some other way (a manager must follow its replays) or when
    this thread captures a different stream."""
    h = stream_handle(stream)
    g = capture.current()
    if g is not None and g.stream_handle == h:
        return g
    if g is not None:
        raise CaptureError(f"stream 0x{h:x} is not the stream this thread is capturing (0x{g.stream_handle:x}); "
                           "a micro-step inside a capture runs on the captured stream")
    if is_capturing(h):
        raise CaptureError(f"stream 0x{h:x} is being captured, but not by lowgrad.Graph: capture gradient-manager "
                           "calls with lowgrad.Graph so that replays advance the manager")
    return None


class Graph:
    """A CUDA graph on ``device`` (a :class:`lowgrad.Device`), captured once, replayed often."""

    def __init__(self, device: Any) -> None:
        if getattr(device, "backend", None) != "cuda":
            raise TypeError(f"CUDA graphs need a lowgrad.Device (CUDA), got {device!r}: the host backend runs "
                            "work eagerly, so there is nothing to capture")
        self.device = device
        self.stream_handle = -1
        self._graph: Any = None
        self._exec: Any = None
        self._exec_handle = 0
        self._keep: set[Any] = set()
        self._participants: dict[Any, Any] = {}  # participant -> its template (None while capturing)
        self._finalizer: release.Finalizer | None = None
        self.kernel_nodes = 0
        self.nodes = 0

    @property
    def captured(self) -> bool:
        return self._exec is not None

    def keep(self, allocations: tuple[Any, ...]) -> None:
        """Hold ``allocations`` for the graph's lifetime (called while capturing)."""
        self._keep.update(allocations)

    def join(self, participant: Participant) -> None:
        """Register an object whose host state must follow replays (called while capturing)."""
        self._participants.setdefault(participant, None)

    @contextmanager
    def capture(self, stream: StreamLike) -> Iterator[Graph]:
        """Capture the work queued on ``stream`` (not the legacy default stream) inside the block."""
        if self._exec is not None or self._graph is not None:
            raise CaptureError("this Graph was already captured; make a new Graph for another capture")
        h = stream_handle(stream)
        if h == 0:
            raise ValueError("cannot capture the legacy default stream (handle 0): use a stream from "
                             "device.stream()")
        drv = _cuda.driver()
        self.device.activate()
        capture.begin(self)
        self.stream_handle = h
        try:
            _cuda.check("cuStreamBeginCapture", drv.cuStreamBeginCapture(drv.CUstream(h), _CAPTURE_MODE_THREAD_LOCAL))
        except BaseException:
            capture.end(self)
            raise
        failed = True
        try:
            yield self
            failed = False
        finally:
            capture.end(self)
            self._finish_capture(drv, h, failed)

    def _finish_capture(self, drv: Any, h: int, failed: bool) -> None:
        """End the capture, let every participant restore its state, instantiate; on a failure
        nothing is kept and (unless the block itself raised) the first error is raised."""
        graph, error, own = None, None, None
        for p in self._participants:
            p.capture_closing(h)
        try:
            graph = _end_capture(drv, h, failed)
        except Exception as exc:  # noqa: BLE001 - e.g. an invalidated capture: participants still restore
            error = exc
        templates = {}
        for p in self._participants:
            try:
                templates[p] = p.capture_ended(self, failed or error is not None)
            except Exception as exc:  # noqa: BLE001 - a participant's own error says more than the driver's
                own = own or exc
        error = own or error
        if graph is not None and error is None:
            self._instantiate(drv, graph)
            self._participants = templates
        else:
            if graph is not None:
                drv.cuGraphDestroy(graph)
            self._participants = {}
            if error is not None and not failed:
                raise error

    def _instantiate(self, drv: Any, graph: Any) -> None:
        try:
            self._exec = _cuda.check("cuGraphInstantiate", drv.cuGraphInstantiate(graph, 0))
        except BaseException:
            drv.cuGraphDestroy(graph)
            raise
        self._graph, self._exec_handle = graph, int(self._exec)
        global _graph_launch
        if _graph_launch is None:
            _graph_launch = _cuda.c_function("cuGraphLaunch", ctypes.c_void_p, ctypes.c_void_p)
        nodes = _cuda.check("cuGraphGetNodes", drv.cuGraphGetNodes(graph, 0))[1]
        listed = _cuda.check("cuGraphGetNodes", drv.cuGraphGetNodes(graph, nodes))[0] if nodes else []
        self.nodes = len(listed)
        self.kernel_nodes = sum(int(_cuda.check("cuGraphNodeGetType", drv.cuGraphNodeGetType(n))) == _KERNEL_NODE
                                for n in listed)
        self._finalizer = release.Finalizer(self, _destroy, drv, self._exec, graph)

    def replay(self, stream: StreamLike = None) -> None:
        """Launch the captured work on ``stream`` (asynchronous). Every participant's check runs
        before the launch; a closed allocation raises ClosedError."""
        if self._exec is None:
            raise CaptureError("Graph.replay before a completed capture")
        for a in self._keep:
            if a._ptr is None:
                raise ClosedError(f"graph replay: the allocation {', '.join(a.parts)!r} it uses was closed")
        h = stream_handle(stream)
        applied = [(p, p.replay_check(t)) for p, t in self._participants.items()]
        begun = 0
        try:
            for p, _ in applied:
                p.replay_before(h)
                begun += 1
            launch = h
            for p, _ in applied:
                launch = p.replay_launch(launch)
            err = _graph_launch(self._exec_handle, launch)
            if err:
                raise _cuda.fail("cuGraphLaunch", err)
        except BaseException:
            for p, _ in applied[:begun]:
                p.replay_failed(h)
            raise
        for p, a in applied:
            p.replay_done(a, launch)

    def close(self) -> None:
        """Destroy the graph now; later replays raise."""
        if self._finalizer is not None:
            self._finalizer()
        self._exec, self._graph, self._keep, self._participants = None, None, set(), {}

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"{self.kernel_nodes} kernels of {self.nodes} nodes" if self.captured else "not captured"
        return f"Graph(device={self.device.ordinal}, {state})"


def _end_capture(drv: Any, h: int, failed: bool) -> Any:
    """End the capture on ``h``; the graph, or None (discarded) when the block failed."""
    err, graph = drv.cuStreamEndCapture(drv.CUstream(h))
    if failed:
        if int(err) == 0:
            drv.cuGraphDestroy(graph)
        return None
    _cuda.check_rc("cuStreamEndCapture", err)
    return graph


def _destroy(drv: Any, exec_: Any, graph: Any) -> None:
    drv.cuGraphExecDestroy(exec_)
    drv.cuGraphDestroy(graph)

