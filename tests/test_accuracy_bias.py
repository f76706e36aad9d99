"""tools/accuracy_bias.py: its statistics are the stated ones (checked by hand), they find the
biases that are there (round to nearest on a constant input, LD-SR across binades) and not the
ones that are not (SR), its candidate roundings round as lowgrad does, and the tool runs end to end
and refuses bad arguments."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from lowgrad.base.dtypes import bf16
from lowgrad.sr.philox import sr_noise
from lowgrad.sr.reference import round_sr

TOOLS = Path(__file__).parents[1] / "tools"
sys.path.insert(0, str(TOOLS))  # accuracy_bias imports its siblings
_spec = importlib.util.spec_from_file_location("accuracy_bias", TOOLS / "accuracy_bias.py")
ab = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(ab)  # type: ignore[union-attr]


def test_statistics_by_hand() -> None:
    ref = np.array([1.0, -1.0, 2.0, -2.0])
    err = np.array([1.0, -1.0, 1.0, 3.0])
    s = ab.bias_stats(ref + err, ref)
    assert s["n"] == 4
    assert s["rel_l2"] == pytest.approx(np.sqrt(12.0) / np.sqrt(10.0))
    assert s["bias"] == pytest.approx(1.0 / 1.5)  # mean error 1 over mean |ref| 1.5
    assert s["bias_se"] == pytest.approx(1.0 / (np.sqrt(8.0 / 3.0) / 2.0))  # sample std sqrt(8/3), n = 4
    signed = np.array([1.0, 1.0, 1.0, -3.0])  # sign(ref) * err: mean 0
    assert s["magnitude_bias"] == pytest.approx(0.0)
    assert s["magnitude_bias_se"] == pytest.approx(0.0)
    assert signed.mean() == 0.0
    same = ab.bias_stats(ref + 0.5, ref)  # every element the same error: a bias beyond any SE
    assert same["bias_se"] == np.inf and not ab.passes(same)
    assert ab.passes(ab.bias_stats(ref, ref))
    with pytest.raises(ValueError, match="finite"):
        ab.bias_stats(np.array([np.nan, 1.0]), np.array([1.0, 1.0]))


def test_sr_is_unbiased_rn_and_ldsr_are_not() -> None:
    """The 3-SE test on inputs of known behaviour: SR's sum is unbiased; RN on a constant input
    stalls (every element the same error); LD-SR on a constant that crosses binades has the bias
    docs/accuracy.md reports (about -80 SE at 2**16 elements)."""
    n, micro = 1 << 16, 16
    inc = ab.synthetic("const0.1234", micro, n)
    got = ab.measure(inc, micro, n, ["sr", "rn", "ldsr"])
    assert ab.passes(got["sr"]), got["sr"]
    assert abs(got["rn"]["bias_se"]) == np.inf and abs(got["rn"]["bias"]) > 1e-4 and not ab.passes(got["rn"])
    assert got["ldsr"]["bias_se"] < -20 and got["ldsr"]["rel_l2"] < got["sr"]["rel_l2"]
    noisy = ab.synthetic("base+noise", micro, n)  # both signs: the magnitude bias is the one to read
    got = ab.measure(noisy, micro, n, ["sr"])
    assert ab.passes(got["sr"]), got["sr"]


def test_ldsr_is_unbiased_within_one_binade() -> None:
    """docs/accuracy.md's account of LD-SR's bias: while the sum stays in one binade the noise's
    uniformity is enough (the accumulator sits on the binade's grid, so what is rounded at each
    micro-step does not depend on earlier roundings); 1 + 0.3 ulp per micro-step stays in [1, 2)."""
    n, micro = 1 << 16, 64
    c = np.full(n, np.float32(2.0 ** -7 * 0.3))

    def inc(m: int) -> np.ndarray:
        return np.full(n, np.float32(1.0)) + c if m == 0 else c

    got = ab.measure(inc, micro, n, ["ldsr", "sr"])
    assert ab.passes(got["ldsr"]), got["ldsr"]
    assert got["ldsr"]["rel_l2"] < got["sr"]["rel_l2"] / 3


def test_candidates_round_as_lowgrad() -> None:
    """The candidates' rounding is round_sr's (for finite values); with the LD noise everywhere a
    candidate would be ldsr, so check the building blocks: the rounding, and ldsr_cross equal to
    SR where every micro-step crosses a binade (M = 2, 0.3: 0.15 then 0.3)."""
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    r = sr_noise(77, 0, x.size).astype(np.uint32)
    assert np.array_equal(ab.round_bits(x, r), round_sr(x, 77, 0, bf16).astype(np.float32))
    inc = ab.synthetic("const0.3", 2, 4096)
    assert np.array_equal(ab.candidate(inc, 2, 4096, "ldsr_cross"), ab.accumulate((inc(m) for m in range(2)), "sr"))
    with pytest.raises(ValueError, match="scheme"):
        ab.candidate(inc, 2, 4096, "ldsr_magic")


def test_world_rows_use_the_real_manager() -> None:
    got = ab.measure_world(ab.aw.make_layout("small", 1), 2, 4, "const0.3", "all_to_all", ["sr", "rn"])
    assert ab.passes(got["sr"]) and not ab.passes(got["rn"])
    assert got["sr"]["n"] > 10_000


def test_tool_end_to_end(tmp_path: Path) -> None:
    grads = np.random.default_rng(1).standard_normal((8, 300)).astype(np.float32)
    np.save(tmp_path / "g.npy", grads)
    out = tmp_path / "b.json"
    assert ab.main(["--inputs", "const0.3,iid", "--micro", "2,4", "--budget", "2048", "--min-n", "256",
                    "--max-n", "1024", "--grads", str(tmp_path / "g.npy"), "--candidates", "--worlds", "2",
                    "--world-micro", "2", "--world-layers", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["input"], r["world"], r["micro"]) for r in rows] == [
        ("const0.3", 1, 2), ("const0.3", 1, 4), ("iid", 1, 2), ("iid", 1, 4), ("real", 1, 2), ("real", 1, 4),
        ("const0.3", 2, 2), ("base+noise", 2, 2)]
    assert rows[0]["n"] == 1024 and rows[1]["n"] == 512  # the budget over M, within [min-n, max-n]
    assert rows[4]["n"] == 900 and rows[5]["n"] == 300  # disjoint runs of M micro-steps side by side, within max-n
    assert set(rows[0]["modes"]) == set(ab.MODES) | set(ab.CANDIDATES)
    assert set(rows[-1]["modes"]) == {"rn", "sr", "ldsr"}
    for bad in (["--inputs", "gauss"], ["--min-n", "8", "--max-n", "4"], ["--modes", "sr,xx"], ["--micro", "1"]):
        with pytest.raises(SystemExit) as exc:
            ab.main(bad + ["--json", str(out)])
        assert exc.value.code == 2
    # refused before anything is measured (the JSON of the run above stays as it was)
    before = out.read_text()
    with pytest.raises(ab.CannotRun, match="--worlds: world 5"):
        ab.main(["--worlds", "5", "--json", str(out)])
    with pytest.raises(ab.CannotRun, match="--grads"):
        ab.main(["--grads", str(tmp_path / "missing.npy"), "--json", str(out)])
    np.save(tmp_path / "flat.npy", np.ones(4, np.float32))
    with pytest.raises(ab.CannotRun, match="shape"):
        ab.main(["--grads", str(tmp_path / "flat.npy"), "--json", str(out)])
    assert out.read_text() == before


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra: pip install '.[plot]')")
    fig = tmp_path / "b.png"
    assert ab.main(["--inputs", "const0.3", "--micro", "2,4", "--budget", "2048", "--min-n", "256", "--max-n", "1024",
                    "--worlds", "2", "--world-micro", "2", "--world-layers", "1", "--json", str(tmp_path / "b.json"),
                    "--plot", str(fig)]) == 0
    assert fig.stat().st_size > 1000
