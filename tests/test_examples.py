"""examples/train_lm.py on the host backend: the loss falls at world 1 and 2 with every strategy,
bf16 with SR ends where fp32 does, backward matches finite differences, the hand-off rounds as
``--accum`` says, the ranks' gathered weights agree, and the CLI writes its JSON."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
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
    assert tl.verdict(run)[0]


def test_fp32_and_sr_bf16_end_close() -> None:
    sr = tl.train(replace(BASE, accum="sr_bf16"))
    fp32 = tl.train(replace(BASE, accum="fp32"))
    assert sr["loss"][0] == pytest.approx(fp32["loss"][0], abs=1e-6)  # same weights and data
    assert abs(_end(sr) - _end(fp32)) < 0.05
    assert abs(sr["val_end"] - fp32["val_end"]) < 0.05


def test_every_rank_ends_with_the_same_weights() -> None:
    """Each rank updates its own rows and gathers the others': the held-out loss (fixed
    positions, forward only) comes out the same on both ranks."""
    cfg = replace(BASE, steps=5, accum="fp32", strategy="all_to_all", world=2).resolved()
    corpus = tl.Corpus(Path(cfg.text).read_text(encoding="utf-8"))
    vals = lg.run_threads(2, lambda comm: tl.run_rank(comm, cfg, corpus)["val_end"], backend="host")
    assert vals[0] == vals[1]


def test_backward_matches_finite_differences() -> None:
    """The hand-written backward (float64) against central differences of the loss."""
    rng = np.random.default_rng(0)
    V, E, K, H, L, B = 16, 4, 3, 8, 2, 5
    w = {(-1, "embed"): rng.standard_normal((V, E)), (-1, "w_in"): rng.standard_normal((H, K * E)) / 3,
         (-1, "head"): rng.standard_normal((V, H)) / 3}
    for layer in range(L):
        w[layer, "w"], w[layer, "b"] = rng.standard_normal((H, H)) / 3, rng.standard_normal(H) / 3
    ctx, y = rng.integers(0, V, (B, K)), rng.integers(0, V, B)
    logits, hs, zs, x = tl.forward(w, L, ctx)
    order = list(tl.backward(w, ctx, hs, zs, x, tl.cross_entropy(logits, y)[1]))
    assert [layer for layer, _ in order] == [-1, *reversed(range(L)), -1, -1]
    got = {(layer, n): g for layer, named in order for n, g in named.items()}
    assert sorted(got) == sorted(w)

    def loss() -> float:
        return float(tl.cross_entropy(tl.forward(w, L, ctx)[0], y)[0])

    for key, g in got.items():
        p = w[key]
        assert g.shape == p.shape
        for i in rng.choice(p.size, 6, replace=False):
            idx = np.unravel_index(i, p.shape)
            keep = p[idx]
            p[idx] = keep + 1e-6
            up = loss()
            p[idx] = keep - 1e-6
            down = loss()
            p[idx] = keep
            assert g[idx] == pytest.approx((up - down) / 2e-6, rel=1e-4, abs=1e-8), (key, idx)


@pytest.mark.parametrize("accum", ["fp32", "rn_bf16", "sr_bf16"])
def test_handoff_writes_and_accumulates_as_accum_says(accum: str) -> None:
    dev = lg.HostDevice()
    hand = tl.Handoff(dev, dev.stream(), accum, seed=7)
    dtype = lg.fp32 if accum == "fp32" else lg.bf16
    t = dev.alloc((4096,), dtype)
    g = np.full(4096, 1.0 + 2.0 ** -10, np.float32)  # between two bf16 values, nearer the lower one
    hand.write((0, "w"), t, g, False, seed=1)
    hand.write((0, "w"), t, g, True, seed=2)
    got = t.numpy().astype(np.float64)
    if accum == "fp32":
        assert np.all(got == 2 * g.astype(np.float64))
    elif accum == "rn_bf16":
        assert np.all(got == 2.0)  # both roundings to nearest drop the 2^-10
    else:
        assert set(np.unique(got)) <= {2.0, 2.0 + 2.0 ** -6} and abs(got.mean() - 2 * (1 + 2.0 ** -10)) < 1e-3


def test_bad_combinations_are_rejected() -> None:
    with pytest.raises(ValueError, match="unsharded"):
        tl.Config(accum="rn_bf16", strategy="scatter_reduce").resolved()
    with pytest.raises(ValueError, match="offload"):
        tl.Config(strategy="unsharded", offload=True).resolved()
    assert tl.Config(accum="rn_bf16").resolved().strategy == "unsharded"


def test_offload_is_a_flag_that_also_takes_on_or_off() -> None:
    """``--offload`` alone is on (as before), ``--offload on|off`` as in ``lowgrad demo``."""
    base = ["--strategy", "all_to_all"]
    assert tl.parse_args(base)[0].offload is False
    assert tl.parse_args([*base, "--offload"])[0].offload is True
    assert tl.parse_args([*base, "--offload", "on"])[0].offload is True
    assert tl.parse_args([*base, "--offload", "off"])[0].offload is False
    with pytest.raises(SystemExit):
        tl.parse_args([*base, "--offload", "both"])  # demo's default: both kinds of run; one run here


def test_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_lm.py"), "--steps", "3", "--world", "2",
                           "--accum", "fp32", "--log-every", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "step    2" in proc.stdout and proc.stdout.splitlines()[-1].startswith("PASS: ")
    run = json.loads(out.read_text())
    assert run["config"]["world"] == 2 and run["config"]["strategy"] == "scatter_reduce"
    assert len(run["loss"]) == 3
