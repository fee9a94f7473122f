#!/usr/bin/env python3
"""The measured strategy comparison at N ranks, one rank per core, with the simulator's
prediction of exactly the plans that ran (docs/performance.md, "16-rank campaign").

    source run/mpienv          # as root: lets mpirun run
    /usr/bin/python3 bench/rank_campaign.py [DECK ...] [--wlb build/bin/wlb] [--out DIR]
        [--rounds 3] [--seed-offset 1] [--mpirun "mpirun --bind-to core"] [--set KEY=VALUE ...]
        [--steps N] [--warmup W] [--quick-profile] [--no-calibrate] [--tolerance 5]
        [--failure] [--failure-only] [--time-limit SECONDS] [--profiles DIR]

DECKs default to inputs/run16_*.toml (16 ranks each); any deck runs at its own mesh size, so
the same script runs the 2-rank decks (inputs/run_cp2.toml ...) on any machine. Stages, each
an ordinary `wlb` command printed before it runs, its output in DIR/logs/:

1. profile   `wlb profile --deck` over the decks of one layer shape (hidden, heads, KV heads,
             ffn, vocab, tp): the plans' shapes timed on this host, one rank
2. calibrate per deck: `mpirun -n RANKS wlb run DECK` on data.seed with that profile, then
             `wlb calibrate` on its trace (skipped with --no-calibrate)
3. runs      per round, every deck: `mpirun -n RANKS wlb run DECK` on data.seed + seed-offset
             (documents the calibration did not see) with the deck's calibrated profile;
             rounds are interleaved deck by deck, strategies step by step inside a run
4. replay    per run: `wlb simulate DECK --as-run --plans RUN_DIR`, the same profile: the
             simulator times exactly the documents and micro-batches that ran (warm-up and
             drain steps included), so a prediction never differs from the run by its plans;
             once more with --mean-speed (the profile's rank-speed spreads left out)
5. table     per deck and strategy: measured tokens/s (mean over rounds, 95% interval),
             speedup vs plain (per-round ratio, mean, 95% interval), predicted tokens/s,
             error = predicted / measured - 1, predicted speedup, the same at the mean
             speed, drain steps; per deck the
             ordering by throughput measured vs predicted ("same up to ties" when a swapped
             pair is closer than either strategy's spread over the rounds)

--failure adds, at the first deck's rank count (N): (a) WLB_INJECT_FAILURE=N-1:1 (the last
rank throws at the start of step 1's walk): every rank ends, with one message; (b)
WLB_INJECT_FAILURE=N-1:1:kill (the last rank dies by SIGKILL): every rank ends; both timed
from the last progress line to the exit; (c) `wlb train` on an N-rank mesh (factors of 2
over dp, pp, cp, tp), killed (SIGKILL) after a step between checkpoints and resumed, against
an uninterrupted run: losses, gradient norms and learning rates bit-identical.
--failure-only runs just that. The failure checks run before the measured stages.

--profiles DIR takes each deck's calibrated profile from an earlier campaign on the same kind
of host (DIR/profile.calibrated.DECK.json, DECK the deck file's stem) and skips stages 1 and
2: a lease then goes to the measured rounds alone.

--resume keeps the rounds that an earlier campaign with the same --out measured and replayed
(DIR/runs/DECK-rK/summary.json and both replays' simulate.json, each written when its stage
ended) and runs the others: `--rounds 2` in one call and `--rounds 3 --resume` in the next
make three rounds. Run it with the same decks, --profiles and --set as the first call.

--time-limit SECONDS fits the campaign into a lease: a calibration or measured run starts
only if a run of its deck as long as its last one still ends in time (a deck's first run
starts while any time is left), and campaign.md / campaign.json are rewritten after every measured run, so
a campaign cut short, by the limit or by a kill, leaves the table of what it measured.
Rounds are interleaved deck by deck, so the decks named first are measured first.

Writes DIR/campaign.md (the table), DIR/campaign.json (every number, every stage's command,
exit code, seconds, CPU seconds, load average and core share). Exit 0 when every |error| is
within --tolerance percent, every ordering the same up to ties and every failure check
passed; 3 when only the tolerance or an ordering was missed or --time-limit cut a deck's rounds; 1 when a stage or a failure
check failed; 2 on bad input (checked before anything runs).
"""
import argparse
import contextlib
import glob
import json
import math
import os
import pathlib
import platform
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import tomllib

MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
# two-sided 95% Student t quantiles, df = 1..30
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
       2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
       2.045, 2.042]


class BadInput(Exception):
    pass


# a run whose ranks got less of their cores than this was disturbed (docs/performance.md)
LOW_CORE_SHARE = 0.9


class StageFailed(Exception):
    pass


class Interrupted(StageFailed):
    """SIGINT or SIGTERM: the running stage is killed and the report so far written."""


def interval(xs):
    """Mean and its 95% interval over rounds (Student t); one round: no interval."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, m, m
    h = T95[min(len(xs) - 1, len(T95)) - 1] * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, max(0.0, m - h), m + h  # rates and their ratios are not negative


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def blas_core(wlb, env):
    """The kernel family OpenBLAS picked on this CPU (its linear-layer rate depends on it; a
    virtual machine that hides the CPU model can leave it on an older family)."""
    try:
        r = subprocess.run([wlb, "--version"], env=dict(env, OPENBLAS_VERBOSE="2"), capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^Core: (.+)$", r.stdout + r.stderr, re.M)
    return m.group(1).strip() if m else None


def load_avg():
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0


class Stages:
    """Runs each stage as a child (its own process group), logs it, records its cost."""

    def __init__(self, out, env):
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.record = []
        self.cpu_prev = children_cpu()

    def run(self, title, args, log, env=None, timeout=None, ranks=0, allow_fail=False, watch=None):
        """Run `args` with its output in logs/`log`. `watch`: a regex of progress lines; the
        record then holds the seconds from the last such line to the exit."""
        print(f"\n== {title}\n   $ {shlex.join(args)}", flush=True)
        log = self.logs / log
        load0, t0 = load_avg(), time.monotonic()
        last_line, timed_out, seen = None, False, 0
        with open(log, "w") as f, open(log) as r:
            p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=env or self.env, start_new_session=True)
            try:
                while p.poll() is None:
                    if watch:
                        new = r.read()
                        if re.search(watch, new, re.M):
                            last_line = time.monotonic()
                    if timeout is not None and time.monotonic() - t0 > timeout:
                        timed_out = True
                        os.killpg(p.pid, signal.SIGKILL)  # the launcher and every rank
                        p.wait()
                        break
                    time.sleep(0.05)
            except BaseException:
                # interrupted (Ctrl-C, SIGTERM): the stage runs in its own session, so no
                # signal reached it; it must not keep the cores busy after the campaign ends
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                raise
            # a line that only arrives with the exit tells nothing about how long the ranks took
        t1 = time.monotonic()
        secs = t1 - t0
        rc = 124 if timed_out else p.returncode
        if rc < 0:
            rc = 128 - rc  # killed by a signal, as a shell reports it
        cpu = children_cpu()
        cpu, self.cpu_prev = cpu - self.cpu_prev, cpu
        rec = {"stage": title, "command": shlex.join(args), "exit": rc, "seconds": secs, "cpu_seconds": cpu,
               "core_share": cpu / (ranks * max(secs, 1e-9)) if ranks else None,
               "load_before": load0, "load_after": load_avg(), "log": str(log)}
        if watch:
            rec["seconds_after_last_progress_line"] = None if last_line is None else t1 - last_line
        self.record.append(rec)
        if rc != 0 and not allow_fail:
            with open(log) as lf:
                tail = "".join("    " + x for x in lf.readlines()[-25:])
            print(f"   FAILED (exit {rc}) after {secs:.1f} s; last lines of {log}:\n{tail}", flush=True)
            raise StageFailed(f"{title}: exit {rc}")
        share = f"; core share {rec['core_share']:.2f}" if rec["core_share"] is not None else ""
        print(f"   exit {rc} in {secs:.1f} s (load average {load0:.2f} -> {rec['load_after']:.2f}{share}); log {log}",
              flush=True)
        return rec


def children_cpu():
    """CPU seconds of every reaped child and what it waited for (mpirun's ranks)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def resolve(wlb, deck, sets):
    """The deck as `wlb validate` resolves it (defaults, --set overrides); exit 2 -> BadInput."""
    cmd = [wlb, "validate", deck]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise BadInput(f"{deck}: {(p.stderr or p.stdout).strip()}")
    return tomllib.loads(p.stdout)


def mpirun_for(words, ranks, cores):
    """The launcher for `ranks` ranks: binding to cores needs a core per rank."""
    w = list(words)
    oversub = ranks > cores
    if oversub and "--bind-to" in w:
        i = w.index("--bind-to")
        if i + 1 < len(w):
            w[i + 1] = "none"
    return w + ["-n", str(ranks)], oversub


def default_mesh(n):
    """tp, cp, pp, dp of an n-rank training mesh: factors of 2 over dp, pp, cp, tp in turn."""
    dims = {"dp": 1, "pp": 1, "cp": 1, "tp": 1}
    order, i = ["dp", "pp", "cp", "tp"], 0
    while n % 2 == 0 and n > 1:
        dims[order[i % 4]] *= 2
        n //= 2
        i += 1
    dims["dp"] *= n
    return dims


def campaign(a, decks, stages, out, cores, deadline, checkpoint):
    """Stages 1-4. `deadline` (monotonic seconds or None): a run is started only if a run of
    its deck as long as the deck's last one still ends before it; `checkpoint()` rewrites
    the report after every measured run, so a campaign cut short leaves its table."""
    wlb = a.wlb
    last = {}  # deck name -> seconds of its last run

    def fits(d, what):
        if deadline is None:
            return True
        need = last.get(d["name"], 0.0)
        if time.monotonic() + need <= deadline:
            return True
        d.setdefault("skipped", []).append(what)
        print(f"\n== skipped: {what} of {d['name']} (a run takes about {need:.0f} s; "
              f"{max(0.0, deadline - time.monotonic()):.0f} s left of --time-limit)", flush=True)
        return False
    set_args = [x for s in a.set for x in ("--set", s)]
    steps_args = (["--steps", str(a.steps)] if a.steps else []) + (["--warmup", str(a.warmup)] if a.warmup is not None else [])
    if a.profiles:  # stages 1-2 done by an earlier campaign
        for d in decks:
            d["profile"] = pathlib.Path(a.profiles).resolve() / f"profile.calibrated.{d['name']}.json"
    # 1. profiles, one per layer shape
    groups = {}
    for d in decks if not a.profiles else []:
        groups.setdefault(d["shape"], []).append(d)
    for gi, (shape, ds) in enumerate(groups.items()):
        prof = out / ("profile.json" if len(groups) == 1 else f"profile.{ds[0]['name']}.json")
        args = [wlb, "profile"] + [x for d in ds for x in ("--deck", d["path"])] + set_args + ["--out", str(prof)]
        if a.quick_profile:
            args += ["--quick", "--reps", "1", "--min-seconds", "0.001"]
        if a.profile:
            prof = pathlib.Path(a.profile).resolve()
        else:
            stages.run(f"profile: the plans' shapes of {', '.join(d['name'] for d in ds)} on this host (one rank)",
                       args, f"profile-{gi}.log")
        for d in ds:
            d["profile"] = prof
    # 2. calibration: each deck on its own documents (data.seed)
    if not a.no_calibrate and not a.profiles:
        for d in decks:
            if not fits(d, "calibration"):
                continue
            run_dir = out / "calibration" / d["name"]
            shutil.rmtree(run_dir, ignore_errors=True)  # no plan file of an earlier campaign
            launcher, _ = mpirun_for(a.mpirun_words, d["ranks"], cores)
            args = launcher + [wlb, "run", d["path"], "--quiet"] + set_args + [
                "--set", f'hardware.profile="{d["profile"]}"', "--set", f"data.seed={d['seed']}",
                "--set", f'output.dir="{run_dir}"', "--set", 'output.trace="trace.h5"'] + steps_args
            rec = stages.run(f"calibration run: {d['name']} (data.seed = {d['seed']}, {d['ranks']} ranks)", args,
                             f"calibration-{d['name']}.log", ranks=d["ranks"])
            last[d["name"]] = rec["seconds"]
            cal = out / f"profile.calibrated.{d['name']}.json"
            stages.run(f"calibrate: {d['name']}'s profile on its calibration run",
                       [wlb, "calibrate", str(run_dir / "trace.h5"), "--profile", str(d["profile"]), "--out", str(cal),
                        "--quiet"], f"calibrate-{d['name']}.log")
            d["profile"] = cal
    # 3-4. measured runs on other documents, rounds interleaved deck by deck; each replayed
    for r in range(a.rounds):
        for d in decks:
            seed = d["seed"] + a.seed_offset
            run_dir = out / "runs" / f"{d['name']}-r{r + 1}"
            sim_dir = out / "replay" / f"{d['name']}-r{r + 1}"
            mean_dir = out / "replay" / f"{d['name']}-r{r + 1}-mean-speed"
            done = [run_dir / "summary.json", sim_dir / "simulate.json", mean_dir / "simulate.json"]
            kept = a.resume and all(x.is_file() for x in done)  # written last: the run and its replays ended
            core_share = None
            if kept:
                print(f"\n== kept: {d['name']} round {r + 1}, measured and replayed by an earlier campaign "
                      f"({run_dir})", flush=True)
            else:
                if not fits(d, f"round {r + 1}"):
                    continue
                for x in (run_dir, sim_dir, mean_dir):
                    shutil.rmtree(x, ignore_errors=True)  # a replay takes every plan file of the directory
                launcher, d["oversubscribed"] = mpirun_for(a.mpirun_words, d["ranks"], cores)
                args = launcher + [wlb, "run", d["path"], "--quiet"] + set_args + [
                    "--set", f'hardware.profile="{d["profile"]}"', "--set", f"data.seed={seed}",
                    "--set", f'output.dir="{run_dir}"', "--set", 'output.trace="trace.h5"'] + steps_args
                rec = stages.run(f"measured run: {d['name']} (data.seed = {seed}, {d['ranks']} ranks, round "
                                 f"{r + 1}/{a.rounds})", args, f"run-{d['name']}-r{r + 1}.log", ranks=d["ranks"])
                last[d["name"]] = rec["seconds"]
                core_share = rec.get("core_share")
                # the run's plans in the simulator, then the same at the profile's mean speed: what
                # the rank-speed spreads change
                for flags, sim, title, log in (
                        ([], sim_dir, "replay: {} round {}, the run's plans in the simulator", ""),
                        (["--mean-speed"], mean_dir,
                         "mean-speed replay: {} round {}, the same without the rank-speed spreads", "-mean-speed")):
                    stages.run(title.format(d["name"], r + 1),
                               [wlb, "simulate", d["path"], "--as-run", *flags, "--plans", str(run_dir)] + set_args +
                               ["--set", f'hardware.profile="{d["profile"]}"', "--set", f"data.seed={seed}",
                                "--out", str(sim)], f"replay-{d['name']}-r{r + 1}{log}.log")
            d.setdefault("rounds", []).append({"dir": str(run_dir), "core_share": core_share, "kept": kept,
                                               "summary": json.loads(done[0].read_text()),
                                               "replay": by_strategy(done[1]), "replay_mean_speed": by_strategy(done[2])})
            if not kept:
                checkpoint(table(a, decks))
    return table(a, decks)


def by_strategy(path):
    """A `wlb simulate --out` directory's simulate.json, by strategy."""
    return {s["strategy"]: s for s in json.loads(path.read_text())}


def table(a, decks):
    rows, deck_rows, all_ok, timing_ok = [], [], True, True
    worst = 0.0
    for d in decks:
        if not d.get("rounds"):
            deck_rows.append({"deck": d["name"], "file": d["path"], "ranks": d["ranks"], "mesh": d["mesh"],
                              "rounds": 0, "skipped": d.get("skipped", [])})
            timing_ok = False  # incomplete: exit 3
            continue
        if d.get("skipped"):
            timing_ok = False
        strategies = [s["strategy"] for s in d["rounds"][0]["summary"]["strategies"]]
        base = "plain" if "plain" in strategies else strategies[0]
        per = {}
        for s in strategies:
            meas = [next(x for x in rd["summary"]["strategies"] if x["strategy"] == s)["tokens_per_second"]
                    for rd in d["rounds"]]
            base_meas = [next(x for x in rd["summary"]["strategies"] if x["strategy"] == base)["tokens_per_second"]
                         for rd in d["rounds"]]
            pred = [rd["replay"][s]["tokens_per_second"] for rd in d["rounds"]]
            pred_base = [rd["replay"][base]["tokens_per_second"] for rd in d["rounds"]]
            flat = [rd["replay_mean_speed"][s]["tokens_per_second"] for rd in d["rounds"]]
            flat_base = [rd["replay_mean_speed"][base]["tokens_per_second"] for rd in d["rounds"]]
            m_tok = [next(x for x in rd["summary"]["strategies"] if x["strategy"] == s)["tokens"] for rd in d["rounds"]]
            p_tok = [rd["replay"][s]["tokens"] for rd in d["rounds"]]
            m_drain = next(x for x in d["rounds"][0]["summary"]["strategies"] if x["strategy"] == s)["drain_steps"]
            mean, lo, hi = interval(meas)
            sp, sp_lo, sp_hi = interval([x / y for x, y in zip(meas, base_meas)])
            p = statistics.fmean(pred)
            err = (p / mean - 1) * 100 if mean > 0 else 0.0
            worst = max(worst, abs(err))
            same_docs = all(x == y for x, y in zip(m_tok, p_tok))
            row = {"deck": d["name"], "ranks": d["ranks"], "strategy": s,
                   "measured_tokens_per_second": mean, "measured_interval": [lo, hi],
                   "measured_tokens_per_second_rounds": meas, "speedup": sp, "speedup_interval": [sp_lo, sp_hi],
                   "predicted_tokens_per_second": p, "predicted_rounds": pred,
                   "predicted_speedup": statistics.fmean([x / y for x, y in zip(pred, pred_base)]),
                   "error_percent": err,
                   "mean_speed_tokens_per_second": statistics.fmean(flat),
                   "mean_speed_error_percent": (statistics.fmean(flat) / mean - 1) * 100 if mean > 0 else 0.0,
                   "mean_speed_speedup": statistics.fmean([x / y for x, y in zip(flat, flat_base)]),
                   "drain_steps_measured": m_drain,
                   "drain_steps_predicted": d["rounds"][0]["replay"][s]["drain_steps"],
                   "tokens_measured": m_tok, "tokens_replayed": p_tok, "replay_same_tokens": same_docs}
            if abs(err) > a.tolerance:
                timing_ok = False
            if not same_docs:
                all_ok = False
            per[s] = row
            rows.append(row)
        # ordering: a swapped pair closer than either strategy's spread over the rounds is a tie
        def spread(s):
            v = per[s]["measured_tokens_per_second_rounds"]
            return (max(v) - min(v)) / max(v) * 100 if max(v) > 0 else 0.0
        mo = sorted(strategies, key=lambda s: -per[s]["measured_tokens_per_second"])
        po = sorted(strategies, key=lambda s: -per[s]["predicted_tokens_per_second"])
        swapped, order_ok = [], True
        for i, x in enumerate(strategies):
            for y in strategies[i + 1:]:
                dm = per[x]["measured_tokens_per_second"] - per[y]["measured_tokens_per_second"]
                dp = per[x]["predicted_tokens_per_second"] - per[y]["predicted_tokens_per_second"]
                if dm * dp >= 0:
                    continue
                gap = abs(dm) / max(per[x]["measured_tokens_per_second"], per[y]["measured_tokens_per_second"]) * 100
                noise = max(spread(x), spread(y))
                tie = gap <= noise
                order_ok = order_ok and tie
                swapped.append(f"{x} / {y} (measured {gap:.1f}% apart, rounds spread {noise:.1f}%: "
                               f"{'a tie' if tie else 'a miss'})")
        if not order_ok:
            timing_ok = False
        shares = [rd["core_share"] for rd in d["rounds"] if rd["core_share"] is not None]
        deck_rows.append({"deck": d["name"], "file": d["path"], "ranks": d["ranks"], "mesh": d["mesh"],
                          "rounds": len(d["rounds"]), "skipped": d.get("skipped", []),
                          "oversubscribed": d.get("oversubscribed", False),
                          "data_seed": d["seed"] + a.seed_offset, "profile": str(d["profile"]),
                          "measured_order": " > ".join(mo), "predicted_order": " > ".join(po),
                          "same_order": mo == po, "order_ok": order_ok, "swapped_pairs": swapped,
                          "min_core_share": min(shares) if shares else None,
                          "kept_rounds": sum(1 for rd in d["rounds"] if rd["kept"])})
    return rows, deck_rows, worst, all_ok, timing_ok


def fmt_table(a, rows, deck_rows, worst, cores):
    lines = [f"Measured (`wlb run`, {a.rounds} round(s)) vs predicted (`wlb simulate --as-run --plans`: the same "
             f"plans) on {cpu_model()} ({cores} cores)", ""]
    lines.append("| deck | strategy | measured tok/s [95%] | speedup vs plain [95%] | predicted tok/s | error | "
                 "predicted speedup | at mean speed: tok/s, error, speedup | drain m/p |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["measured_interval"]
        slo, shi = r["speedup_interval"]
        mark = "" if r["replay_same_tokens"] else " (replay trained other tokens!)"
        one = len(r["measured_tokens_per_second_rounds"]) < 2  # no interval from one round
        mi = "[one round]" if one else f"[{lo:.1f}–{hi:.1f}]"
        si = "[one round]" if one else f"[{slo:.3f}–{shi:.3f}]"
        lines.append(f"| {r['deck']} | {r['strategy']} | {r['measured_tokens_per_second']:.1f} {mi} | "
                     f"{r['speedup']:.3f} {si} | {r['predicted_tokens_per_second']:.1f} | "
                     f"{r['error_percent']:+.1f}% | {r['predicted_speedup']:.3f} | "
                     f"{r['mean_speed_tokens_per_second']:.1f}, {r['mean_speed_error_percent']:+.1f}%, "
                     f"{r['mean_speed_speedup']:.3f} | "
                     f"{r['drain_steps_measured']}/{r['drain_steps_predicted']}{mark} |")
    lines.append("")
    for d in deck_rows:
        if not d["rounds"]:
            lines.append(f"- {d['deck']} ({d['ranks']} ranks, {d['mesh']}): NOT MEASURED: {', '.join(d['skipped'])} "
                         f"did not fit --time-limit")
            continue
        verdict = "same" if d["same_order"] else "same up to ties" if d["order_ok"] else "DIFFERENT"
        share = f"; core share down to {d['min_core_share']:.2f}" if d["min_core_share"] is not None else ""
        if d["min_core_share"] is not None and d["min_core_share"] < LOW_CORE_SHARE:
            share += (f" (LOW CORE SHARE: below {LOW_CORE_SHARE}, other work held the cores; not a measurement of "
                      f"one rank per core)")
        over = "; OVERSUBSCRIBED (more ranks than cores: not a measurement of one rank per core)" \
            if d["oversubscribed"] else ""
        cut = f"; {d['rounds']} of {a.rounds} round(s), {', '.join(d['skipped'])} cut by --time-limit" \
            if d["skipped"] else ""
        kept = f"; {d['kept_rounds']} round(s) kept from an earlier call (--resume)" if d["kept_rounds"] else ""
        lines.append(f"- {d['deck']} ({d['ranks']} ranks, {d['mesh']}): ordering measured {d['measured_order']}; "
                     f"predicted {d['predicted_order']}: {verdict}{share}{over}{cut}{kept}")
        for s in d["swapped_pairs"]:
            lines.append(f"  - swapped: {s}")
    lines.append("")
    lines.append(f"error = predicted / measured - 1 (tokens/s over measured + drain steps, mean over rounds); max "
                 f"|error| {worst:.1f}% vs tolerance {a.tolerance:.1f}%; intervals: Student t over rounds")
    return "\n".join(lines) + "\n"


def failure_checks(a, deck, stages, out, cores):
    """Item 4: a rank failing or killed mid-step ends every rank; train kill + resume is exact."""
    wlb, n = a.wlb, deck["ranks"]
    fdir = out / "failure"
    fdir.mkdir(parents=True, exist_ok=True)
    launcher, _ = mpirun_for(a.mpirun_words, n, cores)
    res = []
    set_args = [x for s in a.set for x in ("--set", s)]
    for mode in ("throw", "kill"):
        env = dict(stages.env)
        env["WLB_INJECT_FAILURE"] = f"{n - 1}:1" + (":kill" if mode == "kill" else "")
        args = launcher + [wlb, "run", deck["path"], "--no-output", "--steps", "3", "--warmup", "0"] + set_args
        rec = stages.run(f"failure: rank {n - 1} of {n} {'throws' if mode == 'throw' else 'is killed (SIGKILL)'} "
                         f"at step 1 of {deck['name']}", args, f"failure-{mode}.log", env=env,
                         timeout=a.failure_timeout, ranks=n, allow_fail=True, watch=r"^\[.*\] step 0 ")
        text = open(rec["log"]).read()
        after = rec.get("seconds_after_last_progress_line")
        if mode == "throw":
            msgs = text.count(f"injected failure on rank {n - 1} at step 1")
            ok = rec["exit"] not in (0, 124) and msgs == 1
            what = f"exit {rec['exit']}, {msgs} message(s)"
        else:
            sig = "signal 9" in text or "Killed" in text
            ok = rec["exit"] not in (0, 124)
            what = f"exit {rec['exit']}, launcher reported signal 9: {'yes' if sig else 'no'}"
        what += f", {rec['seconds']:.1f} s in all"
        if after is not None:
            what += f", every rank ended {after:.1f} s after the last progress line"
        if rec["exit"] == 124:
            what += f" (TIMED OUT after {a.failure_timeout} s: a hang)"
        res.append({"check": f"inject {mode}", "ranks": n, "ok": ok, "result": what,
                    "seconds_after_last_progress_line": after, "exit": rec["exit"]})
    # train: kill after a step between checkpoints, resume, compare with an uninterrupted run
    mesh = default_mesh(n)
    corpus = pathlib.Path(a.corpus)
    data = fdir / "data"
    stages.run("failure: a small dataset for wlb train", [wlb, "data", "prepare", str(corpus), "--out",
               str(data / "lic"), "--valid-fraction", "0.25", "--max-bytes", "4096"], "failure-data.log")
    deck_toml = fdir / "train.toml"
    heads = max(2, mesh["tp"])  # whole heads and KV heads per TP rank
    deck_toml.write_text(f"""[model]
hidden = {16 * heads}
heads = {heads}
kv_heads = {heads}
ffn = 64
layers = {max(2, mesh['pp'])}
vocab = 256
[mesh]
tp = {mesh['tp']}
cp = {mesh['cp']}
pp = {mesh['pp']}
dp = {mesh['dp']}
[data]
context_window = 256
[packing]
strategy = "wlb"
micro_batches = {max(2, mesh['pp'])}
[train]
dataset = "{data / 'lic'}"
steps = 12
checkpoint_interval = 5
lr = 0.01
warmup_steps = 2
eval_interval = 6
eval_tokens = 1024
log_interval = 4
""")
    full, cut = fdir / "train-full", fdir / "train-cut"
    base = launcher + [wlb, "train", str(deck_toml), "--quiet"]
    stages.run(f"failure: wlb train on {n} ranks ({mesh}), uninterrupted", base + ["--set", f'output.dir="{full}"'],
               "failure-train-full.log", timeout=a.failure_timeout * 4, ranks=n)
    env = dict(stages.env)
    env["WLB_TRAIN_KILL_AFTER_STEP"] = "7"
    rec = stages.run("failure: the same, killed (SIGKILL) after step 7 (checkpoint at step 5)",
                     base + ["--set", f'output.dir="{cut}"'], "failure-train-killed.log", env=env,
                     timeout=a.failure_timeout * 4, ranks=n, allow_fail=True)
    killed_ok = rec["exit"] not in (0, 124) and (cut / "checkpoint" / "checkpoint.wlb").exists()
    stages.run("failure: resumed from the checkpoint", base + ["--set", f'output.dir="{cut}"', "--resume"],
               "failure-train-resumed.log", timeout=a.failure_timeout * 4, ranks=n, allow_fail=True)
    same, why = False, "no logs"
    try:
        x = [json.loads(l) for l in open(full / "train_log.jsonl")]
        y = [json.loads(l) for l in open(cut / "train_log.jsonl")]
        keys = ("loss", "grad_norm", "lr", "tokens", "eval_loss")
        diff = [(r["step"], k) for r, q in zip(x, y) for k in keys if r.get(k) != q.get(k)]
        steps_ok = [r["step"] for r in y] == list(range(12)) and len(x) == 12
        same = steps_ok and not diff
        why = "12 steps bit-identical (loss, gradient norm, lr, tokens, eval loss)" if same else \
            f"steps {[r['step'] for r in y]}, first differences {diff[:3]}"
    except (OSError, ValueError, KeyError) as e:
        why = f"cannot compare: {e}"
    res.append({"check": "train kill + resume", "ranks": n, "mesh": mesh, "ok": killed_ok and same,
                "result": ("killed run stopped with a checkpoint; " if killed_ok else
                           f"killed run: exit {rec['exit']}, checkpoint missing or run not killed; ") + why})
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("decks", nargs="*", help="decks (default: inputs/run16_*.toml)")
    ap.add_argument("--wlb", default="build/bin/wlb", help="the wlb binary")
    ap.add_argument("--out", default="wlb-out/campaign", help="output directory")
    ap.add_argument("--rounds", type=int, default=3, help="measured runs per deck (documents of data.seed + offset)")
    ap.add_argument("--seed-offset", type=int, default=1, help="measured runs use data.seed + this (0: circular)")
    ap.add_argument("--mpirun", default="mpirun --bind-to core", help="launcher (words); -n RANKS is appended")
    ap.add_argument("--set", action="append", default=[], help="table.key=value for every deck and stage")
    ap.add_argument("--steps", type=int, help="measured steps per run (default: run.steps)")
    ap.add_argument("--warmup", type=int, help="warm-up steps per run (default: run.warmup)")
    ap.add_argument("--profile", help="start from this profile instead of measuring one")
    ap.add_argument("--quick-profile", action="store_true", help="small profile grid, short timings (tests)")
    ap.add_argument("--no-calibrate", action="store_true", help="validate the profile as measured")
    ap.add_argument("--profiles", metavar="DIR",
                    help="each deck's calibrated profile from an earlier campaign (skips profile and calibration)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rounds an earlier campaign in --out measured and replayed (its runs/ and replay/ "
                         "files) and run the rest: a campaign split over several calls")
    ap.add_argument("--tolerance", type=float, default=5.0, help="largest |error| per strategy, percent")
    ap.add_argument("--malloc-default", action="store_true",
                    help="leave glibc malloc at its defaults (else large buffers stay on the heap)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="wall-clock budget of the whole campaign: a run starts only if a run of its deck as long as "
                         "its last one still ends in time; the table holds what was measured (exit 3 if cut)")
    ap.add_argument("--failure", action="store_true", help="also the failure and resume checks")
    ap.add_argument("--failure-only", action="store_true", help="only the failure and resume checks")
    ap.add_argument("--failure-timeout", type=int, default=120, help="seconds before a failing run counts as a hang")
    ap.add_argument("--corpus", default="/usr/share/common-licenses", help="text files for wlb train's dataset")
    a = ap.parse_args()
    try:
        if a.rounds < 1:
            raise BadInput("--rounds must be >= 1")
        if a.seed_offset < 0:
            raise BadInput("--seed-offset must be >= 0")
        if a.steps is not None and a.steps < 1:
            raise BadInput("--steps must be >= 1")
        if a.warmup is not None and a.warmup < 0:
            raise BadInput("--warmup must be >= 0")
        if a.tolerance <= 0:
            raise BadInput("--tolerance must be > 0 (percent)")
        if a.time_limit is not None and a.time_limit <= 0:
            raise BadInput("--time-limit must be > 0 (seconds)")
        a.wlb = str(pathlib.Path(a.wlb).resolve())
        if not os.access(a.wlb, os.X_OK):
            raise BadInput(f"--wlb: {a.wlb} is not an executable")
        a.mpirun_words = shlex.split(a.mpirun)
        if not a.mpirun_words:
            raise BadInput("--mpirun is empty")
        if a.profile and not pathlib.Path(a.profile).is_file():
            raise BadInput(f"--profile: {a.profile} not found")
        if a.profiles and (a.profile or a.no_calibrate or a.quick_profile):
            raise BadInput("--profiles replaces --profile, --no-calibrate and --quick-profile")
        paths = a.decks or sorted(glob.glob(str(pathlib.Path(__file__).resolve().parent.parent / "inputs" /
                                                "run16_*.toml")))
        if not paths:
            raise BadInput("no decks")
        decks, names = [], set()
        for p in paths:
            r = resolve(a.wlb, p, a.set)
            if r.get("sweep"):
                raise BadInput(f"{p}: [sweep]: run one case at a time (pick it with --set)")
            m, md = r["mesh"], r["model"]
            name = pathlib.Path(p).stem
            while name in names:
                name += "+"
            names.add(name)
            strategies = r["run"]["strategies"]
            if len(strategies) < 2 and not a.failure_only:
                raise BadInput(f"{p}: run.strategies lists fewer than two strategies: nothing to compare")
            decks.append({"path": str(pathlib.Path(p).resolve()), "name": name, "seed": int(r["data"]["seed"]),
                          "ranks": m["tp"] * m["cp"] * m["pp"] * m["dp"],
                          "mesh": f"tp{m['tp']} cp{m['cp']} pp{m['pp']} dp{m['dp']}",
                          "shape": (md["hidden"], md["heads"], md["kv_heads"], md["ffn"], md["vocab"], m["tp"])})
        if (a.failure or a.failure_only) and not pathlib.Path(a.corpus).is_dir():
            raise BadInput(f"--corpus: {a.corpus} is not a directory")
        if a.resume and not (a.profiles or a.no_calibrate):
            raise BadInput("--resume needs --profiles (or --no-calibrate): a new calibration would replay the "
                           "rounds it keeps with another profile than the rounds it runs")
        for d in decks if a.profiles and not a.failure_only else []:
            prof = pathlib.Path(a.profiles) / f"profile.calibrated.{d['name']}.json"
            if not prof.is_file():
                raise BadInput(f"--profiles: {prof} not found (the calibrated profile of {d['name']})")
    except BadInput as e:
        print(f"rank_campaign: error: {e}", file=sys.stderr)
        return 2

    out = pathlib.Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["OPENBLAS_NUM_THREADS"] = "1"
    if not a.malloc_default and "GLIBC_TUNABLES" not in env:
        env["GLIBC_TUNABLES"] = MALLOC
    cores = os.cpu_count() or 1
    stages = Stages(out, env)
    blas = blas_core(a.wlb, env)  # before the clock starts: --time-limit is for the runs
    t_all = time.monotonic()
    listing = ", ".join(f"{d['name']} {d['ranks']} ranks" for d in decks)
    print(f"rank_campaign: {len(decks)} deck(s) ({listing}) on {cpu_model()} ({cores} cores); {a.rounds} round(s); "
          f"output {out}", flush=True)
    report = {"format": "wlb-rank-campaign", "version": 1, "cpu": cpu_model(), "cores": cores,
              "blas_core": blas, "profiles": a.profiles,
              "rounds": a.rounds, "seed_offset": a.seed_offset, "tolerance_percent": a.tolerance,
              "mpirun": a.mpirun, "sets": a.set, "calibrated": not a.no_calibrate, "resume": a.resume,
              "malloc": env.get("GLIBC_TUNABLES", "glibc defaults")}
    print(f"  BLAS kernels: {report['blas_core'] or 'unknown'}"
          + (f"; calibrated profiles from {a.profiles}" if a.profiles else ""), flush=True)
    deadline = None if a.time_limit is None else t_all + a.time_limit

    def write(text):
        for name, body in (("campaign.md", text), ("campaign.json", json.dumps(report, indent=2) + "\n")):
            tmp = out / f".{name}.tmp"
            tmp.write_text(body)
            os.replace(tmp, out / name)

    def fmt_failure(fres):
        return "\nFailure and resume checks:\n\n" + "\n".join(
            f"- {r['check']} ({r['ranks']} ranks): {'ok' if r['ok'] else 'FAILED'}: {r['result']}" for r in fres) + "\n"

    def record(result, partial):
        """The table's numbers into the report; returns the table."""
        rows, deck_rows, worst, same_docs, timing_ok = result
        report.update({"strategies": rows, "decks": deck_rows, "max_abs_error_percent": worst,
                       "replay_same_tokens": same_docs, "timing_pass": timing_ok, "partial": partial})
        return fmt_table(a, rows, deck_rows, worst, cores)

    partial = [""]  # the last partial table: kept in campaign.md when a stage fails or a signal ends it

    def checkpoint(result):
        # a partial table after every measured run: a campaign cut short keeps what it measured
        table_text = record(result, True)
        partial[0] = table_text
        report.update({"stages": stages.record, "seconds": time.monotonic() - t_all})
        write(table_text + (fmt_failure(report["failure"]) if "failure" in report else "")
              + "\n(partial: the campaign is still running)\n")

    text, code = "", 0

    def interrupted(signum, _frame):
        raise Interrupted(f"interrupted by signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    try:
        # the failure checks first: bounded by --failure-timeout, so --time-limit is left to the runs
        if a.failure or a.failure_only:
            report["failure"] = failure_checks(a, decks[0], stages, out, cores)
            if not all(r["ok"] for r in report["failure"]):
                code = 1
        if not a.failure_only:
            text = record(campaign(a, decks, stages, out, cores, deadline, checkpoint), False)
            if not report["replay_same_tokens"]:
                code = 1
            elif not report["timing_pass"] and code == 0:
                code = 3
        if "failure" in report:
            text += fmt_failure(report["failure"])
    except StageFailed as e:
        print(f"rank_campaign: a stage failed: {e}; outputs so far are in {out}", file=sys.stderr)
        report["failed_stage"] = str(e)
        code = 1
        if partial[0]:
            text = partial[0] + f"\n(partial: the campaign ended early: {e})\n"
        if "failure" in report:
            text += fmt_failure(report["failure"])
    # the report is written whole (a moment): a second signal now would leave a temporary
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    report["stages"] = stages.record
    report["seconds"] = time.monotonic() - t_all
    report["exit"] = code
    text += f"\n{report['seconds']:.0f} s in all; exit {code}\n"
    write(text)
    print("\n" + text, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
