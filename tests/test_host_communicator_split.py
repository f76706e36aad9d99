"""``HostCommunicator.split`` (the contract: lowgrad/contracts/communicator.py): ranks of one color
form one new communicator ordered by (key, parent rank); bad arguments raise before anything
happens; a failing rank wakes the ranks waiting in a split communicator."""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.runtime.threads import split_groups


def tensor(comm: Any, arr: np.ndarray) -> Any:
    t = comm.device.alloc(arr.shape, lg.fp32)
    t.numpy()[...] = arr
    return t


@pytest.mark.parametrize("world,group", [(4, 2), (8, 4), (8, 2), (6, 3)])
def test_split_by_node_and_by_local_index(world: int, group: int) -> None:
    """The two splits of a node shape: within a node (color rank // G) and across nodes (color
    rank % G); each all-reduces its own members' values only."""
    def fn(c: Any) -> tuple[int, int, int, int, float, float]:
        node = c.split(c.rank // group)
        cross = c.split(c.rank % group)
        a, b = tensor(node, np.array([2.0 ** c.rank], np.float32)), tensor(cross, np.array([2.0 ** c.rank], np.float32))
        node.all_reduce(a)
        cross.all_reduce(b)
        out = (node.rank, node.world, cross.rank, cross.world, float(a.numpy()[0]), float(b.numpy()[0]))
        node.close()
        cross.close()
        return out

    for r, (nr, nw, cr, cw, a, b) in enumerate(lg.run_threads(world, fn, timeout=30)):
        n, g = divmod(r, group)
        assert (nr, nw, cr, cw) == (g, group, n, world // group)
        assert a == sum(2.0 ** (n * group + k) for k in range(group))
        assert b == sum(2.0 ** (k * group + g) for k in range(world // group))


def test_key_orders_the_new_ranks_and_ties_keep_the_parent_order() -> None:
    keys = [5, -1, 5, 0]  # new order: rank 1 (key -1), rank 3 (0), rank 0 (5), rank 2 (5)

    def fn(c: Any) -> tuple[int, int, list[int]]:
        sub = c.split(7, keys[c.rank])
        with sub:  # the parent ranks in the new rank order
            return sub.rank, sub.world, [b[0] for b in sub.host_allgather(bytes([c.rank]))]
    res = lg.run_threads(4, fn)
    assert [r[:2] for r in res] == [(2, 4), (0, 4), (3, 4), (1, 4)] and all(r[2] == [1, 3, 0, 2] for r in res)
    assert split_groups([(7, k) for k in keys]) == {7: [1, 3, 0, 2]}


def test_uneven_colors_and_default_key() -> None:
    colors = [3, 0, 3, 3, 0]

    def fn(c: Any) -> tuple[int, int, float]:
        with c.split(colors[c.rank]) as sub:
            t = tensor(sub, np.array([float(c.rank)], np.float32))
            sub.all_reduce(t)
            return sub.rank, sub.world, float(t.numpy()[0])
    assert lg.run_threads(5, fn) == [(0, 3, 5.0), (0, 2, 5.0), (1, 3, 5.0), (2, 3, 5.0), (1, 2, 5.0)]


def test_split_of_a_split_and_the_parent_stays_usable() -> None:
    def fn(c: Any) -> tuple[int, int, bool]:
        half = c.split(c.rank // 4)
        quarter = half.split(half.rank // 2)
        t = tensor(c, np.ones(1, np.float32))
        c.all_reduce(t)  # the parent is unchanged by its splits
        quarter.close()
        half.close()
        return quarter.rank, quarter.world, float(t.numpy()[0]) == c.world
    assert lg.run_threads(8, fn) == [(r % 2, 2, True) for r in range(8)]


@pytest.mark.parametrize("color,key,exc,match", [
    (True, None, TypeError, "split color"), (1.0, None, TypeError, "split color"),
    (-1, None, ValueError, r"color must be in \[0, 2\*\*31\)"), (2 ** 31, None, ValueError, "color must be"),
    (0, "a", TypeError, "split key"), (0, 2 ** 31, ValueError, r"key must be in \[-2\*\*31, 2\*\*31\)"),
    (0, -2 ** 31 - 1, ValueError, "key must be")])
def test_bad_arguments_raise_before_anything_happens(color: Any, key: Any, exc: type[Exception], match: str) -> None:
    """Every rank refuses at once (a check that communicated would meet the peers first), and
    a corrected split then works: nothing was consumed."""
    def fn(c: Any) -> int:
        with pytest.raises(exc, match=match):
            c.split(color, key)
        with c.split(0) as sub:
            return sub.world
    assert lg.run_threads(2, fn) == [2, 2]


def test_split_inside_a_group_or_after_close_is_refused() -> None:
    def grouped(c: Any) -> None:
        with pytest.raises(ValueError, match="split cannot run inside comm.group()"), c.group():
            c.split(0)
    lg.run_threads(2, grouped)

    def fn(c: Any) -> bool:
        with c.split(1) as sub:
            ok = sub.world == 2
        sub_closed = c.split(0)
        sub_closed.close()
        with pytest.raises(lg.ClosedError):
            sub_closed.split(0)
        return ok
    assert lg.run_threads(2, fn) == [True, True]


def test_a_failing_rank_wakes_the_ranks_waiting_in_a_split_communicator() -> None:
    def fn(c: Any) -> None:
        sub = c.split(0)
        if c.rank == 1:
            raise RuntimeError("boom in rank 1")
        sub.barrier()  # rank 1 never arrives: run_threads' abort of the parent reaches the split

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        lg.run_threads(3, fn, timeout=60)
    assert time.monotonic() - t0 < 10


def test_a_rank_that_never_splits_times_out() -> None:
    def fn(c: Any) -> None:
        if c.rank == 1:
            time.sleep(1.0)
            return
        c.split(0)

    with pytest.raises(lg.CommTimeoutError, match=r"\[1\]"):
        lg.run_threads(2, fn, timeout=0.3)


def split_cycles(children: Callable[[Any], Any]) -> Callable[[Any], int]:
    """The job of the cycles tests (host and loopback): 50 split-and-close cycles, then how many
    children the parent holds (``children(comm)``), then a live split that rank 1's failure must
    wake (its message says the count)."""
    def fn(c: Any) -> int:
        for _ in range(50):
            sub = c.split(0)
            sub.close()
        del sub
        c.barrier()  # every rank has dropped its last child
        gc.collect()
        c.barrier()
        held = len(children(c))
        live = c.split(0)
        if c.rank == 1:
            raise RuntimeError(f"boom in rank 1 ({held} held)")
        live.barrier()  # rank 1 never arrives: the abort reaches the live split
        return held
    return fn


def test_split_and_close_cycles_leave_nothing_held_by_the_parent() -> None:
    """The parent holds what was split from it weakly (to abort it): 50 split-and-close cycles leave
    no child behind, and a split still alive after them is still reached by a failing rank's abort."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"boom in rank 1 \(0 held\)"):
        lg.run_threads(3, split_cycles(lambda c: c.collective._children), timeout=60)
    assert time.monotonic() - t0 < 10
