"""examples/train_transformer.py on the CPU (tiny Qwen2 config, host backend): every mode trains,
and lowgrad starts from the same loss as PyTorch (same model, same data). Skipped without torch
and transformers."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location("train_transformer",
                                               Path(__file__).parents[1] / "examples" / "train_transformer.py")
tt = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(tt)  # type: ignore[union-attr]


@pytest.mark.timeout(300)
def test_every_mode_trains_from_the_same_start(tmp_path: Path) -> None:
    runs = {}
    for mode, extra in (("torch_bf16", []), ("lowgrad", ["--strategy", "all_to_all"]), ("torch_fp32", [])):
        out = tmp_path / f"{mode}.json"
        assert tt.main(["--mode", mode, *extra, "--size", "tiny", "--steps", "3", "--micro-steps", "2", "--batch", "2",
                        "--seq", "32", "--log-every", "0", "--json", str(out)]) == 0
        runs[mode] = json.loads(out.read_text())
    for r in runs.values():
        assert len(r["loss"]) == 3 and all(math.isfinite(x) for x in r["loss"])
        assert r["loss"][-1] < r["loss"][0]
    assert runs["lowgrad"]["loss"][0] == runs["torch_bf16"]["loss"][0]  # same bf16 model and data
    assert runs["lowgrad"]["strategy"] == "all_to_all" and runs["lowgrad"]["lowgrad"]  # its memory report
