"""Kernel-level cost of the fused statistics: every layer's SR add of the Qwen2.5-1.5B layout with
and without stats (counter at micro-step 2: b measured, a not), interleaved in rounds.
usage: PYTHONPATH=<tree> python3 split.py LABEL OUT.json"""
import json
import statistics
import sys

import numpy as np

import lowgrad as lg
from lowgrad.core.dtypes import byte
from lowgrad.sr.seedcounter import SeedCounter

label, path = sys.argv[1], sys.argv[2]
dev = lg.Device(0)
layout = lg.llama_layout("Qwen2.5-1.5B")
L, specs = layout.num_layers, layout.block
lazy = dev.lazy_allocator("device")
bufs = [[lazy.alloc(s.shape, lg.bf16, "block_grad") for s in specs] for _ in range(2)]
shards = [[lazy.alloc(s.shape, lg.bf16, "shard") for s in specs] for _ in range(L)]
lazy.commit()
rng = np.random.default_rng(0)
big = max(s.numel for s in specs)
bits = rng.integers(0, 1 << 16, big, dtype=np.uint16) & np.uint16(0xBFFF)  # finite, |x| < 2
pool = lg.from_numpy(bits.view(np.uint8), dev, name="pool")
for t in [t for ts in (*bufs, *shards) for t in ts]:
    lg.ops.copy(t.flat().bitcast(byte), pool.view(0, t.nbytes))
s = dev.stream()
counter = SeedCounter(dev, 7, 0, s)
counter.next_micro(s.handle)
counter.next_micro(s.handle)
n = len(specs)
out = dev.alloc((4, n * L, 3), lg.fp64, name="out")
sink = lg.ops.stats_sink(out, counter, micro_steps=4)
lanes = [2 * i for i in range(n)]
items = [[(sh, sh, b, 0) for sh, b in zip(shards[l], bufs[l % 2])] for l in range(L)]
plain = [lg.ops.bind_add_sr_multi(items[l], (counter, l, lanes)) for l in range(L)]
fused = [lg.ops.bind_add_sr_multi(items[l], (counter, l, lanes), stats=(sink, list(range(l * n, l * n + n))))
         for l in range(L)]
e0, e1 = dev.event(timing=True), dev.event(timing=True)


def time_all(fns, reps=3):
    e0.record(s)
    for _ in range(reps):
        for l in reversed(range(L)):
            fns[l](s.handle)
    e1.record(s)
    e1.synchronize()
    return e0.elapsed_ms(e1) * 1e3 / (reps * L)


time_all(plain, 1)
time_all(fused, 1)
rounds = []
for r in range(15):
    order = (plain, fused) if r % 2 == 0 else (fused, plain)
    t = {id(f): time_all(f) for f in order}
    rounds.append((t[id(plain)], t[id(fused)]))
ratios = [f / p for p, f in rounds]
res = {"label": label, "rounds": rounds, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
       "ratio_max": max(ratios), "plain_us": statistics.median(p for p, _ in rounds),
       "fused_us": statistics.median(f for _, f in rounds)}
print(f"{label:<8} plain {res['plain_us']:.2f} us/layer  fused {res['fused_us']:.2f}  "
      f"ratio median {res['ratio_median']:.4f} [{res['ratio_min']:.4f}, {res['ratio_max']:.4f}]")
json.dump(res, open(path, "w"), indent=1)
