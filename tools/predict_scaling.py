"""Scaling model of the gradient managers on one 8-GPU NVLink node (H100/H200 SXM): per micro-step
time of each strategy at world 1, 2, 4 and 8 and the fraction of it hidden behind the engine's
backward, from what one H200 measured (the bench JSON files) and cited NVLink figures.

Per layer, on the manager's communication stream, while the engine runs the backward of the next
layer: the exchange (one grouped NCCL reduce-scatter of the layer's bf16 gradients for
scatter_reduce, and for unsharded on the last micro-step only; world - 1 grouped send/recv steps
of 1/world of the layer for all_to_all), then the SR accumulation of this rank's shard. NCCL
calls are latency + bytes / bandwidth (the messages are tens of MB, far from the >= 1 GB where
the cited bus bandwidth holds); the SR kernels are a fixed cost + bytes / (copy bandwidth x
efficiency), both from the bench JSON; offloaded shards move at the measured pinned SR rate. The
timeline follows docs/protocol.md: two block buffers (the engine runs at most one layer ahead of
the exchange) and the engine waits for all traffic at the end of every micro-step. Every
assumption is printed with the number it predicts, for the first multi-GPU run to check.

Across nodes (``--nodes``, ``--gpus-per-node``, and the link between nodes per GPU,
``--inter-node-gbps``, or per node, ``--inter-node-gbps-per-node``; ``--rounding``): every collective
of a step of each strategy (:func:`hops`: the blocks' exchanges, within the node and across, the
non-block gradients', the global norm's all-reduce and ShardOptimizer's parameter all-gather) with
the bytes a rank sends within its node and to other nodes (a ring in rank order crosses a node
boundary once per node; an all-to-all sends every peer its slot) and its time at the rate of the
link that limits it. tests/test_predict_scaling.py checks these byte formulas against the bytes
counted on the host backend through a wrapped communicator.

    PYTHONPATH=. python3 tools/predict_scaling.py --json $OUT/predict_scaling.json
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import CannotRun, Parser, check_world, int_list, load_layout, output_help, output_path
from _cli import run as run_tool

from bench_manager import RUNS as BENCH_RUNS

import lowgrad as lg
from lowgrad.sr.reference import QBLOCK

# the strategies this model has formulas for (each exchange's collectives and traffic are written
# out below, strategy by strategy), as the manager bench runs them, on the default streams
MODELLED = ("unsharded", "scatter_reduce", "all_to_all")
RUNS = tuple((st, off) for st, off, inline in BENCH_RUNS if inline is None and st in MODELLED)

BENCHMARKS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

# ---- cited figures (each one an option) ------------------------------------------------------
# nccl-tests reduce_scatter_perf, 8 x H100 SXM in one node, >= 1 GB: bus bandwidth ~350 GB/s
# (busBW = algBW * (W-1)/W; ring over NVSwitch, NVLS off). NVIDIA/nccl#1229 reports 360 GB/s for
# H100 reduce-scatter (rings bound by the node's NVLink); all-reduce with NVLS reaches 460-480.
RS_BUSBW_GBPS = 350.0
# One-way GPU-to-GPU bandwidth over NVLink 4: p2pBandwidthLatencyTest on H100 SXM measures 380 GB/s
# one way and 749 GB/s both ways, of 450 / 900 GB/s nominal (18 links x 50 GB/s; NVIDIA/nccl#1264).
P2P_GBPS = 380.0
# With NVLink SHARP (NVLS) nccl-tests all_reduce reaches 460-480 GB/s busBW on 8 x H100 SXM
# (docs.alayanew.com, "NCCL-tests in practice"); quoted only as the case where NCCL picks NVLS.
NVLS_BUSBW_GBPS = 480.0
NVLINK_BIDIR_GBPS = 900.0  # per GPU, both directions together (H100/H200 SXM datasheet); context only
# Latency of one NCCL group launch (kernel launch + cross-GPU handshake) for small messages: 10-30 us
# on H100 NVLink (flashinfer-ai/flashinfer#5023 times NCCL reduce-scatter of a few KB at 8-13 us
# on 4-8 GPUs; this H200's world-1 nccl_bench: 13 us per 1 MiB reduce-scatter call, no peer).
NCCL_LATENCY_US = 20.0
# Engine: H100/H200 SXM dense bf16 peak 989 TFLOP/s (datasheet, without sparsity) at 60% MFU.
PEAK_TFLOPS = 989.0
MFU = 0.6
TOKENS = 4096  # tokens per micro-step per GPU
MICRO_STEPS = 8  # micro-steps per optimizer step (the non-block exchange runs once per step)
# Host DRAM shared by the offloaded shards of all GPUs: DGX/HGX H100 with 2 x Xeon Platinum 8480C,
# 8 channels of DDR5-4800 each: 2 x 8 x 38.4 GB/s = 614.4 GB/s peak.
HOST_DRAM_GBPS = 614.4
NCCL_SMS = 16  # SMs an NCCL collective holds (one block per channel; NCCL picks 16-32 on H100)
NCCL_HOST_US = 10.0  # host time of one NCCL group launch (ncclGroupEnd), on top of the world-1 host path

# Between nodes: one 400 Gb/s NDR InfiniBand NIC (ConnectX-7) per GPU on DGX/HGX H100 and H200,
# 400 Gb/s = 50 GB/s each way. A ring across nodes crosses each node boundary with (W-1)/W of the
# data, spread over the node's G NICs: it runs at min(NVLink bus bandwidth, G x this).
INTER_NODE_GBPS = 50.0
GPUS_PER_NODE = 8
NODES = (2, 4, 8)

MODELS = ("Qwen2.5-1.5B", "Qwen2.5-7B")  # lowgrad presets: Hugging Face config.json values of Qwen/<name>
WORLDS = (1, 2, 4, 8)
LAYER_VARIANT = "multi, resident grid, device seeds"  # bench_layer row: what the managers launch
ADD_SR_CASE = re.compile(r"^add_sr bf16 2\^\d+$")
PINNED_CASE = "add_sr pinned dst 2^26"
REDUCE_CASE = re.compile(r"^reduce_sr bf16 (\d+) shards$")


@dataclass(frozen=True)
class Measured:
    """What the single-GPU run measured (bandwidths in GB/s, times in ms unless named _us)."""

    copy_gbps: float  # device-to-device copy, read + write counted
    h2d_gbps: float
    d2h_gbps: float
    pinned_sr_gbps: float  # add_sr into a pinned destination: PCIe bytes (read + write) per second
    sr_fixed_us: float  # fixed cost of one SR launch: intercept of the add_sr size fit
    sr_slope_gbps: float  # add_sr bytes per second beyond the fixed cost (slope of the same fit)
    layer_sr_ratio: float  # per-layer multi-tensor add_sr: ratio to copy bandwidth
    layer_sr_bytes: int  # the bytes that per-layer figure moved
    reduce_sr_ratio: dict[int, float]  # reduce_sr, n_shards -> ratio to copy bandwidth
    tiny_kernel_us: float  # GPU time of a tiny kernel, back to back
    sm_count: int
    host_ms: dict[str, float]  # strategy label -> host ms to issue a micro-step (world 1)
    micro_ms: dict[str, float]  # strategy label -> measured ms per micro-step (world 1)
    bench_config: str
    sources: dict[str, str]

    @property
    def layer_sr_eff(self) -> float:
        """Efficiency of the per-layer SR kernel beyond its fixed cost (so that the model gives the
        measured per-layer time at the measured size)."""
        t = self.layer_sr_bytes / (self.copy_gbps * 1e9 * self.layer_sr_ratio)
        return self.layer_sr_bytes / (self.copy_gbps * 1e9 * (t - self.sr_fixed_us * 1e-6))


@dataclass(frozen=True)
class Config:
    """Cited and chosen figures (options)."""

    rs_busbw_gbps: float = RS_BUSBW_GBPS
    p2p_gbps: float = P2P_GBPS
    latency_us: float = NCCL_LATENCY_US
    peak_tflops: float = PEAK_TFLOPS
    mfu: float = MFU
    tokens: int = TOKENS
    micro_steps: int = MICRO_STEPS
    host_dram_gbps: float = HOST_DRAM_GBPS
    nccl_sms: int = NCCL_SMS
    nccl_host_us: float = NCCL_HOST_US
    inter_node_gbps: float = INTER_NODE_GBPS  # per GPU (its NIC), each way
    gpus_per_node: int = GPUS_PER_NODE
    inter_node_node_gbps: float | None = None  # per node, each way: the node's GPUs share it (else G x per GPU)
    rounding: str = "ldsr"  # the managers' rounding: "sr" exchanges through all-to-alls where it is unbiased
    cross_node_bits: int = 16  # hierarchical's hop across the nodes: 16 (bf16) or 8 (int8 + a scale per QBLOCK)

    def node_gbps(self) -> float:
        """The bandwidth between a node and the others, each way, all its GPUs together."""
        return self.gpus_per_node * self.inter_node_gbps if self.inter_node_node_gbps is None \
            else self.inter_node_node_gbps


def label(strategy: str, offload: bool) -> str:
    """The strategy's name as bench_manager prints it: ``scatter_reduce+offload``."""
    return strategy + ("+offload" if offload else "")


# ---- reading the bench JSON -------------------------------------------------------------------
def newest(name: str, folder: str) -> str:
    """The newest file ``name`` under ``folder``: the last path in natural order, numbers compared
    as numbers, since run folders are named ``<date>-<machine>-run<N>[-<M>][/run<K>]``. Where there
    is none, the path it would have (reading it then says what is missing)."""
    def key(path: str) -> list[str | int]:
        return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", path))]

    found = glob.glob(os.path.join(glob.escape(folder), "**", name), recursive=True)
    return max(found, key=key) if found else os.path.join(folder, name)


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def load_measured(kernels: str, manager: str, layer: str) -> Measured:
    """Measured inputs from bench_kernels.json, bench_manager.json and bench_layer.json."""
    k, m, lay = _load(kernels), _load(manager), _load(layer)
    cases = k["cases"]
    pts = [(c["bytes"], c["median_ms"] * 1e-3) for name, c in cases.items() if ADD_SR_CASE.match(name)]
    t0, slope = fit_line(pts)  # seconds, seconds per byte
    row = next(r for r in lay["rows"] if r["variant"] == LAYER_VARIANT)
    reduce = {int(hit.group(1)): c["ratio"] for n, c in cases.items() if (hit := REDUCE_CASE.match(n))}
    ceil = m["ceilings"]
    res = m["results"]
    return Measured(
        copy_gbps=ceil["d2d"] / 1e9, h2d_gbps=ceil["h2d"] / 1e9, d2h_gbps=ceil["d2h"] / 1e9,
        pinned_sr_gbps=cases[PINNED_CASE]["GBps"], sr_fixed_us=t0 * 1e6, sr_slope_gbps=1 / slope / 1e9,
        layer_sr_ratio=row["ratio"], layer_sr_bytes=lay["layer_bytes"], reduce_sr_ratio=reduce,
        tiny_kernel_us=k["launch"]["gpu_kernel_us"], sm_count=k["device"]["sm_count"],
        host_ms={label(r["strategy"], r["offload"]): r["host_ms_per_micro"] for r in res},
        micro_ms={label(r["strategy"], r["offload"]): r["micro_ms"] for r in res},
        bench_config=m["config"], sources={"bench_kernels": kernels, "bench_manager": manager, "bench_layer": layer})


# ---- per-layer costs (ms) ---------------------------------------------------------------------
def layer_bytes(layout: lg.Layout) -> int:
    """Bytes of one layer's bf16 gradients."""
    return 2 * layout.block_numel


def exchange_wire_bytes(layout: lg.Layout, strategy: str, world: int) -> int:
    """Bytes one rank sends per layer and exchange: (W-1)/W of the layer for a ring reduce-scatter
    and for the all-to-all alike."""
    return 0 if world == 1 else layer_bytes(layout) * (world - 1) // world


def reduce_scatter_ms(nbytes: int, world: int, cfg: Config) -> float:
    """One grouped reduce-scatter of ``nbytes`` per rank: latency + nbytes (W-1)/W / bus bandwidth."""
    if world == 1:
        return 0.0
    return cfg.latency_us * 1e-3 + nbytes * (world - 1) / world / (cfg.rs_busbw_gbps * 1e6)


def all_to_all_ms(nbytes: int, world: int, cfg: Config) -> float:
    """W-1 grouped send/recv steps, each moving nbytes/W out and in at the one-way P2P rate."""
    if world == 1:
        return 0.0
    return (world - 1) * (cfg.latency_us * 1e-3 + nbytes / world / (cfg.p2p_gbps * 1e6))


def exchange_ms(layout: lg.Layout, strategy: str, world: int, cfg: Config) -> float:
    """One layer's exchange (when it runs: every micro-step, or the last one for unsharded)."""
    if strategy == "all_to_all":
        return all_to_all_ms(layer_bytes(layout), world, cfg)
    return reduce_scatter_ms(layer_bytes(layout), world, cfg)


def add_sr_ms(nbytes: float, m: Measured) -> float:
    """One multi-tensor add_sr launch moving ``nbytes``: fixed cost + bytes / (copy x efficiency)."""
    return m.sr_fixed_us * 1e-3 + nbytes / (m.copy_gbps * 1e6 * m.layer_sr_eff)


def reduce_sr_ratio(world: int, m: Measured) -> float:
    """reduce_sr efficiency at ``world`` shards: linear between the measured shard counts, clamped."""
    pts = sorted(m.reduce_sr_ratio.items())
    if world <= pts[0][0]:
        return pts[0][1]
    for (n0, r0), (n1, r1) in itertools.pairwise(pts):
        if world <= n1:
            return r0 + (r1 - r0) * (world - n0) / (n1 - n0)
    return pts[-1][1]


def reduce_sr_ms(layout: lg.Layout, world: int, m: Measured) -> float:
    """all_to_all phase 1: one reduce_sr launch per tensor, reading W-1 peer slices and reading and
    writing the shard ((W+1)/W of the tensor), each launch at least a tiny kernel's GPU time."""
    if world == 1:
        return 0.0
    eff = reduce_sr_ratio(world, m)
    return sum(m.tiny_kernel_us * 1e-3 + 2 * s.numel * (world + 1) / world / (m.copy_gbps * 1e6 * eff)
               for s in layout.block)


def pinned_sr_gbps(world: int, m: Measured, cfg: Config) -> float:
    """Per-GPU rate of SR into pinned shards: the measured rate, or a 1/W share of host DRAM."""
    return min(m.pinned_sr_gbps, cfg.host_dram_gbps / world)


def sr_ms(layout: lg.Layout, strategy: str, offload: bool, world: int, m: Measured, cfg: Config) -> float:
    """One layer's SR accumulation into this rank's shard (a middle micro-step)."""
    if strategy == "unsharded":
        return 0.0  # the engine accumulates into the full buffers itself
    shard = layer_bytes(layout) / world
    a2a = strategy == "all_to_all" and world > 1
    if offload:  # the shard's read and write cross PCIe, once more for the peers' reduction
        return (4 if a2a else 2) * shard / (pinned_sr_gbps(world, m, cfg) * 1e6)
    return add_sr_ms(3 * shard, m) + (reduce_sr_ms(layout, world, m) if a2a else 0.0)


def backward_ms(layout: lg.Layout, cfg: Config) -> float:
    """The engine's backward of one layer: 4 N T FLOPs (2/3 of 6 N T) at peak x MFU."""
    return 4 * layout.block_numel * cfg.tokens / (cfg.peak_tflops * 1e9 * cfg.mfu)


def engine_ms(layout: lg.Layout, cfg: Config) -> float:
    """Forward + backward of one micro-step: 6 N T FLOPs of the whole model at peak x MFU."""
    return 6 * layout.total_numel * cfg.tokens / (cfg.peak_tflops * 1e9 * cfg.mfu)


def manager_hbm_bytes(layout: lg.Layout, strategy: str, offload: bool, world: int) -> float:
    """Device-memory bytes the manager moves per layer (estimate): ring reduce-scatter 3 (W-1)/W of
    the layer (read the own chunk, peer writes into the FIFO, read it); all-to-all 2 (W-1)/W (read
    sent slots, write received ones); add_sr 3/W (offload: the own slice, 1/W); reduce_sr (W+1)/W
    (offload: the peers' slices, (W-1)/W)."""
    S, W = layer_bytes(layout), world
    if strategy == "unsharded":
        return 3 * S * (W - 1) / W
    if strategy == "scatter_reduce":
        return 3 * S * (W - 1) / W + (1 if offload else 3) * S / W
    out = (1 if offload else 3) * S / W
    if W > 1:
        out += 2 * S * (W - 1) / W + ((W - 1) if offload else (W + 1)) * S / W
    return out


def timeline_ms(layers: int, backward: float, comm: float, buffers: int | None) -> float:
    """End of the last layer's exchange and accumulation, from the start of the first layer's
    backward: layer i's backward waits for the previous one and for its buffer (freed when the
    exchange ``buffers`` layers earlier ends; None: a buffer per layer), its exchange for the
    backward and for the previous exchange."""
    eng = 0.0
    ends: list[float] = []
    for i in range(layers):
        free = ends[i - buffers] if buffers and i >= buffers else 0.0
        eng = max(eng, free) + backward
        ends.append(max(eng, ends[-1] if ends else 0.0) + comm)
    return max(eng, ends[-1])


# ---- one prediction ---------------------------------------------------------------------------
def predict(model: str, layout: lg.Layout, strategy: str, offload: bool, world: int, m: Measured,
            cfg: Config) -> dict[str, Any]:
    """Per-layer costs and the mean micro-step of a step of ``cfg.micro_steps``: the manager's
    stream time, the part of it the engine waits for (exposed) and the hidden fraction."""
    layout.check_world(world)
    L, M, unsharded = layout.num_layers, cfg.micro_steps, strategy == "unsharded"
    x, s, b = exchange_ms(layout, strategy, world, cfg), sr_ms(layout, strategy, offload, world, m, cfg), \
        backward_ms(layout, cfg)
    c = x + s
    nb = reduce_scatter_ms(2 * layout.non_block_numel, world, cfg)  # last micro-step, fully exposed
    buffers = None if unsharded else 2
    t_layers = timeline_ms(L, b, c, buffers)
    if unsharded:  # the blocks' exchange runs in the last micro-step only
        busy, exposed = (L * c + nb) / M, (t_layers - L * b + nb) / M
        groups = (1 if world > 1 else 0) / M
    else:
        busy, exposed = L * c + nb / M, t_layers - L * b + nb / M
        groups = 0 if world == 1 else (world - 1 if strategy == "all_to_all" else 1)
    xchg_busy = (L * x / M) if unsharded else L * x
    hidden = 1.0 - exposed / busy if busy > 0 else 1.0
    slowdown = cfg.nccl_sms / m.sm_count * xchg_busy * hidden
    eng = engine_ms(layout, cfg)
    host_layer = m.host_ms[label(strategy, offload)] / L + groups * cfg.nccl_host_us * 1e-3
    return {
        "model": model, "strategy": strategy, "offload": offload, "label": label(strategy, offload),
        "world": world, "layer_bytes": layer_bytes(layout),
        "exchange_wire_bytes": exchange_wire_bytes(layout, strategy, world),
        "shard_bytes": 0 if unsharded else layer_bytes(layout) // world,
        "exchange_ms": x, "sr_ms": s, "backward_ms": b, "comm_ms": c, "non_block_exchange_ms": nb,
        "manager_ms": busy, "exposed_ms": exposed, "hidden": hidden,
        "steady_hidden": min(1.0, b / c) if c > 0 else 1.0,
        "break_even_tokens": cfg.tokens * c / b,  # fewer tokens per micro-step: comm per layer > backward
        "engine_ms": eng, "engine_slowdown_ms": slowdown, "added_pct": 100 * (exposed + slowdown) / eng,
        "hbm_share": manager_hbm_bytes(layout, strategy, offload, world) / (m.copy_gbps * 1e6 * b),
        "host_ms_per_layer": host_layer, "host_bound": host_layer > b,
        "pinned_gbps": pinned_sr_gbps(world, m, cfg) if offload else None,
    }


def predict_bench(layout: lg.Layout, strategy: str, offload: bool, world: int, m: Measured,
                  cfg: Config) -> float:
    """What tools/bench_manager.py --world W measures (a middle micro-step): its engine is one
    device-to-device copy per layer (memory-bound: it shares HBM with the SR kernels, so the
    micro-step is at least the sum of their times), the non-block copy first, no non-block exchange."""
    L, b = layout.num_layers, 2 * layer_bytes(layout) / (m.copy_gbps * 1e6)
    nb = 4 * layout.non_block_numel / (m.copy_gbps * 1e6)
    x = 0.0 if strategy == "unsharded" else exchange_ms(layout, strategy, world, cfg)
    s = sr_ms(layout, strategy, offload, world, m, cfg)
    pipe = timeline_ms(L, b, x + s, None if strategy == "unsharded" else 2)
    return nb + max(pipe, L * (b + (0.0 if offload else s)))


# ---- across nodes: every exchange of a step, its bytes by link and its time ------------------
@dataclass(frozen=True)
class Hop:
    """One kind of collective of a step: ``part`` (``block``, ``non_block``, ``params``: the
    ShardOptimizer's all-gather of the updated parameters, ``norm``: the global norm's all-reduce),
    ``kind`` (``ring``: a reduce-scatter or an all-gather, ``all_reduce``, ``all_to_all``: the
    destructive all-to-all of :class:`lowgrad.managers.exchange.SumExchange`), the bytes of the
    buffer one call exchanges (per layer for the blocks), over ``ranks`` ranks of which
    ``per_node`` share a node (``ranks``: one node, 1: one per node), ``calls`` times per step
    (per layer for the blocks) at ``when`` (``micro``: every micro-step, ``last``: the last one,
    ``step``: once, after the backward)."""

    part: str
    kind: str
    nbytes: float
    ranks: int
    per_node: int
    calls: int
    when: str

    def bytes(self) -> tuple[float, float]:
        """(intra-node, inter-node) bytes one rank sends per call, the mean over the ranks. A ring
        in rank order sends ``(P-1)/P`` of the buffer from each rank to the next; where it spans
        nodes, the last rank of each node sends across (``nodes`` of the P ranks). An all-to-all
        sends each of the ``P-1`` peers its slot, ``P - per_node`` of them on other nodes."""
        P, G = self.ranks, self.per_node
        if P == 1:
            return 0.0, 0.0
        if self.kind == "all_to_all":
            slot = self.nbytes / P
            return (G - 1) * slot, (P - G) * slot
        total = self.nbytes * (P - 1) / P * (2 if self.kind == "all_reduce" else 1)
        inter = total * (P // G) / P if G < P else 0.0
        return total - inter, inter

    def ms(self, cfg: Config) -> float:
        """One call: latency per launch (``P-1`` for an all-to-all) + its bytes at the rate of the
        link that limits it: within a node the ring's bus bandwidth or the one-way P2P rate;
        across nodes the node's share of the inter-node link (``G`` GPUs' bytes through the
        node's bandwidth) or, for a ring spanning nodes, min(bus bandwidth, the node's link)."""
        P, lat = self.ranks, cfg.latency_us * 1e-3
        if P == 1:
            return 0.0
        intra, inter = self.bytes()
        node = cfg.node_gbps() * 1e6  # bytes per ms
        if self.kind == "all_to_all":
            return (P - 1) * lat + max(intra / (cfg.p2p_gbps * 1e6), inter * cfg.gpus_per_node / node)
        if self.per_node == 1:  # every hop crosses: each rank's share of its node's link
            return lat + inter * cfg.gpus_per_node / node
        rate = cfg.rs_busbw_gbps * 1e6 if self.per_node == P else min(cfg.rs_busbw_gbps * 1e6, node)
        return lat + (intra + inter) / rate


#: HSDP's layout, modelled beside the strategies (not offered: docs/architecture.md says why):
#: optimizer shards of 1/G replicated over the nodes, so no parameter byte crosses a node
HSDP = "hsdp (model)"
#: AdamW's state per parameter: float32 master weights and two moments
OPTIMIZER_STATE_BYTES = 12


def exchange_kind(unbiased: bool) -> str:
    return "all_to_all" if unbiased else "ring"


def hops(layout: lg.Layout, strategy: str, world: int, G: int, cfg: Config) -> list[Hop]:
    """Every collective of one step of ``strategy`` at ``world`` ranks, ``G`` per node, under
    ``cfg.rounding`` (``"sr"``: all_to_all's non-block gradients and hierarchical's every exchange
    through all-to-alls summed in float32), and ShardOptimizer's parameter all-gather after the
    step (through the nodes' hierarchy where the strategy knows the nodes)."""
    M, L, S = cfg.micro_steps, layout.num_layers, layer_bytes(layout)
    N, sr = world // G, cfg.rounding == "sr"
    nb = 2 * layout.non_block_numel
    out = []
    if strategy == HSDP:  # hierarchical's node exchange; the 1/G node sums all-reduced across the nodes
        return [Hop("block", exchange_kind(sr), S, G, G, M * L, "micro"),
                Hop("block", "all_reduce", S / G, N, 1, L, "last"),
                Hop("non_block", "ring", nb, G, G, 1, "step"), Hop("non_block", "all_reduce", nb / G, N, 1, 1, "step"),
                Hop("norm", "all_reduce", 4, world, G, 1, "step"),
                Hop("params", "ring", 2 * layout.total_numel, G, G, 1, "step")]
    if strategy == "hierarchical":
        out.append(Hop("block", exchange_kind(sr), S, G, G, M * L, "micro"))
        if cfg.cross_node_bits == 8 and N > 1:  # each piece of 1/W: a byte an element, a float32 per QBLOCK
            pieces = [s.numel // world for s in layout.block]
            out.append(Hop("block", "all_to_all", sum(N * (p + 4 * -(-p // QBLOCK)) for p in pieces), N, 1, L, "last"))
        else:
            out.append(Hop("block", exchange_kind(sr), S / G, N, 1, L, "last"))
    else:
        kind = "all_to_all" if strategy == "all_to_all" else "ring"
        out.append(Hop("block", kind, S, world, G, L if strategy == "unsharded" else M * L,
                       "last" if strategy == "unsharded" else "micro"))
    if strategy == "hierarchical" and 1 < G < world:
        out += [Hop("non_block", exchange_kind(sr), nb, G, G, 1, "step"),
                Hop("non_block", exchange_kind(sr), nb / G, N, 1, 1, "step")]
    else:
        out.append(Hop("non_block", exchange_kind(sr and strategy in ("all_to_all", "hierarchical")), nb, world, G, 1,
                       "step"))
    out.append(Hop("norm", "all_reduce", 4, world, G, 1, "step"))
    params = 2 * layout.total_numel  # ShardOptimizer's all-gather of the updated bf16 parameters
    if strategy == "hierarchical" and 1 < G < world:  # across the nodes (1/G of it), then within
        out += [Hop("params", "ring", params / G, N, 1, 1, "step"), Hop("params", "ring", params, G, G, 1, "step")]
    else:
        out.append(Hop("params", "ring", params, world, G, 1, "step"))
    return out


def step_bytes(hop_list: list[Hop]) -> dict[str, dict[str, float]]:
    """Per part, the intra- and inter-node bytes a rank sends per step (mean over the ranks)."""
    out: dict[str, dict[str, float]] = {}
    for h in hop_list:
        intra, inter = h.bytes()
        d = out.setdefault(h.part, {"intra": 0.0, "inter": 0.0})
        d["intra"] += intra * h.calls
        d["inter"] += inter * h.calls
    return out


def multi_node(model: str, layout: lg.Layout, nodes: int, m: Measured, cfg: Config) -> list[dict[str, Any]]:
    """Per strategy, ``model`` on ``nodes`` nodes of ``cfg.gpus_per_node`` GPUs: the exchange and SR
    of one layer in a middle and in the last micro-step and their mean over a step; the non-block
    exchange and the parameter all-gather of the step (exposed: after the backward, and after the
    optimizer); what of it all the step exposes (the layers' exchanges beyond the backward, on the
    two-buffer timeline, plus those two); the bytes a rank sends per step, by part and link
    (:func:`hops`); the block accumulator per layer and the optimizer's state per rank; and HSDP's
    layout as a model."""
    G, M, S = cfg.gpus_per_node, cfg.micro_steps, layer_bytes(layout)
    W = G * nodes
    layout.check_world(W)
    b = backward_ms(layout, cfg)
    out = []
    for strategy in ("unsharded", "scatter_reduce", "all_to_all", "hierarchical", HSDP):
        hs = hops(layout, strategy, W, G, cfg)
        block = [h for h in hs if h.part == "block"]
        share = G if strategy in ("hierarchical", HSDP) else W  # the accumulator: 1/W, or 1/G of the layer
        sr = 0.0 if strategy == "unsharded" else add_sr_ms(3 * S / share, m)
        if strategy == "all_to_all":
            sr += reduce_sr_ms(layout, W, m)
        middle = sum(h.ms(cfg) for h in block if h.when == "micro") + sr
        last = middle + sum(h.ms(cfg) for h in block if h.when == "last")
        by_part = step_bytes(hs)
        L = layout.num_layers

        def exposed(comm: float) -> float:  # of one micro-step's layers, behind the backward
            return timeline_ms(L, b, comm, 2) - L * b if comm else 0.0
        nb_ms = sum(h.ms(cfg) for h in hs if h.part == "non_block")
        params_ms = sum(h.ms(cfg) for h in hs if h.part == "params")
        out.append({"model": model, "strategy": strategy, "nodes": nodes, "gpus_per_node": G, "world": W,
                    "rounding": cfg.rounding, "middle_ms": middle, "last_ms": last,
                    "mean_ms": ((M - 1) * middle + last) / M, "backward_ms": b, "hidden_last": min(1.0, b / last),
                    "non_block_ms": nb_ms, "params_ms": params_ms,
                    "step_exposed_ms": (M - 1) * exposed(middle) + exposed(last) + nb_ms + params_ms,
                    "bytes": by_part, "inter_node_bytes_per_step": sum(v["inter"] for v in by_part.values()),
                    "accumulator_bytes": 0 if strategy == "unsharded" else S / share,
                    "optimizer_state_bytes": OPTIMIZER_STATE_BYTES * layout.total_numel / (G if strategy == HSDP
                                                                                           else W)})
    return out


# ---- the whole table --------------------------------------------------------------------------
def run(models: list[str], worlds: list[int], m: Measured, cfg: Config,
        nodes: tuple[int, ...] = NODES) -> dict[str, Any]:
    """Every prediction, the world-1 calibration against bench_manager, the bench predictions at
    world > 1 and the assumptions list."""
    layouts = {name: lg.llama_layout(name) for name in models}
    rows = [predict(name, lay, st, off, w, m, cfg) for name, lay in layouts.items() for w in worlds
            for st, off in RUNS]
    bench_layout = lg.llama_layout(m.bench_config)
    bench = [{"label": label(st, off), "world": w, "predicted_ms": predict_bench(bench_layout, st, off, w, m, cfg),
              "measured_ms": m.micro_ms.get(label(st, off)) if w == 1 else None,
              "host_ms_gil_bound": m.host_ms[label(st, off)] * w}
             for w in sorted({1, *worlds}) for st, off in RUNS]
    out = {"date": time.strftime("%Y-%m-%d"), "config": asdict(cfg), "measured": asdict(m) | {
        "layer_sr_eff": m.layer_sr_eff}, "rows": rows, "bench_manager": bench}
    out["assumptions"] = assumptions(rows, bench, layouts, m, cfg)
    out["multi_node"] = [r for name, lay in layouts.items() for n in nodes for r in multi_node(name, lay, n, m, cfg)]
    return out


def _row(rows: list[dict[str, Any]], model: str, lab: str, world: int) -> dict[str, Any]:
    return next(r for r in rows if r["model"] == model and r["label"] == lab and r["world"] == world)


def _bench(bench: list[dict[str, Any]], lab: str, world: int) -> dict[str, Any]:
    return next(b for b in bench if b["label"] == lab and b["world"] == world)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


@dataclass(frozen=True)
class Focus:
    """What the assumptions quote: the largest world, the smaller and the larger model."""

    rows: list[dict[str, Any]]
    world: int
    small: str
    big: str
    layout: lg.Layout

    def row(self, lab: str, model: str | None = None, world: int | None = None) -> dict[str, Any]:
        return _row(self.rows, model or self.small, lab, world or self.world)


def exchange_assumptions(f: Focus, cfg: Config) -> list[str]:
    """The NCCL figures: reduce-scatter, latency, bandwidth against W, all-to-all, NVLS."""
    W, S, n = f.world, layer_bytes(f.layout), len(f.layout.block)
    rs, a2a = f.row("scatter_reduce"), f.row("all_to_all")
    worlds = sorted({r["world"] for r in f.rows if r["world"] > 1})
    per_w = ", ".join(f"W={w} {f.row('scatter_reduce', world=w)['exchange_ms']:.3f}" for w in worlds)
    eff_bus = S * (W - 1) / W / (rs["exchange_ms"] * 1e6)
    return [
        (f"Reduce-scatter: at world {W} one {f.small} layer ({_mb(S)} bf16, {n} tensors in one NCCL group) takes "
         f"{rs['exchange_ms']:.3f} ms = {cfg.latency_us:.0f} us + {_mb(S)} x {W - 1}/{W} at {cfg.rs_busbw_gbps:.0f} "
         f"GB/s bus bandwidth (effective {eff_bus:.0f} GB/s at this size); nccl_bench at world {W} shows >= "
         f"{cfg.rs_busbw_gbps:.0f} GB/s busBW at >= 1 GB. {f.big}: "
         f"{f.row('scatter_reduce', f.big)['exchange_ms']:.3f} ms per layer."),
        (f"NCCL latency: {cfg.latency_us:.0f} us per group launch, whatever the world and the number of tensors in the "
         f"group (the group of {n} reduce-scatters pays it once); a 1 MiB reduce-scatter at world 2 takes "
         f"{reduce_scatter_ms(1 << 20, 2, cfg) * 1e3:.0f} us."),
        (f"NVSwitch: each GPU keeps its full NVLink bandwidth in a group of 2 or 4, so busBW does not depend on W and "
         f"the layer's reduce-scatter grows as (W-1)/W: {f.small} {per_w} ms."),
        (f"All-to-all: {W - 1} grouped send/recv steps of {_mb(S / W)} each, at {cfg.p2p_gbps:.0f} GB/s one way while "
         f"every GPU sends and receives at once, {cfg.latency_us:.0f} us each: {a2a['exchange_ms']:.3f} ms per "
         f"{f.small} layer at world {W}, {a2a['exchange_ms'] / rs['exchange_ms']:.2f}x the reduce-scatter."),
        (f"NCCL runs the layer's reduce-scatter as a ring (NCCL_DEBUG=INFO names the algorithm), at the "
         f"{rs['exchange_ms']:.3f} ms above; if it picks NVLS (NVLink SHARP) the exchange is faster, "
         f"{reduce_scatter_ms(S, W, replace(cfg, rs_busbw_gbps=NVLS_BUSBW_GBPS)):.3f} ms at the {NVLS_BUSBW_GBPS:.0f} "
         f"GB/s that NVLS all-reduce reaches on 8 x H100, and everything below only hides better."),
    ]


def kernel_assumptions(f: Focus, m: Measured, cfg: Config) -> list[str]:
    """The SR kernels, the engine's backward and HBM contention."""
    W, S = f.world, layer_bytes(f.layout)
    rs, a2a, rs_big = f.row("scatter_reduce"), f.row("all_to_all"), f.row("scatter_reduce", f.big)
    return [
        (f"SR accumulation of the shard: fixed cost {m.sr_fixed_us:.1f} us (intercept of the add_sr size fit) + bytes "
         f"at {m.copy_gbps:.0f} GB/s x {m.layer_sr_eff:.3f}; it gives the measured per-layer time at world 1 "
         f"({add_sr_ms(m.layer_sr_bytes, m) * 1e3:.1f} us for {_mb(m.layer_sr_bytes)}) and {rs['sr_ms'] * 1e3:.1f} us "
         f"for the {f.small} shard at world {W} ({_mb(3 * S / W)} moved)."),
        (f"All-to-all's reduce_sr runs one launch per tensor ({len(f.layout.block)} per layer, each >= "
         f"{m.tiny_kernel_us:.1f} us) at {reduce_sr_ratio(W, m):.3f} of copy bandwidth: SR per {f.small} layer at "
         f"world {W} {a2a['sr_ms'] * 1e3:.0f} us against {rs['sr_ms'] * 1e3:.0f} us for scatter_reduce."),
        (f"Engine: backward = 4 N T FLOPs per layer at {cfg.peak_tflops:.0f} x {cfg.mfu:.2f} = "
         f"{cfg.peak_tflops * cfg.mfu:.0f} TFLOP/s, {cfg.tokens} tokens per micro-step, attention-score FLOPs left out "
         f"(a real backward is longer, which only hides more): {rs['backward_ms']:.2f} ms per {f.small} layer, "
         f"{rs_big['backward_ms']:.2f} ms per {f.big} layer."),
        (f"HBM contention: the engine is compute-bound and keeps its rate while the manager runs; the manager's own "
         f"device traffic per layer is {100 * rs['hbm_share']:.1f}% ({f.small}, scatter_reduce, world {W}) of what HBM "
         f"moves during that layer's backward, and NCCL's {cfg.nccl_sms} of {m.sm_count} SMs cost the engine "
         f"{rs['engine_slowdown_ms']:.2f} ms per micro-step (their share of the overlapped exchange time)."),
    ]


def overlap_assumptions(f: Focus, bench: list[dict[str, Any]], m: Measured, cfg: Config) -> list[str]:
    """Overlap and exposed time, unsharded, offload, host issue time, the manager bench at world W."""
    W, lay = f.world, f.layout
    rs, a2a, rs_big, un = (f.row("scatter_reduce"), f.row("all_to_all"), f.row("scatter_reduce", f.big),
                           f.row("unsharded"))
    off, off_a2a = f.row("scatter_reduce+offload"), f.row("all_to_all+offload")
    b_rs, b_un = _bench(bench, "scatter_reduce", W), _bench(bench, "unsharded", W)
    bound = [f"{r['model']} {r['label']} W={r['world']}" for r in f.rows if r["host_bound"]]
    gil_w = next((b["world"] for b in bench if b["label"] == "scatter_reduce" and b["world"] > 1
                  and b["host_ms_gil_bound"] > b["predicted_ms"]), None)
    return [
        (f"Overlap: with two block buffers the engine runs one layer ahead; comm per layer {rs['comm_ms']:.3f} ms "
         f"< backward {rs['backward_ms']:.2f} ms, so only the last layer's exchange + SR and the non-block "
         f"reduce-scatter ({rs['non_block_exchange_ms']:.2f} ms once per step of {cfg.micro_steps}) are exposed: "
         f"scatter_reduce {f.small} world {W} exposes {rs['exposed_ms']:.3f} ms per micro-step, "
         f"{100 * rs['hidden']:.1f}% of its {rs['manager_ms']:.2f} ms hidden; {f.big}: {rs_big['exposed_ms']:.3f} ms, "
         f"{100 * rs_big['hidden']:.1f}%. The exchange stays hidden down to {rs['break_even_tokens']:.0f} tokens per "
         f"micro-step ({a2a['break_even_tokens']:.0f} for all_to_all; {f.big}: {rs_big['break_even_tokens']:.0f})."),
        (f"Unsharded exchanges the blocks in the last micro-step only: {un['manager_ms']:.3f} ms per micro-step "
         f"averaged over {cfg.micro_steps} ({f.small}, world {W}), {100 * un['hidden']:.1f}% hidden."),
        (f"Offload: every GPU's pinned SR traffic (2/W of the layer per layer, 4/W for all_to_all) shares the host's "
         f"{cfg.host_dram_gbps:.0f} GB/s DRAM at its peak: {pinned_sr_gbps(W, m, cfg):.1f} GB/s per GPU at world {W} "
         f"(measured alone: {m.pinned_sr_gbps:.1f}); SR per {f.small} layer {off['sr_ms']:.3f} ms "
         f"(scatter_reduce), {off_a2a['sr_ms']:.3f} ms (all_to_all), {100 * off['hidden']:.1f}% / "
         f"{100 * off_a2a['hidden']:.1f}% hidden."),
        (f"Host: issuing a layer costs the world-1 host time ({1e3 * m.host_ms['scatter_reduce'] / lay.num_layers:.0f} "
         f"us per layer) + {cfg.nccl_host_us:.0f} us per NCCL group launch: {1e3 * a2a['host_ms_per_layer']:.0f} "
         f"us for all_to_all at world {W}, against a {1e3 * a2a['backward_ms']:.0f} us backward: "
         + (f"host-bound: {', '.join(bound)}." if bound else "no strategy is host-bound (eager, no CUDA graph).")),
        (f"tools/bench_manager.py --world {W} ({m.bench_config}, synthetic copy engine, a middle micro-step): "
         f"scatter_reduce {b_rs['predicted_ms']:.2f} ms (exchange-bound: its copy engine has no backward to hide "
         f"behind), unsharded {b_un['predicted_ms']:.2f} ms (no exchange before the last micro-step). Its {W} ranks "
         f"are threads of one process: if their Python serialises on the GIL the host needs up to {W} x "
         f"{m.host_ms['scatter_reduce']:.2f} = {b_rs['host_ms_gil_bound']:.1f} ms per micro-step"
         + (f", which makes it host-bound from world {gil_w} on." if gil_w else ", still below the GPU time.")),
    ]


def assumptions(rows: list[dict[str, Any]], bench: list[dict[str, Any]], layouts: dict[str, lg.Layout],
                m: Measured, cfg: Config) -> list[str]:
    """Checkable statements, each with the number this model predicts (at the largest world)."""
    W = max(r["world"] for r in rows)
    if W == 1:
        return ["world 1 only: no exchange, nothing to check on several GPUs"]
    small = min(layouts, key=lambda n: layouts[n].total_numel)
    big = max(layouts, key=lambda n: layouts[n].total_numel)
    f = Focus(rows, W, small, big, layouts[small])
    return [*exchange_assumptions(f, cfg), *kernel_assumptions(f, m, cfg), *overlap_assumptions(f, bench, m, cfg)]


# ---- output -----------------------------------------------------------------------------------
HEADER = (f"{'model':<14}{'strategy':<24}{'W':>3}{'xchg ms':>9}{'SR ms':>8}{'bwd ms':>8}{'mgr ms':>9}"
          f"{'exposed':>9}{'hidden':>8}{'+eng %':>8}")


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table: per-layer exchange, SR and backward; per micro-step (mean over a step) the
    manager's stream time, the exposed part, the hidden fraction and the engine's added time."""
    out = [HEADER]
    for r in rows:
        out.append(f"{r['model']:<14}{r['label']:<24}{r['world']:>3}{r['exchange_ms']:>9.3f}{r['sr_ms']:>8.3f}"
                   f"{r['backward_ms']:>8.3f}{r['manager_ms']:>9.3f}{r['exposed_ms']:>9.3f}"
                   f"{100 * r['hidden']:>7.1f}%{r['added_pct']:>7.2f}%")
    return out


def multi_node_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = [f"{'model':<14}{'strategy':<16}{'nodes':>6}{'W':>4}{'middle ms':>11}{'last ms':>9}{'mean ms':>9}"
           f"{'bwd ms':>8}{'nb ms':>8}{'params ms':>10}{'step ms':>9}{'inter MB/step: block':>22}{'nb':>8}"
           f"{'params':>8}{'acc MB':>8}{'opt GB':>8}"]
    for r in rows:
        by = r["bytes"]
        out.append(f"{r['model']:<14}{r['strategy']:<16}{r['nodes']:>6}{r['world']:>4}{r['middle_ms']:>11.3f}"
                   f"{r['last_ms']:>9.3f}{r['mean_ms']:>9.3f}{r['backward_ms']:>8.3f}{r['non_block_ms']:>8.3f}"
                   f"{r['params_ms']:>10.3f}{r['step_exposed_ms']:>9.1f}{by['block']['inter'] / 1e6:>22.1f}"
                   f"{by['non_block']['inter'] / 1e6:>8.1f}{by['params']['inter'] / 1e6:>8.1f}"
                   f"{r['accumulator_bytes'] / 1e6:>8.1f}{r['optimizer_state_bytes'] / 1e9:>8.2f}")
    return out


def bench_lines(bench: list[dict[str, Any]]) -> list[str]:
    out = [f"{'strategy':<24}{'W':>3}{'predicted ms':>14}{'measured ms':>13}{'GIL host ms':>13}"]
    for b in bench:
        meas = f"{b['measured_ms']:.3f}" if b["measured_ms"] is not None else "-"
        out.append(f"{b['label']:<24}{b['world']:>3}{b['predicted_ms']:>14.3f}{meas:>13}"
                   f"{b['host_ms_gil_bound']:>13.2f}")
    return out


def markdown(result: dict[str, Any], command: str) -> str:
    """The section for BENCHMARKS.md: command, the table, the bench predictions, the assumptions."""
    rows = result["rows"]
    lines = [f"Command: `{command}`", "",
             ("| model | strategy | W | exchange ms/layer | SR ms/layer | backward ms/layer | manager ms/micro | "
              "exposed ms/micro | hidden | engine +% |"),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['label']} | {r['world']} | {r['exchange_ms']:.3f} | {r['sr_ms']:.3f} | "
              f"{r['backward_ms']:.3f} | {r['manager_ms']:.3f} | {r['exposed_ms']:.3f} | {100 * r['hidden']:.1f}% | "
              f"{r['added_pct']:.2f}% |" for r in rows]
    lines += ["", (f"`tools/bench_manager.py --world W` ({result['measured']['bench_config']}, synthetic copy "
                   "engine, a middle micro-step), predicted; world 1 against the measured run:"), "",
              "| strategy | W | predicted ms | measured ms | host ms if the GIL serialises the ranks |",
              "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {b['label']} | {b['world']} | {b['predicted_ms']:.3f} | "
              f"{'-' if b['measured_ms'] is None else format(b['measured_ms'], '.3f')} | {b['host_ms_gil_bound']:.2f} |"
              for b in result["bench_manager"]]
    lines += ["", f"Across nodes: {link_text(result['config'])}; per layer (block) and per step:", "",
              "| model | strategy | nodes | W | middle ms | last ms | mean ms | backward ms | non-block ms | "
              "params ms | exposed ms/step | inter-node MB/step: block | non-block | params | accumulator MB | "
              "optimizer GB |",
              "| --- | --- |" + " ---: |" * 14]
    lines += [f"| {r['model']} | {r['strategy']} | {r['nodes']} | {r['world']} | {r['middle_ms']:.3f} | "
              f"{r['last_ms']:.3f} | {r['mean_ms']:.3f} | {r['backward_ms']:.3f} | {r['non_block_ms']:.3f} | "
              f"{r['params_ms']:.3f} | {r['step_exposed_ms']:.1f} | {r['bytes']['block']['inter'] / 1e6:.1f} | "
              f"{r['bytes']['non_block']['inter'] / 1e6:.1f} | {r['bytes']['params']['inter'] / 1e6:.1f} | "
              f"{r['accumulator_bytes'] / 1e6:.1f} | {r['optimizer_state_bytes'] / 1e9:.2f} |"
              for r in result["multi_node"]]
    lines += ["", "Assumptions that the first multi-GPU run can confirm or refute:", ""]
    lines += [f"{i}. {a}" for i, a in enumerate(result["assumptions"], 1)]
    return "\n".join(lines) + "\n"


def link_text(cfg: dict[str, Any]) -> str:
    """The links between nodes, as the tables name them."""
    G = cfg["gpus_per_node"]
    per_node = cfg["inter_node_node_gbps"] if cfg["inter_node_node_gbps"] is not None else G * cfg["inter_node_gbps"]
    given = "given per node" if cfg["inter_node_node_gbps"] is not None else "given per GPU"
    return (f"nodes of {G} GPUs, {per_node:.1f} GB/s each way between a node and the others ({given}: "
            f"{per_node / G:.2f} GB/s per GPU), rounding {cfg['rounding']!r}")


def command_line(argv: list[str]) -> str:
    """The command as the Markdown shows it: the options given, less where the output went."""
    shown, args = [], iter(argv)
    for a in args:
        if a in ("--json", "--markdown"):
            next(args, None)
        elif not a.startswith(("--json=", "--markdown=")):
            shown.append(a)
    return " ".join(["PYTHONPATH=. python3 tools/predict_scaling.py", *shown, "--json $OUT/predict_scaling.json"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser("predict_scaling", description=__doc__.split("\n\n")[0] + " Runs on the CPU: it reads the bench "
               "JSON of H200 runs and measures nothing.")
    p.add_argument("--benchmarks", default=BENCHMARKS, metavar="DIR",
                   help="where the bench JSON defaults are looked for (default: the repository's benchmarks/)")
    for tool in ("bench_kernels", "bench_manager", "bench_layer"):
        p.add_argument(f"--{tool.replace('_', '-')}", metavar="JSON",
                       help=f"{tool}.json (default: the newest under --benchmarks, by run folder name)")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of presets or config.json paths")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma list of GPU counts")
    d = Config()
    p.add_argument("--rs-busbw", type=float, default=d.rs_busbw_gbps, help="reduce-scatter bus bandwidth, GB/s")
    p.add_argument("--p2p", type=float, default=d.p2p_gbps, help="one-way NVLink P2P bandwidth, GB/s")
    p.add_argument("--latency-us", type=float, default=d.latency_us, help="per NCCL group launch")
    p.add_argument("--peak-tflops", type=float, default=d.peak_tflops)
    p.add_argument("--mfu", type=float, default=d.mfu)
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per micro-step per GPU")
    p.add_argument("--micro-steps", type=int, default=d.micro_steps)
    p.add_argument("--host-dram", type=float, default=d.host_dram_gbps, help="host DRAM GB/s shared by offload")
    p.add_argument("--nccl-sms", type=int, default=d.nccl_sms)
    p.add_argument("--nccl-host-us", type=float, default=d.nccl_host_us)
    link = p.add_mutually_exclusive_group()
    link.add_argument("--inter-node-gbps", type=float, default=d.inter_node_gbps,
                      help="bandwidth between nodes per GPU (its NIC), GB/s each way (default: one 400 Gb/s NIC "
                           "per GPU)")
    link.add_argument("--inter-node-gbps-per-node", type=float, default=None,
                      help="bandwidth between nodes per node, GB/s each way, shared by its GPUs")
    p.add_argument("--rounding", choices=("ldsr", "sr", "rn"), default=d.rounding,
                   help="the managers' rounding: under sr all_to_all's non-block gradients and hierarchical's every "
                        "exchange go through all-to-alls")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument("--cross-node-bits", type=int, choices=(16, 8), default=d.cross_node_bits,
                   help="hierarchical's hop across the nodes: bf16, or int8 with a float32 scale per "
                        f"{QBLOCK} elements (cross_node_bits=8)")
    p.add_argument("--nodes", default=",".join(map(str, NODES)), help="comma list of node counts (across nodes)")
    p.add_argument("--json", help=output_help("predict_scaling.json"))
    p.add_argument("--markdown", default=None, help="also write the section as Markdown to this path")
    args = p.parse_args(argv)
    for tool in ("bench_kernels", "bench_manager", "bench_layer"):
        if getattr(args, tool) is None:
            setattr(args, tool, newest(f"{tool}.json", args.benchmarks))
    for opt, value in (("--worlds", args.worlds), ("--nodes", args.nodes)):
        try:
            int_list(1)(value)
        except argparse.ArgumentTypeError as exc:
            p.error(f"{opt}: {exc}")
    per_node = args.inter_node_gbps_per_node
    if args.inter_node_gbps <= 0 or args.gpus_per_node < 1 or (per_node is not None and per_node <= 0):
        p.error("--inter-node-gbps and --inter-node-gbps-per-node must be > 0 and --gpus-per-node >= 1")
    return args


def config_of(args: argparse.Namespace) -> Config:
    return replace(Config(), rs_busbw_gbps=args.rs_busbw, p2p_gbps=args.p2p, latency_us=args.latency_us,
                   peak_tflops=args.peak_tflops, mfu=args.mfu, tokens=args.tokens, micro_steps=args.micro_steps,
                   host_dram_gbps=args.host_dram, nccl_sms=args.nccl_sms, nccl_host_us=args.nccl_host_us,
                   inter_node_gbps=args.inter_node_gbps, gpus_per_node=args.gpus_per_node,
                   inter_node_node_gbps=args.inter_node_gbps_per_node, rounding=args.rounding,
                   cross_node_bits=args.cross_node_bits)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models, worlds = [x for x in args.models.split(",") if x], int_list(1)(args.worlds)
    nodes = tuple(int_list(1)(args.nodes))
    for model in models:
        for w in worlds:
            check_world(load_layout(model, "--models"), w, f"--worlds ({model}): world")
        for n in nodes:
            check_world(load_layout(model, "--models"), n * args.gpus_per_node, f"--nodes ({model}): world")
    args.json = output_path("predict_scaling.json", args.json)
    if args.markdown:
        output_path("", args.markdown)  # its folder exists
    try:
        m = load_measured(args.bench_kernels, args.bench_manager, args.bench_layer)
    except (OSError, ValueError, KeyError, StopIteration) as exc:  # missing, not JSON, or not a bench's JSON
        raise CannotRun(f"cannot read the bench JSON ({type(exc).__name__}: {exc}); give --bench-kernels, "
                        "--bench-manager and --bench-layer") from None
    cfg = config_of(args)
    result = run(models, worlds, m, cfg, nodes)
    print(f"predict_scaling: copy {m.copy_gbps:.0f} GB/s, pinned SR {m.pinned_sr_gbps:.1f} GB/s "
          f"(H2D {m.h2d_gbps:.1f} + D2H {m.d2h_gbps:.1f}), SR launch {m.sr_fixed_us:.1f} us + bytes at "
          f"{m.layer_sr_eff:.3f} x copy; "
          f"reduce-scatter busBW {cfg.rs_busbw_gbps:.0f} GB/s, P2P {cfg.p2p_gbps:.0f} GB/s one way "
          f"({cfg.p2p_gbps / (NVLINK_BIDIR_GBPS / 2):.2f} of NVLink's {NVLINK_BIDIR_GBPS / 2:.0f}), latency "
          f"{cfg.latency_us:.0f} us; engine {cfg.peak_tflops * cfg.mfu:.0f} TFLOP/s, {cfg.tokens} tokens, "
          f"{cfg.micro_steps} micro-steps per step")
    print("per layer: exchange, SR, backward (ms); per micro-step, mean over a step: manager stream time, exposed "
          "time, hidden fraction, engine time added (exposed + NCCL's SMs) in % of the engine's micro-step")
    print("\n".join(table_lines(result["rows"])))
    print(f"\ntools/bench_manager.py --world W ({m.bench_config}, synthetic copy engine, a middle micro-step):")
    print("\n".join(bench_lines(result["bench_manager"])))
    print(f"\nacross nodes: {link_text(asdict(cfg))}; per layer: exchange + SR of a middle and of the last "
          "micro-step, their mean over a step (ms); per step: the non-block exchange and the parameter all-gather "
          "(ms), the bytes a rank sends between nodes (block, non-block, parameters; MB), the accumulator per layer:")
    print("\n".join(multi_node_lines(result["multi_node"])))
    print("\nassumptions that the first multi-GPU run can confirm or refute:")
    for i, a in enumerate(result["assumptions"], 1):
        print(f"{i:>2}. {a}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(result, command_line(sys.argv[1:] if argv is None else argv)))
    print(f"wrote {args.json}" + (f" and {args.markdown}" if args.markdown else ""))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool("predict_scaling", main))
