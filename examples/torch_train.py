#!/usr/bin/env python3
"""Train a tiny causal language model on a Megatron .idx/.bin dataset with wlb's packer
running online in the data loader (CPU, a few seconds per step).

    PYTHONPATH=build/python /usr/bin/python3 examples/torch_train.py --steps 20
    PYTHONPATH=build/python /usr/bin/python3 examples/torch_train.py --steps 40 --resume   # continue
    PYTHONPATH=build/python /usr/bin/python3 examples/torch_train.py --steps 20 --cp 2 --sharding hybrid --comm sharding_aware

Without --data a synthetic corpus is written first (document lengths from wlb's
long-context preset, tokens from a per-document recurrence the model can learn). Each
step packs one global batch with the chosen packer (default wlb: variable-length
micro-batches balanced by attention work, outlier documents deferred), the sampler yields
this rank's micro-batches, the collate builds packed input ids, labels, position ids and
cu_seqlens, and the model attends within each document only. With --cp N the script starts
N processes, a context-parallel group over torch.distributed (gloo): every micro-batch is
CP-sharded by the planner, each process embeds, projects and scores only its own tokens,
and attention runs through wlb.torch.cp_attention, which moves K/V by the shard plan's
comm plan (--comm) and returns dK/dV to their owners; parameter gradients are summed over
the group before the optimizer step. The checkpoint holds the sampler state, so --resume
continues with the next micro-batch: no document is lost or repeated.
With --packer slimpack the step's MicroPack count varies and long documents are cut into
slices whose queries attend to their document's earlier slices: the model keeps each
document's keys and values for the step (sliced_attention), and a slice's backward reaches
the earlier slices through them. See docs/python.md.
"""

import argparse
import datetime
import math
import os
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import wlb
from wlb.torch import (CPAttentionPlan, CPCommStats, MegatronDataset, PackedBatchSampler, PackedCollate,
                       cp_attention, document_attention, make_loader, write_megatron_dataset)


def synthetic_corpus(prefix, documents, vocab, seed):
    """Documents whose tokens follow t[i] = (a + b * i) mod vocab, a and b (1..4) drawn per document:
    learnable in context, so the loss falls within a few dozen steps."""
    deck = wlb.Deck(overrides={"data.preset": "long_context_128k", "data.context_window": 2048,
                               "data.length_scale": 1 / 64, "data.seed": seed, "packing.micro_batches": 4})
    src = wlb.LengthSource(deck)
    lengths = []
    while len(lengths) < documents:
        lengths.extend(src.next().lengths.tolist())
    rng = np.random.default_rng(seed)
    docs = []
    for n in lengths[:documents]:
        a, b = int(rng.integers(0, vocab)), int(rng.integers(1, 5))
        docs.append((a + b * np.arange(n)) % vocab)
    write_megatron_dataset(prefix, docs, dtype=np.int32)


class Block(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, dim + 2 * kv_heads * self.head_dim)  # GQA: fewer K/V heads
        self.out = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x, attention):
        T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split([D, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
        d = self.head_dim  # explicit: a CP rank may hold no token of a micro-batch
        o, _ = attention(q.view(T, self.heads, d), k.view(T, self.kv_heads, d), v.view(T, self.kv_heads, d))
        x = x + self.out(o.reshape(T, D))
        return x + self.mlp(self.ln2(x))


def sliced_attention(batch, cache):
    """The `attention` of one micro-batch whose segments may be SlimPack slices: each
    segment's queries attend to its document's keys k_range, the prefix [k_begin, q_begin)
    from `cache` (the keys and values its document's earlier slices computed this step, kept
    with their autograd graph, per layer), then its own (causal bottom-right, GQA). Clear
    `cache` after the step's last backward. On unsliced micro-batches it equals
    document_attention. The model calls it once per layer, in order."""
    cu_q = batch["cu_seqlens_q"].tolist()
    layers = iter(range(1 << 30))

    def attention(q, k, v):
        li = next(layers)
        T, H, d = q.shape
        g = H // k.shape[1]
        outs = []
        for i, s in enumerate(batch["segments"]):
            a, e = cu_q[i], cu_q[i + 1]
            ks, vs = k[a:e], v[a:e]
            if s.q_offset:
                pk, pv = cache.get((s.doc, li), (k[:0], v[:0]))
                if pk.shape[0] != s.q_offset:
                    raise RuntimeError(f"document {s.doc}: slice at {s.offset} before the {s.q_offset} tokens it "
                                       "attends to were computed this step")
                ks, vs = torch.cat((pk, ks)), torch.cat((pv, vs))
            cache[(s.doc, li)] = (ks, vs)
            nq, nk = e - a, ks.shape[0]
            mask = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
            kh, vh = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
            sc = torch.einsum("qhd,khd->hqk", q[a:e], kh) / math.sqrt(d)
            outs.append(torch.einsum("hqk,khd->qhd", sc.masked_fill(~mask, float("-inf")).softmax(-1), vh))
        return (torch.cat(outs) if outs else q.new_zeros(0, H, d)), None

    return attention


def forward_cached(model, batch, cache):
    """The model over a micro-batch of SlimPack slices (sliced_attention)."""
    return model(batch["input_ids"], batch["position_ids"], sliced_attention(batch, cache))


class TinyLM(torch.nn.Module):
    """Packed (THD) causal LM: one sequence of documents, attention inside each document.
    `attention(q, k, v) -> (o, lse)` is document_attention over the whole micro-batch, or
    cp_attention over this CP rank's tokens."""

    def __init__(self, vocab, dim, heads, kv_heads, layers, max_pos):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(max_pos, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids, attention):
        x = self.tok(input_ids) + self.pos(position_ids)
        for b in self.blocks:
            x = b(x, attention)
        return self.head(x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", help="Megatron dataset prefix (PREFIX.idx, PREFIX.bin); default: a synthetic one")
    ap.add_argument("--workdir", default=os.path.join("wlb-out", "torch_train"), help="synthetic data and checkpoint")
    ap.add_argument("--steps", type=int, default=20, help="train until this many steps in total")
    ap.add_argument("--packer", default="wlb", choices=wlb.packer_names())
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (packing.micro_batches)")
    ap.add_argument("--window", type=int, default=1024, help="context window S (s_max = 1.25 S)")
    ap.add_argument("--cp", type=int, default=1, help="CP degree: processes of the context-parallel group")
    ap.add_argument("--sharding", default="per_document", choices=wlb.sharding_names(), help="CP shard strategy")
    ap.add_argument("--comm", default="sharding_aware", choices=["allgather", "sharding_aware"],
                    help="KV exchange of the CP attention")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (per CP rank)")
    ap.add_argument("--resume", action="store_true", help="continue from WORKDIR/checkpoint.pt")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if args.cp < 1:
        ap.error("--cp: must be >= 1")
    if args.packer == "slimpack" and args.cp > 1:
        ap.error("--packer slimpack: CP sharding of slices is not supported here; use --cp 1")

    os.makedirs(args.workdir, exist_ok=True)
    prefix = args.data or os.path.join(args.workdir, "corpus")
    if not args.data and not os.path.exists(prefix + ".idx"):
        synthetic_corpus(prefix, 3000, 64, args.seed)  # once, before the ranks start
    if args.cp == 1:
        return train(0, args, None)
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(train, args=(args, port), nprocs=args.cp)
    return 0


def train(rank, args, port):
    """One CP rank (the only one without --cp)."""
    cp = args.cp
    group = None
    if cp > 1:
        # a timeout, so a rank that fails leaves the others with an error instead of a hang
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp,
                                timeout=datetime.timedelta(seconds=120))
    log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)  # the same initial model on every rank
    torch.set_num_threads(1)
    prefix = args.data or os.path.join(args.workdir, "corpus")
    dataset = MegatronDataset(prefix)
    vocab = max(64, int(max(dataset[i].max() for i in range(min(len(dataset), 1000)))) + 1)

    # The deck describes the run for the planners: batch shape, packer, the model for the
    # cost model (what "balanced" means), CP sharding. The data source is the .idx itself.
    deck = wlb.Deck(overrides={
        "data.source": "megatron", "data.path": os.path.abspath(prefix + ".idx"),
        "data.context_window": args.window, "data.s_max": args.window + args.window // 4,
        "packing.strategy": args.packer, "packing.micro_batches": args.micro_batches,
        "packing.milp_time_limit": 0.2,
        "mesh.cp": cp, "cp.strategy": args.sharding, "cp.comm": args.comm,
        "model.hidden": 64, "model.heads": 4, "model.kv_heads": 2, "model.ffn": 256, "model.layers": 2,
        "model.vocab": vocab, "model.dtype_bytes": 4,
    })
    # every rank runs the same sampler: the same plan, its own CP view of each micro-batch
    sampler = PackedBatchSampler(deck, dp_rank=0, steps=args.steps)
    collate = PackedCollate(wlb.ShardPlanner(deck), rank) if cp > 1 else PackedCollate()
    # slimpack slices keep their document's positions (a whole document of any length)
    max_pos = deck.s_max if args.packer != "slimpack" else max(deck.s_max, max(len(d) for d in dataset))
    model = TinyLM(vocab, 64, 4, 2, 2, max_pos)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = os.path.join(args.workdir, "checkpoint.pt")
    if args.resume:
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        log(f"resumed from {ckpt} at step {sampler.position // sampler.micro_batches}")

    loader = make_loader(dataset, sampler, collate, num_workers=args.workers)
    M = sampler.micro_batches
    step_loss = step_tokens = 0.0
    stats = CPCommStats()
    cache = {}  # slimpack: each document's keys and values of the step (sliced_attention)
    t0 = time.time()
    last = None
    for batch in loader:
        if sampler.variable:
            M = sampler.micro_batches_of(batch["step"])
        if batch["num_tokens"]:  # an empty micro-batch still takes its slot (on every rank)
            if sampler.variable:
                # slices: a later slice's backward reaches the earlier ones through the cache
                ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
                attention = sliced_attention(batch, cache)
            elif cp == 1:
                ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]

                def attention(q, k, v):
                    return document_attention(q, k, v, batch["cu_seqlens"])
            else:
                # this rank's tokens only; attention exchanges K/V with the other ranks
                ids, pos, labels = batch["cp_input_ids"], batch["cp_position_ids"], batch["cp_labels"]
                plan = CPAttentionPlan(batch["shard_plan"], rank)  # once per micro-batch, for every layer

                def attention(q, k, v):
                    return cp_attention(q, k, v, plan, group, stats=stats)
            logits = model(ids, pos, attention)
            loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            trained = int((batch["labels"] != -100).sum())  # of the whole micro-batch
            (loss / max(trained, 1) / M).backward(retain_graph=sampler.variable)
            step_loss += float(loss)
            step_tokens += trained
        last = batch
        if batch["micro_batch"] == M - 1:  # the step's last micro-batch: one optimizer step
            if cp > 1:
                # each rank's gradients come from its own tokens: their sum is the full gradient
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
                flat = torch.cat([g.flatten() for g in grads] + [torch.tensor([step_loss])])
                dist.all_reduce(flat, group=group)
                step_loss = float(flat[-1])
                for p, g in zip(model.parameters(), flat[:-1].split([g.numel() for g in grads])):
                    p.grad = g.view_as(p).clone()
            opt.step()
            opt.zero_grad()
            cache.clear()
            m = sampler.metrics(batch["step"])
            kv = f"  KV {(stats.fwd_bytes_recv + stats.bwd_bytes_recv) / 1e6:.2f} MB recv" if cp > 1 else ""
            log(f"step {batch['step']:4d}  loss {step_loss / max(step_tokens, 1):.6f}  tokens {int(step_tokens):6d}  "
                f"imbalance {m.get('imbalance', float('nan')):.3f}  delayed docs {m.get('delayed_docs', 0)}  "
                f"plan {m.get('plan_us', float('nan')):.0f} us{kv}", flush=True)
            step_loss = step_tokens = 0.0
            stats = CPCommStats()
    if last is None:
        log(f"nothing to do: the sampler is at step {sampler.position // M} of {args.steps}")
    elif rank == 0:
        # the sampler state of what was trained (a prefetching loader may have run ahead)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "sampler": sampler.state_dict(consumed=last["position"] + 1)}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
        log(f"trained to step {last['step'] + 1} in {time.time() - t0:.1f} s; checkpoint {ckpt}")
    if cp > 1:
        dist.barrier(group)  # rank 0's checkpoint is written before any rank leaves
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
