"""Process-group workers of test_cp_attention.py (a module of its own: spawned processes
import it by name). Every rank builds the same packed Q/K/V, the single-process dense
reference and its gradients, runs wlb.torch.cp_attention on its own tokens and reports the
largest differences and the bytes it moved."""

import datetime
import json
import os
import socket
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import wlb
from wlb.torch import ContextParallelAttention, CPAttentionPlan, CPCommStats, CPPlanError, cp_attention

GROUP_TIMEOUT_S = 60  # a rank that never arrives fails the others' collectives instead of hanging them


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world, args, deadline_s=240):
    """Run fn(rank, world, port, *args) in `world` spawned processes; kill them all if they
    have not finished within deadline_s. Returns each process's exit code."""
    port = free_port()
    ctx = mp.start_processes(fn, args=(world, port) + tuple(args), nprocs=world, join=False, start_method="spawn")
    end = time.time() + deadline_s
    try:
        while not ctx.join(timeout=max(1, end - time.time())):
            if time.time() > end:
                break
    except Exception:  # a child's exception: report through its exit code
        pass
    codes = []
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    return codes


def dense_reference(q, k, v, lengths, scale):
    """o, lse of document-masked causal attention over the packed sequence (T x T scores)."""
    T, H, _ = q.shape
    g = H // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(lengths))
    idx = torch.arange(T)
    mask = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    return o, torch.logsumexp(s, -1).t()


def make_planner(world, strategy, comm, heads, kv_heads, head_dim):
    # the deck's model is the tensors' shape, so the comm plan's bytes are these FP32 tensors'
    deck = wlb.Deck(overrides={"mesh.cp": world, "model.hidden": heads * head_dim, "model.heads": heads,
                               "model.kv_heads": kv_heads, "model.dtype_bytes": 4})
    return wlb.ShardPlanner(deck, strategy=strategy, comm=comm, cp=world), deck


def plan_of(world, case):
    planner, deck = make_planner(world, case["strategy"], case["comm"], case["heads"], case["kv_heads"],
                                 case["head_dim"])
    lengths = np.asarray(case["lengths"], dtype=np.int64)
    if case.get("head_tail"):  # PyTorch's per-document head-tail, through ShardPlan.from_ranges
        ranges = []
        for s, n in enumerate(lengths.tolist()):
            cuts = np.linspace(0, n, 2 * world + 1).astype(np.int64)
            for c in range(2 * world):
                if cuts[c + 1] > cuts[c]:
                    ranges.append([min(c, 2 * world - 1 - c), s, cuts[c], cuts[c + 1] - cuts[c]])
        return wlb.ShardPlan.from_ranges(lengths, np.array(ranges, dtype=np.int64), world, planner.cost,
                                         case["comm"], "head_tail")
    return planner.plan(lengths)


def run_case(rank, world, case, group=None, module=None):
    torch.manual_seed(case.get("seed", 0))
    lengths = case["lengths"]
    H, Hkv, D = case["heads"], case["kv_heads"], case["head_dim"]
    T = int(sum(lengths))
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    wo, wl = torch.randn(T, H, D), torch.randn(T, H)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = dense_reference(*full, lengths, D ** -0.5)
    grads_ref = torch.autograd.grad((o_ref * wo).sum() + (lse_ref * wl).sum(), full)

    plan = plan_of(world, case)
    idx = torch.from_numpy(plan.token_index(rank))
    local = [t[idx].clone().requires_grad_() for t in (q, k, v)]
    stats = CPCommStats()
    if module is not None:
        o, lse = module(*local, plan)
        stats = module.last_stats
    else:
        use = CPAttentionPlan(plan, rank) if case.get("prepared") else plan
        o, lse = cp_attention(*local, use, group, stats=stats)
    loss = (o * wo[idx]).sum() + (lse * wl[idx]).sum()
    loss.backward()
    comm = plan.comm.ranks[rank]

    def err(a, b):
        return float((a - b).abs().max()) if a.numel() else 0.0

    return {
        "name": case["name"], "strategy": plan.strategy, "comm": plan.comm.mode, "tokens": int(idx.numel()),
        "sharded_segments": int(plan.sharded_segments),
        "o": err(o, o_ref[idx]), "lse": err(lse, lse_ref[idx]),
        "dq": err(local[0].grad, grads_ref[0][idx]), "dk": err(local[1].grad, grads_ref[1][idx]),
        "dv": err(local[2].grad, grads_ref[2][idx]),
        "bytes": [stats.fwd_bytes_recv, stats.fwd_bytes_sent, stats.bwd_bytes_recv, stats.bwd_bytes_sent],
        "plan_bytes": [comm["fwd_bytes_recv"], comm["fwd_bytes_sent"], comm["bwd_bytes_recv"],
                       comm["bwd_bytes_sent"]],
    }


def error_cases(rank, world, group):
    """Each: what every rank raised (the message) when one rank's input misses the plan."""
    base = {"lengths": [40, 9, 77, 30], "heads": 4, "kv_heads": 2, "head_dim": 8}
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except CPPlanError as e:
            out[name] = str(e)

    plan = plan_of(world, dict(base, strategy="per_document", comm="sharding_aware"))
    n = len(plan.token_index(rank))

    def short_rank():  # the last rank's tensors lack a token
        m = n - 1 if rank == world - 1 else n
        cp_attention(torch.randn(m, 4, 8), torch.randn(m, 2, 8), torch.randn(m, 2, 8), plan, group)

    def other_plan():  # rank 0 holds another strategy's plan (tokens may even agree)
        p = plan_of(world, dict(base, strategy="whole_document" if rank == 0 else "per_document",
                                comm="sharding_aware"))
        m = len(p.token_index(rank))
        cp_attention(torch.randn(m, 4, 8), torch.randn(m, 2, 8), torch.randn(m, 2, 8), p, group)

    def wrong_cp():  # a plan for fewer ranks than the group
        p = plan_of(world - 1 if world > 2 else 1, dict(base, strategy="per_document", comm="allgather"))
        m = len(p.token_index(min(rank, p.cp - 1)))
        cp_attention(torch.randn(m, 4, 8), torch.randn(m, 2, 8), torch.randn(m, 2, 8), p, group)

    def bad_heads():  # rank 0's q has 3 heads for 2 KV heads
        h = 3 if rank == 0 else 4
        cp_attention(torch.randn(n, h, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8), plan, group)

    for name, fn in (("short_rank", short_rank), ("other_plan", other_plan), ("wrong_cp", wrong_cp),
                     ("bad_heads", bad_heads)):
        attempt(name, fn)
    return out


def worker(rank, world, port, cases, outdir):
    result = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        torch.set_num_threads(1)
        result["cases"] = [run_case(rank, world, c) for c in cases]
        result["errors"] = error_cases(rank, world, None)
        # the group still works after the collective errors; through the nn.Module too
        module = ContextParallelAttention()
        result["after"] = run_case(rank, world, dict(cases[0], name="after errors (module)"), module=module)
        dist.destroy_process_group()
    except Exception:
        result["exception"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
