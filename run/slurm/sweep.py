"""Submit a wlb deck's [sweep] as a Slurm job array: one array task per case.

Run through run/slurm/sweep (see docs/slurm.md):

    run/slurm/sweep DECK [--subcommand run|simulate|plan|...] [--set table.key=value ...]
                    [--wait] [--timeout S] [--sbatch-arg ARG ...] [--dry-run]
    run/slurm/sweep collect DIR

How the cases are found: `wlb validate DECK --set ... --cases` prints the resolved deck
(including its [sweep] table) and every case's output.dir. Its case list names only the
directories, so the key/value pairs of each case are rebuilt from the resolved [sweep]
table in wlb::expandSweep's order (keys sorted, first key fastest) and checked against
those directories. Each task then runs the deck *without* its [sweep] table (so that
subcommands that expand sweeps themselves, like `simulate`, run just their case) with the
case's values and output.dir passed as --set overrides.

Cases that need different rank counts (a sweep over the mesh) are submitted as one array
per rank count. The sweep is recorded in <output.dir>/.wlb-sweep/<stamp>/sweep.json (keys,
each case's values and directory, job ids). With --wait, or later with `collect DIR`, every
case's results (run: summary.json; simulate: simulate.json; plan: plan-summary.json, which
wlb.sbatch asks those subcommands to write into the case directory) are gathered into
<output.dir>/sweep.csv (one row per case and strategy, keyed by the swept values) and
sweep.png. Exit status: 0 if submitted (and, with --wait, all tasks COMPLETED and every
case has results), 1 if a task failed or timed out or a case has no results, 2 on bad input.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shlex
import shutil
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
MPI_SUBCOMMANDS = os.environ.get("WLB_MPI_SUBCOMMANDS", "run mesh train").split()


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


def parse_validate(text: str) -> tuple[dict, list[tuple[str, list[str]]]]:
    """Split `wlb validate --cases` output into (resolved deck, cases); a case is its output
    dir and its "table.key=literal" overrides as wlb wrote them (tab-separated after the dir)."""
    m = re.search(r"^# (\d+) sweep case\(s\)\s*$", text, re.M)
    head = text[: m.start()] if m else text
    cases = []
    if m:
        for line in text[m.end():].splitlines():
            if line.startswith("#   "):
                d, *sets = line[4:].split("\t")
                cases.append((d, sets))
        if len(cases) != int(m.group(1)):
            raise InputError(f"wlb printed {m.group(1)} case(s) but listed {len(cases)}")
    try:
        resolved = tomllib.loads(head)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"cannot parse the resolved deck printed by 'wlb validate': {e}")
    return resolved, cases


def override_value(s: str):
    """The value of a "table.key=literal" override, parsed as TOML."""
    key, _, lit = s.partition("=")
    try:
        return key, tomllib.loads("v = " + lit)["v"]
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"cannot parse wlb's case override '{s}': {e}")


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
    base = deck_dir(deck_path)
    if base == Path(os.path.abspath(job_deck_dir)):
        return fixes
    for table, kv in deck.items():
        if table == "sweep" or not isinstance(kv, dict):
            continue
        for key, v in kv.items():
            if beside_deck(base, f"{table}.{key}", v):
                fixes.append(f"{table}.{key}={toml_literal(str(base / v))}")
    return fixes


def deck_dir(deck_path: Path) -> Path:
    """The deck's folder as wlb takes it: the path as given, links not followed."""
    return Path(os.path.abspath(deck_path)).parent


# The keys wlb resolves against the deck's folder (model::deckInputFiles); output names are
# relative to output.dir and stay as they are.
INPUT_KEYS = ("hardware.profile", "data.path", "train.dataset")


def beside_deck(base: Path, key: str, v) -> bool:
    """Whether value v of the input `key` names a file relative to the deck's folder `base`."""
    if key not in INPUT_KEYS or not isinstance(v, str) or not v or os.path.isabs(v):
        return False
    # a dataset is a prefix: wlb looks for PREFIX_train.idx next to the deck
    return (base / (v + "_train.idx")).exists() if key == "train.dataset" else (base / v).exists()


def fix_override(base: Path, s: str) -> str:
    """A "table.key=literal" override whose value is a file beside the deck, made absolute
    (a --set or [sweep] value, which the case copy of the deck would resolve elsewhere)."""
    key, _, lit = s.partition("=")
    try:
        v = tomllib.loads("v = " + lit)["v"]
    except tomllib.TOMLDecodeError:
        v = lit.strip()  # a bare word: wlb takes it as a string
    return f"{key.strip()}={toml_literal(str(base / v))}" if beside_deck(base, key.strip(), v) else s


def mesh_ranks(resolved: dict) -> int:
    m = resolved.get("mesh", {})
    return int(m.get("tp", 1)) * int(m.get("cp", 1)) * int(m.get("pp", 1)) * int(m.get("dp", 1))


def make_folder(path: Path, what: str, made: list[Path]) -> None:
    """mkdir -p PATH; the top-most folder it makes goes to `made` (removed again while empty
    if the submission fails). InputError naming `what` where none can be made."""
    top, p = None, path.absolute()
    while not p.exists() and p != p.parent:
        top, p = p, p.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{what} '{path}': cannot create the folder ({e.strerror})")
    if top is not None:
        made.append(top)


def remove_empty_folders(top: Path) -> None:
    """The empty folders under (and including) `top`, deepest first; anything holding a file stays."""
    if not top.is_dir():
        return
    for d, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
        try:
            os.rmdir(d)
        except OSError:
            pass


def sh(cmd: list[str], env=None, check=True, timeout=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise RuntimeError(f"'{' '.join(shlex.quote(c) for c in cmd)}' failed with exit {p.returncode}")
    return p


def task_ids(spec: str) -> list[int]:
    """The task ids of a Slurm array task field: "3", or the record of tasks not yet split
    apart (pending), "0-3", "0,2,5-7", with a throttle "0-3%2"."""
    ids: list[int] = []
    for part in spec.split("%", 1)[0].split(","):
        a, _, b = part.partition("-")
        if a.isdigit() and (not b or b.isdigit()):
            ids.extend(range(int(a), int(b or a) + 1))
    return ids


def task_states(job_ids: list[str]) -> dict[tuple[str, int], tuple[str, str]]:
    """(array job id, task id) -> (state, exit code) from scontrol, else sacct."""
    states: dict[tuple[str, int], tuple[str, str]] = {}
    for jid in job_ids:
        p = sh(["scontrol", "show", "job", "-o", jid], check=False, timeout=60)
        for line in p.stdout.splitlines():
            f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            if f.get("ArrayJobId") != jid:
                continue
            for tid in task_ids(f.get("ArrayTaskId", "")):
                states[(jid, tid)] = (f.get("JobState", "?"), f.get("ExitCode", "?"))
        p = sh(["sacct", "-n", "-P", "-X", "-j", jid, "-o", "JobID,State,ExitCode"], check=False, timeout=60)
        if p.returncode == 0:
            for line in p.stdout.splitlines():
                parts = line.split("|")
                if len(parts) >= 3 and "_" in parts[0]:
                    a, t = parts[0].split("_", 1)
                    for tid in task_ids(t.strip("[]")) if a == jid else []:
                        if (a, tid) not in states:
                            states[(a, tid)] = (parts[1].split()[0], parts[2])
    return states


# --- collecting a sweep's results -----------------------------------------------------------
#
# At submission the launcher writes <output.dir>/.wlb-sweep/<stamp>/sweep.json (format
# "wlb-sweep" v1): the deck, the subcommand, the swept keys, every case's values, its
# directory relative to output.dir and the array job ids. `collect` reads the newest such
# manifest, each case's job state (Slurm, else the task's log) and its result file, and
# writes <output.dir>/sweep.csv and sweep.png.

MANIFEST_FORMAT = "wlb-sweep"
CSV_NAME, PLOT_NAME = "sweep.csv", "sweep.png"

# Per subcommand: the result file in a case directory and the CSV columns taken from it.
RESULT_FILES = {"run": "summary.json", "simulate": "simulate.json", "plan": "plan-summary.json"}
RUN_COLUMNS = ["strategy", "packer", "sharding", "baseline", "tokens_per_second", "useful_flops_per_second",
               "speedup", "speedup_lo", "speedup_hi", "step_seconds_mean", "step_seconds_median",
               "step_seconds_min", "step_time_ratio", "cp_imbalance", "mb_imbalance", "predicted_imbalance",
               "tokens", "drain_steps", "steps", "mesh"]
SIM_COLUMNS = ["strategy", "packer", "sharding", "baseline", "tokens_per_second", "useful_flops_per_second",
               "speedup", "speedup_lo", "speedup_hi", "step_seconds_mean", "step_time_ratio",
               "bubble_fraction", "idle_fraction", "grad_sync_seconds", "peak_gb_per_stage", "fits_memory",
               "tokens", "drain_steps", "steps", "mesh"]
PLAN_COLUMNS = ["strategy", "imbalance_mean", "imbalance_max", "imbalance_attn_fwd_mean",
                "imbalance_attn_bwd_mean", "imbalance_total_fwd_mean", "imbalance_total_bwd_mean",
                "tokens_max_over_mean", "delay_mean", "delay_max", "tokens", "steps", "plan_us_mean"]
METRIC_COLUMNS = {"run": RUN_COLUMNS, "simulate": SIM_COLUMNS, "plan": PLAN_COLUMNS}


def write_atomic(path: Path, data) -> None:
    """Write text or bytes to a temporary name beside PATH, then rename it over PATH."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_manifest(path: Path, deck: Path, sub: str, base_out: Path, keys: list[str],
                   rows: list, cases: list, submitted: list) -> None:
    base = base_out.resolve()
    man = {
        "format": MANIFEST_FORMAT, "version": 1, "deck": str(deck), "subcommand": sub,
        "keys": keys,
        "cases": [{"case": i, "dir": os.path.relpath(Path(d).resolve(), base), "ranks": r,
                   "values": {k: v for k, v in case}}
                  for (i, r, d, _), case in zip(rows, cases)],
        "jobs": {j: idx for j, idx in submitted},
    }
    write_atomic(path, json.dumps(man, indent=1) + "\n")


def find_manifest(arg: str) -> tuple[Path, Path]:
    """(manifest, sweep output dir) for DIR = the sweep's output.dir or one of its stamp dirs."""
    p = Path(arg)
    if not p.exists():
        raise InputError(f"no such directory '{arg}'")
    if not p.is_dir():
        raise InputError(f"'{arg}' is not a directory (give the sweep's output.dir)")
    if (p / "sweep.json").is_file() and p.parent.name == ".wlb-sweep":
        return p / "sweep.json", p.parent.parent
    found = sorted((p / ".wlb-sweep").glob("*/sweep.json"), key=lambda f: (f.stat().st_mtime, f.parent.name))
    if not found:
        hint = (" (it was submitted before sweeps recorded sweep.json; submit it again)"
                if any((p / ".wlb-sweep").glob("*/cases.tsv")) else "")
        raise InputError(f"'{arg}' is not a sweep directory: no .wlb-sweep/*/sweep.json in it "
                         f"(give the output.dir that run/slurm/sweep printed){hint}")
    return found[-1], p


def fmt_value(v) -> str:
    """A swept value or metric as a CSV cell."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, str):
        return v
    return toml_literal(v)


def exit_from_log(log: Path) -> tuple[str, str]:
    """(state, exit code) from a task's log: wlb.sbatch ends it with 'exit RC after S s'."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "UNKNOWN", ""
    m = None
    for m in re.finditer(r"^wlb\.sbatch: exit (\d+) after", text, re.M):
        pass
    if not m:
        return "UNKNOWN", ""
    return ("COMPLETED" if m.group(1) == "0" else "FAILED"), f"{m.group(1)}:0"


def case_results(sub: str, path: Path) -> list[dict]:
    """Rows (column -> value) of one case's result file; raises ValueError if unreadable."""
    data = json.loads(path.read_text())
    rows = []
    if sub == "run":
        if not isinstance(data, dict) or data.get("format") != "wlb-run-summary":
            raise ValueError("not a wlb-run-summary file")
        for s in data.get("strategies", []):
            r = dict(s)
            r["speedup_lo"], r["speedup_hi"] = (s.get("speedup_interval") or [None, None])[:2]
            for k in ("baseline", "steps", "mesh"):
                r[k] = data.get(k)
            rows.append(r)
    elif sub == "simulate":
        if not isinstance(data, list):
            raise ValueError("not a wlb simulate JSON array")
        for s in data:
            r = dict(s)
            r["speedup_lo"], r["speedup_hi"] = (s.get("speedup_interval") or [None, None])[:2]
            r["step_seconds_mean"] = s.get("step_seconds")
            peak = s.get("peak_gb_per_stage")
            r["peak_gb_per_stage"] = max(peak) if isinstance(peak, list) and peak else peak
            rows.append(r)
    elif sub == "plan":
        if not isinstance(data, list):
            raise ValueError("not a wlb plan summary JSON array")
        for p in data:
            r = dict(p.get("summary", {}))
            r["strategy"] = p.get("packer")
            rows.append(r)
    if not rows:
        raise ValueError("no strategies in it")
    return rows


def safe_task_states(job_ids: list[str]) -> dict:
    if not job_ids:
        return {}
    try:
        return task_states(job_ids)
    except (OSError, subprocess.SubprocessError):
        return {}


def collect(arg: str, quiet_nothing: bool = False) -> int:
    """Collect a sweep's results into sweep.csv and sweep.png; exit status (see docs/slurm.md)."""
    man_path, base = find_manifest(arg)
    try:
        man = json.loads(man_path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read '{man_path}': {e}")
    if not isinstance(man, dict) or man.get("format") != MANIFEST_FORMAT or man.get("version") != 1:
        raise InputError(f"'{man_path}' is not a {MANIFEST_FORMAT} v1 manifest")
    sub, keys, cases = man.get("subcommand", "?"), man.get("keys", []), man.get("cases", [])
    if sub not in METRIC_COLUMNS:
        msg = (f"'wlb {sub}' writes no per-case results to collect (only run, simulate and plan "
               "sweeps do); no table written")
        if quiet_nothing:
            log(f"collect: {msg}")
            return 0
        raise InputError(f"{base}: {msg}")

    # A case's result file from before this submission (an earlier sweep into the same
    # folders) is not this sweep's: the case table, written once before sbatch, dates it.
    try:
        submitted_at = (man_path.parent / "cases.tsv").stat().st_mtime
    except OSError:
        submitted_at = None
    job_of = {i: jid for jid, idx in man.get("jobs", {}).items() for i in idx}
    states = safe_task_states(list(man.get("jobs", {})))
    cols = METRIC_COLUMNS[sub]
    header = ["case", *keys, "state", "exit_code", "result", *cols, "case_dir"]
    table: list[dict] = []
    bad: list[str] = []
    for c in cases:
        i, cdir = c["case"], base / c["dir"]
        jid = job_of.get(i)
        log_path = base / f"slurm-{jid}_{i}.out" if jid else None
        st, ec = states.get((jid, i), ("", ""))
        if not st or st == "?":
            st, ec = exit_from_log(log_path) if log_path else ("NOT_SUBMITTED", "")
        elif ":" not in ec:
            ec = ""
        rfile = cdir / RESULT_FILES[sub]
        head = {"case": i, **{k: c["values"].get(k) for k in keys}, "state": st, "exit_code": ec,
                "case_dir": c["dir"]}
        try:
            if submitted_at is not None and rfile.stat().st_mtime < submitted_at:
                rows, result = [], "stale"
            else:
                rows = case_results(sub, rfile)
                result = "ok"
        except FileNotFoundError:
            rows, result = [], "missing"
        except (OSError, ValueError) as e:
            rows, result = [], "unreadable"
            log(f"collect: case {i}: cannot read '{rfile}': {e}")
        if not rows:
            table.append({**head, "result": result})
            vals = " ".join(f"{k}={fmt_value(c['values'].get(k))}" for k in keys)
            where = f"; log {log_path}" if log_path and log_path.exists() else ""
            bad.append(f"case {i} ({vals or c['dir']}): job {st}{' exit ' + ec if ec else ''}, "
                       f"{RESULT_FILES[sub]} {result}{where}")
        for r in rows:
            table.append({**head, "result": result, **{k: r.get(k) for k in cols}})

    out_csv, out_png = base / CSV_NAME, base / PLOT_NAME
    lines = [",".join(csv_cell(h) for h in header)]
    for r in table:
        lines.append(",".join(csv_cell(fmt_value(r.get(h))) for h in header))
    write_atomic(out_csv, "\n".join(lines) + "\n")
    plotted = plot_sweep(out_png, man, sub, keys, cases, table)

    n_ok = len(cases) - len(bad)
    print(f"sweep: collected {n_ok} of {len(cases)} case(s) of 'wlb {sub}' "
          f"({len(table)} row(s)) into {out_csv}" + (f" and {out_png}" if plotted else ""))
    print_table(sub, keys, table)
    for b in bad:
        log(f"collect: no results: {b}")
    return 1 if bad else 0


def csv_cell(s: str) -> str:
    return '"' + s.replace('"', '""') + '"' if any(ch in s for ch in ',"\n\r') else s


def print_table(sub: str, keys: list[str], table: list[dict]) -> None:
    kw = [max(len(k), *(len(fmt_value(r.get(k))) for r in table)) for k in keys]
    sw = max([8] + [len(str(r.get("strategy") or "")) for r in table])
    if sub == "plan":
        head = f"{'imbalance':>9} {'imb.max':>8} {'delay':>7}"
    else:
        head = f"{'tok/s':>10} {'speedup':>8} {'[95% interval]':>15} {'step[s]':>8}"
    stw = max([10] + [len(str(r.get("state") or "")) for r in table])
    print("  " + "".join(f"{k:<{w}} " for k, w in zip(keys, kw)) + f"{'state':<{stw}} {'strategy':<{sw}} {head}")
    for r in table:
        vals = "".join(f"{fmt_value(r.get(k)):<{w}} " for k, w in zip(keys, kw))
        line = f"  {vals}{r['state']:<{stw}} {str(r.get('strategy') or '-'):<{sw}} "
        if r.get("result") != "ok":
            line += f"(no results: {r.get('result')})"
        elif sub == "plan":
            line += f"{num(r.get('imbalance_mean'), '9.4f')} {num(r.get('imbalance_max'), '8.4f')} " \
                    f"{num(r.get('delay_mean'), '7.3f')}"
        else:
            iv = (f"[{r['speedup_lo']:.3f}-{r['speedup_hi']:.3f}]"
                  if isinstance(r.get("speedup_lo"), (int, float)) and isinstance(r.get("speedup_hi"), (int, float))
                  else "")
            line += f"{num(r.get('tokens_per_second'), '10.0f')} {num(r.get('speedup'), '7.3f')}x " \
                    f"{iv:>15} {num(r.get('step_seconds_mean'), '8.4f')}"
        print(line.rstrip())


def num(v, spec: str) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, spec)
    w = re.match(r"\d*", spec).group(0)
    return format("-", f">{w}") if w else "-"


def sig3(v: float) -> str:
    """About three significant digits, no trailing point: 0.123, 5.00, 10.6, 142, 1234."""
    a = abs(v)
    return f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 1 else f"{v:.3g}"


def plot_sweep(path: Path, man: dict, sub: str, keys: list[str], cases: list, table: list[dict]) -> bool:
    """The comparison plot; False (with a note) if there is nothing to plot or no matplotlib."""
    if not any(r.get("result") == "ok" for r in table):
        log("collect: no case has results; no plot" + (f" (removed the old {path})" if path.exists() else ""))
        path.unlink(missing_ok=True)
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"collect: matplotlib not available in {sys.executable}; no plot (the CSV has everything)")
        return False

    def label(c) -> str:
        if not keys:
            return f"case {c['case']}"
        if len(keys) == 1:
            return fmt_value(c["values"].get(keys[0]))
        return "\n".join(f"{k}={fmt_value(c['values'].get(k))}" for k in keys)

    ok_rows = [r for r in table if r.get("result") == "ok"]
    strategies = list(dict.fromkeys(r["strategy"] for r in ok_rows))
    by = {(r["case"], r["strategy"]): r for r in ok_rows}
    failed = {r["case"]: r["state"] for r in table if r.get("result") != "ok"}
    n, ns = len(cases), max(1, len(strategies))
    width = 0.8 / ns
    xs = list(range(n))
    figw = min(24.0, max(7.0, 2.0 + n * (0.45 + 0.38 * ns)))
    panels = [("speedup",), ("tokens_per_second",)] if sub != "plan" else [("imbalance_mean",)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(figw, 3.6 * len(panels) + 0.8), squeeze=False,
                             sharex=True)
    axes = [a[0] for a in axes]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    annotate = n * ns <= 24

    def bars(ax, metric, scale=1.0, err=None, fmt="{:.2f}"):
        for si, s in enumerate(strategies):
            pos, val, lo, hi = [], [], [], []
            for ci, c in enumerate(cases):
                r = by.get((c["case"], s))
                v = r.get(metric) if r else None
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    continue
                pos.append(ci - 0.4 + width * (si + 0.5))
                val.append(v / scale)
                if err:
                    a, b = err(r)
                    lo.append(max(0.0, (v - a) / scale) if isinstance(a, (int, float)) else 0.0)
                    hi.append(max(0.0, (b - v) / scale) if isinstance(b, (int, float)) else 0.0)
            if not pos:
                continue
            ax.bar(pos, val, width * 0.92, color=colors[si % len(colors)], label=s,
                   yerr=[lo, hi] if err else None, capsize=4 if err else 0,
                   error_kw={"elinewidth": 1.2, "ecolor": "black"})
            if annotate:
                for p, v, h in zip(pos, val, hi if err else [0] * len(val)):
                    ax.annotate(fmt(v) if callable(fmt) else fmt.format(v), (p, v + h), xytext=(0, 2), textcoords="offset points",
                                ha="center", va="bottom", fontsize=8)

    deck = Path(man.get("deck", "deck")).name
    what = f"sweep over {', '.join(keys)}" if keys else "(one case: no [sweep])"
    if sub != "plan":
        base = next((r.get("baseline") for r in ok_rows if r.get("baseline")), "the first strategy")
        ax = axes[0]
        bars(ax, "speedup", err=lambda r: (r.get("speedup_lo"), r.get("speedup_hi")), fmt="{:.2f}x")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_ylabel(f"speedup vs {base}\n(tokens/s ratio)")
        ax.set_title(f"{deck}: wlb {sub} {what}\n"
                     f"speedup = throughput over {base} of the same case; error bars: 95% interval",
                     fontsize=10, wrap=True)
        ax = axes[1]
        tmax = max([r.get("tokens_per_second") or 0 for r in ok_rows] + [0])
        scale, unit = (1e6, "Mtok/s") if tmax >= 1e6 else (1e3, "ktok/s") if tmax >= 1e3 else (1.0, "tok/s")
        bars(ax, "tokens_per_second", scale=scale, fmt=sig3)
        ax.set_ylabel(f"throughput [{unit}]\n(trained tokens / time)")
    else:
        ax = axes[0]
        bars(ax, "imbalance_mean", err=lambda r: (r.get("imbalance_mean"), r.get("imbalance_max")), fmt="{:.3f}")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        lo = min([r.get("imbalance_mean") or 1.0 for r in ok_rows] + [1.0])
        ax.set_ylim(bottom=max(0.0, 1.0 - (1.0 - lo) - 0.05) if lo >= 1.0 else 0.0)
        ax.set_ylabel("imbalance degree\n(max/mean micro-batch workload)")
        ax.set_title(f"{deck}: wlb plan {what}\n"
                     "bars: mean over steps; whisker: worst step; 1.0 = perfectly balanced", fontsize=10,
                     wrap=True)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.margins(y=0.15)
        if strategies and ax is axes[0]:
            ax.legend(title="strategy", fontsize=8, title_fontsize=8, loc="upper left",
                      bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
        for ci, c in enumerate(cases):
            if c["case"] in failed:
                ax.axvspan(ci - 0.45, ci + 0.45, color="#f4cccc", alpha=0.6, lw=0)
                if ax is axes[0]:
                    ax.annotate(f"no results\n(job {failed[c['case']]})", (ci, 0.5), xycoords=("data", "axes fraction"),
                                ha="center", va="center", fontsize=8, color="#990000")
    axes[-1].set_xticks(xs)
    axes[-1].set_xticklabels([label(c) for c in cases], fontsize=9, rotation=30 if n > 8 else 0,
                             ha="right" if n > 8 else "center")
    for ci, c in enumerate(cases):
        if c["case"] in failed:
            axes[-1].get_xticklabels()[ci].set_color("#990000")
    axes[-1].set_xlabel(keys[0] if len(keys) == 1 else "case (swept values)" if keys else "case")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
    return True


def collect_after_wait(base_out: Path) -> int:
    try:
        return collect(str(base_out), quiet_nothing=True)
    except InputError as e:
        log(f"collect: error: {e}")
        return 1


def main_collect(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="run/slurm/sweep collect",
        description="Collect a submitted sweep's results into <DIR>/sweep.csv and sweep.png "
                    "(one row per case and strategy). Exit status: 0 if every case has results, "
                    "1 if some have none (they are listed, and appear in the CSV with empty metrics), "
                    "2 on bad input.")
    ap.add_argument("dir", metavar="DIR", help="the sweep's output.dir (as printed by run/slurm/sweep)")
    o = ap.parse_args(argv)
    return collect(o.dir)


def main(argv: list[str]) -> int:
    if argv[:1] == ["collect"]:
        return main_collect(argv[1:])
    ap = argparse.ArgumentParser(prog="run/slurm/sweep", description=__doc__.split("\n\n")[0],
                                 epilog="run/slurm/sweep collect DIR: collect a submitted sweep's results "
                                        "(see 'run/slurm/sweep collect --help')")
    ap.add_argument("deck")
    ap.add_argument("--subcommand", default="run", help="wlb subcommand per case (default: run)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="table.key=value",
                    help="override for every case (repeatable)")
    ap.add_argument("--wait", action="store_true",
                    help="wait for all tasks, report each case's state and collect the results (run, simulate, plan)")
    ap.add_argument("--timeout", type=float, default=0, help="with --wait: cancel and fail after S seconds")
    ap.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                    help="extra sbatch option, e.g. --sbatch-arg=--time=00:10:00 (repeatable)")
    ap.add_argument("--throttle", type=int, default=0, help="at most N tasks of an array at once (%%N)")
    ap.add_argument("--wlb", default=os.environ.get("WLB", "build/bin/wlb"), help="wlb binary (env WLB)")
    ap.add_argument("--dry-run", action="store_true", help="print the cases and sbatch commands only")
    ap.add_argument("--wlb-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the wlb subcommand, e.g. --wlb-arg=--steps=5 (repeatable)")
    # "--sbatch-arg --time=..." as documented: argparse takes no value that starts with '-'
    joined, i = [], 0
    while i < len(argv):
        if argv[i] in ("--sbatch-arg", "--wlb-arg") and i + 1 < len(argv):
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    o = ap.parse_args(joined)

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

    resolved, wlb_cases = parse_validate(run_wlb(wlb, ["validate", str(deck_path), *user_sets, "--cases"]))
    base_out = Path(resolved.get("output", {}).get("dir", "wlb-out"))
    sweep = flatten_sweep(resolved.get("sweep", {}))
    cases = expand_cases(sweep)
    # wlb names every case's folder and writes its overrides: each task passes those
    # literals back as they are; the values here (typed, for the manifest and the CSV) must
    # be the same ones in the same order.
    if sweep:
        if len(cases) != len(wlb_cases):
            raise InputError(f"[sweep] expands to {len(cases)} case(s) here but wlb lists {len(wlb_cases)}")
        for c, (d, sets) in zip(cases, wlb_cases):
            if [override_value(s) for s in sets] != c:
                raise InputError(f"case order mismatch: wlb's case '{d}' has {' '.join(sets)}, expected "
                                 + " ".join(f"{k}={toml_literal(v)}" for k, v in c)
                                 + " (has wlb::expandSweep's order changed?)")
        dirs = [d for d, _ in wlb_cases]
        case_sets = [sets for _, sets in wlb_cases]
    else:
        dirs = [str(base_out)]
        case_sets = [[]]

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

    # Until every array is queued, a failure (a case refused, sbatch refusing an array, a
    # folder that cannot be made, Ctrl-C) undoes the submission: arrays already queued are
    # cancelled, and the stamp folder and the folders made for it go again, so the newest
    # manifest stays the last sweep that was submitted.
    made: list[Path] = []
    submitted: list[tuple[str, list[int]]] = []

    def undo() -> None:
        if submitted:
            sh(["scancel", *[j for j, _ in submitted]], check=False)
        shutil.rmtree(state_dir / stamp, ignore_errors=True)
        for top in reversed(made):
            remove_empty_folders(top)
        try:
            state_dir.rmdir()  # only if empty
        except OSError:
            pass

    try:
        if not o.dry_run:
            make_folder(base_out, "output.dir", made)
            if not os.access(base_out, os.W_OK | os.X_OK):
                raise InputError(f"output.dir '{base_out}': cannot write in the folder")
            make_folder(state_dir / stamp, "output.dir", made)
            if sweep:
                job_deck.write_text(f"# {deck_path} without its [sweep] table, for run/slurm/sweep\n{stripped}")

        # Validate every case as its task will run it; take the rank count from its mesh.
        check_deck = job_deck if job_deck.exists() else deck_path
        rows = []  # (index, ranks, dir, overrides)
        here = deck_dir(deck_path)
        given = [fix_override(here, s) for s in o.sets] if sweep else list(o.sets)
        for i, (d, own) in enumerate(zip(dirs, case_sets)):
            sets = fixes + given + ([fix_override(here, s) for s in own] if sweep else own)
            args = ["validate", str(check_deck)] + [a for s in sets for a in ("--set", s)]
            r = parse_validate(run_wlb(wlb, args))[0]
            if check_deck == job_deck and job_deck != deck_path and r.get("sweep"):
                raise InputError(f"case deck '{job_deck}' still has a [sweep]")
            if o.subcommand == "train":  # validate takes a dataset still to be prepared; a task would not
                ds = r.get("train", {}).get("dataset", "")
                if ds and not any((p / (ds + "_train.idx")).is_file() for p in (check_deck.parent, Path("."))):
                    raise InputError(f"case {i}: train.dataset = \"{ds}\": no {ds}_train.idx next to the deck or "
                                     "here (prepare it with wlb data prepare)")
            ranks = mesh_ranks(r) if o.subcommand in MPI_SUBCOMMANDS else 1
            rows.append((i, ranks, d, sets))
            for s in sets:  # the case table is tab-separated, a line per case
                if "\t" in s or "\n" in s:
                    raise InputError(f"override '{s}' contains a tab or newline")

        print(f"sweep: {deck_path}: {len(rows)} case(s), wlb {o.subcommand}, outputs under {base_out}/")
        for i, ranks, d, sets in rows:
            print(f"  case {i}: {ranks} rank(s)  {d}  {' '.join(s for s in sets if s not in fixes)}")

        cases_file = state_dir / stamp / "cases.tsv"
        if not o.dry_run:
            for i, _, d, _ in rows:
                make_folder(Path(d), f"case {i}'s folder", made)
            cases_file.write_text("".join("\t".join([str(r), d, *s]) + "\n" for _, r, d, s in rows))
            manifest = state_dir / stamp / "sweep.json"
            write_manifest(manifest, deck_path, o.subcommand, base_out, sorted(sweep), rows, cases, [])

        env = dict(os.environ, WLB=wlb, WLB_ROOT=str(ROOT), WLB_CASES=str(cases_file.resolve()))
        env.pop("WLB_ARGS", None)
        env.pop("WLB_NTASKS", None)
        by_ranks: dict[int, list[int]] = {}
        for i, ranks, _, _ in rows:
            by_ranks.setdefault(ranks, []).append(i)
        for ranks, idx in sorted(by_ranks.items()):
            array = ",".join(map(str, idx)) + (f"%{o.throttle}" if o.throttle > 0 else "")
            cmd = ["sbatch", "--parsable", f"--array={array}", f"--ntasks={ranks}",
                   f"--job-name=wlb-{o.subcommand}-{deck_path.stem}",
                   f"--output={base_out.resolve()}/slurm-%A_%a.out", *o.sbatch_arg,
                   # as arguments, not only the environment: a cluster (or the user) may submit
                   # with --export=NONE, and a task must not then run the deck's base case
                   str(TEMPLATE), "--cases", str(cases_file.resolve()), "--wlb", wlb, "--root", str(ROOT),
                   str(job_deck), o.subcommand, *o.wlb_arg]
            if o.dry_run:
                print("  " + " ".join(shlex.quote(c) for c in cmd))
                continue
            jid = sh(cmd, env=env).stdout.strip().split(";")[0]
            submitted.append((jid, idx))
            write_manifest(manifest, deck_path, o.subcommand, base_out, sorted(sweep), rows, cases, submitted)
            print(f"sweep: submitted array job {jid}: {len(idx)} task(s) of {ranks} rank(s): "
                  + " ".join(f"{jid}_{i}" for i in idx), flush=True)
        if submitted:
            (state_dir / stamp / "jobs.json").write_text(json.dumps({j: i for j, i in submitted}) + "\n")
    except BaseException:
        if not o.dry_run:
            if submitted:
                log(f"cancelling the array job(s) already queued: {' '.join(j for j, _ in submitted)}")
            undo()
        raise
    if o.dry_run or not o.wait:
        return 0

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
            collect_after_wait(base_out)
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
    rc = collect_after_wait(base_out)
    return 1 if failed or rc else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except InputError as e:
        log(f"error: {e}")
        sys.exit(2)
    except (RuntimeError, OSError) as e:
        log(f"error: {e}")
        sys.exit(1)
