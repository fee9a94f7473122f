"""Imbalance metrics of a wlb trace (definitions: docs/analysis.md).

All times are nanoseconds. Events are grouped by (strategy, step). Labels in
CONTAINER_LABELS (e.g. "step") and IDLE_LABELS ("idle") only count for the step span.

  step time        = max over ranks of (last end - first start) of the rank's events in the step
  busy(rank)       = length of the union of the rank's work-event intervals in the step
  idle(rank)       = step time - busy(rank)
  mb latency       = sum over PP stages of max over the stage's (tp, cp) ranks of the union
                     length of that rank's work events of the micro-batch (dp, micro_batch)
  imbalance degree = max / mean of mb latency over the step's micro-batches (also per phase)
  CP imbalance(mb) = max over (pp, tp) groups of [max / mean over the group's CP ranks of
                     the summed duration of `attn` events of the micro-batch]

Steps keep the trace's 0-based index (/events.step). The first /meta.warmup steps are
warm-up and skipped everywhere (counted_steps); the /meta.measured_steps after them are
"measured", any later ones "drain" (no new documents, until the packer holds nothing).
"""

from __future__ import annotations

from collections import defaultdict

import math

import numpy as np

from wlb_trace import PHASE_BWD, PHASE_FWD, Trace

CONTAINER_LABELS = ("step",)
IDLE_LABELS = ("idle",)
PIPELINE_WAIT_LABELS = ("pp_recv",)  # waiting for a pipeline message: not a unit's own work
ATTN_LABEL = "attn"

# Op kinds of the Gantt charts (docs/trace-schema.md, "Op labels"). Labels not listed are
# classified by name: *attn* -> attention, collectives and P2P -> comm, the rest compute.
OP_KINDS = ("attention", "gemm", "comm", "idle")
OP_KIND_NAMES = {"attention": "attention", "gemm": "GEMM / other compute",
                 "comm": "communication (incl. waiting)", "idle": "idle"}
GEMM_LABELS = ("qkv_proj", "out_proj", "mlp", "embed", "loss", "norm", "optimizer", "recompute")
COMM_LABELS = ("tp_allreduce", "kv_allgather", "kv_exchange", "pp_send", "pp_recv", "grad_allreduce")
_COMM_WORDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "exchange", "send", "recv",
               "broadcast", "comm")


def op_kind(label: str) -> str:
    """'container', 'idle', 'attention', 'gemm' or 'comm' for an op label."""
    if label in CONTAINER_LABELS:
        return "container"
    if label in IDLE_LABELS:
        return "idle"
    if label in GEMM_LABELS:
        return "gemm"
    if label in COMM_LABELS or any(w in label for w in _COMM_WORDS):
        return "comm"
    if "attn" in label or "attention" in label:
        return "attention"
    return "gemm"


def union_length(starts, ends) -> int:
    """Total length covered by intervals [start, end) (nested/overlapping counted once)."""
    if len(starts) == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    total = 0
    cur_s = cur_e = None
    for i in order:
        s, e = int(starts[i]), int(ends[i])
        if e < s:
            e = s
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    total += cur_e - cur_s
    return total


def _grouped_union(keys, starts, ends):
    """dict key-tuple -> union length, for events grouped by the rows of `keys` (n x k)."""
    out = {}
    if len(starts) == 0:
        return out
    keys = np.asarray(keys)
    order = np.lexsort(tuple(keys[:, j] for j in reversed(range(keys.shape[1]))))
    sk = keys[order]
    boundaries = np.nonzero(np.any(sk[1:] != sk[:-1], axis=1))[0] + 1
    for idx in np.split(order, boundaries):
        k = tuple(int(x) for x in keys[idx[0]])
        out[k] = union_length(starts[idx], ends[idx])
    return out


def _ratio(values):
    v = np.asarray(list(values), dtype=np.float64)
    if v.size == 0 or v.mean() <= 0:
        return float("nan")
    return float(v.max() / v.mean())


def _unit_latency(coords, mb, rank, start, end):
    """(dp, micro_batch) -> sum over PP stages of the max over the stage's ranks of the
    union length of the rank's events of the unit (the events given)."""
    per_rank = _grouped_union(np.stack([mb, rank], axis=1), start, end)
    stage_max = defaultdict(int)  # (dp, mb, pp) -> max over the stage's ranks
    for (m, r), u in per_rank.items():
        k = (int(coords["dp"][r]), m, int(coords["pp"][r]))
        stage_max[k] = max(stage_max[k], u)
    lat = defaultdict(int)
    for (dp, m, _pp), u in stage_max.items():
        lat[(dp, m)] += u
    return dict(lat)


def strategy_events(trace: Trace, strategy: int):
    """Event columns of one strategy (dict of arrays)."""
    sel = trace.events["strategy"] == strategy
    return {k: v[sel] for k, v in trace.events.items()}


def steps_of(trace: Trace, strategy: int):
    ev = strategy_events(trace, strategy)
    return sorted(int(s) for s in np.unique(ev["step"]) if s >= 0)


def step_metrics(trace: Trace, strategy: int):
    """Per-step metrics of one strategy: list of dicts sorted by step."""
    coords = trace.coords()
    ev = strategy_events(trace, strategy)
    work_ids = [i for i, l in enumerate(trace.regions) if l not in CONTAINER_LABELS + IDLE_LABELS]
    # a unit's latency leaves out its waits for pipeline messages, as wlb run's mb-imb does
    unit_ids = [i for i in work_ids if trace.regions[i] not in PIPELINE_WAIT_LABELS]
    attn_id = trace.region_id(ATTN_LABEL)
    nranks = len(coords["dp"])
    results = []
    for step in steps_of(trace, strategy):
        m = ev["step"] == step
        e = {k: v[m] for k, v in ev.items()}
        rank = e["rank"]
        # Step time: per-rank span, max over ranks.
        spans = {}
        for r in np.unique(rank):
            rm = rank == r
            spans[int(r)] = int(e["end_ns"][rm].max() - e["start_ns"][rm].min())
        step_time = max(spans.values()) if spans else 0
        work = np.isin(e["region"], work_ids)
        busy_d = _grouped_union(np.stack([rank[work]], axis=1), e["start_ns"][work], e["end_ns"][work])
        busy = np.zeros(nranks, dtype=np.float64)
        for (r,), b in busy_d.items():
            busy[r] = b
        present = np.zeros(nranks, dtype=bool)
        present[list(spans.keys())] = True
        idle = np.where(present, step_time - busy, 0.0)

        # Micro-batch latency (total and per phase).
        mbw = np.isin(e["region"], unit_ids) & (e["micro_batch"] >= 0)
        lat = {}
        for name, pm in (("all", mbw), ("fwd", mbw & (e["phase"] == PHASE_FWD)),
                         ("bwd", mbw & (e["phase"] == PHASE_BWD))):
            lat[name] = _unit_latency(coords, e["micro_batch"][pm], rank[pm], e["start_ns"][pm], e["end_ns"][pm])

        # CP imbalance from attention time per CP rank.
        cp_ratios = {}
        cp_attn = {}  # (dp, mb) -> attn ns per CP rank of the worst (pp, tp) group
        if attn_id >= 0:
            am = (e["region"] == attn_id) & (e["micro_batch"] >= 0)
            attn = defaultdict(float)  # (dp, mb, pp, tp, cp) -> summed attn duration
            for r, mb, s0, s1 in zip(rank[am], e["micro_batch"][am], e["start_ns"][am], e["end_ns"][am]):
                c = (int(coords["dp"][r]), int(mb), int(coords["pp"][r]), int(coords["tp"][r]), int(coords["cp"][r]))
                attn[c] += float(s1 - s0)
            ncp = max(trace.mesh.get("cp", 1), 1)
            groups = defaultdict(lambda: np.zeros(ncp))  # CP ranks without attention work: 0
            for (dp, mb, pp, tp, cp), t in attn.items():
                groups[(dp, mb, pp, tp)][cp] = t
            for (dp, mb, pp, tp), ts in sorted(groups.items()):
                r_ = _ratio(ts)
                if not np.isnan(r_) and r_ > cp_ratios.get((dp, mb), 0.0):
                    cp_ratios[(dp, mb)] = r_
                    cp_attn[(dp, mb)] = ts  # the group that sets the micro-batch's ratio
        cpv = list(cp_ratios.values())
        results.append({
            "step": step,
            "strategy": strategy,
            "step_time_ns": step_time,
            "micro_batches": len(lat["all"]),
            "imbalance": _ratio(lat["all"].values()),
            "imbalance_fwd": _ratio(lat["fwd"].values()),
            "imbalance_bwd": _ratio(lat["bwd"].values()),
            "cp_imbalance_mean": float(np.mean(cpv)) if cpv else float("nan"),
            "cp_imbalance_max": float(np.max(cpv)) if cpv else float("nan"),
            "busy_ns": busy,
            "idle_ns": idle,
            "present": present,
            "mb_latency_ns": lat["all"],
            "mb_latency_fwd_ns": lat["fwd"],
            "mb_latency_bwd_ns": lat["bwd"],
            "cp_imbalance_by_mb": cp_ratios,
            "cp_attn_by_mb": cp_attn,
        })
    return results


def mb_workload(trace: Trace, strategy: int):
    """(step, dp, mb) -> workload: summed event FLOPs of the micro-batch if any were
    recorded, else attention pairs sum(l*(l+1)/2) of its plan segments. Returns
    (dict, unit label)."""
    coords = trace.coords()
    ev = strategy_events(trace, strategy)
    sel = (ev["micro_batch"] >= 0) & (ev["step"] >= 0)
    if sel.any() and ev["flops"][sel].sum() > 0:
        out = defaultdict(float)
        for r, s, mb, fl in zip(ev["rank"][sel], ev["step"][sel], ev["micro_batch"][sel], ev["flops"][sel]):
            out[(int(s), int(coords["dp"][r]), int(mb))] += float(fl)
        return dict(out), "recorded FLOPs"
    seg = trace.segments
    m = seg["strategy"] == strategy
    out = defaultdict(float)
    for s, dp, mb, length in zip(seg["step"][m], seg["dp"][m], seg["micro_batch"][m], seg["length"][m]):
        out[(int(s), int(dp), int(mb))] += float(length) * (float(length) + 1) / 2
    return dict(out), "attention pairs (plan)"


def doc_lengths(trace: Trace, strategy: int | None = None):
    """Lengths of the documents in the plan (segments of one document summed)."""
    seg = trace.segments
    m = np.ones(len(seg["doc"]), dtype=bool) if strategy is None else seg["strategy"] == strategy
    if strategy is None and len(trace.strategies):
        # Every strategy trains the same documents: use the first strategy with a plan.
        for s in range(len(trace.strategies)):
            ms = seg["strategy"] == s
            if ms.any():
                m = ms
                break
    totals = defaultdict(int)
    for d, l in zip(seg["doc"][m], seg["length"][m]):
        totals[int(d)] += int(l)
    return np.array(sorted(totals.values()), dtype=np.int64)


def step_kind(trace: Trace, step: int) -> str:
    """'warmup', 'measured' or 'drain' for a trace step index (0-based)."""
    if step < trace.warmup:
        return "warmup"
    measured = trace.meta.get("measured_steps")
    if measured is not None and step >= trace.warmup + int(measured):
        return "drain"
    return "measured"


def counted_steps(trace: Trace, steps, drain=True):
    """The step records after the warm-up (all of them if there are no others); without
    the drain steps when drain=False (step-time and imbalance means)."""
    use = [s for s in steps if step_kind(trace, s["step"]) != "warmup"] or list(steps)
    if not drain:
        use = [s for s in use if step_kind(trace, s["step"]) != "drain"] or use
    return use


def summarize(trace: Trace, strategy: int, steps=None):
    """Means over the measured steps (after warm-up, before drain; all steps if there are
    no others)."""
    steps = steps if steps is not None else step_metrics(trace, strategy)
    use = counted_steps(trace, steps, drain=False)
    if not use:
        return {"steps": 0, "step_time_ns": float("nan"), "imbalance": float("nan"),
                "cp_imbalance": float("nan"), "busy_frac": float("nan")}

    def nanmean(k):
        v = np.array([s[k] for s in use], dtype=np.float64)
        return float(np.nanmean(v)) if np.any(~np.isnan(v)) else float("nan")

    busy_frac = []
    for s in use:
        if s["step_time_ns"] > 0:
            busy_frac.append(float(np.mean(s["busy_ns"][s["present"]]) / s["step_time_ns"]))
    return {
        "steps": len(use),
        "step_time_ns": nanmean("step_time_ns"),
        "imbalance": nanmean("imbalance"),
        "imbalance_fwd": nanmean("imbalance_fwd"),
        "imbalance_bwd": nanmean("imbalance_bwd"),
        "cp_imbalance": nanmean("cp_imbalance_mean"),
        "busy_frac": float(np.mean(busy_frac)) if busy_frac else float("nan"),
    }


def step_work(trace: Trace, strategy: int, steps=None):
    """[(step, step time ns, trained tokens)] after warm-up, drain steps included.

    Tokens come from /plan/segments (the plan the step ran); a trace without segments
    gives tokens = nan, so the throughput speedup is unavailable."""
    steps = steps if steps is not None else step_metrics(trace, strategy)
    seg = trace.segments
    tokens = defaultdict(int)
    have = seg is not None and len(seg.get("step", [])) > 0
    if have:
        sel = seg["strategy"] == strategy
        for st, ln in zip(seg["step"][sel], seg["length"][sel]):
            tokens[int(st)] += int(ln)
    use = counted_steps(trace, steps)
    return [(s["step"], float(s["step_time_ns"]), float(tokens[s["step"]]) if have else float("nan")) for s in use]


def fold_to(work, n):
    """The first n step records, the rest folded into the last (traces without
    measured_steps, whose drain steps are not marked)."""
    if len(work) <= n or n < 1:
        return list(work)
    head = [list(w) for w in work[:n]]
    for _s, t, k in work[n:]:
        head[-1][1] += t
        head[-1][2] += k
    return [tuple(w) for w in head]


def fold_drain(trace: Trace, work):
    """The measured step records, each drain step's folded into the last of them: the
    strategies pair step by step however long each drained (model::foldDrain, as wlb run
    pairs them; docs/analysis.md). Records of a trace without measured steps stay as they are."""
    head = [list(w) for w in work if step_kind(trace, w[0]) != "drain"]
    if not head:
        return list(work)
    for s, t, k in work:
        if step_kind(trace, s) == "drain":
            head[-1][1] += t
            head[-1][2] += k
    return [tuple(w) for w in head]


def throughput_speedup(base, other, resamples=2000, seed=12345):
    """(ratio, lo, hi): tokens/s of `other` over `base` (paired step records of equal
    length), 95% interval of a paired bootstrap over steps — as wlb run and wlb simulate
    compute it (src/model/throughput.hpp)."""
    b = np.array([[w[1], w[2]] for w in base], dtype=np.float64)
    o = np.array([[w[1], w[2]] for w in other], dtype=np.float64)

    def ratio(bs, os_):
        tb, to = bs[:, 1].sum() / bs[:, 0].sum(), os_[:, 1].sum() / os_[:, 0].sum()
        return to / tb if tb > 0 else float("nan")

    r = ratio(b, o)
    if len(b) < 2:
        return r, r, r
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(b), size=(resamples, len(b)))
    # A resample of only empty baseline steps (a packer still filling its window) has no
    # ratio: it is left out, as in model::throughputSpeedup.
    vals = np.sort([v for v in (ratio(b[i], o[i]) for i in idx) if not math.isnan(v)])
    if len(vals) == 0:
        return r, r, r
    return r, float(np.quantile(vals, 0.025)), float(np.quantile(vals, 0.975))


def normalised_latencies(trace: Trace, steps):
    """WLB-LLM Fig. 4 data of one strategy over its measured steps (counted_steps without
    drain, as the summary's means).

    Returns {"mb": ..., "cp": ...}, each with
      slots:  x positions' labels ((dp, mb) pairs, or CP ranks)
      points: [(slot index, step, latency / mean)] — micro-batch latency over the step's
              mean; attention time of a CP rank over the mean of its CP group (the group
              that sets the micro-batch's CP imbalance)
      degree: mean over steps of the step's max/mean (= summary imbalance / CP imbalance)
      worst:  max over steps (micro-batches) of max/mean
    A dimension with one slot (one micro-batch per step; cp = 1) has points = []."""
    use = counted_steps(trace, steps, drain=False)
    slots = sorted({k for s in use for k in s["mb_latency_ns"]})
    slot_ix = {k: i for i, k in enumerate(slots)}
    mb_pts, mb_deg = [], []
    for s in use:
        lat = s["mb_latency_ns"]
        mean = np.mean(list(lat.values())) if lat else 0.0
        if len(lat) < 2 or mean <= 0:
            continue
        for k, v in lat.items():
            mb_pts.append((slot_ix[k], s["step"], v / mean))
        mb_deg.append(max(lat.values()) / mean)
    ncp = max(int(trace.mesh.get("cp", 1)), 1)
    cp_pts, cp_step, cp_all = [], [], []
    for s in use:
        per_mb = []
        for k, ts in s.get("cp_attn_by_mb", {}).items():
            mean = float(np.mean(ts))
            if ncp < 2 or mean <= 0:
                continue
            for c, t in enumerate(ts):
                cp_pts.append((c, s["step"], t / mean))
            per_mb.append(float(np.max(ts)) / mean)
        if per_mb:
            cp_step.append(float(np.mean(per_mb)))
            cp_all.extend(per_mb)
    nan = float("nan")
    return {
        "mb": {"slots": slots, "points": mb_pts if len(slots) > 1 else [],
               "degree": float(np.mean(mb_deg)) if mb_deg else nan,
               "worst": float(np.max(mb_deg)) if mb_deg else nan},
        "cp": {"slots": list(range(ncp)), "points": cp_pts,
               "degree": float(np.mean(cp_step)) if cp_step else nan,
               "worst": float(np.max(cp_all)) if cp_all else nan},
    }


def micropack_latencies(trace: Trace, steps, strategy: int | None = None):
    """SlimPack's Figs. 14-16 data of one strategy over its measured steps: the compute
    latency of every forward and every backward unit (dp, micro_batch) — under PackFlow the
    backward units are the asymmetric partition's MicroPacks — as the sum over PP stages of
    the max over the stage's (tp, cp) ranks of the union of the unit's events without the
    pipeline's pp_send / pp_recv (waiting for the neighbour stage is not the unit's work).
    `steps`: step_metrics() rows of the strategy (its id from them when not given).
    Returns {"fwd": {"ms": [...], "rel": [...], "cv": .., "max_over_mean": ..}, "bwd": ...};
    rel = latency over its step's mean, cv = standard deviation / mean of rel (pooled)."""
    use = counted_steps(trace, steps, drain=False)
    out = {ph: {"ms": [], "rel": []} for ph in ("fwd", "bwd")}
    if use and strategy is None:
        strategy = steps[0].get("strategy")
    if strategy is not None and use:
        coords = trace.coords()
        skip = [i for i, l in enumerate(trace.regions)
                if l in CONTAINER_LABELS + IDLE_LABELS + ("pp_send", "pp_recv")]
        ev = strategy_events(trace, strategy)
        for s in use:
            m = (ev["step"] == s["step"]) & (ev["micro_batch"] >= 0) & ~np.isin(ev["region"], skip)
            for ph, code in (("fwd", PHASE_FWD), ("bwd", PHASE_BWD)):
                pm = m & (ev["phase"] == code)
                lat = _unit_latency(coords, ev["micro_batch"][pm], ev["rank"][pm], ev["start_ns"][pm],
                                    ev["end_ns"][pm])
                vals = [v for v in lat.values() if v > 0]
                if not vals:
                    continue
                mean = float(np.mean(vals))
                out[ph]["ms"].extend(v / 1e6 for v in vals)
                out[ph]["rel"].extend(v / mean for v in vals)
    for d in out.values():
        r = np.asarray(d["rel"])
        d["cv"] = float(r.std() / r.mean()) if r.size > 1 else float("nan")
        d["max_over_mean"] = float(r.max()) if r.size else float("nan")
    return out


def rank_timeline(trace: Trace, strategy: int, step: int, rank: int):
    """One rank's step as Gantt bars: [(start_ns, end_ns, kind, label, micro_batch, phase)]
    sorted by start. kind is an op_kind(); idle covers explicit `idle` events and the gaps
    between work events inside the rank's step span (its `step` event, else its first
    start to its last end)."""
    ev = trace.events
    m = (ev["strategy"] == strategy) & (ev["step"] == step) & (ev["rank"] == rank)
    if not m.any():
        return []
    starts, ends = ev["start_ns"][m], ev["end_ns"][m]
    kinds = [op_kind(trace.regions[r]) for r in ev["region"][m]]
    span_s, span_e = int(starts.min()), int(ends.max())
    bars = []
    for s0, s1, k, r, mb, ph in zip(starts, ends, kinds, ev["region"][m], ev["micro_batch"][m], ev["phase"][m]):
        if k != "container":
            bars.append((int(s0), int(s1), k, trace.regions[r], int(mb), int(ph)))
    # Gaps: the span minus the union of every non-container interval (explicit idle included,
    # so it is not drawn twice).
    covered = sorted((b[0], b[1]) for b in bars)
    cur = span_s
    for s0, s1 in covered:
        if s0 > cur:
            bars.append((cur, s0, "idle", "(gap)", -1, 0))
        cur = max(cur, s1)
    if cur < span_e:
        bars.append((cur, span_e, "idle", "(gap)", -1, 0))
    return sorted(bars, key=lambda b: (b[0], b[1]))


def micro_batch_runs(bars):
    """Consecutive bars of one rank belonging to the same (micro-batch, phase) merged into
    [(start_ns, end_ns, micro_batch, phase)], for the Gantt's micro-batch outlines/labels.
    Idle bars inside a run do not end it (waiting is part of the micro-batch's latency);
    a bar of another micro-batch, phase or a step-level bar (micro_batch < 0) does."""
    runs = []
    open_ = False
    for s0, s1, kind, _label, mb, ph in bars:
        if kind == "idle":
            continue
        if mb < 0:
            open_ = False
            continue
        if open_ and runs[-1][2] == mb and runs[-1][3] == ph:
            runs[-1][1] = max(runs[-1][1], s1)
        else:
            runs.append([s0, s1, mb, ph])
            open_ = True
    return [tuple(r) for r in runs]
