#!/usr/bin/env python3
"""The paper-scale table of docs/performance.md ("SlimPack at the paper's scale") against
its raw results, bench/results/cpu/slimpack_paper_scale/<mix>/simulate.csv: every row's
throughput, speedup and 95% interval, bubble, peak GB per stage and fit, within the
table's rounding. Prints the tolerance and each mismatch; exit 1 on any.

    /usr/bin/python3 bench/check_paper_table.py [--root .]
"""
import argparse
import csv
import pathlib
import re
import sys

ROW = re.compile(r"^\| (\S+) \| [^|]+ \| (code|pile|wikipedia) \| (plain|best-fit|wlb|slimpack) \| ([0-9.]+) \| "
                 r"\**([0-9.]+)×(?: \[([0-9.]+)–([0-9.]+)\])?\** \| ([0-9.]+) \| ([0-9./]+) \| (yes|no) \|$", re.M)
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
    bad, n = [], 0
    for m in ROW.finditer(doc):
        case, mix, strat = m.group(1), m.group(2), STRATEGY[m.group(3)]
        r = runs.get((case, mix, strat))
        where = f"{case} {mix} {m.group(3)}"
        if r is None:
            bad.append(f"{where}: no raw result")
            continue
        n += 1
        want = [(float(m.group(4)), float(r["tokens_per_second"]) / 1000, 0.05, "ktok/s"),
                (float(m.group(5)), float(r["speedup"]), 0.005, "speedup"),
                (float(m.group(8)), float(r["bubble_fraction"]), 0.005, "bubble")]
        if m.group(6):
            want += [(float(m.group(6)), float(r["speedup_lo"]), 0.005, "interval low"),
                     (float(m.group(7)), float(r["speedup_hi"]), 0.005, "interval high")]
        peaks = [float(x) for x in r["peak_gb_per_stage"].split(";")]
        shown = m.group(9).split("/")
        if len(shown) != len(peaks):
            bad.append(f"{where}: {len(shown)} stages shown, {len(peaks)} in the raw result")
        for s, p in zip(shown, peaks):
            want.append((float(s), p, 0.005 if "." in s else 0.5, "peak GB"))
        for doc_v, raw_v, tol, what in want:
            if abs(doc_v - raw_v) > tol + 1e-9:
                bad.append(f"{where}: {what} {doc_v} in the table, {raw_v:.4f} raw (tolerance {tol})")
        if (m.group(10) == "yes") != (r["fits_memory"] == "1"):
            bad.append(f"{where}: fits {m.group(10)} in the table, fits_memory {r['fits_memory']} raw")
    if n == 0:
        bad.append("no table row found")
    for b in bad:
        print("MISMATCH", b)
    print(f"paper-scale table: {n} rows against bench/results/cpu/slimpack_paper_scale; tolerance: the table's "
          f"rounding (ktok/s 0.05, speedup, interval and bubble 0.005, peak GB 0.5 or 0.005): "
          f"{'PASS' if not bad else 'FAIL'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
