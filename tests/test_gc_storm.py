"""The GC storm: collection at (almost) every allocation, threads allocating tensors held in
reference cycles, exporting DLPack views (accepted and rejected by numpy) and dropping gradient
managers in cycles, all on one host device. Nothing may hang, and once everything is dropped and
drained the memory report is empty."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.buffers import dlpack, release
from lowgrad.runtime.threads import ThreadCollective

LAYOUT = lg.Layout(block=[lg.ParamSpec("w", (8, 4)), lg.ParamSpec("b", (8,))],
                   non_block=[lg.ParamSpec("emb", (6, 4))], num_layers=2)


def _worker(dev: lg.HostDevice, seed: int, rounds: int, errors: list[BaseException]) -> None:
    rng = np.random.default_rng(seed)
    ring: list[object] = [None] * 16
    try:
        for i in range(rounds):
            t = dev.alloc(int(rng.integers(1, 64)), lg.fp32, name=f"storm{seed}")
            view = np.from_dlpack(t)  # versioned capsule, consumed
            view[:] = i
            bad = dev.alloc(4, lg.bf16, name="storm_bf16")
            try:
                np.from_dlpack(bad)  # rejected by numpy: its capsule is dropped unconsumed
            except (BufferError, RuntimeError, TypeError):
                pass
            box: list[object] = [t, view, bad, t.__dlpack__()]  # one capsule never consumed
            box.append(box)
            if i % 3 == 0:
                t.close()  # the view still holds the memory
            if i % 10 == 0:
                comm = lg.HostCommunicator(0, 1, ThreadCollective(1), dev)
                gm = lg.create_gradient_manager(LAYOUT, comm, strategy=("unsharded", "scatter_reduce")[i % 2],
                                                dtype="fp32")
                cyc: list[object] = [gm, comm]
                cyc.append(cyc)
                if i % 20 == 0:
                    gm.close()
                box.append(cyc)
                del gm, comm, cyc
            ring[i % len(ring)] = box
            assert float(view[0]) == i
            del t, view, bad, box
            if i % 7 == 0:
                dev.memory_report()
    except BaseException as exc:  # noqa: BLE001 - the test asserts the list is empty
        errors.append(exc)


@pytest.mark.timeout(120, method="thread")  # a deadlock inside a finalizer defeats the signal method
def test_gc_storm_threads_dlpack_managers() -> None:
    dev = lg.HostDevice()
    errors: list[BaseException] = []
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        threads = [threading.Thread(target=_worker, args=(dev, s, 300, errors)) for s in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        gc.set_threshold(*old)
    assert errors == []
    gc.collect()
    release.drain()
    assert dev.memory_report().total() == 0, str(dev.memory_report())
    assert dlpack.live_exports() == 0 and release.pending() == 0
