"""tools/predict_scaling.py (CPU, reads the newest committed bench JSON): it runs and writes JSON and
Markdown, its predictions pass sanity checks that can fail, and each cited constant moves the
prediction the way it should."""
from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lowgrad.managers import STRATEGIES

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "predict_scaling.py"


def _load_tool() -> Any:
    spec = importlib.util.spec_from_file_location("predict_scaling", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


ps = _load_tool()
SMALL, BIG = ps.MODELS
SHARDED = ("scatter_reduce", "all_to_all")


@pytest.fixture(scope="module")
def measured() -> Any:
    a = ps.parse_args([])
    return ps.load_measured(a.bench_kernels, a.bench_manager, a.bench_layer)


@pytest.fixture(scope="module")
def result(measured: Any) -> dict[str, Any]:
    return ps.run(list(ps.MODELS), list(ps.WORLDS), measured, ps.Config())


def row(result: dict[str, Any], model: str, lab: str, world: int) -> dict[str, Any]:
    return ps._row(result["rows"], model, lab, world)


def test_the_tool_runs_and_writes_json_and_markdown(tmp_path: Path) -> None:
    out, md = tmp_path / "p.json", tmp_path / "p.md"
    proc = subprocess.run([sys.executable, str(TOOL), "--json", str(out), "--markdown", str(md)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "assumptions that the first multi-GPU run can confirm or refute" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data["rows"]) == len(ps.MODELS) * len(ps.WORLDS) * len(ps.RUNS)
    assert {r["world"] for r in data["rows"]} == set(ps.WORLDS)
    assert len(data["assumptions"]) >= 10 and all(any(ch.isdigit() for ch in a) for a in data["assumptions"])
    text = md.read_text()
    assert "| Qwen2.5-7B | all_to_all+offload | 8 |" in text and "confirm or refute" in text


def test_measured_inputs_come_from_the_newest_bench_json(measured: Any) -> None:
    assert 4000 < measured.copy_gbps < 4500 and 50 < measured.h2d_gbps < 60
    assert 70 < measured.pinned_sr_gbps < 100
    assert 0 < measured.sr_fixed_us < 20 and set(measured.reduce_sr_ratio) == {4, 8}
    assert measured.host_ms.keys() == {ps.label(s, o) for s, o in ps.RUNS}
    # the SR model passes through the measured per-layer time
    t = measured.layer_sr_bytes / (measured.copy_gbps * 1e6 * measured.layer_sr_ratio)
    assert ps.add_sr_ms(measured.layer_sr_bytes, measured) == pytest.approx(t)


def test_world_one_predicts_no_exchange(result: dict[str, Any]) -> None:
    for r in result["rows"]:
        if r["world"] == 1:
            assert r["exchange_ms"] == 0 and r["exchange_wire_bytes"] == 0 and r["non_block_exchange_ms"] == 0, r
        else:
            assert r["exchange_ms"] > 0 and r["exchange_wire_bytes"] > 0, r


def test_shard_bytes_fall_and_wire_bytes_stay_below_the_layer(result: dict[str, Any]) -> None:
    """Per rank, scatter_reduce's shard (and its SR traffic) falls as 1/W; the bytes a rank sends in
    the ring reduce-scatter are (W-1)/W of the layer: they rise with W but never reach the layer."""
    for model in ps.MODELS:
        rs = [row(result, model, "scatter_reduce", w) for w in ps.WORLDS]
        assert all(a["shard_bytes"] > b["shard_bytes"] for a, b in itertools.pairwise(rs))
        assert all(a["sr_ms"] > b["sr_ms"] for a, b in itertools.pairwise(rs))
        assert all(r["exchange_wire_bytes"] < r["layer_bytes"] for r in rs)
        assert rs[-1]["exchange_wire_bytes"] == rs[-1]["layer_bytes"] * 7 // 8


def test_hidden_fraction_and_exposed_time_are_bounded(result: dict[str, Any]) -> None:
    for r in result["rows"]:
        assert 0.0 <= r["hidden"] <= 1.0 and 0.0 <= r["steady_hidden"] <= 1.0, r
        assert -1e-12 <= r["exposed_ms"] <= r["manager_ms"] + 1e-12, r
        assert 0.0 <= r["hbm_share"] < 1.0, r


def test_7b_is_slower_than_1_5b(result: dict[str, Any]) -> None:
    for w in ps.WORLDS:
        for s, o in ps.RUNS:
            a, b = row(result, SMALL, ps.label(s, o), w), row(result, BIG, ps.label(s, o), w)
            assert b["engine_ms"] > a["engine_ms"] and b["backward_ms"] > a["backward_ms"]
            assert b["manager_ms"] > a["manager_ms"] or a["manager_ms"] == b["manager_ms"] == 0  # unsharded, W 1


def test_offload_is_slower(result: dict[str, Any]) -> None:
    for model in ps.MODELS:
        for w in ps.WORLDS:
            for s in SHARDED:
                dev, off = row(result, model, s, w), row(result, model, s + "+offload", w)
                assert off["sr_ms"] > dev["sr_ms"] and off["manager_ms"] > dev["manager_ms"]
                assert off["exposed_ms"] >= dev["exposed_ms"]


def test_timeline_follows_the_two_buffers() -> None:
    assert ps.timeline_ms(28, 1.0, 0.0, 2) == pytest.approx(28.0)
    assert ps.timeline_ms(28, 1.0, 0.5, 2) == pytest.approx(28.5)  # hidden but the last layer's tail
    assert ps.timeline_ms(3, 1.0, 10.0, 2) == pytest.approx(31.0)  # comm-bound: first backward + 3 exchanges
    # two buffers hold the engine back when the exchange is slow; one buffer per layer does not
    assert ps.timeline_ms(4, 1.0, 3.0, 2) == ps.timeline_ms(4, 1.0, 3.0, None) == pytest.approx(13.0)


def _predict(measured: Any, cfg: Any, strategy: str, world: int = 8, model: str = SMALL,
             offload: bool = False) -> dict[str, Any]:
    return ps.predict(model, ps.lg.llama_layout(model), strategy, offload, world, measured, cfg)


def test_cited_constants_move_the_prediction(measured: Any) -> None:
    base = ps.Config()
    rs0, a2a0 = _predict(measured, base, "scatter_reduce"), _predict(measured, base, "all_to_all")
    faster = replace(base, rs_busbw_gbps=2 * base.rs_busbw_gbps)
    assert _predict(measured, faster, "scatter_reduce")["exchange_ms"] < rs0["exchange_ms"]
    assert _predict(measured, faster, "all_to_all")["exchange_ms"] == a2a0["exchange_ms"]
    p2p = replace(base, p2p_gbps=2 * base.p2p_gbps)
    assert _predict(measured, p2p, "all_to_all")["exchange_ms"] < a2a0["exchange_ms"]
    slow = replace(base, latency_us=base.latency_us + 10)
    assert _predict(measured, slow, "scatter_reduce")["exchange_ms"] == pytest.approx(rs0["exchange_ms"] + 0.010)
    assert _predict(measured, slow, "all_to_all")["exchange_ms"] == pytest.approx(a2a0["exchange_ms"] + 7 * 0.010)
    weak = replace(base, mfu=base.mfu / 2)  # a slower engine: longer backward, more of the manager hidden
    rs_weak = _predict(measured, weak, "scatter_reduce")
    # not less hidden (equal where the measured inputs leave the hidden share at its bound: equal up to rounding)
    assert rs_weak["backward_ms"] == pytest.approx(2 * rs0["backward_ms"])
    assert rs_weak["hidden"] >= rs0["hidden"] - 1e-12
    few = replace(base, tokens=256)  # too few tokens: the exchange no longer hides
    assert _predict(measured, few, "scatter_reduce")["exposed_ms"] > rs0["exposed_ms"]
    off0 = _predict(measured, base, "scatter_reduce", offload=True)
    off_dram = _predict(measured, replace(base, host_dram_gbps=base.host_dram_gbps / 4), "scatter_reduce", offload=True)
    assert off_dram["sr_ms"] > off0["sr_ms"]
    assert _predict(measured, replace(base, nccl_sms=0), "scatter_reduce")["engine_slowdown_ms"] == 0


def test_world_one_reproduces_the_manager_bench(result: dict[str, Any]) -> None:
    """The single-GPU calibration: the model of bench_manager's copy engine against its run-9 time."""
    for b in result["bench_manager"]:
        if b["world"] == 1:
            assert 0.85 <= b["predicted_ms"] / b["measured_ms"] <= 1.02, b


def test_worlds_that_do_not_divide_the_layout_are_refused(measured: Any) -> None:
    with pytest.raises(ValueError, match="not divisible"):
        _predict(measured, ps.Config(), "scatter_reduce", world=3)


def test_the_default_inputs_are_the_newest_runs_by_number(tmp_path: Path) -> None:
    """Run folders compare by their numbers (run10 after run9), nested runs included; a folder
    without the file gives the path it would have."""
    for folder in ("2026-12-03-h200-run9", "2026-12-03-h200-run10", "2026-12-02-h200-run11",
                   "2026-12-03-h200-run10-12/run12", "2026-12-03-h200-run10-12/run11"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "bench_kernels.json").write_text("{}")
    assert ps.newest("bench_kernels.json", str(tmp_path)) == str(tmp_path / "2026-12-03-h200-run10" /
                                                                  "bench_kernels.json")
    (tmp_path / "2026-12-03-h200-run10" / "bench_kernels.json").unlink()
    assert ps.newest("bench_kernels.json", str(tmp_path)).endswith("run10-12/run12/bench_kernels.json")
    assert ps.newest("bench_layer.json", str(tmp_path)) == str(tmp_path / "bench_layer.json")
    args = ps.parse_args(["--benchmarks", str(tmp_path)])
    assert args.bench_kernels.endswith("run12/bench_kernels.json") and args.bench_layer.endswith("bench_layer.json")


def mn(result: dict[str, Any], model: str, strategy: str, nodes: int) -> dict[str, Any]:
    return next(r for r in result["multi_node"] if (r["model"], r["strategy"], r["nodes"]) == (model, strategy, nodes))


def test_hierarchical_sends_fewer_bytes_between_nodes_by_the_micro_steps(result: dict[str, Any]) -> None:
    """Per step a rank's NIC carries M (W-1)/W / G of the blocks for scatter_reduce, (N-1)/N / G
    for hierarchical: fewer by M (W-1)/W N/(N-1), more than the M micro-steps, and so for the
    non-block gradients without the M; hierarchical's accumulator is 1/G, N times scatter_reduce's
    shard; it crosses the nodes at the last micro-step only."""
    M, G = ps.Config().micro_steps, ps.Config().gpus_per_node
    for model in ps.MODELS:
        for n in ps.NODES[1:]:
            sr, h = mn(result, model, "scatter_reduce", n), mn(result, model, "hierarchical", n)
            block = (sr["bytes"]["block"]["inter"], h["bytes"]["block"]["inter"])
            assert block[1] * M < block[0]
            assert block[0] / block[1] == pytest.approx(M * (1 - 1 / (n * G)) / (1 - 1 / n))
            nb = (sr["bytes"]["non_block"]["inter"], h["bytes"]["non_block"]["inter"])
            assert nb[0] / nb[1] == pytest.approx((1 - 1 / (n * G)) / (1 - 1 / n))
            assert h["accumulator_bytes"] == sr["accumulator_bytes"] * n
            assert h["middle_ms"] < h["last_ms"] and sr["middle_ms"] == sr["last_ms"]
            assert h["middle_ms"] == mn(result, model, "hierarchical", ps.NODES[0])["middle_ms"]  # within the node


def test_the_inter_node_link_moves_the_predictions_the_right_way(measured: Any) -> None:
    """A slower link between nodes slows scatter_reduce every micro-step and hierarchical at its
    last only: below the NVLink rate hierarchical's mean micro-step is the faster; one node is
    scatter_reduce's ring within the node either way."""
    lay = ps.lg.llama_layout(BIG)
    fast = {r["strategy"]: r for r in ps.multi_node(BIG, lay, 4, measured, ps.Config())}
    slow = {r["strategy"]: r for r in ps.multi_node(BIG, lay, 4, measured, ps.Config(inter_node_gbps=6.25))}
    assert slow["scatter_reduce"]["middle_ms"] > fast["scatter_reduce"]["middle_ms"]
    assert slow["hierarchical"]["middle_ms"] == fast["hierarchical"]["middle_ms"]
    assert slow["hierarchical"]["last_ms"] > fast["hierarchical"]["last_ms"]
    assert slow["hierarchical"]["mean_ms"] < slow["scatter_reduce"]["mean_ms"] / 3
    one = {r["strategy"]: r for r in ps.multi_node(BIG, lay, 1, measured, ps.Config(inter_node_gbps=1.0))}
    assert one["hierarchical"]["mean_ms"] == pytest.approx(one["scatter_reduce"]["mean_ms"])
    assert one["hierarchical"]["inter_node_bytes_per_step"] == one["scatter_reduce"]["inter_node_bytes_per_step"] == 0


def test_the_link_between_nodes_per_node_or_per_gpu(measured: Any) -> None:
    """25 GB/s per node is 25/G per GPU: the same predictions; at 25 GB/s per node (issue 40)
    hierarchical's last micro-step outlasts a 7B layer's backward, at 50 GB/s per GPU it does not."""
    lay = ps.lg.llama_layout(BIG)
    per_node = ps.multi_node(BIG, lay, 2, measured, ps.Config(inter_node_node_gbps=25.0))
    per_gpu = ps.multi_node(BIG, lay, 2, measured, ps.Config(inter_node_gbps=25.0 / 8))
    assert per_node == per_gpu
    h = next(r for r in per_node if r["strategy"] == "hierarchical")
    assert h["last_ms"] > h["backward_ms"] > h["middle_ms"]
    fast = next(r for r in ps.multi_node(BIG, lay, 2, measured, ps.Config()) if r["strategy"] == "hierarchical")
    assert fast["last_ms"] < fast["backward_ms"]
    args = ps.parse_args(["--inter-node-gbps-per-node", "25", "--rounding", "sr"])
    assert ps.config_of(args).node_gbps() == 25.0 and ps.config_of(args).rounding == "sr"


def test_bad_multi_node_options_are_refused() -> None:
    for args in (["--inter-node-gbps", "0"], ["--gpus-per-node", "0"], ["--nodes", "x"],
                 ["--inter-node-gbps-per-node", "0"], ["--inter-node-gbps", "5", "--inter-node-gbps-per-node", "25"],
                 ["--rounding", "fp32"]):
        with pytest.raises(SystemExit):
            ps.parse_args(args)


# ---- the byte model against the bytes the managers send (host backend, a counting communicator) ----
PARTS = {"block_grad": "block", "block_grad_shards": "block", "block_grad_node_shards": "block",
         "non_block_grad": "non_block", "non_block_exchange": "non_block", "grad_norm": "norm",
         "lowgrad_torch_gather": "params", "cross_node_int8": "block", "cross_node_scales": "block"}


class Counting:
    """A communicator that counts what this rank sends, by part (the tensor's allocation name) and
    by link (to a rank on its own node or another; global rank r is on node r // G), then does
    it: a ring collective sends ``(P-1)/P`` of the buffer (an all-reduce twice that) to the next
    rank of the communicator; the all-to-all each peer its slot; a send its tensor. Its splits
    count too (their members' global ranks gathered at the split)."""

    def __init__(self, inner: Any, members: list[int], G: int, log: dict[int, dict[str, list[float]]]) -> None:
        self._inner, self._members, self._G, self._log = inner, members, G, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _count(self, t: Any, peer: int, nbytes: float) -> None:
        me = self._members[self._inner.rank]
        part = self._log.setdefault(me, {}).setdefault(PARTS[t.name], [0.0, 0.0])
        part[int(self._members[peer] // self._G != me // self._G)] += nbytes

    def _ring(self, t: Any, nbytes: float, times: int = 1) -> None:
        P = self._inner.world
        if P > 1:
            self._count(t, (self._inner.rank + 1) % P, times * nbytes * (P - 1) / P)

    def reduce_scatter(self, t: Any, op: str = "avg", stream: Any = None) -> None:
        self._ring(t, t.nbytes)
        self._inner.reduce_scatter(t, op=op, stream=stream)

    def all_gather(self, t: Any, out: Any = None, stream: Any = None) -> None:
        self._ring(t, (t if out is None else out).nbytes)
        self._inner.all_gather(t, out, stream=stream)

    def all_reduce(self, t: Any, op: str = "sum", stream: Any = None) -> None:
        self._ring(t, t.nbytes, 2)
        self._inner.all_reduce(t, op=op, stream=stream)

    def all_to_all_many(self, tensors: Any, stream: Any = None) -> None:
        P, r = self._inner.world, self._inner.rank
        for t in tensors:
            for d in range(1, P):
                self._count(t, (r + d) % P, t.nbytes / P)
        self._inner.all_to_all_many(tensors, stream=stream)

    def send(self, t: Any, peer: int, stream: Any = None) -> None:
        self._count(t, peer, t.nbytes)
        self._inner.send(t, peer, stream=stream)

    def split(self, color: int, key: int | None = None) -> Counting:
        new = self._inner.split(color, key)
        members = [int(x) for x in new.host_allgather(str(self._members[self._inner.rank]).encode())]
        return Counting(new, members, self._G, self._log)


def counted(strategy: str, world: int, G: int, rounding: str, micro: int,
            **options: Any) -> dict[str, dict[str, float]]:
    """The mean over the ranks of the bytes each sent in one step of ``micro`` micro-steps and a
    global norm, by part and link."""
    from test_managers import drive
    lay = byte_layout()
    log: dict[int, dict[str, list[float]]] = {}
    opts = {"group_size": G, **options} if strategy == "hierarchical" else {}

    def fn(c: Any) -> None:
        comm = Counting(c, list(range(world)), G, log)
        with ps.lg.create_gradient_manager(lay, comm, strategy=strategy, seed=1, **opts,
                                           rounding=None if strategy == "unsharded" else rounding) as gm:
            drive(comm, lay, strategy, False, micro, gm=gm)
            gm.grad_norm_squared()
    ps.lg.run_threads(world, fn)
    parts = {p for per in log.values() for p in per}
    return {p: {"intra": sum(log[r].get(p, [0.0, 0.0])[0] for r in log) / world,
                "inter": sum(log[r].get(p, [0.0, 0.0])[1] for r in log) / world} for p in parts}


def byte_layout() -> Any:
    """Dims that divide by 16; two non-block tensors of different sizes."""
    block = [ps.lg.ParamSpec("w1", (32, 6)), ps.lg.ParamSpec("b1", (16,), zero_init=True),
             ps.lg.ParamSpec("w2", (48, 3))]
    return ps.lg.Layout(block=block, non_block=[ps.lg.ParamSpec("emb", (64, 4)), ps.lg.ParamSpec("norm", (16,))],
                        num_layers=3)


# every registered strategy (a strategy the model does not know fails here), with each rounding it takes
BYTE_CASES = [(name, r) for name, cls in STRATEGIES.items() for r in (("ldsr", "sr") if cls.rounds() else ("ldsr",))]


@pytest.mark.parametrize("world,G", [(8, 2), (8, 4), (16, 4)])
@pytest.mark.parametrize("strategy,rounding", BYTE_CASES)
def test_the_byte_model_is_what_the_managers_send(world: int, G: int, strategy: str, rounding: str) -> None:
    """Every collective of a step, counted on the host backend by part and by link, is what
    :func:`hops` says, byte for byte (mean over the ranks): the blocks' exchanges (hierarchical's
    within the node and across), the non-block gradients', the norm's all-reduce. A strategy that
    rounds nothing runs once (the model's rounding is then the default's, which it ignores)."""
    M = 3
    cfg = replace(ps.Config(), micro_steps=M, gpus_per_node=G, rounding=rounding)
    want = ps.step_bytes([h for h in ps.hops(byte_layout(), strategy, world, G, cfg) if h.part != "params"])
    got = counted(strategy, world, G, rounding, M)
    for part in set(want) | set(got):
        w, g = want.get(part, {"intra": 0.0, "inter": 0.0}), got.get(part, {"intra": 0.0, "inter": 0.0})
        assert g["intra"] == pytest.approx(w["intra"], rel=1e-12), (part, g, w)
        assert g["inter"] == pytest.approx(w["inter"], rel=1e-12), (part, g, w)


@pytest.mark.parametrize("world,G", [(8, 2), (8, 4), (16, 4)])
@pytest.mark.parametrize("rounding", ["ldsr", "sr"])
def test_the_int8_hop_sends_what_the_model_says(world: int, G: int, rounding: str) -> None:
    """``cross_node_bits=8``: the blocks' bytes across the nodes are the int8 slots and their
    scales (counted), a little over half of bf16's."""
    cfg = replace(ps.Config(), micro_steps=2, gpus_per_node=G, rounding=rounding, cross_node_bits=8)
    want = ps.step_bytes([h for h in ps.hops(byte_layout(), "hierarchical", world, G, cfg) if h.part != "params"])
    got = counted("hierarchical", world, G, rounding, 2, cross_node_bits=8)
    assert got["block"]["inter"] == pytest.approx(want["block"]["inter"], rel=1e-12)
    assert got["block"]["intra"] == pytest.approx(want["block"]["intra"], rel=1e-12)
    bf16 = ps.step_bytes(ps.hops(byte_layout(), "hierarchical", world, G, replace(cfg, cross_node_bits=16)))
    assert want["block"]["inter"] < bf16["block"]["inter"]  # tiny pieces: a scale for every few bytes
    big = ps.lg.Layout(block=[ps.lg.ParamSpec("w", (4096, 4096))], non_block=[], num_layers=1)
    ratio = [ps.step_bytes(ps.hops(big, "hierarchical", world, G, replace(cfg, cross_node_bits=b)))["block"]["inter"]
             for b in (8, 16)]
    assert ratio[0] / ratio[1] == pytest.approx((1 + 4 / ps.QBLOCK) / 2)  # 0.516 for a 7B layer


def test_the_issue_numbers_follow_from_the_byte_model() -> None:
    """Issue 40's counts: at W = 8, G = 4 a flat ring sends 0.219 of its bytes per rank across
    the nodes, hierarchical (N-1)/N/G = 0.125; scatter_reduce's blocks cross 14x hierarchical's at
    M = 8 (not M = 8x); all_to_all's (W-G)/W = 0.5 per micro-step."""
    lay, cfg = byte_layout(), replace(ps.Config(), micro_steps=8, gpus_per_node=4)
    S = ps.layer_bytes(lay) * lay.num_layers
    by = {st: ps.step_bytes(ps.hops(lay, st, 8, 4, cfg)) for st in ("scatter_reduce", "all_to_all", "hierarchical")}
    nb = 2 * lay.non_block_numel
    assert by["scatter_reduce"]["non_block"]["inter"] / nb == pytest.approx(7 / 8 / 4)
    assert by["hierarchical"]["non_block"]["inter"] / nb == pytest.approx(1 / 2 / 4)
    assert by["hierarchical"]["block"]["inter"] / S == pytest.approx(1 / 2 / 4)
    assert by["scatter_reduce"]["block"]["inter"] / by["hierarchical"]["block"]["inter"] == pytest.approx(14)
    assert by["all_to_all"]["block"]["inter"] / S == pytest.approx(8 * 0.5)


def test_the_parameter_gather_is_what_the_byte_model_says() -> None:
    """ShardOptimizer's all-gather of the updated parameters, counted: over every rank in a ring
    (scatter_reduce), across the nodes and then within them (hierarchical, W = 8 in 2 x 4 and 4 x 2)."""
    torch = pytest.importorskip("torch")
    from lowgrad.torch import ShardOptimizer, attach, module_layout

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(32, 16)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
            self.to(torch.bfloat16)

        def forward(self, x: Any) -> Any:
            h = self.embed(x)
            for blk in self.layers:
                h = torch.tanh(blk(h))
            return h.float().square().mean()

    for strategy, G in (("scatter_reduce", 4), ("hierarchical", 4), ("hierarchical", 2)):
        log: dict[int, dict[str, list[float]]] = {}

        def fn(c: Any, strategy: str = strategy, G: int = G, log: dict[int, dict[str, list[float]]] = log) -> None:
            net = Net()
            opts = {"group_size": G} if strategy == "hierarchical" else {}
            att = attach(net, Counting(c, list(range(8)), G, log), strategy=strategy, **opts)
            opt = ShardOptimizer(att, lr=1e-3)
            with att.micro_step(0, 1):
                net(torch.arange(8).reshape(2, 4) + c.rank).backward()
            opt.step()
            opt.close()
            att.close()
        ps.lg.run_threads(8, fn)
        got = [sum(log[r]["params"][i] for r in log) / 8 for i in (0, 1)]
        layout = module_layout(Net())[0]
        want = ps.step_bytes([h for h in ps.hops(layout, strategy, 8, G, replace(ps.Config(), gpus_per_node=G))
                              if h.part == "params"])["params"]
        assert got == pytest.approx([want["intra"], want["inter"]], rel=1e-12), (strategy, G)
