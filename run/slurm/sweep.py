"""Submit a wlb deck's [sweep] as a Slurm job array: one array task per case.

Run through run/slurm/sweep (see docs/slurm.md):

    run/slurm/sweep DECK [--subcommand run|simulate|plan|...] [--set table.key=value ...]
                    [--wait] [--timeout S] [--sbatch-arg ARG ...] [--dry-run]

How the cases are found: `wlb validate DECK --set ... --cases` prints the resolved deck
(including its [sweep] table) and every case's output.dir. Its case list names only the
directories, so the key/value pairs of each case are rebuilt from the resolved [sweep]
table in wlb::expandSweep's order (keys sorted, first key fastest) and checked against
those directories. Each task then runs the deck *without* its [sweep] table (so that
subcommands that expand sweeps themselves, like `simulate`, run just their case) with the
case's values and output.dir passed as --set overrides.

Cases that need different rank counts (a sweep over the mesh) are submitted as one array
per rank count. Exit status: 0 if submitted (and, with --wait, all tasks COMPLETED),
1 if a task failed or timed out, 2 on bad input.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # pragma: no cover - older Pythons on clusters
    try:
        import tomli as tomllib  # type: ignore
    except ModuleNotFoundError:
        sys.exit("sweep: needs Python >= 3.11 (tomllib) or the 'tomli' module")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TEMPLATE = HERE / "wlb.sbatch"
MPI_SUBCOMMANDS = os.environ.get("WLB_MPI_SUBCOMMANDS", "run mesh").split()


class InputError(Exception):
    pass


def log(msg: str) -> None:
    print(f"sweep: {msg}", file=sys.stderr, flush=True)


def toml_literal(v) -> str:
    """A TOML literal as wlb prints it (literalOf / formatDouble / quote in deck.cpp)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        s = repr(v)
        return s if any(c in s for c in ".eEn") else s + ".0"
    if isinstance(v, str):
        out = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
        return f'"{out}"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_literal(e) for e in v) + "]"
    raise InputError(f"unsupported value in [sweep]: {v!r}")


def run_wlb(wlb: str, args: list[str]) -> str:
    p = subprocess.run([wlb, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise InputError(f"'wlb {' '.join(shlex.quote(a) for a in args)}' failed with exit {p.returncode}")
    return p.stdout


def wlb_subcommands(wlb: str) -> list[str]:
    """Subcommand names from `wlb --help` (empty if the help text has no such list)."""
    text = subprocess.run([wlb, "--help"], capture_output=True, text=True).stdout
    m = re.search(r"^Subcommands:\s*$(.*)", text, re.M | re.S)
    return re.findall(r"^  (\S+)", m.group(1), re.M) if m else []


def parse_validate(text: str) -> tuple[dict, list[str]]:
    """Split `wlb validate --cases` output into (resolved deck, case output dirs)."""
    m = re.search(r"^# (\d+) sweep case\(s\)\s*$", text, re.M)
    head = text[: m.start()] if m else text
    dirs = []
    if m:
        for line in text[m.end():].splitlines():
            if line.startswith("#   "):
                dirs.append(line[4:])
        if len(dirs) != int(m.group(1)):
            raise InputError(f"wlb printed {m.group(1)} case(s) but listed {len(dirs)}")
    try:
        resolved = tomllib.loads(head)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"cannot parse the resolved deck printed by 'wlb validate': {e}")
    return resolved, dirs


def flatten_sweep(sweep: dict) -> dict[str, list]:
    """[sweep] as {"table.key": [values]} (quoted dotted keys or nested tables)."""
    flat = {}
    for k1, v1 in sweep.items():
        if isinstance(v1, dict):
            for k2, v2 in v1.items():
                flat[f"{k1}.{k2}"] = v2
        else:
            flat[k1] = v1
    return flat


def expand_cases(sweep: dict[str, list]) -> list[list[tuple[str, object]]]:
    """Cartesian product in wlb::expandSweep order: keys sorted, the first key fastest."""
    if not sweep:
        return [[]]
    axes = sorted(sweep.items())
    cases = []
    for combo in itertools.product(*[vals for _, vals in reversed(axes)]):
        values = list(reversed(combo))
        cases.append([(axes[a][0], values[a]) for a in range(len(axes))])
    return cases


def case_suffix(case: list[tuple[str, object]]) -> str:
    return "_".join(f"{k}-{toml_literal(v).replace(chr(34), '')}" for k, v in case)


SWEEP_HEADER = re.compile(r"^\s*\[\s*(\"sweep\"|'sweep'|sweep)\s*[.\]]")
TABLE_HEADER = re.compile(r"^\s*\[")


def strip_sweep(text: str) -> str:
    """The deck text without its [sweep] table(s); verified with tomllib by the caller."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if SWEEP_HEADER.match(line):
            skipping = True
            continue
        if skipping and TABLE_HEADER.match(line) and not line.lstrip().startswith("[["):
            skipping = False
        if not skipping:
            out.append(line)
    return "".join(out)


def path_fixes(deck_path: Path, deck: dict, job_deck_dir: Path) -> list[str]:
    """--set overrides that keep deck-relative file names working from another directory.

    wlb resolves a relative file name against the deck's directory first, then the working
    directory; the job deck lives elsewhere, so names found next to the original deck are
    passed as absolute paths.
    """
    fixes = []
    base = deck_path.resolve().parent
    if base == job_deck_dir.resolve():
        return fixes
    for table, kv in deck.items():
        if table == "sweep" or not isinstance(kv, dict):
            continue
        for key, v in kv.items():
            if isinstance(v, str) and v and not os.path.isabs(v) and (base / v).exists():
                fixes.append(f"{table}.{key}={toml_literal(str(base / v))}")
    return fixes


def mesh_ranks(resolved: dict) -> int:
    m = resolved.get("mesh", {})
    return int(m.get("tp", 1)) * int(m.get("cp", 1)) * int(m.get("pp", 1)) * int(m.get("dp", 1))


def sh(cmd: list[str], env=None, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise RuntimeError(f"'{' '.join(shlex.quote(c) for c in cmd)}' failed with exit {p.returncode}")
    return p


def task_states(job_ids: list[str]) -> dict[tuple[str, int], tuple[str, str]]:
    """(array job id, task id) -> (state, exit code) from scontrol, else sacct."""
    states: dict[tuple[str, int], tuple[str, str]] = {}
    for jid in job_ids:
        p = sh(["scontrol", "show", "job", "-o", jid], check=False)
        for line in p.stdout.splitlines():
            f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            tid = f.get("ArrayTaskId", "")
            if f.get("ArrayJobId") == jid and tid.isdigit():
                states[(jid, int(tid))] = (f.get("JobState", "?"), f.get("ExitCode", "?"))
        p = sh(["sacct", "-n", "-P", "-X", "-j", jid, "-o", "JobID,State,ExitCode"], check=False)
        if p.returncode == 0:
            for line in p.stdout.splitlines():
                parts = line.split("|")
                if len(parts) >= 3 and "_" in parts[0]:
                    a, t = parts[0].split("_", 1)
                    if a == jid and t.isdigit() and (a, int(t)) not in states:
                        states[(a, int(t))] = (parts[1].split()[0], parts[2])
    return states


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="run/slurm/sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("deck")
    ap.add_argument("--subcommand", default="run", help="wlb subcommand per case (default: run)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="table.key=value",
                    help="override for every case (repeatable)")
    ap.add_argument("--wait", action="store_true", help="wait for all tasks and report each case's state")
    ap.add_argument("--timeout", type=float, default=0, help="with --wait: cancel and fail after S seconds")
    ap.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                    help="extra sbatch option, e.g. --sbatch-arg=--time=00:10:00 (repeatable)")
    ap.add_argument("--throttle", type=int, default=0, help="at most N tasks of an array at once (%%N)")
    ap.add_argument("--wlb", default=os.environ.get("WLB", "build/bin/wlb"), help="wlb binary (env WLB)")
    ap.add_argument("--dry-run", action="store_true", help="print the cases and sbatch commands only")
    ap.add_argument("--wlb-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the wlb subcommand, e.g. --wlb-arg=--steps=5 (repeatable)")
    o = ap.parse_args(argv)

    wlb = os.path.abspath(o.wlb)
    if not os.access(wlb, os.X_OK):
        raise InputError(f"wlb binary '{o.wlb}' not found (pass --wlb or set WLB)")
    deck_path = Path(o.deck)
    if not deck_path.is_file():
        raise InputError(f"cannot open deck '{o.deck}'")
    user_sets = [a for s in o.sets for a in ("--set", s)]
    subs = wlb_subcommands(wlb)
    if subs and o.subcommand not in subs:
        raise InputError(f"'{o.subcommand}' is not a subcommand of this wlb (has: {' '.join(subs)})")

    resolved, dirs = parse_validate(run_wlb(wlb, ["validate", str(deck_path), *user_sets, "--cases"]))
    base_out = Path(resolved.get("output", {}).get("dir", "wlb-out"))
    sweep = flatten_sweep(resolved.get("sweep", {}))
    cases = expand_cases(sweep)
    if sweep:
        if len(cases) != len(dirs):
            raise InputError(f"[sweep] expands to {len(cases)} case(s) here but wlb lists {len(dirs)}")
        for c, d in zip(cases, dirs):
            if os.path.basename(d) != case_suffix(c):
                raise InputError(f"case naming mismatch: wlb says '{d}', expected '.../{case_suffix(c)}' "
                                 "(has wlb::expandSweep's order or naming changed?)")
    else:
        dirs = [str(base_out)]

    # The deck each task runs: the original, or a copy without [sweep].
    state_dir = base_out / ".wlb-sweep"
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    original_text = deck_path.read_text()
    original = tomllib.loads(original_text)
    if sweep:
        stripped = strip_sweep(original_text)
        want = {k: v for k, v in original.items() if k != "sweep"}
        try:
            got = tomllib.loads(stripped)
        except tomllib.TOMLDecodeError as e:
            raise InputError(f"cannot remove [sweep] from '{deck_path}' textually: {e}")
        if got != want:
            raise InputError(f"cannot remove [sweep] from '{deck_path}' textually (put [sweep] in its own "
                             "[sweep] table with one key = [values] per line)")
        job_deck = state_dir / stamp / deck_path.name
        fixes = path_fixes(deck_path, original, job_deck.parent)
    else:
        job_deck = deck_path
        fixes = []

    if not o.dry_run:
        job_deck.parent.mkdir(parents=True, exist_ok=True)
        if sweep:
            job_deck.write_text(f"# {deck_path} without its [sweep] table, for run/slurm/sweep\n{stripped}")

    # Validate every case as its task will run it; take the rank count from its mesh.
    check_deck = job_deck if job_deck.exists() else deck_path
    rows = []  # (index, ranks, dir, overrides)
    for i, (case, d) in enumerate(zip(cases, dirs)):
        sets = fixes + o.sets + [f"{k}={toml_literal(v)}" for k, v in case]
        args = ["validate", str(check_deck)] + [a for s in sets for a in ("--set", s)]
        r = parse_validate(run_wlb(wlb, args))[0]
        if check_deck == job_deck and job_deck != deck_path and r.get("sweep"):
            raise InputError(f"case deck '{job_deck}' still has a [sweep]")
        ranks = mesh_ranks(r) if o.subcommand in MPI_SUBCOMMANDS else 1
        rows.append((i, ranks, d, sets))

    print(f"sweep: {deck_path}: {len(rows)} case(s), wlb {o.subcommand}, outputs under {base_out}/")
    for i, ranks, d, sets in rows:
        print(f"  case {i}: {ranks} rank(s)  {d}  {' '.join(s for s in sets if s not in fixes)}")

    cases_file = state_dir / stamp / "cases.tsv"
    for _, _, d, sets in rows:
        for s in sets:
            if "\t" in s or "\n" in s:
                raise InputError(f"override '{s}' contains a tab or newline")
    if not o.dry_run:
        cases_file.parent.mkdir(parents=True, exist_ok=True)
        cases_file.write_text("".join("\t".join([str(r), d, *s]) + "\n" for _, r, d, s in rows))
        for _, _, d, _ in rows:
            Path(d).mkdir(parents=True, exist_ok=True)

    env = dict(os.environ, WLB=wlb, WLB_ROOT=str(ROOT), WLB_CASES=str(cases_file.resolve()))
    env.pop("WLB_ARGS", None)
    env.pop("WLB_NTASKS", None)
    by_ranks: dict[int, list[int]] = {}
    for i, ranks, _, _ in rows:
        by_ranks.setdefault(ranks, []).append(i)
    submitted: list[tuple[str, list[int]]] = []
    for ranks, idx in sorted(by_ranks.items()):
        array = ",".join(map(str, idx)) + (f"%{o.throttle}" if o.throttle > 0 else "")
        cmd = ["sbatch", "--parsable", f"--array={array}", f"--ntasks={ranks}",
               f"--job-name=wlb-{o.subcommand}-{deck_path.stem}",
               f"--output={base_out.resolve()}/slurm-%A_%a.out", *o.sbatch_arg,
               str(TEMPLATE), str(job_deck), o.subcommand, *o.wlb_arg]
        if o.dry_run:
            print("  " + " ".join(shlex.quote(c) for c in cmd))
            continue
        jid = sh(cmd, env=env).stdout.strip().split(";")[0]
        submitted.append((jid, idx))
        print(f"sweep: submitted array job {jid}: {len(idx)} task(s) of {ranks} rank(s): "
              + " ".join(f"{jid}_{i}" for i in idx), flush=True)
    if o.dry_run or not o.wait:
        if submitted:
            (state_dir / stamp / "jobs.json").write_text(json.dumps({j: i for j, i in submitted}) + "\n")
        return 0

    (state_dir / stamp / "jobs.json").write_text(json.dumps({j: i for j, i in submitted}) + "\n")
    ids = [j for j, _ in submitted]
    t0 = time.monotonic()
    while True:
        p = sh(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"], check=False)
        active = [l for l in p.stdout.splitlines() if l.strip()]
        if p.returncode == 0 and not active:
            break
        if o.timeout and time.monotonic() - t0 > o.timeout:
            log(f"timed out after {o.timeout:.0f} s; cancelling {' '.join(ids)}")
            sh(["scancel", *ids], check=False)
            return 1
        time.sleep(1 if time.monotonic() - t0 < 30 else 5)

    states = task_states(ids)
    failed = 0
    print(f"sweep: all tasks finished after {time.monotonic() - t0:.0f} s")
    for jid, idx in submitted:
        for i in idx:
            st, ec = states.get((jid, i), ("UNKNOWN", "?"))
            failed += st != "COMPLETED"
            print(f"  {jid}_{i}  {st:<10} exit {ec:<5} {rows[i][2]}")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except InputError as e:
        log(f"error: {e}")
        sys.exit(2)
    except (RuntimeError, OSError) as e:
        log(f"error: {e}")
        sys.exit(1)
