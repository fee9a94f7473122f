#!/usr/bin/python3
"""Where a measured multi-rank run loses time against the simulator's replay of the same
plans (docs/performance.md, "16-rank campaign").

    wlb simulate DECK --as-run --plans RUN_DIR --set hardware.profile='"PROFILE"' \
        --set data.seed=SEED --trace REPLAY.h5
    /usr/bin/python3 bench/sync_waits.py RUN_DIR/trace.h5 REPLAY.h5

Per strategy, over the measured and drain steps (warm-up left out):
- span: the step's wall time (first event to last), mean over steps, measured and replayed;
- regions: each region's time per rank and step, measured / replayed;
- collectives: each communication region split into its transfer (the shortest member's
  duration, summed over the members: the last to arrive waits for nobody) and the waiting
  of the members that arrived earlier;
- skew: per micro-batch and CP group, the compute (attn, qkv_proj, out_proj, mlp) of the
  group's slowest rank over the group's mean, measured and replayed; and the seconds per
  step the group's ranks wait for its slowest at those points;
- rank speed: each rank's measured compute over its replayed compute (the same work),
  relative to the mean of that ratio over the ranks: 1 everywhere on ranks of equal speed.
"""

import argparse
import collections
import sys

import h5py
import numpy as np

COMPUTE = ("attn", "qkv_proj", "out_proj", "mlp")
# the members of one instance of a collective: mesh coordinates that stay fixed
COLLECTIVES = {"kv_exchange": ("tp", "pp", "dp"), "kv_allgather": ("tp", "pp", "dp"),
               "tp_allreduce": ("cp", "pp", "dp"), "grad_allreduce": ("tp", "cp", "pp")}


def text(v):
    return v.decode() if isinstance(v, bytes) else str(v)


class Trace:
    def __init__(self, path):
        with h5py.File(path, "r") as f:
            self.ev = f["events"][:]
            self.regions = [text(r) for r in f["regions"][:]]
            self.strategies = [text(s) for s in f["meta/strategies"][:]]
            ranks = f["ranks"][:]
            self.warmup = int(f["meta"].attrs.get("warmup", 0))  # steps 0 .. warmup-1 are left out
        self.coord = {int(r["rank"]): {k: int(r[k]) for k in ("tp", "cp", "pp", "dp")} for r in ranks}
        self.nranks = len(self.coord)

    def region_ids(self, names):
        return [self.regions.index(n) for n in names if n in self.regions]

    def events(self, strategy):
        si = self.strategies.index(strategy)
        return self.ev[(self.ev["strategy"] == si) & (self.ev["step"] >= self.warmup)]


def seconds(e):
    return (e["end_ns"] - e["start_ns"]) / 1e9


def span(e):
    steps = np.unique(e["step"])
    return np.mean([(e["end_ns"][e["step"] == s].max() - e["start_ns"][e["step"] == s].min()) / 1e9 for s in steps])


def regions(t, e, nsteps):
    out = {}
    for ri in np.unique(e["region"]):
        out[t.regions[ri]] = seconds(e[e["region"] == ri]).sum() / t.nranks / nsteps
    return out


def collectives(t, e, nsteps):
    out = {}
    for name, fixed in COLLECTIVES.items():
        ids = t.region_ids([name])
        if not ids:
            continue
        m = e[e["region"] == ids[0]]
        if len(m) == 0:
            continue
        groups = collections.defaultdict(list)
        seen = collections.Counter()
        for x in m:
            c = t.coord[int(x["rank"])]
            key = (int(x["step"]), int(x["micro_batch"]), int(x["layer"]), int(x["phase"]), int(x["chunk"]),
                   tuple(c[k] for k in fixed))
            seen[key + (int(x["rank"]),)] += 1  # the n-th call of this rank at this point
            groups[key + (seen[key + (int(x["rank"]),)],)].append((x["end_ns"] - x["start_ns"]) / 1e9)
        transfer = sum(min(d) * len(d) for d in groups.values())
        total = sum(sum(d) for d in groups.values())
        out[name] = (transfer / t.nranks / nsteps, (total - transfer) / t.nranks / nsteps)
    return out


def compute_by_group(t, e):
    """(step, micro_batch, tp, pp, dp) -> {cp: compute seconds}; rank -> compute seconds."""
    m = e[np.isin(e["region"], t.region_ids(COMPUTE))]
    groups = collections.defaultdict(lambda: collections.defaultdict(float))
    per_rank = collections.defaultdict(float)
    for x, d in zip(m, seconds(m)):
        c = t.coord[int(x["rank"])]
        groups[(int(x["step"]), int(x["micro_batch"]), c["tp"], c["pp"], c["dp"])][c["cp"]] += d
        per_rank[int(x["rank"])] += d
    return groups, per_rank


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("measured", help="trace.h5 of a wlb run")
    ap.add_argument("replay", help="the --trace of wlb simulate --as-run --plans of that run")
    a = ap.parse_args()
    try:
        meas, rep = Trace(a.measured), Trace(a.replay)
    except (OSError, KeyError) as err:
        print(f"sync_waits: error: {err}", file=sys.stderr)
        return 2
    if meas.nranks != rep.nranks or meas.strategies != rep.strategies:
        print("sync_waits: error: the traces differ in ranks or strategies (not a replay of this run)", file=sys.stderr)
        return 2
    for s in meas.strategies:
        em, er = meas.events(s), rep.events(s)
        nm, nr = len(np.unique(em["step"])), len(np.unique(er["step"]))
        sm, sr = span(em), span(er)
        print(f"{s}: {nm} steps measured, {nr} replayed; step span measured {sm:.3f} s, replayed {sr:.3f} s "
              f"({100 * (sr / sm - 1):+.1f}%)")
        rm, rr = regions(meas, em, nm), regions(rep, er, nr)
        print("  per rank and step [s], measured/replayed: " + "  ".join(
            f"{k} {rm.get(k, 0):.3f}/{rr.get(k, 0):.3f}" for k in sorted(set(rm) | set(rr))
            if max(rm.get(k, 0), rr.get(k, 0)) >= 5e-4))
        for name, (x, w) in collectives(meas, em, nm).items():
            print(f"  {name} measured per rank and step: transfer {x:.3f} s + waiting for peers {w:.3f} s")
        gm, pm = compute_by_group(meas, em)
        gr, pr = compute_by_group(rep, er)
        keys = [k for k in gm if k in gr and len(gm[k]) > 1]
        if keys:
            def skew(g):
                return np.mean([max(g[k].values()) / np.mean(list(g[k].values())) for k in keys])

            def wait(g, n):
                return sum(max(g[k].values()) * len(g[k]) - sum(g[k].values()) for k in keys) / meas.nranks / n
            print(f"  CP-group skew (slowest rank's compute / group mean, per micro-batch): measured {skew(gm):.3f}, "
                  f"replayed {skew(gr):.3f}; ranks waiting for the slowest: {wait(gm, nm):.3f} vs {wait(gr, nr):.3f} "
                  f"s per rank and step")
        speed = {r: pm[r] / pr[r] for r in pm if pr.get(r, 0) > 0}
        if speed:
            mean = np.mean(list(speed.values()))
            speed = {r: x / mean for r, x in speed.items()}
            v = np.array(list(speed.values()))
            print(f"  rank time for the same work, over the ranks' mean (measured / replayed compute): min {v.min():.3f} (rank "
                  f"{min(speed, key=speed.get)}), max {v.max():.3f} (rank {max(speed, key=speed.get)}), "
                  f"spread {v.max() / v.min():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
