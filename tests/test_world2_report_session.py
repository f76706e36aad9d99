"""``tools/gpu_session.sh --world 2 --dry-run`` on the CPU: every piece of the two-GPU call runs at a
tiny size (the same scripts and arguments; torchrun with gloo for DDP and FSDP2, lowgrad's ranks as
threads at world 2, nccl_bench as far as its argument parsing), so that the device call cannot
fail on a typo; and the script's own arguments (``--help`` is help, not an output folder)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_session.sh"
RUNS = ("lowgrad_scatter_reduce", "lowgrad_all_to_all", "lowgrad_unsharded", "ddp", "fsdp2")


def _run(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_help_is_help_not_an_output_folder(tmp_path: Path) -> None:
    for flag in ("--help", "-h"):
        proc = _run(flag, cwd=tmp_path)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert "--world 2" in proc.stdout and "--dry-run" in proc.stdout
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("args, says", [(["--world", "3"], "--world must be 1 or 2"),
                                        (["--world"], "--world needs"),
                                        (["--bogus"], "unrecognized arguments: --bogus"),
                                        (["--dry-run"], "--dry-run goes with --world 2"),
                                        (["a", "b"], "one output folder only")])
def test_bad_arguments_are_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and says in proc.stderr, proc.stderr


@pytest.mark.timeout(900)
def test_the_world2_dry_run_runs_every_piece(tmp_path: Path) -> None:
    for module in ("torch", "transformers"):  # torchrun and the tiny model of examples/train_transformer.py
        pytest.importorskip(module, reason=f"the dry run trains through torchrun: needs {module} "
                                           "(pip install '.[torch]' transformers)")
    out = tmp_path / "w2"
    proc = _run("--world", "2", "--dry-run", str(out), cwd=tmp_path, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = out / "run"
    for name in ("nccl_blocking", "nccl_nonblocking", "nccl_w1_blocking", "nccl_w1_nonblocking"):
        # no GPU: its arguments were taken, then the one line
        log = (run / f"{name}.log").read_text()
        assert "needs an NVIDIA GPU" in log and log.rstrip().endswith("rc=2"), log
    for name in RUNS:
        for world in (1, 2):
            log = (run / f"step_{name}_w{world}.log").read_text()
            assert log.rstrip().endswith("rc=0"), log[-3000:]
            got = json.loads((run / f"step_{name}_w{world}.json").read_text())
            assert got["world"] == world and len(got["loss"]) == 2, got
    tests = (run / "tests_world2.log").read_text()
    assert "skipped" in tests and tests.rstrip().endswith("rc=0"), tests[-3000:]
    report = json.loads((run / "world2_report.json").read_text())
    assert set(report["steps"]) == set(RUNS) and all(set(v) == {"w1", "w2"} for v in report["steps"].values())
    assert "host_ms" in report["timeline"]["ddp"] and "host_ms" in report["timeline"]["lowgrad_scatter_reduce"]
    assert (out / "results.tar").is_file()
    # the world-1 baselines (the 1.05x criterion's) run first, one at a time, before any world-2 step
    ran = [line.split(":")[0][3:] for line in proc.stdout.splitlines() if line.startswith("== step_")]
    assert ran == [f"step_{n}_w{w}" for w in (1, 2) for n in RUNS], ran


def test_the_pieces_limits_fit_the_device_calls_budget() -> None:
    """Each piece's limit is its worst case: together they fit GPU_SESSION_BUDGET (570 s) less the
    checks and the report (15 s), so no piece is skipped for time on the GPU."""
    text = (REPO / "tools" / "gpu_session_world2.sh").read_text()
    gpu = next(line for line in text.splitlines() if line.strip().startswith("L_W1="))  # the GPU branch's, first
    lim = {k: int(v) for k, v in (kv.split("=") for kv in gpu.split())}
    total = 5 * lim["L_W1"] + 5 * lim["L_W2"] + lim["L_NB2"] + lim["L_NNB2"] + 2 * lim["L_NB1"] + lim["L_TEST"]
    assert total <= 570 - 15, total
    assert "BUDGET=${GPU_SESSION_BUDGET:-570}" in text


def _bench_json(path: Path, mode: str, world: int, ms: float, host_us: float, torch_ms: float | None) -> None:
    """What nccl_bench writes (its own merge), from made-up timings."""
    sys.path.insert(0, str(REPO / "tools"))
    import nccl_bench

    ours = [{"op": "reduce_scatter", "dtype": "bf16", "bytes": b, "ms": ms * b / 2**20, "host_us": host_us}
            for b in (2**20, 2**22)]
    theirs = None if torch_ms is None else [{**r, "ms": torch_ms * r["bytes"] / 2**20, "host_us": 30.0}
                                            for r in ours]
    rows = nccl_bench.merge(ours, theirs, world)
    path.write_text(json.dumps({"world": world, "mode": mode, "rows": rows}))


def test_the_report_reads_nccl_bench_and_names_what_is_missing(tmp_path: Path) -> None:
    _bench_json(tmp_path / "nccl_blocking.json", "blocking", 2, 0.1, 10.0, 0.095)
    _bench_json(tmp_path / "nccl_nonblocking.json", "nonblocking", 2, 0.2, 40.0, None)
    _bench_json(tmp_path / "nccl_w1_blocking.json", "blocking", 1, 0.01, 11.0, None)
    _bench_json(tmp_path / "nccl_w1_nonblocking.json", "nonblocking", 1, 0.01, 10.0, None)
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "world2_report.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "world2_report.json").read_text())
    assert [round(r["ratio_blocking"], 3) for r in got["nccl"]] == [0.95, 0.95]
    assert [round(r["ratio_nonblocking"], 3) for r in got["nccl"]] == [0.475, 0.475]
    assert [round(r["ratio"], 3) for r in got["world1_host"]] == [1.1, 1.1]
    assert got["steps"] == {name: {} for name in RUNS}  # no step ran: empty, not guessed
    assert "timeline: no world-2 step" in proc.stdout
