#!/usr/bin/env python3
"""The paper-scale table of docs/performance.md ("SlimPack at the paper's scale") against
its raw results, bench/results/cpu/slimpack_paper_scale/<mix>/simulate.csv: every row's
mesh, throughput, speedup and 95% interval, bubble, peak GB per stage and fit, within the
table's rounding, and its recompute against the case's deck (inputs/paper/). Every line
of the table must be a row it reads, and every raw result must have its row. Prints the
tolerance and each mismatch; exit 1 on any.

    /usr/bin/python3 bench/check_paper_table.py [--root .]
"""
import argparse
import csv
import pathlib
import re
import sys
import tomllib

MARKER = "<!-- figures: bench/check_paper_table.py -->"
ROW = re.compile(r"^\| (\S+) \| ([0-9×]+), (none|selective|full) \| (code|pile|wikipedia) \| (plain|best-fit|wlb|slimpack) \| ([0-9.]+) \| "
                 r"\**([0-9.]+)×(?: \[([0-9.]+)–([0-9.]+)\])?\** \| ([0-9.]+) \| ([0-9./]+) \| (yes|no) \|$")
STRATEGY = {"plain": "plain", "best-fit": "best_fit", "wlb": "wlb", "slimpack": "slimpack"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=".", help="the repository")
    root = pathlib.Path(ap.parse_args().root)
    doc = (root / "docs/performance.md").read_text()
    runs = {}
    for mix in ("code", "pile", "wikipedia"):
        for r in csv.DictReader(open(root / f"bench/results/cpu/slimpack_paper_scale/{mix}/simulate.csv")):
            runs[(r["case"].replace("slimpack-", ""), mix, r["strategy"].split("+")[0])] = r
    bad, n, seen = [], 0, set()
    if MARKER not in doc:
        bad.append(f"no table after {MARKER}")
    lines = doc.split(MARKER, 1)[-1].lstrip("\n").splitlines()
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append(line)
    for line in table[2:]:  # after the header and the rule
        m = ROW.match(line)
        if m is None:
            bad.append(f"a table line that is no row: {line}")
            continue
        case, mesh, recompute, mix, strat = m.group(1), m.group(2), m.group(3), m.group(4), STRATEGY[m.group(5)]
        r = runs.get((case, mix, strat))
        where = f"{case} {mix} {m.group(5)}"
        if r is None:
            bad.append(f"{where}: no raw result")
            continue
        if (case, mix, strat) in seen:
            bad.append(f"{where}: two rows")
        seen.add((case, mix, strat))
        n += 1
        if mesh.replace("×", "x") != r["mesh"]:
            bad.append(f"{where}: mesh {mesh} in the table, {r['mesh']} raw")
        deck = root / f"inputs/paper/slimpack-{case}.toml"
        want_rc = tomllib.loads(deck.read_text()).get("pipeline", {}).get("recompute", "none") if deck.exists() else None
        if recompute != want_rc:
            bad.append(f"{where}: recompute {recompute} in the table, {want_rc} in {deck.name}")
        want = [(float(m.group(6)), float(r["tokens_per_second"]) / 1000, 0.05, "ktok/s"),
                (float(m.group(7)), float(r["speedup"]), 0.005, "speedup"),
                (float(m.group(10)), float(r["bubble_fraction"]), 0.005, "bubble")]
        if m.group(8):
            want += [(float(m.group(8)), float(r["speedup_lo"]), 0.005, "interval low"),
                     (float(m.group(9)), float(r["speedup_hi"]), 0.005, "interval high")]
        peaks = [float(x) for x in r["peak_gb_per_stage"].split(";")]
        shown = m.group(11).split("/")
        if len(shown) != len(peaks):
            bad.append(f"{where}: {len(shown)} stages shown, {len(peaks)} in the raw result")
        for s, p in zip(shown, peaks):
            want.append((float(s), p, 0.005 if "." in s else 0.5, "peak GB"))
        for doc_v, raw_v, tol, what in want:
            if abs(doc_v - raw_v) > tol + 1e-9:
                bad.append(f"{where}: {what} {doc_v} in the table, {raw_v:.4f} raw (tolerance {tol})")
        if (m.group(12) == "yes") != (r["fits_memory"] == "1"):
            bad.append(f"{where}: fits {m.group(12)} in the table, fits_memory {r['fits_memory']} raw")
    for key in sorted(set(runs) - seen):
        bad.append(f"{' '.join(key)}: a raw result without its row")
    for b in bad:
        print("MISMATCH", b)
    print(f"paper-scale table: {n} rows against bench/results/cpu/slimpack_paper_scale; tolerance: the table's "
          f"rounding (ktok/s 0.05, speedup, interval and bubble 0.005, peak GB 0.5 or 0.005): "
          f"{'PASS' if not bad else 'FAIL'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
