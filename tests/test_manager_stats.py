"""Gradient statistics of the managers (``stats=True``) on the host backend: every row against a
float64 reference of what the engine wrote and what the manager holds, on every strategy at
world 1, 2 and 4; the rows not measured; the non-finite report; the refusals."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_managers import STRATS, bf16_grad, drive, small_layout

import lowgrad as lg
from lowgrad.diagnostics.report import StepStats
from lowgrad.managers import STRATEGIES, ProtocolError

M = 3


def ranks_stats(world: int, strategy: str, offload: bool, gfun: Any = bf16_grad, steps: int = 2
                ) -> list[tuple[dict[str, np.ndarray], StepStats]]:
    """Each rank's shards and step statistics after ``steps`` steps of M micro-steps."""
    layout = small_layout()

    def job(comm: Any) -> tuple[dict[str, np.ndarray], StepStats]:
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, stats=True)
        for step in range(steps):
            shards = drive(comm, layout, strategy, offload, M, gm=gm, first_step=step, gfun=gfun)
            stats = gm.step_stats()
            assert stats.step == step and stats.micro_steps == M and stats.world == world
        gm.close()
        return shards, stats
    return lg.run_threads(world, job, backend="host")


def measured(world: int, strategy: str, offload: bool) -> tuple[bool, str | None]:
    """What the strategy says it measures at ``world`` (``Strategy.stats_kinds``: the micro-step
    rows, and each rank's own gradient per micro-step, per step or never): what to expect, by
    capability rather than by name."""
    def job(comm: Any) -> tuple[bool, str | None]:
        gm = lg.create_gradient_manager(small_layout(), comm, strategy=strategy, offload=offload)
        kinds = gm._strategy.stats_kinds()
        gm.close()
        return kinds
    return lg.run_threads(world, job, backend="host")[0]


def columns() -> list[tuple[str, int, int]]:
    """(name, layer, index in its list) per column: non-block first, then each layer's block."""
    layout = small_layout()
    return ([(s.name, -1, i) for i, s in enumerate(layout.non_block)]
            + [(f"layers.{l}.{s.name}", l, i) for l in range(layout.num_layers) for i, s in enumerate(layout.block)])


def sq(x: np.ndarray) -> float:
    return float((x.astype(np.float64) ** 2).sum())


@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_rows_equal_a_float64_reference(world: int, strategy: str, offload: bool) -> None:
    results = ranks_stats(world, strategy, offload)
    cols = columns()
    last = 1  # the step the statistics are of
    stats, (micro_kind, local_kind) = results[0][1], measured(world, strategy, offload)
    assert stats.names == tuple(n for n, _, _ in cols)
    for r, (shards, other) in enumerate(results):  # every rank holds every rank's rows
        assert np.array_equal(other.accumulated.sumsq, stats.accumulated.sumsq, equal_nan=True)
        for t, (name, layer, i) in enumerate(cols):
            shard = shards[f"nb.{name}" if layer < 0 else f"{layer}.{small_layout().block[i].name}"]
            acc = stats.accumulated
            assert acc.sumsq[r, t] == pytest.approx(sq(shard), rel=1e-6), (r, name)
            assert acc.nonfinite[r, t] == 0 and acc.maxabs[r, t] == np.abs(shard).max()
    # what the strategy says it measures (hierarchical here: one node, no launcher says otherwise)
    assert (stats.micro is not None) == micro_kind
    assert (stats.local is not None) == (world > 1 and local_kind is not None)
    micro_measured = micro_kind
    layout = small_layout()
    for t, (_, layer, i) in enumerate(cols):
        shape = layout.non_block[i].shape if layer < 0 else layout.block[i].shape
        if stats.micro is not None:
            for m in range(M):
                if layer < 0:  # the engine accumulates the non-block gradients: not measured
                    assert (stats.micro.nonfinite[:, m, t] == -1).all() and np.isnan(stats.micro.sumsq[:, m, t]).all()
                    continue
                mean = sum(bf16_grad(r, m, layer, i, shape, last).astype(np.float64) for r in range(world)) / world
                per = shape[0] // world
                for r in range(world):
                    want = sq(mean[r * per:(r + 1) * per])
                    assert stats.micro.sumsq[r, m, t] == pytest.approx(want, rel=1e-6 if world == 1 else 2e-2)
        if stats.local is not None:
            for r in range(world):
                if local_kind == "step":  # the step's accumulated local gradient, before the exchange
                    want = sq(sum(bf16_grad(r, m, layer, i, shape, last).astype(np.float64) for m in range(M)))
                    assert stats.local.sumsq[r, 0, t] == pytest.approx(want, rel=2e-2)
                elif layer < 0:
                    assert (stats.local.nonfinite[r, :, t] == -1).all()
                else:
                    for m in range(M):
                        g = bf16_grad(r, m, layer, i, shape, last)
                        assert stats.local.sumsq[r, m, t] == pytest.approx(sq(g), rel=1e-6)
                        assert stats.local.maxabs[r, m, t] == np.abs(g).max() and stats.local.nonfinite[r, m, t] == 0
    if micro_measured:  # three micro-steps against the step: an estimate exists
        assert stats.summary().noise is not None


def nan_at(rank: int, micro: int, layer: int, index: int) -> Any:
    def gfun(r: int, m: int, l: int, i: int, shape: tuple[int, ...], step: int = 0) -> np.ndarray:
        g = bf16_grad(r, m, l, i, shape, step)
        if (r, m, l, i, step) == (rank, micro, layer, index, 1):
            g.reshape(-1)[3] = np.nan
        return g
    return gfun


@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_first_non_finite_value_is_named(world: int, strategy: str, offload: bool) -> None:
    rank = world - 1
    results = ranks_stats(world, strategy, offload, gfun=nan_at(rank, 1, 2, 0))
    reports = [s.first_nonfinite() for _, s in results]
    micro_kind, local_kind = measured(world, strategy, offload)
    assert all(rep == reports[0] for rep in reports)  # the same report on every rank
    rep = reports[0]
    assert rep is not None and rep.parameter == "layers.2.w1" and rep.layer == 2 and rep.step == 1
    if world > 1 and local_kind is not None:  # each rank's own gradient names the rank
        assert (rep.source, rep.rank) == ("local", rank)
        assert rep.micro_step == (None if local_kind == "step" else 1)
    elif world > 1 and micro_kind:  # no local rows: the micro-step's mean names the micro-step
        assert (rep.source, rep.micro_step) == ("micro", 1)
    elif not micro_kind:  # nothing per micro-step: the accumulated gradient
        assert (rep.source, rep.micro_step) == ("step", None)
    else:
        assert (rep.source, rep.micro_step) == ("micro", 1)
    assert "layers.2.w1 non-finite" in str(rep) and "step 1 skipped" in str(rep)


def test_stats_refused_without_stats_true_before_a_step_and_during_one() -> None:
    def job(comm: Any) -> None:
        layout = small_layout()
        plain = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce")
        drive(comm, layout, "scatter_reduce", False, 2, gm=plain)
        with pytest.raises(ValueError, match="stats=True"):
            plain.stats()
        with pytest.raises(TypeError, match="stats must be a bool"):
            lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=1)
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True)
        with pytest.raises(ProtocolError):
            gm.stats()
        gm.start_micro_step(None, 0, 2)
        with pytest.raises(ProtocolError):
            gm.stats()
        gm.close()
        with pytest.raises(lg.ClosedError):
            gm.stats()
    lg.run_threads(1, job, backend="host")


def test_more_micro_steps_later_regrow_the_rows() -> None:
    """A step of more micro-steps than any before gets rows for them (between steps), with the
    same values a manager made for that many from the start would hold."""
    layout = small_layout()

    def job(comm: Any) -> tuple[StepStats, StepStats]:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True)
        drive(comm, layout, "scatter_reduce", False, 2, gm=gm, gfun=bf16_grad)
        drive(comm, layout, "scatter_reduce", False, 4, gm=gm, first_step=1, gfun=bf16_grad)
        grown = gm.step_stats()
        fresh = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True, step=1)
        drive(comm, layout, "scatter_reduce", False, 4, gm=fresh, first_step=1, gfun=bf16_grad)
        return grown, fresh.step_stats()
    grown, fresh = lg.run_threads(1, job, backend="host")[0]
    assert grown.micro is not None and fresh.micro is not None and grown.micro_steps == 4
    assert np.array_equal(grown.micro.sumsq, fresh.micro.sumsq, equal_nan=True)
    assert np.array_equal(grown.accumulated.sumsq, fresh.accumulated.sumsq)


def test_step_stats_checks_names_before_the_collective() -> None:
    """Wrong names are refused before the rows are measured again or gathered."""
    layout = small_layout()

    def job(comm: Any) -> None:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True)
        drive(comm, layout, "scatter_reduce", False, 2, gm=gm, gfun=bf16_grad)
        rows = gm.stats()
        before = rows.numpy().copy()
        names = tuple(gm.step_stats().names)
        lg.ops.fill_nan(rows)  # any new measurement would overwrite these
        for bad in (("only-one",), names[:-1] + (names[0],), names[:-1] + ("",), [*names, "extra"]):
            with pytest.raises(ValueError, match="distinct non-empty strings"):
                gm.step_stats(names=bad)
        for wrong, said in ((7, "names must be a list or tuple"), ("".join(names), "names must be a list or tuple"),
                            ({n: 0 for n in names}, "names must be a list or tuple"),
                            (iter(names), "names must be a list or tuple"), (b"x", "names must be a list or tuple"),
                            ((*names[:-1], 3), rf"names\[{len(names) - 1}\] must be a str"),
                            ([None] * len(names), r"names\[0\] must be a str")):
            with pytest.raises(TypeError, match=said):  # a clear error naming the argument, not a raw one
                gm.step_stats(names=wrong)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=said):
                gm.read_stats(names=wrong)  # type: ignore[arg-type]
        assert np.isnan(rows.numpy()).all()  # nothing measured, nothing gathered
        renamed = tuple(f"p{i}" for i in range(len(names)))
        got = gm.step_stats(names=renamed)
        assert got.names == renamed and np.array_equal(got.accumulated.sumsq[0], before[0, -1, :, 0])
        gm.close()
    lg.run_threads(2, job, backend="host")


def test_graphs_keep_the_micro_step_count_and_refuse_rows_that_grew(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture leaves the statistics' micro-step count as it was, a replay sets its own, and a
    graph captured before the rows grew (a step of more micro-steps) is refused at replay."""
    from test_replay import FakeGraph
    holder: list[Any] = [None]
    monkeypatch.setattr(lg.HostDevice, "capture_of", lambda device, stream: holder[0])
    layout = small_layout()

    def job(comm: Any) -> None:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True)
        drive(comm, layout, "scatter_reduce", False, 3, gm=gm, gfun=bf16_grad)  # rows for 3 micro-steps
        g = holder[0] = FakeGraph()
        drive(comm, layout, "scatter_reduce", False, 2, gm=gm, first_step=1, gfun=bf16_grad)  # a template of 2
        holder[0] = None
        tpl = gm._graph_hooks.capture_ended(g, False)
        assert gm.step_stats().micro_steps == 3  # the capture changed nothing
        gm._graph_hooks.replay_done(gm._graph_hooks.replay_check(tpl), 0)
        assert gm.step_stats().micro_steps == 2  # the replayed step's
        drive(comm, layout, "scatter_reduce", False, 5, gm=gm, first_step=3, gfun=bf16_grad)  # the rows grow
        with pytest.raises(ProtocolError, match="rows grew"):
            gm._graph_hooks.replay_check(tpl)
        gm.close()
    lg.run_threads(1, job, backend="host")


def test_a_failed_growth_keeps_the_rows_it_had(monkeypatch: pytest.MonkeyPatch) -> None:
    """When binding the launches for larger rows fails (out of memory), the manager keeps its
    rows, the completed step's statistics stay readable, and it goes on measuring steps that fit
    them."""
    layout = small_layout()

    def job(comm: Any) -> None:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True)
        drive(comm, layout, "scatter_reduce", False, 2, gm=gm, gfun=bf16_grad)
        rows = gm.stats().numpy().copy()
        real = lg.ops.bind_stats_finish
        calls = [0]

        def failing(sink: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:  # the growth's finish (the first call binds the step pass's)
                raise MemoryError("out of memory for the statistics")
            return real(sink)
        monkeypatch.setattr(lg.ops, "bind_stats_finish", failing)
        with pytest.raises(MemoryError):
            gm.start_micro_step(None, 0, 4)
        monkeypatch.setattr(lg.ops, "bind_stats_finish", real)
        assert not gm.in_micro_step
        # the completed step is still readable, its rows as they were
        assert np.array_equal(gm.stats().numpy(), rows, equal_nan=True) and not np.isnan(rows[0, 1, :, 0]).all()
        drive(comm, layout, "scatter_reduce", False, 2, gm=gm, first_step=1, gfun=bf16_grad)
        stats = gm.step_stats()
        assert stats.micro is not None and stats.micro_steps == 2 and not np.isnan(stats.micro.sumsq[0, 1, -1])
        gm.close()
    lg.run_threads(1, job, backend="host")


def test_read_stats_refusals_queue_nothing_and_a_retry_works() -> None:
    """read_stats is refused before a step, during one, after close and without stats=True, and
    for bad names with the rows and the host buffer untouched; the corrected call works."""
    layout = small_layout()

    def job(comm: Any) -> None:
        plain = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce")
        drive(comm, layout, "scatter_reduce", False, 2, gm=plain)
        with pytest.raises(ValueError, match="stats=True"):
            plain.read_stats()
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True)
        with pytest.raises(ProtocolError, match="read_stats"):
            gm.read_stats()
        drive(comm, layout, "scatter_reduce", False, 2, gm=gm, gfun=bf16_grad)
        want = gm.step_stats()
        rows, host = gm.stats(), gm._statistics.host
        assert host is not None
        lg.ops.fill_nan(rows)  # any new measurement, gather or copy would overwrite these
        lg.ops.fill_nan(host.tensor)
        with pytest.raises(ValueError, match="distinct non-empty strings"):
            gm.read_stats(names=("only-one",))
        assert np.isnan(rows.numpy()).all() and np.isnan(host.tensor.numpy()).all()
        got = gm.read_stats().result()
        assert np.array_equal(got.accumulated.sumsq, want.accumulated.sumsq)
        gm.start_micro_step(None, 0, 2)
        with pytest.raises(ProtocolError, match="read_stats"):
            gm.read_stats()
        gm.close()
        with pytest.raises(lg.ClosedError):
            gm.read_stats()
    lg.run_threads(2, job, backend="host")


def same_stats(a: StepStats, b: StepStats) -> None:
    assert a.names == b.names and (a.step, a.micro_steps, a.world) == (b.step, b.micro_steps, b.world)
    for field in ("accumulated", "micro", "local"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            for part in ("sumsq", "nonfinite", "maxabs"):
                assert np.array_equal(getattr(x, part), getattr(y, part), equal_nan=True), (field, part)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("world", [1, 2])
def test_a_reading_equals_step_stats_and_outlives_the_next_step(world: int, strategy: str) -> None:
    """A reading's result equals step_stats (a StepStats whose checks it passes), is the same
    object when asked again, and keeps its values after the next step and its reading; a
    reading left unresolved at the next read_stats is stale (ProtocolError), one left at close
    ClosedError."""
    layout = small_layout()

    def job(comm: Any) -> None:
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, stats=True)
        drive(comm, layout, strategy, False, M, gm=gm, gfun=bf16_grad)
        reading = gm.read_stats()
        assert reading.ready()  # the host backend's streams are synchronous
        stats = reading.result()
        assert reading.result() is stats and reading.ready()
        same_stats(stats, gm.step_stats())
        same_stats(stats, StepStats(**{f: getattr(stats, f) for f in stats.__dataclass_fields__}))
        kept = {f: getattr(stats, f).sumsq.copy() for f in ("accumulated", "micro", "local")
                if getattr(stats, f) is not None}
        drive(comm, layout, strategy, False, M, gm=gm, first_step=1, gfun=nan_at(comm.rank, 0, 1, 0))
        stale = gm.read_stats()
        fresh = gm.read_stats()
        for call in (stale.ready, stale.result):
            with pytest.raises(ProtocolError, match="reused"):
                call()
        assert fresh.result().step == 1 and fresh.result().first_nonfinite() is not None
        assert reading.result() is stats and stats.first_nonfinite() is None
        for f, v in kept.items():
            assert np.array_equal(getattr(stats, f).sumsq, v, equal_nan=True), f
        last = gm.read_stats()
        gm.close()
        with pytest.raises(lg.ClosedError, match="closed before"):
            last.result()
        assert fresh.result().step == 1
    lg.run_threads(world, job, backend="host")


def test_a_reading_survives_the_rows_growing() -> None:
    """A step of more micro-steps gives the manager new rows and a new host buffer; a reading of
    the step before, resolved only then, holds that step's values."""
    layout = small_layout()

    def job(comm: Any) -> None:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True)
        drive(comm, layout, "scatter_reduce", False, 2, gm=gm, gfun=bf16_grad)
        want = gm.step_stats()
        reading = gm.read_stats()
        drive(comm, layout, "scatter_reduce", False, 4, gm=gm, first_step=1, gfun=bf16_grad)
        assert gm.read_stats().result().micro_steps == 4
        same_stats(reading.result(), want)
        gm.close()
    lg.run_threads(1, job, backend="host")


@pytest.mark.parametrize("world", [1, 2])
def test_a_shorter_step_reads_none_of_a_longer_steps_rows(world: int) -> None:
    """Each launch keeps a slot set per micro-step until stats() finishes the step: after a step
    of 4 micro-steps, a step of 2 reports the rows of its own 2 (as a manager that only ever had
    2-micro-step steps does) and leaves the rows of micro-steps 2 and 3 unmeasured (NaN), in the
    device tensor too; stats() called twice gives the same rows."""
    layout = small_layout()

    def job(comm: Any) -> tuple[np.ndarray, np.ndarray, StepStats, StepStats]:
        gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True)
        drive(comm, layout, "scatter_reduce", False, 4, gm=gm, gfun=bf16_grad)
        gm.stats()
        drive(comm, layout, "scatter_reduce", False, 2, gm=gm, first_step=1, gfun=bf16_grad)
        rows = gm.stats().numpy().copy()
        again = gm.stats().numpy().copy()
        shorter = gm.step_stats()
        fresh = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", stats=True, step=1)
        drive(comm, layout, "scatter_reduce", False, 2, gm=fresh, first_step=1, gfun=bf16_grad)
        return rows, again, shorter, fresh.step_stats()
    for rows, again, shorter, fresh in lg.run_threads(world, job, backend="host"):
        assert np.array_equal(rows, again, equal_nan=True)
        C = 4  # the capacity the first step left: micro-step rows [0, C), local rows [C, 2C)
        assert np.isnan(rows[:, 2:C]).all()
        assert np.isnan(rows[:, C + 2:2 * C]).all() and (world > 1 or np.isnan(rows[:, C:2 * C]).all())
        assert shorter.micro is not None and fresh.micro is not None and shorter.micro_steps == 2
        assert np.array_equal(shorter.micro.sumsq, fresh.micro.sumsq, equal_nan=True)
        assert np.array_equal(shorter.accumulated.sumsq, fresh.accumulated.sumsq)
        if world > 1:
            assert shorter.local is not None and fresh.local is not None
            assert np.array_equal(shorter.local.sumsq, fresh.local.sumsq, equal_nan=True)
            first_block = len(layout.non_block)  # layer 0's first block tensor: measured locally
            assert not np.isnan(rows[:, C:C + 2, first_block]).any()
