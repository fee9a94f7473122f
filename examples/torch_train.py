#!/usr/bin/env python3
"""Train a tiny causal language model on a Megatron .idx/.bin dataset with wlb's packer
running online in the data loader (CPU, a few seconds per step).

    PYTHONPATH=build/python /usr/bin/python3 examples/torch_train.py --steps 20
    PYTHONPATH=build/python /usr/bin/python3 examples/torch_train.py --steps 40 --resume   # continue

Without --data a synthetic corpus is written first (document lengths from wlb's
long-context preset, tokens from a per-document recurrence the model can learn). Each
step packs one global batch with the chosen packer (default wlb: variable-length
micro-batches balanced by attention work, outlier documents deferred), the sampler yields
this rank's micro-batches, the collate builds packed input ids, labels, position ids and
cu_seqlens, and the model attends within each document only. With --cp 2 every micro-batch
is also CP-sharded and the loss is gathered from each CP rank's tokens (cp_index), as the
ranks of a context-parallel group would compute it. The checkpoint holds the sampler state,
so --resume continues with the next micro-batch: no document is lost or repeated.
With --packer slimpack the step's MicroPack count varies and long documents are cut into
slices whose queries attend to their document's earlier slices: the model keeps each
document's keys and values for the step (forward_cached), and a slice's backward reaches
the earlier slices through them.
See docs/python.md.
"""

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import wlb
from wlb.torch import MegatronDataset, PackedBatchSampler, PackedCollate, make_loader, write_megatron_dataset


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
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(T, 3, self.heads, D // self.heads).unbind(1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D // self.heads)
        a = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
        x = x + self.out(a.reshape(T, D))
        return x + self.mlp(self.ln2(x))


class TinyLM(torch.nn.Module):
    """Packed (THD) causal LM: one sequence of documents, attention inside each document."""

    def __init__(self, vocab, dim, heads, layers, max_pos):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(max_pos, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids, cu_seqlens):
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        idx = torch.arange(len(input_ids))
        mask = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])  # document-causal
        x = self.tok(input_ids) + self.pos(position_ids)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(x)


def forward_cached(model, batch, cache):
    """TinyLM's forward over a micro-batch whose segments may be SlimPack slices: each
    segment's queries attend to its document's keys k_range, the prefix [k_begin, q_begin)
    from `cache` (the keys and values its document's earlier slices computed this step, kept
    with their autograd graph), then its own (causal bottom-right). Clear `cache` after the
    step's last backward. On unsliced micro-batches it equals model(...)."""
    x = model.tok(batch["input_ids"]) + model.pos(batch["position_ids"])
    cu_q = batch["cu_seqlens_q"].tolist()
    for li, b in enumerate(model.blocks):
        T, D = x.shape
        q, k, v = b.qkv(b.ln1(x)).view(T, 3, b.heads, D // b.heads).unbind(1)
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
            sc = torch.einsum("qhd,khd->hqk", q[a:e], ks) / math.sqrt(D // b.heads)
            outs.append(torch.einsum("hqk,khd->qhd", sc.masked_fill(~mask, float("-inf")).softmax(-1), vs))
        x = x + b.out(torch.cat(outs).reshape(T, D) if outs else x.new_zeros(0, D))
        x = x + b.mlp(b.ln2(x))
    return model.head(x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", help="Megatron dataset prefix (PREFIX.idx, PREFIX.bin); default: a synthetic one")
    ap.add_argument("--workdir", default=os.path.join("wlb-out", "torch_train"), help="synthetic data and checkpoint")
    ap.add_argument("--steps", type=int, default=20, help="train until this many steps in total")
    ap.add_argument("--packer", default="wlb", choices=wlb.packer_names())
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (packing.micro_batches)")
    ap.add_argument("--window", type=int, default=1024, help="context window S (s_max = 1.25 S)")
    ap.add_argument("--cp", type=int, default=1, help="CP degree to shard every micro-batch for")
    ap.add_argument("--sharding", default="per_document", choices=wlb.sharding_names())
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    ap.add_argument("--resume", action="store_true", help="continue from WORKDIR/checkpoint.pt")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if args.packer == "slimpack" and args.cp > 1:
        ap.error("--packer slimpack: CP sharding of slices is not supported here; use --cp 1")

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    os.makedirs(args.workdir, exist_ok=True)
    vocab = 64
    prefix = args.data or os.path.join(args.workdir, "corpus")
    if not args.data and not os.path.exists(prefix + ".idx"):
        synthetic_corpus(prefix, 3000, vocab, args.seed)
    dataset = MegatronDataset(prefix)
    vocab = max(vocab, int(max(dataset[i].max() for i in range(min(len(dataset), 1000)))) + 1)

    # The deck describes the run for the planners: batch shape, packer, the model for the
    # cost model (what "balanced" means), CP sharding. The data source is the .idx itself.
    deck = wlb.Deck(overrides={
        "data.source": "megatron", "data.path": os.path.abspath(prefix + ".idx"),
        "data.context_window": args.window, "data.s_max": args.window + args.window // 4,
        "packing.strategy": args.packer, "packing.micro_batches": args.micro_batches,
        "packing.milp_time_limit": 0.2,
        "mesh.cp": args.cp, "cp.strategy": args.sharding,
        "model.hidden": 64, "model.heads": 4, "model.kv_heads": 4, "model.ffn": 256, "model.layers": 2,
        "model.vocab": vocab,
    })
    sampler = PackedBatchSampler(deck, dp_rank=0, steps=args.steps)
    collates = [PackedCollate()]
    if args.cp > 1:
        planner = wlb.ShardPlanner(deck)
        collates = [PackedCollate(planner, r) for r in range(args.cp)]  # one per CP rank of the group
    # slimpack slices keep their document's positions (a whole document of any length)
    max_pos = deck.s_max if args.packer != "slimpack" else max(deck.s_max, max(len(d) for d in dataset))
    model = TinyLM(vocab, 64, 4, 2, max_pos)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = os.path.join(args.workdir, "checkpoint.pt")
    if args.resume:
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        print(f"resumed from {ckpt} at step {sampler.position // sampler.micro_batches}")

    # A CP rank would run collates[r] in its own loader; here rank 0's loader drives the
    # step and the other ranks' views are built from the same items.
    loader = make_loader(dataset, sampler, lambda items: [c(items) for c in collates], num_workers=args.workers)
    M = sampler.micro_batches
    cache = {}  # slimpack: each document's keys and values of the step (forward_cached)
    step_loss = step_tokens = 0.0
    t0 = time.time()
    last = None
    for views in loader:
        batch = views[0]
        if sampler.variable:
            M = sampler.micro_batches_of(batch["step"])
        if batch["num_tokens"] and sampler.variable:
            # slices: a later slice's backward reaches the earlier ones through the cache
            logits = forward_cached(model, batch, cache)
            loss = F.cross_entropy(logits, batch["labels"], ignore_index=-100, reduction="sum")
            trained = int((batch["labels"] != -100).sum())
            (loss / max(trained, 1) / M).backward(retain_graph=True)
            step_loss += float(loss)
            step_tokens += trained
        elif batch["num_tokens"]:  # an empty micro-batch still takes its slot
            if args.cp == 1:
                logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
                loss = F.cross_entropy(logits, batch["labels"], ignore_index=-100, reduction="sum")
            else:
                # every CP rank scores its own tokens: the sum over ranks is the full loss
                logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
                assert sorted(torch.cat([v["cp_index"] for v in views]).tolist()) == list(range(batch["num_tokens"]))
                loss = sum(F.cross_entropy(logits[v["cp_index"]], v["cp_labels"], ignore_index=-100, reduction="sum")
                           for v in views)
            trained = int((batch["labels"] != -100).sum())
            (loss / max(trained, 1) / M).backward()
            step_loss += float(loss)
            step_tokens += trained
        last = batch
        if batch["micro_batch"] == M - 1:  # the step's last micro-batch: one optimizer step
            opt.step()
            opt.zero_grad()
            cache.clear()
            m = sampler.metrics(batch["step"])
            print(f"step {batch['step']:4d}  loss {step_loss / max(step_tokens, 1):.3f}  tokens {int(step_tokens):6d}  "
                  f"imbalance {m.get('imbalance', float('nan')):.3f}  delayed docs {m.get('delayed_docs', 0)}  "
                  f"plan {m.get('plan_us', float('nan')):.0f} us", flush=True)
            step_loss = step_tokens = 0.0
    if last is None:
        print(f"nothing to do: the sampler is at step {sampler.position // M} of {args.steps}")
        return 0
    # the sampler state of what was trained (a prefetching loader may have run ahead)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "sampler": sampler.state_dict(consumed=last["position"] + 1)}, ckpt + ".tmp")
    os.replace(ckpt + ".tmp", ckpt)
    print(f"trained to step {last['step'] + 1} in {time.time() - t0:.1f} s; checkpoint {ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
