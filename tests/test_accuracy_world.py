"""tools/accuracy_world.py: the ring-order emulation of NCCL's bf16 reduce-scatter, its agreement
with the real scatter_reduce manager when given the host's reduction, the reproducibility of
all_to_all shards on the host backend, SR noise that does not depend on the world size, and the
tool's main run on a tiny configuration."""
from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import lowgrad as lg

TOOL = Path(__file__).resolve().parents[1] / "tools" / "accuracy_world.py"
BF16 = lg.bf16.np


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("accuracy_world", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


aw = _load()
LAYOUT = aw.make_layout("small", 2)  # two layers: both full buffers of the sharded managers are used
NUMEL = LAYOUT.num_layers * LAYOUT.block_numel


def _random_bf16(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """bf16 values with random signs over a wide exponent range (so fp32 sums can round too)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))).astype(np.float32).astype(BF16)


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16)


# ---- the ring emulation -------------------------------------------------------------------------
def test_ring_at_world_1_is_the_input() -> None:
    x = _random_bf16((1, 4096), 0)
    np.testing.assert_array_equal(_bits(aw.ring_avg(x)), _bits(x[0]))
    np.testing.assert_array_equal(_bits(aw.exact_avg(x)), _bits(x[0]))


def test_ring_at_world_2_equals_one_rounding() -> None:
    """Two ranks: the ring adds two exactly halved values and rounds once, which is the host's
    float32 sum rounded once: rounding order cannot matter with two terms."""
    x = _random_bf16((2, 1 << 16), 1)
    np.testing.assert_array_equal(_bits(aw.ring_avg(x)), _bits(aw.exact_avg(x)))
    np.testing.assert_array_equal(_bits(aw.ring_avg(x, ring=[1, 0])), _bits(aw.exact_avg(x)))


def test_ring_at_world_4_rounds_each_partial_sum() -> None:
    """Rank 0 holds 1, the others 2**-8; after the 1/4 pre-scale a small term is exactly half an
    ulp of 1/4. The host sums in float32 (1 + 3 * 2**-8) and rounds once, the tie going to even:
    (1 + 2**-6) / 4. A ring that meets rank 0 first or second adds each small term to 1/4 alone,
    a tie that rounds back to 1/4 every time; a ring that meets two small terms first carries
    them and agrees with the host. Which shards lose depends on the ring order."""
    n = 4 * 8
    x = np.full((4, n), 2.0**-8, dtype=np.float32)
    x[0] = 1.0
    x = x.astype(BF16)
    exact = aw.exact_avg(x).astype(np.float32)
    np.testing.assert_array_equal(exact, np.full(n, (1 + 2.0**-6) / 4, dtype=np.float32))

    def lost(ring: list[int] | None) -> list[int]:
        out = aw.ring_avg(x, ring).astype(np.float32).reshape(4, 8)
        assert set(out.reshape(-1)) <= {0.25, exact[0]}
        return [d for d in range(4) if out[d, 0] == 0.25]

    assert lost(None) == [2, 3]  # shard 3 starts at rank 0, shard 2 at rank 3 then rank 0
    assert lost([0, 2, 1, 3]) == [1, 3]


def test_ring_at_world_3_is_scaled_by_bf16_of_one_third() -> None:
    """NCCL's avg pre-multiplies by bf16(1/3) = 0.333984375: about +0.2 % on every value, which
    the host's float32(1/3) does not do."""
    x = _random_bf16((3, 1 << 15), 2)
    mean = x.astype(np.float64).mean(axis=0)
    ok = np.abs(mean) > 0
    ring_ratio = np.median(aw.ring_avg(x).astype(np.float64)[ok] / mean[ok])
    host_ratio = np.median(aw.exact_avg(x).astype(np.float64)[ok] / mean[ok])
    assert abs(host_ratio - 1) < 1e-3
    assert abs(ring_ratio - 0.333984375 * 3) < 1e-3 and ring_ratio > 1.0015


def test_ring_rejects_a_bad_ring() -> None:
    with pytest.raises(ValueError):
        aw.ring_avg(_random_bf16((3, 6), 3), ring=[0, 1, 1])


# ---- the real managers on the host backend --------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_emulation_with_the_host_reduction_is_the_manager(world: int) -> None:
    grads = aw.make_gradients(NUMEL, world, 3, seed=4)
    manager = aw.run_manager(LAYOUT, "scatter_reduce", grads, seed=5)
    np.testing.assert_array_equal(_bits(aw.emulate_scatter_reduce(LAYOUT, grads, aw.exact_avg, seed=5)), _bits(manager))
    ring = aw.differ(aw.emulate_scatter_reduce(LAYOUT, grads, aw.ring_avg, seed=5), manager)
    assert ring == 0.0 if world == 2 else ring > 0.1  # two terms: one rounding either way


def test_all_to_all_is_reproducible_whatever_the_arrival_order() -> None:
    """Two runs with the same seed, one where rank 0 reaches each exchange late and one where
    rank 1 does, give the same shard bits; they differ from scatter_reduce's (two SR roundings
    per micro-step instead of one rounding to nearest and one SR)."""
    grads = aw.make_gradients(NUMEL, 2, 3, seed=6)

    def late(slow: int):
        def delay(rank: int, micro: int, layer: int) -> None:
            if rank == slow:
                time.sleep(0.002)
        return delay

    a = aw.run_manager(LAYOUT, "all_to_all", grads, seed=7, delay=late(0))
    b = aw.run_manager(LAYOUT, "all_to_all", grads, seed=7, delay=late(1))
    np.testing.assert_array_equal(_bits(a), _bits(b))
    assert aw.differ(a, aw.run_manager(LAYOUT, "all_to_all", grads, seed=8)) > 0.1  # the seed matters
    assert aw.differ(a, aw.run_manager(LAYOUT, "scatter_reduce", grads, seed=7)) > 0.1


def test_strategies_agree_at_world_1() -> None:
    grads = aw.make_gradients(NUMEL, 1, 3, seed=9)
    np.testing.assert_array_equal(_bits(aw.run_manager(LAYOUT, "all_to_all", grads)),
                                  _bits(aw.run_manager(LAYOUT, "scatter_reduce", grads)))


def test_sr_noise_does_not_depend_on_the_world() -> None:
    """Noise is drawn per full-tensor index and per-use seed, neither of which involves the world:
    when every rank writes the same gradients (so the host's average is exact), scatter_reduce's
    shards at worlds 1, 2, 3 and 4 are the same bits. all_to_all's are not: its shards hold a
    sum over ranks and it rounds twice per micro-step at world > 1."""
    one = aw.make_gradients(NUMEL, 1, 3, seed=10)
    sr = {w: aw.run_manager(LAYOUT, "scatter_reduce", np.repeat(one, w, axis=1)) for w in (1, 2, 3, 4)}
    for w in (2, 3, 4):
        np.testing.assert_array_equal(_bits(sr[w]), _bits(sr[1]))
    a2a = aw.run_manager(LAYOUT, "all_to_all", np.repeat(one, 2, axis=1))
    assert aw.differ(a2a, sr[1]) > 0.1


# ---- errors and the tool's main -------------------------------------------------------------------
def test_ulps_and_errors() -> None:
    np.testing.assert_array_equal(aw.bf16_ulp(np.array([1.0, -1.5, 2.0, 0.75])), [2.0**-7, 2.0**-7, 2.0**-6, 2.0**-8])
    ref = np.array([1.0, -2.0])
    e = aw.errors(np.array([1.0 + 2.0**-7, -2.0], dtype=np.float32).astype(BF16), ref, np.abs(ref))
    assert e["max_ulp"] == 1.0 and e["bias_ulp"] == 0.5 and e["magnitude_bias_ulp"] == 0.5
    assert math.isclose(e["rel_l2"], 2.0**-7 / math.sqrt(5))


def test_main_on_a_tiny_configuration(tmp_path: Path) -> None:
    out = tmp_path / "acc.json"
    assert aw.main(["--worlds", "1,2,4", "--micro-steps", "2,8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["emulation_matches_manager"] is True
    rows = {(r["strategy"], r["world"], r["micro_steps"]): r for r in data["results"]}
    assert len(rows) == 3 * 3 * 2
    for r in rows.values():
        assert all(math.isfinite(r[k]) for k in ("rel_l2", "max_ulp", "bias_ulp", "magnitude_bias_ulp"))
        assert 0 < r["rel_l2"] < 0.05 and r["max_ulp"] < 64 and abs(r["bias_ulp"]) < 0.2
    for m in (2, 8):
        for name in ("all_to_all", "scatter_reduce_ring"):
            assert rows[name, 1, m]["differ_from_host_scatter_reduce"] == 0.0
        assert rows["scatter_reduce_ring", 2, m]["differ_from_host_scatter_reduce"] == 0.0
        assert rows["scatter_reduce_ring", 4, m]["differ_from_host_scatter_reduce"] > 0.05
        assert rows["all_to_all", 2, m]["differ_from_host_scatter_reduce"] > 0.1
        # more SR roundings per micro-step: a larger error than scatter_reduce's at world > 1
        assert rows["all_to_all", 4, m]["rel_l2"] > rows["scatter_reduce", 4, m]["rel_l2"]
    # the error grows with the number of micro-steps (sqrt(M) SR roundings)
    assert rows["scatter_reduce", 2, 8]["rel_l2"] > rows["scatter_reduce", 2, 2]["rel_l2"]
