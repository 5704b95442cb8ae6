"""Cost of the unused-parameter bookkeeping (view hooks + one mask all-reduce per backward) on the small
benchmark model, world 2, gloo: steps alternate with the bookkeeping on and off (interleaved A/B, so machine
load hits both alike); prints the median step time of each and the time inside the mask agreement.

    PYTHONPATH=. python benchmarks/bench_unused.py [steps]
"""
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]
import torch
import fsdp_plugin as fp
import fsdp_plugin._schedule.root as rootmod
import fsdp_plugin._flat.flat_param as fpm
from _model import PRESETS, GPTConfig, GPT, Block
from _dist import run_ranks

def worker(rank, world, steps):
    cfg = GPTConfig(**PRESETS["small"])
    model = fp.shard(GPT(cfg), auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    real_views = fpm.FlatParamHandle.views
    inside = []

    class Timed(rootmod.UsageAgreement):
        def __init__(self, root):
            t = time.perf_counter()
            super().__init__(root)
            self.spent = time.perf_counter() - t

        def finish(self):
            t = time.perf_counter()
            super().finish()
            inside.append(self.spent + time.perf_counter() - t)

    class Off:
        def __init__(self, root):
            pass

        def finish(self):
            pass

    def plain_views(self):
        pieces = torch.split(self.leaf, self._split_sizes)     # segments: slots, row-alignment gaps, padding
        return [pieces[i].view(s.shape) for i, s in zip(self._slot_segment, self.slots)]
    on, off = [], []
    for s in range(steps):
        g = torch.Generator().manual_seed(s * 10 + rank)
        idx = torch.randint(0, cfg.vocab, (4, cfg.seq_len + 1), generator=g)
        enabled = s % 2 == 0
        rootmod.UsageAgreement = Timed if enabled else Off
        fpm.FlatParamHandle.views = real_views if enabled else plain_views
        torch.distributed.barrier()
        t, c = time.perf_counter(), time.process_time()
        loss = model(idx[:, :-1], idx[:, 1:]); opt.zero_grad(); loss.backward(); opt.step()
        dt, dc = time.perf_counter() - t, time.process_time() - c
        if s >= 4:
            (on if enabled else off).append((dt, dc))
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    return (med(on, 0), med(off, 0), med(on, 1), med(off, 1), statistics.median(inside),
            fp.comm_stats.snapshot())

r = run_ranks(worker, 2, int(sys.argv[1]) if len(sys.argv) > 1 else 40, timeout=900)
for on, off, con, coff, inside, stats in r:
    print(f"wall: on {on*1e3:.1f} ms off {off*1e3:.1f} ms ratio {on/off:.4f} | cpu: on {con*1e3:.1f} ms "
          f"off {coff*1e3:.1f} ms ratio {con/coff:.4f} | mask agreement {inside*1e3:.3f} ms ({inside/on*100:.2f}%)")
print(r[0][-1])
