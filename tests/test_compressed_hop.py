"""tools/compressed_hop.py (the 8-bit cross-node hop, studied in numpy): its roundings are what they
say (SR unbiased on a grid, to nearest biased where it is), the quantisation keeps every block in
range, the bf16 hop adds no bias, and the tool runs end to end and refuses what it cannot run."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

TOOLS = Path(__file__).parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
_spec = importlib.util.spec_from_file_location("compressed_hop", TOOLS / "compressed_hop.py")
ch = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(ch)  # type: ignore[union-attr]


def test_rounding_on_a_grid() -> None:
    """0.3 between 0 and 1: SR gives 1 with probability 0.3 (unbiased), nearest gives 0."""
    rng = np.random.default_rng(0)
    x = np.full(1 << 16, 0.3)
    grid = np.array([-1.0, 0.0, 1.0])
    sr = ch.round_to(x, grid, rng)
    assert set(np.unique(sr)) == {0.0, 1.0}
    assert abs(sr.mean() - 0.3) < 4 * np.sqrt(0.21 / x.size)
    assert np.all(ch.round_to(x, grid, None) == 0.0)
    assert np.all(ch.round_to(np.array([1.0, -1.0, 0.0]), grid, rng) == [1.0, -1.0, 0.0])  # on the grid: itself


@pytest.mark.parametrize("scheme", [s for s in ch.SCHEMES if s != "bf16"])
def test_quantisation_keeps_each_block_in_range_and_near(scheme: str) -> None:
    rng = np.random.default_rng(1)
    piece = (rng.standard_normal(1024) * np.repeat([1e-6, 1e-3, 1.0, 30.0], 256)).astype(np.float32)
    got = ch.quantize(piece.astype(np.float64), scheme, 256, rng)
    assert np.all(np.isfinite(got))
    for b in range(4):
        blk, q = piece[b * 256:(b + 1) * 256], got[b * 256:(b + 1) * 256]
        amax = np.abs(blk).max()
        assert np.abs(q).max() <= amax * (1 + 2 ** -2)  # never beyond the block's range (+ one step at most)
        assert np.abs(q - blk).max() <= amax * (2 ** -2 if scheme.startswith("e5m2") else 2 ** -3)


def test_the_bf16_hop_is_unbiased_and_sr_keeps_the_8_bit_hops_so() -> None:
    """A constant 1/3 per element (every rank, every micro-step): to nearest the 8-bit hops err the
    same way on every element; SR stays within 4 SE."""
    grads = np.full((16, 4096), 1.0 / 3.0, np.float32) * np.linspace(0.5, 2.0, 4096, dtype=np.float32)
    stats = ch.measure(grads, 2, 2, 4, 256, 4)
    for scheme in ("bf16", "int8-sr", "e4m3-sr", "e5m2-sr"):
        assert abs(stats[scheme]["bias_se"]) <= 4, (scheme, stats[scheme])
    assert any(abs(stats[s]["bias_se"]) > 10 for s in ("int8-rn", "e4m3-rn", "e5m2-rn")), stats


def test_the_tool_runs_and_refuses_too_few_micro_batches(tmp_path: Path) -> None:
    g = tmp_path / "g.npy"
    np.save(g, np.random.default_rng(0).standard_normal((32, 2048)).astype(np.float32) * 1e-3)
    out = tmp_path / "c.json"
    assert ch.main(["--grads", str(g), "--seeds", "1", "--micro-steps", "4", "--json", str(out)]) == 0
    data = __import__("json").loads(out.read_text())
    assert set(data["stats"]) == set(ch.SCHEMES)
    assert data["modelled"]["last_ms_8bit"] < data["modelled"]["last_ms_bf16"]
    with pytest.raises(ch.CannotRun, match="need 64"):
        ch.main(["--grads", str(g), "--gpus-per-node", "4", "--micro-steps", "8"])
