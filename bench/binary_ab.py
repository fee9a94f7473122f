#!/usr/bin/env python3
"""Two `wlb` binaries on the same deck, interleaved: the throughput ratio new / old.

    /usr/bin/python3 bench/binary_ab.py --old OLD/wlb --new build/bin/wlb \
        --deck inputs/run_cp2.toml --ranks 2 --rounds 3 [--set KEY=VALUE ...]

Each round runs `mpirun -n RANKS BIN run DECK --quiet` with the old binary, then the new
one (A B A B ...: a slow drift of the machine hits both alike), each into its own output
directory, and reads every strategy's tokens/s and useful FLOP/s from the run's
summary.json (docs/runtime.md). Per strategy it prints the median of the per-round ratios
new / old and their range, for tokens/s and for useful FLOP/s (the second differs from the
first when the binaries count different work, e.g. a model with more ops). Raw per-round
figures go to --json. With --region LABEL (repeatable) it also reads each run's trace and
reports the seconds per measured step spent in that region (the trace's events of that
label, summed per rank, mean over ranks; docs/trace-schema.md), old and new and their
ratio: a change inside one region shows there undiluted by the rest of the step (no ratio,
"-", for a region one side never records).
--old-set / --new-set (repeatable) override a key on one side only, so one binary can be
compared with itself under two settings (--old and --new the same file). Needs OpenMPI's
mpirun (`source run/mpienv` as root).
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "analysis"))


def region_seconds(trace_path, labels):
    """Seconds per measured step in each region label, per strategy: {strategy: {label: s}}."""
    import numpy as np
    import wlb_metrics
    import wlb_trace
    tr = wlb_trace.load(str(trace_path))
    ev = tr.events
    ranks = len(np.unique(ev["rank"])) or 1
    out = {}
    for si, name in enumerate(tr.strategies):
        steps = [s for s in wlb_metrics.steps_of(tr, si) if wlb_metrics.step_kind(tr, s) == "measured"]
        out[name] = {}
        for label in labels:
            rid = tr.region_id(label)
            if rid < 0:  # a binary older than the label: none recorded (main() refuses a label no trace has)
                out[name][label] = 0.0
                continue
            sel = (ev["strategy"] == si) & (ev["region"] == rid) & np.isin(ev["step"], steps)
            ns = float(np.sum(ev["end_ns"][sel] - ev["start_ns"][sel]))
            out[name][label] = ns / 1e9 / ranks / max(len(steps), 1)
    return out


def run_once(binary, deck, ranks, sets, out_dir, regions=()):
    cmd = ["mpirun", "-n", str(ranks), binary, "run", deck, "--quiet", "--set", f'output.dir="{out_dir}"']
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    summary = json.loads((pathlib.Path(out_dir) / "summary.json").read_text())
    out = {s["strategy"]: {"tokens_per_second": s["tokens_per_second"],
                           "flops_per_second": s["useful_flops_per_second"]} for s in summary["strategies"]}
    if regions:
        for name, secs in region_seconds(pathlib.Path(out_dir) / summary["trace"], regions).items():
            out[name]["region_seconds"] = secs
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--deck", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="deck override for both binaries")
    ap.add_argument("--old-set", action="append", default=[], help="deck override for the old side only")
    ap.add_argument("--new-set", action="append", default=[], help="deck override for the new side only")
    ap.add_argument("--json", type=pathlib.Path, help="raw per-round figures")
    ap.add_argument("--region", action="append", default=[],
                    help="also report the seconds per step in this trace region (repeatable)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds: must be >= 1 (got {a.rounds})")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="wlb-ab-") as tmp:
        for r in range(a.rounds):
            row = {}
            for tag, binary, own in (("old", a.old, a.old_set), ("new", a.new, a.new_set)):
                row[tag] = run_once(binary, a.deck, a.ranks, a.set + own, f"{tmp}/{tag}{r}", a.region)
            rounds.append(row)
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(f"{'strategy':<10} {'old ktok/s':>11} {'new ktok/s':>11} {'tok/s new/old':>14} {'[range]':>15} "
          f"{'FLOP/s new/old':>15} {'[range]':>15}")
    result = {}
    for name in rounds[0]["old"]:
        tok = [r["new"][name]["tokens_per_second"] / r["old"][name]["tokens_per_second"] for r in rounds]
        flo = [r["new"][name]["flops_per_second"] / r["old"][name]["flops_per_second"] for r in rounds]
        old_k = statistics.median(r["old"][name]["tokens_per_second"] for r in rounds) / 1e3
        new_k = statistics.median(r["new"][name]["tokens_per_second"] for r in rounds) / 1e3
        result[name] = {"tokens_ratio_median": statistics.median(tok), "tokens_ratio_range": [min(tok), max(tok)],
                        "flops_ratio_median": statistics.median(flo), "flops_ratio_range": [min(flo), max(flo)]}
        print(f"{name:<10} {old_k:11.2f} {new_k:11.2f} {statistics.median(tok):13.3f}x "
              f"{'[%.3f-%.3f]' % (min(tok), max(tok)):>15} {statistics.median(flo):14.3f}x "
              f"{'[%.3f-%.3f]' % (min(flo), max(flo)):>15}")
    for label in a.region:  # a typo, or a label neither binary records
        if not any(r[t][n]["region_seconds"][label] > 0 for r in rounds for t in ("old", "new") for n in r[t]):
            sys.exit(f"--region {label}: no events of that label in any run of either binary")
    if a.region:
        print(f"{'strategy':<10} {'region':<14} {'old s/step':>11} {'new s/step':>11} {'new/old':>9} {'[range]':>15}")
    for name in rounds[0]["old"] if a.region else []:
        for label in a.region:
            old = [r["old"][name]["region_seconds"][label] for r in rounds]
            new = [r["new"][name]["region_seconds"][label] for r in rounds]
            # a region only one side records (pipeline.recompute's `recompute`) has no ratio
            q = [n / o for n, o in zip(new, old)] if all(o > 0 for o in old) else []
            result[name].setdefault("regions", {})[label] = {
                "old_median": statistics.median(old), "new_median": statistics.median(new),
                "ratio_median": statistics.median(q) if q else None, "ratio_range": [min(q), max(q)] if q else None}
            ratio = f"{statistics.median(q):8.3f}x {'[%.3f-%.3f]' % (min(q), max(q)):>15}" if q else f"{'-':>9} {'-':>15}"
            print(f"{name:<10} {label:<14} {statistics.median(old):11.4f} {statistics.median(new):11.4f} {ratio}")
    if a.json:
        a.json.write_text(json.dumps({"deck": a.deck, "ranks": a.ranks, "sets": a.set, "rounds": rounds,
                                      "ratios": result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
