#!/usr/bin/env python3
"""Planning time of one CP sharding strategy against the CP degree, two `wlb` binaries
interleaved on the same micro-batches, and a check that both chose the same plans.

    /usr/bin/python3 bench/shard_scaling.py --old OLD/wlb --new build/bin/wlb \
        --deck inputs/shard_long_context.toml --cp 8 32 128 512 --rounds 3

Per CP degree and round it runs `BIN shard DECK --steps STEPS --strategy S --comm C
--metrics-only --out FILE --set mesh.cp=CP --set cp.strategy=S --set cp.comm=C` (S and C
are then also the deck's chosen plan, so nothing else is planned) with the old binary,
then the new one, and times the whole process (the deck, profile and packing take a fixed
part; the rest is planning). The two JSONL files must agree on every micro-batch's plan
metrics (the chosen metrics and the compared row: latency, bytes, imbalance, sharded
segments); the summary line, which may carry fields one binary lacks, is not compared.
Prints per CP degree the median wall and its range per binary, old / new, the new
binary's wall per micro-batch and its own plan.us (mean, max per micro-batch; medians over
the rounds), and the peak resident memory of each binary (max over rounds).
"""
import argparse
import json
import pathlib
import os
import statistics
import subprocess
import sys
import tempfile
import time


def run_once(binary, args, out):
    """(wall seconds, peak resident MiB, stdout) of one run; os.wait4 gives this child's own rusage."""
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        p = subprocess.Popen([binary, *args, "--out", str(out)], stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
    if p.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed ({p.returncode}):\n{text}")
    return wall, usage.ru_maxrss / 1024, text


def plans(path):
    """The micro-batch lines' chosen metrics and compared rows, in order."""
    out = []
    for line in path.read_text().splitlines():
        j = json.loads(line)
        if j["type"] == "micro_batch":
            out.append(json.dumps([j["metrics"], j["compare"]], sort_keys=True))
    return out


def plan_us(stdout, strategy, comm):
    for line in stdout.splitlines():
        f = line.split()
        if f[:2] == [strategy, comm] and len(f) >= 12:
            return float(f[10]), float(f[11])
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--deck", required=True)
    ap.add_argument("--cp", type=int, nargs="+", required=True)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--strategy", default="hybrid")
    ap.add_argument("--comm", default="sharding_aware")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds: must be >= 1 (got {a.rounds})")
    print(f"# {a.strategy} + {a.comm}, {a.deck}, {a.steps} step(s), {a.rounds} rounds, old then new per round")
    print(f"{'cp':>5} {'mbs':>4} {'old_s':>8} {'old_lo':>8} {'old_hi':>8} {'new_s':>8} {'new_lo':>8} {'new_hi':>8}"
          f" {'old/new':>8} {'new_ms/mb':>10} {'plan.us':>10} {'plan.us.mx':>10} {'old_MiB':>8} {'new_MiB':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for cp in a.cp:
            args = ["shard", a.deck, "--steps", str(a.steps), "--strategy", a.strategy, "--comm", a.comm,
                    "--metrics-only", "--set", f"mesh.cp={cp}", "--set", f'cp.strategy="{a.strategy}"',
                    "--set", f'cp.comm="{a.comm}"']
            walls = {"old": [], "new": []}
            rss = {"old": 0, "new": 0}
            us = []
            for r in range(a.rounds):
                got = {}
                for name, binary in (("old", a.old), ("new", a.new)):
                    out = pathlib.Path(tmp) / f"{name}.jsonl"
                    wall, m, stdout = run_once(binary, args, out)
                    walls[name].append(wall)
                    rss[name] = max(rss[name], m)
                    got[name] = plans(out)
                    row_us = plan_us(stdout, a.strategy, a.comm) if name == "new" else None
                    if row_us:
                        us.append(row_us)
                if got["old"] != got["new"]:
                    sys.exit(f"cp {cp} round {r}: the binaries chose different plans")
            mbs = len(got["new"])
            if mbs == 0:
                sys.exit(f"cp {cp}: no micro-batches")
            us = (statistics.median(u[0] for u in us), statistics.median(u[1] for u in us)) if us else None
            o, n = statistics.median(walls["old"]), statistics.median(walls["new"])
            print(f"{cp:>5} {mbs:>4} {o:>8.3f} {min(walls['old']):>8.3f} {max(walls['old']):>8.3f} {n:>8.3f}"
                  f" {min(walls['new']):>8.3f} {max(walls['new']):>8.3f} {o / n:>8.2f} {1e3 * n / mbs:>10.2f}"
                  f" {us[0] if us else float('nan'):>10.1f} {us[1] if us else float('nan'):>10.1f}"
                  f" {rss['old']:>8.1f} {rss['new']:>8.1f}", flush=True)
    print("same plans: yes (every micro-batch's plan metrics equal, every CP degree and round)")


if __name__ == "__main__":
    main()
