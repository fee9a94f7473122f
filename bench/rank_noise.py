#!/usr/bin/python3
"""How a multi-rank run's compute time varies beyond the plan (docs/performance.md, "16-rank
campaign"): the time scales behind the profile's rank_speed.

    /usr/bin/python3 bench/rank_noise.py RUN_DIR/trace.h5 [more traces]

Per strategy, over the measured and drain steps, with a stage task the compute (attn,
qkv_proj, out_proj, mlp) of one rank for one micro-batch and phase, and its reference the
mean log time of the same micro-batch's stage tasks on the ranks of the same TP and CP
coordinate and replica (other stages: the same work, at other times):
- task sd: the standard deviation of a stage task's log time around its reference, less its
  rank's mean (pipeline decks only: without pp > 1 there is no other stage);
- step sd: of a rank's compute in one step around the replica's other stages, less its
  rank's mean (pipeline decks);
- lag-1 / lag-4: autocorrelation of a rank's task deviations in time order (a slow period
  spans several tasks when they are short);
- busy ranks: correlation of a task's deviation with how many ranks computed during it
  (0 when a rank's speed does not depend on the host's load);
- time correlation (every deck): a layer task's log time around its sync group (the TP x CP
  ranks of the same layer, micro-batch and replica; without TP and CP, the same
  micro-batch's layers on the other stages), each rank's mean removed; the correlation of
  two tasks of one rank by the time between their starts (how long a slow period lasts).
"""

import argparse
import collections
import sys

import numpy as np

from sync_waits import COMPUTE, Trace

ANY = COMPUTE + ("norm", "loss", "embed")


def pooled_sd(dev, rank):
    """sd of deviations less each rank's mean, with the rank means' degrees of freedom."""
    x = dev.copy()
    for r in np.unique(rank):
        x[rank == r] -= x[rank == r].mean()
    df = len(x) - len(np.unique(rank))
    return float(np.sqrt((x ** 2).sum() / df)) if df > 0 else float("nan"), x


LAGS = (0.1, 0.5, 2.0, 5.0)  # seconds: the upper edges of the time-correlation bins


def time_correlation(e, comp, coord):
    """Correlation of a rank's layer-task deviations by the time between their starts."""
    tasks, start = collections.defaultdict(float), {}
    for r in e[np.isin(e["region"], comp)]:
        k = (int(r["rank"]), int(r["step"]), int(r["micro_batch"]), int(r["layer"]), int(r["phase"]))
        tasks[k] += (r["end_ns"] - r["start_ns"]) / 1e9
        start[k] = min(start.get(k, np.inf), r["start_ns"] / 1e9)
    peers = max(c[0] for c in coord.values()) + max(c[1] for c in coord.values()) > 0  # TP or CP

    def group(k):
        t, c, p, d = coord[k[0]]
        return (k[1], k[2], k[3], k[4], p, d) if peers else (k[1], k[2], k[4], d)
    groups = collections.defaultdict(list)
    for k, v in tasks.items():
        groups[group(k)].append(np.log(v))
    per_rank = collections.defaultdict(list)
    for k, v in tasks.items():
        g = groups[group(k)]
        if len(g) > 1:
            per_rank[k[0]].append((start[k], np.log(v) - np.mean(g)))
    num, cnt, var = np.zeros(len(LAGS) + 1), np.zeros(len(LAGS) + 1), []
    for items in per_rank.values():
        items.sort()
        t = np.array([a for a, _ in items])
        y = np.array([b for _, b in items])
        y -= y.mean()
        var.append(np.mean(y * y))
        for lag in range(1, min(400, len(y))):
            at = np.searchsorted(LAGS, t[lag:] - t[:-lag])
            np.add.at(num, at, y[lag:] * y[:-lag])
            np.add.at(cnt, at, 1)
    if not var:
        return "no layer task has a group"
    c0 = float(np.mean(var))
    edges = ("0", *(f"{x:g}" for x in LAGS))
    cells = [f"{lo}-{hi} s {num[i] / cnt[i] / c0:+.2f}" for i, (lo, hi) in enumerate(zip(edges, edges[1:]))
             if cnt[i] >= 200]
    return f"time correlation (log sd {np.sqrt(c0):.3f}): " + ", ".join(cells)


def analyse(path):
    trace = Trace(path)
    ev = trace.ev
    coord = {r: (c["tp"], c["cp"], c["pp"], c["dp"]) for r, c in trace.coord.items()}
    comp, busy_ids = trace.region_ids(COMPUTE), trace.region_ids(ANY)
    print(f"== {path}")
    for si, name in enumerate(trace.strategies):
        e = ev[(ev["strategy"] == si) & (ev["step"] >= trace.warmup)]  # warm-up left out
        busy = e[np.isin(e["region"], busy_ids)]
        edges = np.concatenate([busy["start_ns"], busy["end_ns"]])
        order = np.argsort(edges, kind="stable")
        times = edges[order]
        level = np.cumsum(np.concatenate([np.ones(len(busy)), -np.ones(len(busy))])[order])
        tasks = collections.defaultdict(float)
        span = {}
        step_time = collections.defaultdict(float)
        for r in e[np.isin(e["region"], comp)]:
            k = (int(r["rank"]), int(r["step"]), int(r["micro_batch"]), int(r["phase"]))
            tasks[k] += (r["end_ns"] - r["start_ns"]) / 1e9
            a, b = span.get(k, (np.iinfo(np.int64).max, 0))
            span[k] = (min(a, int(r["start_ns"])), max(b, int(r["end_ns"])))
            step_time[k[:2]] += (r["end_ns"] - r["start_ns"]) / 1e9

        def ref(k):  # other stages of the same (tp, cp, replica)
            t, c, _, d = coord[k[0]]
            return (t, c, d) + tuple(k[1:])

        groups = collections.defaultdict(list)
        for k, v in tasks.items():
            groups[ref(k)].append(np.log(v))
        keys = [k for k in tasks if len(groups[ref(k)]) > 1]
        print(f"{name}: {time_correlation(e, comp, coord)}")
        if not keys:
            print(f"{name}: no other stage holds the same work (pp = 1)")
            continue
        dev = np.array([np.log(tasks[k]) - np.mean(groups[ref(k)]) for k in keys])
        rank = np.array([k[0] for k in keys])
        task_sd, centred = pooled_sd(dev, rank)
        # step: a rank's compute in a step against the other stages of its replica
        sg = collections.defaultdict(list)
        for (r, s), v in step_time.items():
            t, c, _, d = coord[r]
            sg[(t, c, d, s)].append(np.log(v))
        sk = [(r, s) for (r, s) in step_time if len(sg[coord[r][:2] + (coord[r][3], s)]) > 1]
        sdev = np.array([np.log(step_time[k]) - np.mean(sg[coord[k[0]][:2] + (coord[k[0]][3], k[1])]) for k in sk])
        step_sd, _ = pooled_sd(sdev, np.array([k[0] for k in sk]))
        # autocorrelation in each rank's time order, and the host's load during a task
        lag1, lag4 = [], []
        for r in np.unique(rank):
            idx = np.where(rank == r)[0]
            x = centred[idx[np.argsort([span[keys[i]][0] for i in idx])]]
            if len(x) > 8:
                lag1.append(np.corrcoef(x[:-1], x[1:])[0, 1])
                lag4.append(np.corrcoef(x[:-4], x[4:])[0, 1])

        def load(a, b):
            i, j = np.searchsorted(times, a, side="right"), np.searchsorted(times, b, side="left")
            ts = np.concatenate([[a], times[i:j], [b]])
            return float(np.sum(np.diff(ts) * level[i - 1:j])) / max(1, b - a)

        busy_ranks = np.array([load(*span[k]) for k in keys])
        corr = np.corrcoef(busy_ranks, centred)[0, 1]
        dur = np.median([tasks[k] for k in keys]) * 1e3
        print(f"{name}: {len(keys)} stage tasks, median {dur:.1f} ms; task sd {task_sd:.3f}, step sd {step_sd:.3f}; "
              f"lag-1 {np.mean(lag1):.2f}, lag-4 {np.mean(lag4):.2f}; busy ranks {busy_ranks.mean():.1f} "
              f"(corr with the deviation {corr:+.3f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    a = ap.parse_args()
    for t in a.traces:
        try:
            analyse(t)
        except (OSError, KeyError, ValueError) as e:
            print(f"rank_noise.py: {t}: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
