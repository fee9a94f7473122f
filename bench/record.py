#!/usr/bin/env python3
"""Run one command and keep its output as a raw log for docs/: a header with the command,
the commit (and whether the tree was dirty), the date, the CPU, its clocks and the load
before and after, then everything the command printed.

    /usr/bin/python3 bench/record.py --log bench/results/cpu/NAME.log [--note TEXT] -- CMD ...

Paths under the repository are written relative to it. The log is written to a temporary
file beside it and renamed only when the command
succeeded, so a failed or interrupted measurement never leaves a half-written log. The
command runs in the repository root. bench/figures.py reads the header back (`# commit`,
`# clocks`) and checks the doc's tables against the output.
"""
import argparse
import datetime
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def relative(text):
    """Paths under the repository written relative to it, scratch files under $TMPDIR: a log
    speaks of the project, not of the machine it was measured on."""
    text = text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".")
    return re.sub(r"(^|[^\w$.])" + re.escape(tempfile.gettempdir().rstrip("/")) + "/", r"\1$TMPDIR/", text, flags=re.M)


def clocks():
    """MHz per CPU as the kernel reports them (the guest's view on a VM)."""
    try:
        mhz = [line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("cpu MHz")]
    except OSError:
        mhz = []
    return " ".join(mhz) + " MHz" if mhz else "unknown"


def cpu():
    model, flags = platform.processor() or "unknown", ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512bw") if f in have)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, {flags or 'no AVX flags'}"


def git(*args):
    p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", required=True, type=pathlib.Path, help="raw log to write")
    ap.add_argument("--note", default="", help="one line on the conditions (load, niceness, machine)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and its arguments")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command after --")
    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    head = [f"# command: {relative(' '.join(cmd))}",
            f"# commit {commit} ({'dirty tree' if dirty else 'clean tree'})",
            f"# date {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
            f"# cpu: {cpu()}",
            f"# clocks before: {clocks()}",
            f"# load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    if a.note:
        head.append(f"# note: {a.note}")
    start = datetime.datetime.now()
    # bytes that are no UTF-8 (a binary's stray output) become U+FFFD rather than lose the run
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       errors="replace")
    secs = (datetime.datetime.now() - start).total_seconds()
    tail = [f"# clocks after: {clocks()}",
            f"# load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
            f"# wall {secs:.1f} s, exit {p.returncode}"]
    p.stdout = relative(p.stdout)
    sys.stdout.write(p.stdout)
    if p.returncode != 0:
        sys.exit(f"record.py: {cmd[0]} exited {p.returncode}; {a.log} not written")
    a.log.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.log.with_name(a.log.name + ".part")
    try:
        tmp.write_text("\n".join(head) + "\n" + p.stdout + ("" if p.stdout.endswith("\n") else "\n") +
                       "\n".join(tail) + "\n")
        tmp.replace(a.log)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        sys.exit(f"record.py: {a.log}: cannot write it ({e.strerror}); the output is above")


if __name__ == "__main__":
    main()
