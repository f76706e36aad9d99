"""tools/accuracy.py: its modes are lowgrad's roundings (SR bit for bit with the reference), one
low-discrepancy rounding is unbiased and the LD sum beats fresh noise where increments are consistent, and it
reads a user's gradients or refuses them clearly."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from lowgrad.base.dtypes import bf16
from lowgrad.sr import reference
from lowgrad.sr.seeds import use_seed

_spec = importlib.util.spec_from_file_location("accuracy", Path(__file__).parents[1] / "tools" / "accuracy.py")
acc = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(acc)  # type: ignore[union-attr]


def test_sr_and_rn_are_lowgrads_roundings() -> None:
    incs = list(acc.synthetic(3.0, 5, 1000, seed=4))
    state = np.zeros(1000, ml_dtypes.bfloat16)
    for m, g in enumerate(incs):
        state = reference.add_sr(state, g, 1.0, use_seed(1, 0, m, 0, 0, 0), 0, bf16)
    assert np.array_equal(acc.accumulate(incs, "sr", seed=1), state.astype(np.float64))
    rn = np.zeros(1000, ml_dtypes.bfloat16)
    for g in incs:
        rn = (rn.astype(np.float32) + g).astype(ml_dtypes.bfloat16)
    assert np.array_equal(acc.accumulate(incs, "rn"), rn.astype(np.float64))
    f32 = np.zeros(1000, np.float32)
    for g in incs:
        f32 = f32 + g
    assert np.array_equal(acc.accumulate(incs, "fp32"), f32.astype(np.float64))


def test_each_low_discrepancy_rounding_is_unbiased_and_wins_on_consistent_increments() -> None:
    x = np.full(200_000, 1.0 + 2 ** -9, np.float32)  # a quarter of the way between two bf16 values
    for m in (0, 1, 7):
        incs = [np.zeros_like(x)] * m + [x]
        got = acc.accumulate(incs, "ldsr")
        assert abs(got.mean() - float(x[0])) < 2e-5, m  # E[round(x)] = x at every micro-step
    consistent = acc.errors(list(acc.synthetic(0.0, 1024, 2048, seed=2)))
    assert consistent["rn"]["rel_l2"] > 0.3  # RN stalls once increments fall below half an ulp
    assert consistent["sr"]["rel_l2"] < 0.1
    assert consistent["ldsr"]["rel_l2"] < consistent["sr"]["rel_l2"] / 3
    assert consistent["fp32"]["rel_l2"] < 1e-4
    # the bf16 Kahan pair (4 bytes, as fp32) sits between: far better than one bf16, worse than fp32
    assert consistent["fp32"]["rel_l2"] < consistent["kahan"]["rel_l2"] < consistent["ldsr"]["rel_l2"] / 10


def test_own_gradients_from_files(tmp_path: Path) -> None:
    grads = np.stack(list(acc.synthetic(1.0, 8, 64, seed=3)))
    npy, npz = tmp_path / "g.npy", tmp_path / "g.npz"
    np.save(npy, grads)
    np.savez(npz, **{f"m{i:02d}": g.astype(ml_dtypes.bfloat16) for i, g in enumerate(grads)})
    out = tmp_path / "a.json"
    assert acc.main(["--grads", str(npy), "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["micro"] == 8 and row["n"] == 64 and set(acc.MODES) <= row.keys()
    assert acc.main(["--grads", str(npy), "--micro", "2,8,99", "--json", str(out)]) == 0  # prefixes; 99 > M
    assert [r["micro"] for r in json.loads(out.read_text())["rows"]] == [2, 8]
    assert len(acc.load_grads(str(npz))) == 8
    np.save(tmp_path / "flat.npy", grads[0])
    with pytest.raises(ValueError, match="shape"):
        acc.load_grads(str(tmp_path / "flat.npy"))
    np.save(tmp_path / "ints.npy", np.ones((3, 4), np.int32))
    with pytest.raises(TypeError, match="floating point"):
        acc.load_grads(str(tmp_path / "ints.npy"))
    with pytest.raises(ValueError, match="finite"):
        acc.errors([np.full(4, np.inf, np.float32)])
    with pytest.raises(ValueError, match="mode"):
        acc.accumulate([np.ones(2, np.float32)], "stochastic")
