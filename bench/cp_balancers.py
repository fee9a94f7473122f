#!/usr/bin/env python3
"""wlb's CP shard planners side by side with PyTorch's published CP load balancers, on the
same packed micro-batches (docs/cp.md, "wlb and PyTorch's load balancers").

    PYTHONPATH=build/python /usr/bin/python3 bench/cp_balancers.py [--deck inputs/shard_long_context.toml]
        [--idx PREFIX.idx [--idx-from DIR]] [--steps 4] [--ptrr-block 128] [--json out.json]

The deck (default the long-context 128K preset: CP 8, TP 8, a Llama-3-8B-like layer, the
wlb packer, the H100 profile) packs --steps steps; with --idx the same deck runs a second
time over that Megatron .idx (data.source = "megatron"). Every micro-batch is sharded by

  wlb:      per_sequence, per_document, adaptive, whole_document, hybrid (wlb.ShardPlanner)
  PyTorch:  head_tail       the packed sequence cut into 2C chunks, rank r takes chunks r and
                            2C-1-r (_HeadTailLoadBalancer; PyTorch PR 161062)
            doc_head_tail   every document cut into 2C chunks, rank r takes chunks r and
                            2C-1-r of each (_PerDocumentHeadTailLoadBalancer with the
                            rank-major layout of PyTorch PR 189902)
            ptrr            process-time round-robin over query blocks of --ptrr-block
                            tokens: a token's work is its position in its document + 1, a
                            block's the sum; blocks sorted by work, descending, dealt to
                            the ranks in zig-zag order (PyTorch PR 163617 for block masks,
                            PyTorch PR 181079 and TorchTitan PR 3411 for varlen attention,
                            TorchTitan PR 3972)

reimplemented here from those descriptions. PyTorch asks for documents (per-document
head-tail) or the sequence (head-tail) padded to a multiple of 2C and for a multiple of C
blocks (PTRR); here the chunks are np.array_split's (sizes differ by at most one) and the
last PTRR row is dealt short, so no padding tokens add work. A PyTorch assignment becomes a
wlb.ShardPlan through ShardPlan.from_ranges, so every plan is laid out, comm-planned and
costed by the same code (CostModel, docs/cp.md): attention imbalance (max/mean of rank
attention FLOPs), KV bytes received per rank (K, V forward and dK, dV backward, one
layer, one TP rank) and predicted latency (max over ranks of attention + linear + KV
communication seconds). Each plan is costed with both KV exchanges: allgather (what
PyTorch's CP does) and sharding_aware (wlb's point-to-point exchange of the needed runs).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

import wlb

WLB = ["per_sequence", "per_document", "adaptive", "whole_document", "hybrid"]
TORCH = ["head_tail", "doc_head_tail", "ptrr"]
COMMS = ["allgather", "sharding_aware"]


def split_packed(bounds, ranks, seg_begin, seg_len):
    """Packed ranges [a, b) held by `ranks` -> from_ranges rows [rank, segment, q_offset, q_len]
    (a range crossing documents becomes one row per document)."""
    seg_end = seg_begin + seg_len
    rows = []
    for (a, b), r in zip(bounds, ranks):
        if b <= a:
            continue
        s = int(np.searchsorted(seg_end, a, side="right"))
        while a < b:
            e = min(b, int(seg_end[s]))
            rows.append([r, s, a - int(seg_begin[s]), e - a])
            a, s = e, s + 1
    return rows


def head_tail_chunks(n, cp):
    """2C chunk bounds of [0, n) (array_split sizes) and the rank of each: r and 2C-1-r."""
    sizes = [len(c) for c in np.array_split(np.arange(n), 2 * cp)]
    ends = np.cumsum(sizes)
    bounds = list(zip(ends - sizes, ends))
    return bounds, [min(c, 2 * cp - 1 - c) for c in range(2 * cp)]


def head_tail(seg_len, cp):
    seg_begin = np.concatenate(([0], np.cumsum(seg_len)[:-1]))
    bounds, ranks = head_tail_chunks(int(seg_len.sum()), cp)
    return split_packed(bounds, ranks, seg_begin, seg_len)


def doc_head_tail(seg_len, cp):
    rows = []
    for s, n in enumerate(seg_len.tolist()):
        bounds, ranks = head_tail_chunks(n, cp)
        rows += [[r, s, a, b - a] for (a, b), r in zip(bounds, ranks) if b > a]
    return rows


def ptrr(seg_len, cp, block):
    """Blocks by work, descending, dealt in zig-zag rows of C (PTRR scheduling)."""
    seg_begin = np.concatenate(([0], np.cumsum(seg_len)[:-1]))
    T = int(seg_len.sum())
    work = np.arange(T) - np.repeat(seg_begin, seg_len) + 1  # keys a token attends to
    nblocks = -(-T // block)
    block_work = np.add.reduceat(work, np.arange(0, T, block)).astype(np.float64)
    order = np.argsort(-block_work, kind="stable")
    rank = np.empty(nblocks, dtype=np.int64)
    for i, b in enumerate(order.tolist()):
        row, col = divmod(i, cp)
        rank[b] = col if row % 2 == 0 else cp - 1 - col
    bounds = [(b * block, min(T, (b + 1) * block)) for b in range(nblocks)]
    return split_packed(bounds, rank.tolist(), seg_begin, seg_len)


def plans_of(segments, cost, deck, cp, block):
    """{(balancer, comm): ShardPlan} of one micro-batch."""
    seg_len = np.asarray(segments, dtype=np.int64).reshape(-1, 4)[:, 2]
    out = {}
    for comm in COMMS:
        for s in WLB:
            out[(s, comm)] = wlb.ShardPlanner(deck, strategy=s, comm=comm, cp=cp, cost=cost).plan(segments)
    for name, rows in (("head_tail", head_tail(seg_len, cp)), ("doc_head_tail", doc_head_tail(seg_len, cp)),
                       ("ptrr", ptrr(seg_len, cp, block))):
        ranges = np.array(rows, dtype=np.int64).reshape(-1, 4)
        for comm in COMMS:
            out[(name, comm)] = wlb.ShardPlan.from_ranges(segments, ranges, cp, cost, comm, name)
    return out


def run_dataset(label, deck, steps, block):
    cost = wlb.CostModel(deck)
    packer = wlb.Packer(deck)
    cp = deck.cp
    acc = {}
    mbs = tokens = 0
    t0 = time.time()
    for _ in range(steps):
        plan = packer.pack()
        for r in range(deck.dp):
            for m in range(deck.micro_batches):
                segs = plan.micro_batch(r, m)
                if len(segs) == 0:
                    continue
                mbs += 1
                tokens += int(segs[:, 2].sum())
                for key, sp in plans_of(segs, cost, deck, cp, block).items():
                    met = sp.metrics
                    a = acc.setdefault(key, {"imb": [], "kv_mean": 0.0, "kv_max": 0.0, "lat": 0.0, "attn": 0.0,
                                             "applied": {}})
                    a["imb"].append(met["imbalance_attn"])
                    a["kv_mean"] += met["kv_bytes_total"] / cp
                    a["kv_max"] += met["kv_bytes_max"]
                    a["lat"] += met["max_latency"]
                    a["attn"] += met["max_attn_seconds"]
                    a["applied"][sp.strategy] = a["applied"].get(sp.strategy, 0) + 1
    base = acc[("per_document", "allgather")]
    rows = []
    for (name, comm), a in acc.items():
        rows.append({
            "dataset": label, "balancer": name, "family": "wlb" if name in WLB else "pytorch", "comm": comm,
            "micro_batches": mbs, "tokens": tokens,
            "imbalance_attn_mean": float(np.mean(a["imb"])), "imbalance_attn_max": float(np.max(a["imb"])),
            "kv_mb_per_rank": a["kv_mean"] / mbs / 1e6, "kv_mb_max_rank": a["kv_max"] / mbs / 1e6,
            "kv_vs_baseline": a["kv_mean"] / base["kv_mean"] if base["kv_mean"] else float("nan"),
            "latency_ms_sum": a["lat"] * 1e3, "latency_vs_baseline": a["lat"] / base["lat"],
            "attn_ms_sum": a["attn"] * 1e3, "applied": a["applied"],
        })
    order = {n: i for i, n in enumerate(WLB + TORCH)}
    rows.sort(key=lambda x: (COMMS.index(x["comm"]), order[x["balancer"]]))
    return rows, time.time() - t0


def table(rows):
    head = ("| data | balancer | KV exchange | attn imbalance mean / max | KV MB per rank (max rank) | "
            "KV vs baseline | predicted latency ms | vs baseline |")
    out = [head, "|" + "---|" * 8]
    for x in rows:
        name = x["balancer"] + (" (PyTorch)" if x["family"] == "pytorch" else "")
        out.append(f"| {x['dataset']} | {name} | {x['comm']} | {x['imbalance_attn_mean']:.3f} / "
                   f"{x['imbalance_attn_max']:.3f} | {x['kv_mb_per_rank']:.1f} ({x['kv_mb_max_rank']:.1f}) | "
                   f"{x['kv_vs_baseline']:.2f} | {x['latency_ms_sum']:.1f} | {x['latency_vs_baseline']:.3f} |")
    return "\n".join(out)


def write_idx_from(root, path):
    sizes = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) > 0:
                sizes.append(min(os.path.getsize(p), 2**31 - 1))
    lengths = np.array(sizes, dtype=np.int64)[np.random.default_rng(1).permutation(len(sizes))]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    wlb.write_megatron_idx(path, lengths)
    return len(lengths)


def provenance():
    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=os.path.dirname(__file__),
                                  timeout=10).stdout.strip()
        except OSError:
            return ""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--deck", default=os.path.join(here, "..", "inputs", "shard_long_context.toml"))
    ap.add_argument("--idx", help="a Megatron .idx dataset to run the same deck over as well")
    ap.add_argument("--idx-from", metavar="DIR",
                    help="first write --idx from the files under DIR: one document per regular file, as many "
                         "tokens as bytes (the byte tokenizer of `wlb data prepare`), in a shuffled order (seed 1)")
    ap.add_argument("--steps", type=int, default=4, help="packed steps per dataset")
    ap.add_argument("--ptrr-block", type=int, default=128, help="PTRR query block (tokens)")
    ap.add_argument("--json", help="write the rows and the provenance here")
    args = ap.parse_args(argv)
    if args.ptrr_block < 1 or args.steps < 1:
        ap.error("--steps and --ptrr-block must be >= 1")

    if args.idx_from:
        if not args.idx:
            ap.error("--idx-from needs --idx (the file to write)")
        n = write_idx_from(args.idx_from, args.idx)
        print(f"# wrote {args.idx}: {n} documents, the files under {args.idx_from}")
    deck = wlb.Deck(args.deck)
    sets = [(deck["data.preset"] if deck["data.source"] == "generator" else deck["data.source"], deck)]
    if args.idx:
        sets.append((os.path.basename(args.idx),
                     deck.with_overrides({"data.source": "megatron", "data.path": os.path.abspath(args.idx)})))
    prov = provenance()
    prov.update({"deck": os.path.relpath(args.deck), "idx": args.idx, "steps": args.steps, "cp": deck.cp,
                 "tp": deck["mesh.tp"], "ptrr_block": args.ptrr_block, "packer": deck.packer,
                 "profile": wlb.CostModel(deck).profile})
    print(f"# cp_balancers: commit {prov['commit'][:12]}{' (dirty)' if prov['dirty'] else ''}, CPU {prov['cpu']} "
          f"({prov['cores']} cores), deck {prov['deck']}, CP {deck.cp}, TP {prov['tp']}, packer {deck.packer}, "
          f"{args.steps} steps, PTRR block {args.ptrr_block}, profile {prov['profile']}")
    print("# baseline: per_document + allgather; KV bytes: K,V fwd + dK,dV bwd received, one layer, one TP rank, "
          "mean per rank per micro-batch; latency: sum over micro-batches of the max-rank predicted seconds")
    rows = []
    for label, d in sets:
        r, secs = run_dataset(label, d, args.steps, args.ptrr_block)
        print(f"# {label}: {r[0]['micro_batches']} micro-batches, {r[0]['tokens']} tokens, {secs:.1f} s")
        rows += r
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": prov, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
