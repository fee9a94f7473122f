"""Context-parallel attention over torch.distributed, driven by wlb's shard and comm plans.

    plan = batch["shard_plan"]                      # wlb.ShardPlan of the micro-batch (PackedCollate)
    o, lse = cp_attention(q, k, v, plan, group)     # this rank's q (T_r, H, D), k and v (T_r, H_kv, D)

Every CP rank of `group` holds the Q, K and V of its own tokens in the plan's local order
(`ShardPlan.token_index(rank)`, the collate's `cp_*` tensors). Forward builds the rank's
KV buffer as docs/cp.md lays it out and runs document-masked causal attention (bottom-right
aligned, GQA) for each local piece over its key prefix; backward computes dQ locally and
returns the partial dK/dV of every KV-buffer slot to the rank that owns the token. The KV
exchange follows the plan's comm mode:

* allgather: every rank's K/V reaches every other rank (one all-to-all with per-peer
  sizes, so a rank receives exactly the other ranks' tokens); backward sends each owner
  its gradient rows, which it sums (a reduce-scatter).
* sharding_aware: one point-to-point message per CommPlan transfer (K and V of its runs
  back to back), backward the reverse messages added into the owner's dK/dV. Messages
  run only between the ranks of a transfer, so a hybrid plan's segment sharded over a
  subgroup moves its KV inside that subgroup and whole segments move nothing.

Before any exchange the ranks compare, in one small all-reduce, whether each rank's
tensors match its part of the plan and whether all hold the same plan; a mismatch raises
CPPlanError on every rank with each failing rank's reason (no rank is left waiting in an
exchange). docs/python.md.
"""

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "CPAttentionPlan",
    "CPCommStats",
    "CPPlanError",
    "ContextParallelAttention",
    "cp_attention",
    "document_attention",
]

# Queries per score block: bounds the (heads, block, keys) score tensor of long pieces.
QUERY_BLOCK = 256
_TAG_FWD, _TAG_BWD = 7101, 7102  # gloo matches point-to-point messages by tag


class CPPlanError(ValueError):
    """A rank's plan does not match its tensors, or the ranks hold different plans (raised
    on every rank of the group)."""


@dataclass
class CPCommStats:
    """Bytes this rank moved for one attention call (K and V forward, dK and dV backward)."""

    fwd_bytes_recv: int = 0
    fwd_bytes_sent: int = 0
    bwd_bytes_recv: int = 0
    bwd_bytes_sent: int = 0


def _ranges(begins, lengths):
    """Concatenated aranges [b, b + n) as an int64 array."""
    begins = np.asarray(begins, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(begins - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return starts + np.arange(int(lengths.sum()), dtype=np.int64)


def _fingerprint(shard_plan):
    """A 56-bit digest of the plan's layout: equal on every rank that holds the same plan."""
    h = hashlib.blake2b(digest_size=7)
    comm = shard_plan.comm
    h.update(f"{shard_plan.strategy}|{comm.mode}|{shard_plan.cp}|{shard_plan.total_tokens}".encode())
    for a in (shard_plan.owner, shard_plan.local_index, shard_plan.kv_tokens, comm.gather_counts):
        h.update(np.ascontiguousarray(a).tobytes())
    for t in comm.transfers:
        h.update(f"{t['src']},{t['dst']},{t['tokens']};".encode())
    return int.from_bytes(h.digest(), "little")


class CPAttentionPlan:
    """One CP rank's part of a micro-batch's shard plan as index arrays: the pieces, the
    rank's own KV runs and the messages of its comm mode. Built once per micro-batch and
    rank, shared by every layer (cp_attention accepts it in place of the ShardPlan);
    picklable, so a DataLoader worker can build it."""

    def __init__(self, shard_plan, rank):
        comm = shard_plan.comm
        self.shard_plan = shard_plan
        self.cp = int(shard_plan.cp)
        self.rank = int(rank)
        if not 0 <= self.rank < self.cp:
            raise IndexError(f"CP rank {rank} out of range [0, {self.cp})")
        self.mode = comm.mode
        self.fingerprint = _fingerprint(shard_plan)
        r = self.rank
        self.tokens = int(shard_plan.rank_tokens[r])
        self.kv_tokens = int(shard_plan.kv_tokens[r])
        p = shard_plan.pieces(r)
        self.pieces = list(zip(p["local_begin"].tolist(), p["q_len"].tolist(), p["kv_begin"].tolist(),
                               p["kv_len"].tolist()))
        runs = shard_plan.kv_runs(r).reshape(-1, 4)  # [src, src_local_begin, len, kv_begin]
        own, remote = runs[runs[:, 0] == r], runs[runs[:, 0] != r]
        self.own_local = _ranges(own[:, 1], own[:, 2])
        self.own_kv = _ranges(own[:, 3], own[:, 2])
        if self.mode == "allgather":
            counts = np.asarray(comm.gather_counts, dtype=np.int64)
            # the receive buffer holds the other ranks' local tokens back to back, in rank order
            self.recv_splits = [0 if q == r else int(counts[q]) for q in range(self.cp)]
            self.send_splits = [0 if q == r else self.tokens for q in range(self.cp)]
            offset = np.concatenate(([0], np.cumsum(self.recv_splits)[:-1]))
            self.remote_recv = _ranges(offset[remote[:, 0]] + remote[:, 1], remote[:, 2])
            self.remote_kv = _ranges(remote[:, 3], remote[:, 2])
        elif self.mode == "sharding_aware":
            transfers = comm.transfers
            # recvs: (peer, KV-buffer slots); sends: (peer, local rows); ascending peer
            self.recvs = [(t["src"], _ranges(t["runs"][:, 2], t["runs"][:, 1]))
                          for t in (transfers[i] for i in comm.transfers_to(r))]
            self.sends = [(t["dst"], _ranges(t["runs"][:, 0], t["runs"][:, 1]))
                          for t in (transfers[i] for i in comm.transfers_from(r))]
        else:
            raise ValueError(f"comm mode '{self.mode}' of the plan is not supported")
        self._device_cache = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_device_cache"] = {}
        return state

    def index(self, name, device):
        """An index array of the plan as an int64 tensor on `device` (cached)."""
        key = (name, str(device))
        t = self._device_cache.get(key)
        if t is None:
            t = torch.from_numpy(np.ascontiguousarray(getattr(self, name))).to(device)
            self._device_cache[key] = t
        return t

    def peer_index(self, which, i, device):
        key = (which, i, str(device))
        t = self._device_cache.get(key)
        if t is None:
            t = torch.from_numpy(np.ascontiguousarray(getattr(self, which)[i][1])).to(device)
            self._device_cache[key] = t
        return t


# ---- local attention over pieces (no communication) ------------------------------------


def _heads(x, kv_heads):
    """(n, H, D) -> (H_kv, g, n, D): query head h uses KV head h // g."""
    n, h, d = x.shape
    return x.reshape(n, kv_heads, h // kv_heads, d).permute(1, 2, 0, 3)


def _unheads(x):
    """(H_kv, g, n, D) -> (n, H, D) (or (H_kv, g, n) -> (n, H))."""
    if x.dim() == 4:
        return x.permute(2, 0, 1, 3).reshape(x.shape[2], -1, x.shape[3])
    return x.permute(2, 0, 1).reshape(x.shape[2], -1)


def _block_scores(qh, kh, j0, j1, nq, nk, scale):
    """Scaled scores of queries [j0, j1) of a piece against its visible keys, masked: query j
    sees keys [0, nk - nq + j] (causal, bottom-right aligned)."""
    kend = nk - nq + j1
    s = torch.matmul(qh[:, :, j0:j1], kh[:, None, :kend].transpose(-1, -2)) * scale
    rows = torch.arange(j0, j1, device=s.device)[:, None] + (nk - nq)
    cols = torch.arange(kend, device=s.device)[None, :]
    return s.masked_fill(cols > rows, float("-inf")), kend


def _pieces_forward(q, kbuf, vbuf, pieces, scale):
    """o (n, H, D) and lse (n, H) of every piece: queries q[local_begin, +q_len) against
    keys kbuf / vbuf[kv_begin, +kv_len)."""
    hkv = kbuf.shape[1]
    o = q.new_zeros(q.shape)
    lse = q.new_zeros(q.shape[:2])
    for lb, nq, kb, nk in pieces:
        qh = _heads(q[lb:lb + nq], hkv)
        kh = kbuf[kb:kb + nk].transpose(0, 1)
        vh = vbuf[kb:kb + nk].transpose(0, 1)
        for j0 in range(0, nq, QUERY_BLOCK):
            j1 = min(nq, j0 + QUERY_BLOCK)
            s, kend = _block_scores(qh, kh, j0, j1, nq, nk, scale)
            m = torch.logsumexp(s, -1)
            p = torch.exp(s - m[..., None])
            o[lb + j0:lb + j1] = _unheads(torch.matmul(p, vh[:, None, :kend]))
            lse[lb + j0:lb + j1] = _unheads(m)
    return o, lse


def _pieces_backward(q, kbuf, vbuf, o, lse, do, dlse, pieces, scale):
    """dq (n, H, D) and the KV buffer's dk, dv (kv_tokens, H_kv, D) of _pieces_forward."""
    hkv = kbuf.shape[1]
    dq = q.new_zeros(q.shape)
    dk = kbuf.new_zeros(kbuf.shape)
    dv = vbuf.new_zeros(vbuf.shape)
    for lb, nq, kb, nk in pieces:
        sl = slice(lb, lb + nq)
        qh, oh, doh = _heads(q[sl], hkv), _heads(o[sl], hkv), _heads(do[sl], hkv)
        lh, dlh = _heads(lse[sl][..., None], hkv)[..., 0], _heads(dlse[sl][..., None], hkv)[..., 0]
        kh = kbuf[kb:kb + nk].transpose(0, 1)
        vh = vbuf[kb:kb + nk].transpose(0, 1)
        dkh = dk[kb:kb + nk].transpose(0, 1)  # views: accumulate in place
        dvh = dv[kb:kb + nk].transpose(0, 1)
        for j0 in range(0, nq, QUERY_BLOCK):
            j1 = min(nq, j0 + QUERY_BLOCK)
            s, kend = _block_scores(qh, kh, j0, j1, nq, nk, scale)
            p = torch.exp(s - lh[:, :, j0:j1, None])
            dob = doh[:, :, j0:j1]
            dvh[:, :kend] += torch.matmul(p.transpose(-1, -2), dob).sum(1)
            dp = torch.matmul(dob, vh[:, None, :kend].transpose(-1, -2))
            delta = (dob * oh[:, :, j0:j1]).sum(-1) - dlh[:, :, j0:j1]  # dlse enters as d lse / d s = p
            ds = p * (dp - delta[..., None])
            dq[lb + j0:lb + j1] = _unheads(torch.matmul(ds, kh[:, None, :kend])) * scale
            dkh[:, :kend] += torch.matmul(ds.transpose(-1, -2), qh[:, :, j0:j1]).sum(1) * scale
    return dq, dk, dv


def _scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / float(head_dim) ** 0.5
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale: must be finite (got {softmax_scale!r})")
    return scale


class _DocumentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pieces, scale):
        o, lse = _pieces_forward(q, k, v, pieces, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.pieces, ctx.scale = pieces, scale
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _pieces_backward(q, k, v, o, lse, do.contiguous(), dlse.contiguous(), ctx.pieces, ctx.scale)
        return dq, dk, dv, None, None


def document_attention(q, k, v, cu_seqlens, softmax_scale=None):
    """Single-process document-masked causal attention of a packed micro-batch (THD):
    q (T, H, D), k and v (T, H_kv, D), cu_seqlens the collate's (k + 1,) segment offsets.
    Returns o (T, H, D) and lse (T, H) (natural log of the softmax denominator), both
    differentiable. The same kernels as cp_attention, with one piece per segment."""
    _check_local_shapes(q, k, v)
    cu_t = torch.as_tensor(cu_seqlens)
    if cu_t.is_floating_point() or cu_t.is_complex() or cu_t.dtype == torch.bool:
        raise TypeError(f"cu_seqlens: expected integer offsets, got {cu_t.dtype}")
    cu = [int(x) for x in cu_t.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to {q.shape[0]} (the tokens of q)")
    pieces = [(a, b - a, a, b - a) for a, b in zip(cu, cu[1:]) if b > a]
    return _DocumentAttention.apply(q, k, v, pieces, _scale(softmax_scale, q.shape[2]))


def _check_local_shapes(q, k, v):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v: expected (tokens, heads, head_dim) tensors, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q, k, v: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not agree "
                         "(k and v (tokens, kv_heads, head_dim), q (tokens, heads, head_dim))")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q, k: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v: need one dtype and one device")


# ---- the distributed operator ------------------------------------------------------------


def _global_rank(group, r):
    if group is None or group is dist.group.WORLD:
        return r
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return get(group, r)


def _control_device(group, like):
    # NCCL reduces device tensors only; gloo and MPI take CPU tensors
    return like.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _check_plan(q, k, v, shard_plan, prepared, group):
    """Collective: every rank learns whether any rank's tensors miss its plan or the ranks
    hold different plans, and all raise the same CPPlanError."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    problem = None
    try:
        _check_local_shapes(q, k, v)
        if shard_plan.cp != size:
            problem = f"the plan is for {shard_plan.cp} CP ranks, the process group has {size}"
        elif prepared is not None and prepared.rank != me:
            problem = f"the prepared plan is CP rank {prepared.rank}'s, this is rank {me} of the process group"
        elif q.shape[0] != int(shard_plan.rank_tokens[me]):
            problem = (f"q, k, v hold {q.shape[0]} tokens, the plan gives CP rank {me} "
                       f"{int(shard_plan.rank_tokens[me])} (its token_index)")
    except ValueError as e:
        problem = str(e)
    fp = _fingerprint(shard_plan) if prepared is None else prepared.fingerprint
    # the messages' row width must agree as well: fold it into the digest
    width = (k.shape[1] * k.shape[2] * k.element_size()) if k.dim() == 3 else -1
    fp = (fp ^ (width * 0x9E3779B1)) & ((1 << 56) - 1)
    flags = torch.zeros(size + 2, dtype=torch.int64)
    flags[me] = problem is not None
    flags[size], flags[size + 1] = fp, -fp
    flags = flags.to(_control_device(group, q))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    flags = flags.cpu()
    failed = flags[:size].nonzero().flatten().tolist()
    same = int(flags[size]) == -int(flags[size + 1])
    if not failed and same:
        return
    what = problem or (f"plan {shard_plan.strategy}/{shard_plan.comm.mode} of {shard_plan.total_tokens} tokens, "
                       f"k {tuple(k.shape)} {k.dtype}")
    reports = [None] * size
    dist.all_gather_object(reports, what, group=group)
    if failed:
        msg = "; ".join(f"CP rank {r}: {reports[r]}" for r in failed)
    else:
        msg = "the ranks hold different plans or K/V widths: " + "; ".join(
            f"CP rank {r}: {reports[r]}" for r in range(size))
    raise CPPlanError(f"wlb context-parallel attention: {msg}")


def _p2p(sends, recvs, group, tag):
    """Post every send and receive of this rank at once, then wait (no ordering deadlock)."""
    ops = [dist.P2POp(dist.isend, t, _global_rank(group, peer), group, tag) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, _global_rank(group, peer), group, tag) for peer, t in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _exchange_forward(kv_local, plan, group, stats):
    """The rank's KV buffer (kv_tokens, 2, H_kv, D) from every rank's local K/V."""
    dev = kv_local.device
    kv = kv_local.new_empty((plan.kv_tokens,) + kv_local.shape[1:])
    kv[plan.index("own_kv", dev)] = kv_local[plan.index("own_local", dev)]
    row = kv_local.shape[1] * kv_local.shape[2] * kv_local.shape[3] * kv_local.element_size()
    if plan.cp == 1:
        return kv
    if plan.mode == "allgather":
        send = kv_local.repeat((plan.cp - 1, 1, 1, 1))
        recv = kv_local.new_empty((sum(plan.recv_splits),) + kv_local.shape[1:])
        dist.all_to_all_single(recv, send, plan.recv_splits, plan.send_splits, group=group)
        kv[plan.index("remote_kv", dev)] = recv[plan.index("remote_recv", dev)]
        stats.fwd_bytes_recv += recv.shape[0] * row
        stats.fwd_bytes_sent += send.shape[0] * row
    else:
        sends = [(peer, kv_local[plan.peer_index("sends", i, dev)].contiguous())
                 for i, (peer, _) in enumerate(plan.sends)]
        recvs = [(peer, kv_local.new_empty((len(slots),) + kv_local.shape[1:])) for peer, slots in plan.recvs]
        _p2p(sends, recvs, group, _TAG_FWD)
        for i, (_, buf) in enumerate(recvs):
            kv[plan.peer_index("recvs", i, dev)] = buf
        stats.fwd_bytes_recv += sum(b.shape[0] for _, b in recvs) * row
        stats.fwd_bytes_sent += sum(b.shape[0] for _, b in sends) * row
    return kv


def _return_grad_backward(dkv, plan, group, stats, local_shape):
    """dK/dV (tokens, 2, H_kv, D) of the rank's own tokens: its KV-buffer gradient rows
    summed over every rank whose buffer holds them."""
    dev = dkv.device
    out = dkv.new_zeros(local_shape)
    out.index_add_(0, plan.index("own_local", dev), dkv[plan.index("own_kv", dev)])
    row = local_shape[1] * local_shape[2] * local_shape[3] * dkv.element_size()
    if plan.cp == 1:
        return out
    if plan.mode == "allgather":
        send = dkv.new_zeros((sum(plan.recv_splits),) + local_shape[1:])
        send.index_add_(0, plan.index("remote_recv", dev), dkv[plan.index("remote_kv", dev)])
        recv = dkv.new_empty(((plan.cp - 1) * plan.tokens,) + local_shape[1:])
        dist.all_to_all_single(recv, send, plan.send_splits, plan.recv_splits, group=group)
        out += recv.view((plan.cp - 1,) + tuple(local_shape)).sum(0)
        stats.bwd_bytes_recv += recv.shape[0] * row
        stats.bwd_bytes_sent += send.shape[0] * row
    else:
        sends = [(peer, dkv[plan.peer_index("recvs", i, dev)].contiguous()) for i, (peer, _) in enumerate(plan.recvs)]
        recvs = [(peer, dkv.new_empty((len(rows),) + local_shape[1:])) for peer, rows in plan.sends]
        _p2p(sends, recvs, group, _TAG_BWD)
        for i, (_, buf) in enumerate(recvs):
            out.index_add_(0, plan.peer_index("sends", i, dev), buf)
        stats.bwd_bytes_recv += sum(b.shape[0] for _, b in recvs) * row
        stats.bwd_bytes_sent += sum(b.shape[0] for _, b in sends) * row
    return out


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, group, scale, stats):
        kv = _exchange_forward(torch.stack((k, v), 1), plan, group, stats)
        kbuf, vbuf = kv[:, 0], kv[:, 1]
        o, lse = _pieces_forward(q, kbuf, vbuf, plan.pieces, scale)
        ctx.save_for_backward(q, kv, o, lse)  # the KV buffer is kept: backward exchanges nothing more
        ctx.plan, ctx.group, ctx.scale, ctx.stats = plan, group, scale, stats
        ctx.local_shape = (k.shape[0], 2) + tuple(k.shape[1:])
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, kv, o, lse = ctx.saved_tensors
        dq, dk, dv = _pieces_backward(q, kv[:, 0], kv[:, 1], o, lse, do.contiguous(), dlse.contiguous(),
                                      ctx.plan.pieces, ctx.scale)
        dkv = _return_grad_backward(torch.stack((dk, dv), 1), ctx.plan, ctx.group, ctx.stats, ctx.local_shape)
        return dq, dkv[:, 0], dkv[:, 1], None, None, None, None


def cp_attention(q, k, v, plan, group=None, softmax_scale=None, stats=None):
    """Context-parallel attention of one micro-batch on this rank of `group`.

    q (T_r, H, D), k and v (T_r, H_kv, D): the rank's tokens in the plan's local order
    (PackedCollate's cp_* tensors; H a multiple of H_kv, query head h uses KV head
    h // (H / H_kv)). plan: the micro-batch's wlb.ShardPlan (its .comm gives the mode) or
    this rank's CPAttentionPlan. group: the torch.distributed process group of the plan's
    cp ranks (None: the default group); gloo on CPU tensors, NCCL on CUDA tensors. stats: a
    CPCommStats that the call adds its bytes to (backward's when backward runs).

    Returns o (T_r, H, D) and lse (T_r, H), differentiable with respect to q, k and v.
    Collective over the group, forward and backward alike; raises CPPlanError on every
    rank when a rank's tensors do not match the plan or the ranks hold different plans.
    """
    prepared = plan if isinstance(plan, CPAttentionPlan) else None
    shard_plan = prepared.shard_plan if prepared is not None else plan
    _check_plan(q, k, v, shard_plan, prepared, group)
    if prepared is None:
        prepared = CPAttentionPlan(shard_plan, dist.get_rank(group))
    return _CPAttention.apply(q, k, v, prepared, group, _scale(softmax_scale, q.shape[2]),
                              stats if stats is not None else CPCommStats())


class ContextParallelAttention(torch.nn.Module):
    """cp_attention as a module: forward(q, k, v, plan) -> (o, lse) over its process group.
    The rank's CPAttentionPlan of the last few ShardPlans is kept, so the layers of a model
    that share one module (or one plan) prepare it once per micro-batch. `last_stats` holds
    the bytes of the latest call (forward, then backward's added)."""

    def __init__(self, group=None, softmax_scale=None, cache=4):
        super().__init__()
        self.group = group
        self.softmax_scale = softmax_scale
        self.cache = max(1, int(cache))
        self._plans = []  # [(ShardPlan, CPAttentionPlan)], the objects kept alive so their ids stay unique
        self.last_stats = None

    def prepared(self, shard_plan):
        if isinstance(shard_plan, CPAttentionPlan):
            return shard_plan
        for sp, prep in self._plans:
            if sp is shard_plan:
                return prep
        rank = dist.get_rank(self.group)
        if shard_plan.cp != dist.get_world_size(self.group) or not 0 <= rank < shard_plan.cp:
            return None  # cp_attention reports it on every rank
        prep = CPAttentionPlan(shard_plan, rank)
        self._plans = (self._plans + [(shard_plan, prep)])[-self.cache:]
        return prep

    def forward(self, q, k, v, plan):
        prep = self.prepared(plan)
        self.last_stats = CPCommStats()
        return cp_attention(q, k, v, prep if prep is not None else plan, self.group, self.softmax_scale,
                            self.last_stats)
