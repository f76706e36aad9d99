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


@pytest.mark.timeout(300)
def test_stats_log_names_an_injected_nan_and_the_step_is_skipped(tmp_path: Path) -> None:
    """--stats logs every step; --inject-nan puts one NaN into one parameter's gradient at one
    micro-step: that step is skipped (nothing changes), its line and the run's report name the
    parameter and the micro-step, and the other steps have a noise scale."""
    from lowgrad.diagnostics import read_log
    log, out = tmp_path / "grad.jsonl", tmp_path / "run.json"
    name = "model.layers.1.mlp.down_proj.weight"
    assert tt.main(["--size", "tiny", "--steps", "5", "--micro-steps", "3", "--batch", "2", "--seq", "32",
                    "--log-every", "0", "--stats", str(log), "--inject-nan", f"2:1:{name}", "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    lines = read_log(log)
    assert [x["step"] for x in lines] == list(range(5)) and run["skipped_steps"] == [2]
    assert [x["skipped"] for x in lines] == [False, False, True, False, False]
    bad = lines[2]["nonfinite"]
    assert bad["parameter"] == name and bad["micro_step"] == 1 and name in run["nonfinite_reports"][0]
    assert all(x["nonfinite"] is None and x["global"]["noise"] is not None for x in lines if x["step"] != 2)
    with pytest.raises(SystemExit):
        tt.parse_args(["--mode", "torch_bf16", "--stats", str(log)])
    with pytest.raises(SystemExit):
        tt.parse_args(["--inject-nan", "2:x"])


@pytest.mark.timeout(300)
def test_world_2_prints_each_step_once_labelled(capsys: pytest.CaptureFixture[str]) -> None:
    """Ranks as threads: rank 0 prints the step lines, once each, saying whose loss it is (every
    rank printed its own, unlabelled)."""
    assert tt.main(["--size", "tiny", "--steps", "3", "--micro-steps", "1", "--batch", "2", "--seq", "32",
                    "--world", "2", "--strategy", "all_to_all", "--log-every", "1"]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["0", "1", "2"], steps
    assert all(line.endswith("(rank 0 of 2)") for line in steps), steps
