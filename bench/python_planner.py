#!/usr/bin/env python3
"""Planning time per global batch of a wlb packer called from Python (docs/performance.md,
"Planning from Python").

    PYTHONPATH=build/python /usr/bin/python3 bench/python_planner.py [--packer wlb|all] [--passes 4]

The setting of bench_packing (bench/bench_packing.cpp): long_context_128k lengths scaled
to the window, a Llama-3-8B-like layer for the cost model, s_max = 1.25 S, thresholds
S/4, S/2, 3S/4, dp = 1, 16 or 64 micro-batches; 256 global batches drawn beforehand and
packed in order, a fresh packer per pass. Per call it reports wall and CPU time of

  pack_documents  Packer.pack_documents(docs, step): the packer and the Python call around it
  pack            Packer.pack(): the same plus drawing the step's documents from the source
  pack+arrays     pack() and reading plan.segments / plan.offsets (what a loader consumes)
  sampler step    a PackedBatchSampler step: pack(), its checkpoint for state_dict(),
                  and the M micro-batches as lists of Segments for this rank

and `plan_us`, the C++ time of the packer alone as `wlb plan` reports it, so the
difference is what Python adds.
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np

import wlb


def deck_for(window, mbs):
    return wlb.Deck(overrides={
        "model.hidden": 4096, "model.heads": 32, "model.kv_heads": 8, "model.ffn": 14336, "model.layers": 32,
        "data.preset": "long_context_128k", "data.context_window": window, "data.s_max": window + window // 4,
        "data.length_scale": window / 131072, "mesh.dp": 1, "packing.micro_batches": mbs,
        "packing.outlier_thresholds": [window // 4, window // 2, window * 3 // 4], "packing.milp_time_limit": 2.0,
    })


def timed(fn, calls):
    """Per-call wall and CPU µs of fn(i) for i in range(calls)."""
    wall, cpu = [], []
    for i in range(calls):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn(i)
        cpu.append((time.thread_time_ns() - c0) / 1e3)
        wall.append((time.perf_counter_ns() - w0) / 1e3)
    return wall, cpu


def bench_case(packer_name, window, mbs, steps, passes):
    deck = deck_for(window, mbs)
    cost = wlb.CostModel(deck)
    src = wlb.LengthSource(deck)
    batches = [src.next() for _ in range(steps)]  # drawn outside the timed region
    rows = {}

    def per_pass(name, make, call):
        wall, cpu, plan_us = [], [], []
        for _ in range(passes):
            state = make()
            w, c = timed(lambda i: plan_us.append(call(state, i)), steps)
            wall += w
            cpu += c
        rows[name] = {"wall_us_median": statistics.median(wall), "wall_us_mean": statistics.fmean(wall),
                      "cpu_us_median": statistics.median(cpu), "cpu_us_mean": statistics.fmean(cpu),
                      "plan_us_mean": statistics.fmean(x for x in plan_us if x is not None) if any(
                          x is not None for x in plan_us) else None}

    per_pass("pack_documents", lambda: wlb.Packer(deck, packer_name, cost),
             lambda p, i: p.pack_documents(batches[i], i).plan_us)
    per_pass("pack", lambda: wlb.Packer(deck, packer_name, cost), lambda p, i: p.pack().plan_us)

    def with_arrays(p, i):
        plan = p.pack()
        plan.segments, plan.offsets  # noqa: B018 — the arrays a loader reads
        return plan.plan_us

    per_pass("pack+arrays", lambda: wlb.Packer(deck, packer_name, cost), with_arrays)
    try:
        from wlb.torch import PackedBatchSampler
    except ImportError:  # torch missing: the sampler row is left out
        return rows
    # the sampler needs a dataset's lengths: the generator's stream itself (same batches)
    lengths = np.concatenate([b.lengths for b in batches] + [src.next().lengths])

    def sampler_step(it, i):
        for _ in range(mbs):
            next(it)
        return None

    per_pass("sampler step",
             lambda: iter(PackedBatchSampler(deck, packer=packer_name, cost=cost, lengths=lengths)), sampler_step)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packer", default="wlb", help="packer name or 'all'")
    ap.add_argument("--windows", default="65536,131072")
    ap.add_argument("--micro-batches", default="16,64")
    ap.add_argument("--steps", type=int, default=256, help="global batches per pass")
    ap.add_argument("--passes", type=int, default=4, help="passes over the batches (a fresh packer each)")
    ap.add_argument("--json", help="write the results here as well")
    args = ap.parse_args(argv)
    packers = wlb.packer_names() if args.packer == "all" else [args.packer]
    results = []
    print(f"{'packer':<14} {'S/M':>9} {'call':<15} {'wall med':>9} {'wall mean':>9} {'cpu med':>8} {'cpu mean':>8} "
          f"{'plan_us':>8}   (µs per global batch)")
    for packer in packers:
        for window in (int(x) for x in args.windows.split(",")):
            for mbs in (int(x) for x in args.micro_batches.split(",")):
                steps = 8 if packer == "fixed_optimal" else args.steps
                rows = bench_case(packer, window, mbs, steps, args.passes)
                for name, r in rows.items():
                    pu = f"{r['plan_us_mean']:8.1f}" if r["plan_us_mean"] is not None else "       -"
                    print(f"{packer:<14} {window // 1024:>5}K/{mbs:<3} {name:<15} {r['wall_us_median']:9.1f} "
                          f"{r['wall_us_mean']:9.1f} {r['cpu_us_median']:8.1f} {r['cpu_us_mean']:8.1f} {pu}",
                          flush=True)
                    results.append({"packer": packer, "window": window, "micro_batches": mbs, "call": name, **r})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
