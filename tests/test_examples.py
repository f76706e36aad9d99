"""examples/train_lm.py on the host backend: the loss falls at world 1 and 2, bf16 with SR ends
where fp32 does, backward matches finite differences, the CLI writes its JSON, and the PyTorch
backend (CPU, where PyTorch is installed) computes what numpy does."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

import lowgrad as lg

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLES / "train_lm.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


tl = _load()
BASE = tl.Config(steps=60, quiet=True)


def _end(run: dict[str, Any]) -> float:
    """Mean training loss of the last 10 steps (single steps are noisy)."""
    return float(np.mean(run["loss"][-10:]))


@pytest.mark.parametrize("world,accum,strategy,offload", [
    (1, "sr_bf16", "scatter_reduce", False),
    (2, "sr_bf16", "all_to_all", True),
    (2, "rn_bf16", "unsharded", False),
])
def test_loss_falls(world: int, accum: str, strategy: str, offload: bool) -> None:
    run = tl.train(replace(BASE, world=world, accum=accum, strategy=strategy, offload=offload))
    assert len(run["loss"]) == BASE.steps
    assert _end(run) < 0.8 * run["loss"][0], run["loss"]
    assert run["val_end"] < 0.8 * run["val_start"]


def test_fp32_and_sr_bf16_end_close() -> None:
    sr = tl.train(replace(BASE, accum="sr_bf16"))
    fp32 = tl.train(replace(BASE, accum="fp32"))
    assert sr["loss"][0] == pytest.approx(fp32["loss"][0], abs=1e-6)  # same weights and data
    assert abs(_end(sr) - _end(fp32)) < 0.05
    assert abs(sr["val_end"] - fp32["val_end"]) < 0.05


def test_backward_matches_finite_differences() -> None:
    """The hand-written backward (float64) against central differences of the loss."""
    be = tl.NumpyBackend(None)
    rng = np.random.default_rng(0)
    V, E, K, H, L, B = 16, 4, 3, 8, 2, 5
    m = SimpleNamespace(nb={"embed": rng.standard_normal((V, E)), "w_in": rng.standard_normal((H, K * E)) / 3,
                            "head": rng.standard_normal((V, H)) / 3},
                        bl=[{"w": rng.standard_normal((H, H)) / 3, "b": rng.standard_normal(H) / 3} for _ in range(L)])
    ctx, y = rng.integers(0, V, (B, K)), rng.integers(0, V, B)
    got: dict[tuple[int, str], np.ndarray] = {}
    hand = SimpleNamespace(non_block=lambda n, g: got.__setitem__((-1, n), g),
                           block=lambda l, gs: got.update({(l, n): g for n, g in gs.items()}))
    tl.train_micro_step(be, m, hand, ctx, y, 1.0)
    assert sorted(got) == sorted([(-1, n) for n in m.nb] + [(l, n) for l in range(L) for n in ("w", "b")])

    def loss() -> float:
        return float(tl.cross_entropy(be, tl.forward(be, m, ctx)[0], y)[0])

    for (layer, name), g in got.items():
        p = m.nb[name] if layer < 0 else m.bl[layer][name]
        assert g.shape == p.shape
        for i in rng.choice(p.size, 6, replace=False):
            idx = np.unravel_index(i, p.shape)
            keep = p[idx]
            p[idx] = keep + 1e-6
            up = loss()
            p[idx] = keep - 1e-6
            down = loss()
            p[idx] = keep
            assert g[idx] == pytest.approx((up - down) / 2e-6, rel=1e-4, abs=1e-8), (layer, name, idx)


def test_bf16_bit_helpers_match_ml_dtypes() -> None:
    """The CuPy backend's bf16 conversions (run here with numpy as the array module)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(10_000) * np.exp2(rng.integers(-20, 20, 10_000))).astype(np.float32)
    x[:3] = [0.0, -0.0, 1.0 + 2.0 ** -8]  # a tie: rounds to even
    bits = tl.f32_to_bf16_bits_rn(np, x)
    assert np.array_equal(bits, x.astype(lg.bf16.np).view(np.uint16))
    assert np.array_equal(tl.bf16_bits_to_f32(np, bits), bits.view(lg.bf16.np).astype(np.float32))


def test_bad_combinations_are_rejected() -> None:
    with pytest.raises(ValueError, match="unsharded"):
        tl.Config(accum="rn_bf16", strategy="scatter_reduce").resolved()
    with pytest.raises(ValueError, match="offload"):
        tl.Config(strategy="unsharded", offload=True).resolved()
    with pytest.raises(ValueError, match="cannot run"):
        tl.Config(backend="numpy", device="cuda").resolved()
    assert tl.Config(accum="rn_bf16").resolved().strategy == "unsharded"


def test_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_lm.py"), "--steps", "3", "--world", "2",
                           "--accum", "fp32", "--log-every", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "step    2" in proc.stdout
    run = json.loads(out.read_text())
    assert run["config"]["world"] == 2 and run["config"]["strategy"] == "scatter_reduce"
    assert len(run["loss"]) == 3


def test_torch_backend_on_host_matches_numpy() -> None:
    pytest.importorskip("torch")
    cfg = replace(BASE, steps=12, world=2, strategy="all_to_all")
    ref = tl.train(cfg)
    got = tl.train(replace(cfg, backend="torch", device="host"))
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-3)
