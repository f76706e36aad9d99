"""Properties of the host communicator (``lowgrad.host.communicator``): bad ops and sizes raise and
leave the communicator usable.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from props import BAD, FEW, alloc_filled, host

import lowgrad

bad_ops = st.one_of(st.text(max_size=5), st.none(), st.integers(), st.floats())


@FEW
@given(st.data())
def test_host_comm_rejects_bad_ops_and_sizes(data) -> None:
    rs_op = data.draw(bad_ops.filter(lambda o: o not in ("avg", "sum")))
    ar_op = data.draw(bad_ops.filter(lambda o: o not in ("sum", "avg", "max")))
    n = data.draw(st.integers(1, 9))
    odd = data.draw(st.integers(0, 4).map(lambda k: 2 * k + 1))
    dt = data.draw(st.sampled_from([lowgrad.fp32, lowgrad.bf16, lowgrad.byte]))

    def world1(comm):
        t = alloc_filled(comm.device, n, dt, "t", 1)
        errs = []
        for fn in (lambda: comm.reduce_scatter(t, op=rs_op), lambda: comm.all_reduce(t, op=ar_op),
                   lambda: comm.all_gather(t, out=alloc_filled(comm.device, n + 1, dt, "out")),
                   lambda: comm.all_gather(t, out=alloc_filled(comm.device, n, lowgrad.fp16, "out")),
                   lambda: comm.reduce_scatter(alloc_filled(host(), n, dt, "other")),
                   lambda: comm.all_reduce(np.zeros(n))):
            try:
                fn()
                errs.append(None)
            except Exception as e:  # noqa: BLE001 - recorded and checked by the caller
                errs.append(type(e))
        comm.all_reduce(t, op="sum")  # still usable after rejected calls
        return errs, bytes(t.numpy().view(np.uint8))

    [(errs, after)] = lowgrad.run_threads(1, world1, timeout=20)
    assert all(e in BAD for e in errs), errs
    assert after == bytes([1]) * (n * dt.itemsize)

    def world2(comm):
        t = alloc_filled(comm.device, odd, dt, "t", 1)
        errs = []
        for fn in (lambda: comm.reduce_scatter(t), lambda: comm.all_gather(t), lambda: comm.all_to_all(t),
                   lambda: comm.reduce_scatter(t, op=rs_op)):
            try:
                fn()
                errs.append(None)
            except Exception as e:  # noqa: BLE001
                errs.append(type(e))
        even = alloc_filled(comm.device, 2, lowgrad.fp32, "e", 0)
        even.numpy()[:] = comm.rank + 1
        comm.reduce_scatter(even, op="sum")
        return errs, float(even.numpy()[comm.rank])

    res = lowgrad.run_threads(2, world2, timeout=20)
    for errs, v in res:
        assert all(e in BAD for e in errs), errs
        assert v == 3.0
