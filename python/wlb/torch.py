"""PyTorch integration: balanced packed micro-batches and CP shards for a training loop.

    deck = wlb.Deck("my.toml")                         # [data] source = "megatron", path = "corpus.idx"
    dataset = MegatronDataset("corpus")                 # any map-style dataset of token sequences
    sampler = PackedBatchSampler(deck, dp_rank=rank)    # runs the packer online, one step at a time
    loader = make_loader(dataset, sampler, PackedCollate())
    for batch in loader:                                # one micro-batch of this DP rank per item
        model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"]) ...
    torch.save({"sampler": sampler.state_dict(consumed=batch["position"] + 1), ...}, path)

The sampler yields, per micro-batch, a list whose first element is a MicroBatchInfo and
whose others are Segments (dataset index, offset, length); SegmentDataset fetches each
segment's tokens and PackedCollate builds the packed tensors (THD layout). With CP, the
ranks of a torch.distributed group run their attention with cp_attention (cp_attention.py),
which exchanges K/V by the micro-batch's shard plan. docs/python.md.
"""

import collections
import operator
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from . import _wlb
from .cp_attention import (  # noqa: F401
    ContextParallelAttention,
    CPAttentionPlan,
    CPCommStats,
    CPPlanError,
    cp_attention,
    document_attention,
)
from .megatron import MegatronDataset, write_megatron_dataset  # noqa: F401


def _int_arg(value, name):
    """An integer argument: int() would truncate 1.7 to 1 and take True as 1."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}") from None

SAMPLER_FORMAT = "wlb-sampler-state"


class Segment(NamedTuple):
    """Tokens [offset, offset + length) of dataset item `index` (one causal attention span),
    or, with q_offset > 0, a SlimPack slice: those tokens are the queries and attend to the
    keys [offset - q_offset, offset + length) of their document, the earlier part computed
    by the document's earlier slices in earlier micro-batches of the step."""

    index: int  # dataset index: doc % documents_per_epoch
    offset: int
    length: int
    doc: int  # stream document id (unique across epochs)
    arrival: int  # step at which the document arrived (delay = step - arrival)
    q_offset: int = 0  # keys before the first query (a slice: = offset)


class MicroBatchInfo(NamedTuple):
    """Where a micro-batch sits: step, DP rank, index within the step, and `position`, the
    rank's running micro-batch count (step * micro_batches + micro_batch)."""

    step: int
    dp_rank: int
    micro_batch: int
    position: int


class _Entry(NamedTuple):
    step: int  # the packer's state is the one after this step
    checkpoint: object  # wlb.PackerCheckpoint
    plan: object  # wlb.Plan of `step` (None for the state before the first packed step)
    end: int  # the rank's position after `step`


class PackedBatchSampler(Sampler):
    """Runs a wlb packer online and yields this DP rank's micro-batches, step after step.

    deck: wlb.Deck or a deck path; its mesh.dp, packing.micro_batches, context window,
        s_max, packer settings and cost model are used.
    dp_rank: which replica's micro-batches to yield (every rank plans the same step).
    lengths: document lengths of the dataset in index order; None takes the deck's file
        source (text, jsonl or megatron), whose file order must be the dataset's order.
    packer: packer name (default packing.strategy). steps: yield steps 0 .. steps - 1
        (None: never stop). history: packed steps kept for state_dict(consumed=...) behind a
        prefetching DataLoader.

    Each item is [MicroBatchInfo, Segment, ...]: M items per step, empty micro-batches
    included (then the list holds the MicroBatchInfo only), so every rank sees the same
    number of items. Documents wrap around at the end of the dataset (ids keep growing).
    `slimpack` chooses M per step (micro_batches_of(step)) and cuts long documents into
    slices (Segment.q_offset > 0) that PackedCollate describes for a per-document KV cache;
    its DP-Merge groups (samples sharded over several replicas) are refused here, set
    packing.slimpack_dp_merge = 0.
    """

    def __init__(self, deck, *, dp_rank=0, lengths=None, packer=None, steps=None, cost=None, history=4,
                 source_name=None):
        super().__init__(None)
        if not isinstance(deck, _wlb.Deck):
            deck = _wlb.Deck(deck)
        dp_rank = _int_arg(dp_rank, "dp_rank")
        steps = None if steps is None else _int_arg(steps, "steps")
        history = _int_arg(history, "history")
        if not 0 <= dp_rank < deck.dp:
            raise ValueError(f"dp_rank: {dp_rank} is out of range [0, {deck.dp}) (mesh.dp = {deck.dp})")
        if lengths is None and deck["data.source"] == "generator":
            raise ValueError("PackedBatchSampler: give lengths= (the dataset's document lengths) or a deck whose "
                             "data.source is a file (text, jsonl, megatron) in the dataset's order")
        if lengths is not None:  # its own dtype: the packer refuses floats and booleans rather than truncate
            lengths = np.asarray(lengths)
        if steps is not None and steps < 0:
            raise ValueError(f"steps: must be >= 0 (got {steps})")
        if history < 1:
            raise ValueError(f"history: must be >= 1 step (got {history})")
        self.deck = deck
        self.dp_rank = dp_rank
        self.steps = steps
        self.packer = _wlb.Packer(deck, packer, cost, lengths, source_name)
        self.micro_batches = self.packer.micro_batches
        self.documents_per_epoch = self.packer.documents_per_epoch
        # slimpack chooses its MicroPack count per step: positions then count micro-batches
        # as yielded instead of step * M + m
        self.variable = self.packer.name == "slimpack"
        self._history = collections.deque(maxlen=history + 1)
        self._reset(None, self.micro_batches, self.packer.next_step * self.micro_batches)

    def _reset(self, plan, next_mb, base):
        """`base`: the position at the start of `plan`'s step (after the last step without one)."""
        self._plan, self._next_mb, self._base = plan, next_mb, base
        after = plan.step if plan is not None else self.packer.next_step - 1
        self._history.clear()
        self._history.append(_Entry(after, self.packer.checkpoint(), plan,
                                    base + (plan.micro_batches if plan is not None else 0)))

    @property
    def position(self):
        """Micro-batches this rank has been given so far, counted from step 0 (for
        slimpack, from the first step this sampler or the state it resumed counted)."""
        if self._plan is None:
            return self._base
        return self._base + self._next_mb

    def micro_batches_of(self, step):
        """Micro-batches of a recently packed step (M; slimpack's count of that step)."""
        for e in self._history:
            if e.plan is not None and e.plan.step == step:
                return e.plan.micro_batches
        raise KeyError(f"step {step} is not among the sampler's recent steps")

    @property
    def plan(self):
        """The wlb.Plan of the step being yielded (None before the first)."""
        return self._plan

    def metrics(self, step):
        """Metrics of a recently packed step (imbalance, delay, plan_us, ...; docs/packing.md):
        behind a prefetching DataLoader the sampler's current plan is ahead of the batch."""
        for e in self._history:
            if e.plan is not None and e.plan.step == step:
                return e.plan.metrics
        raise KeyError(f"step {step} is not among the sampler's recent steps")

    def __len__(self):
        if self.steps is None:
            raise TypeError("PackedBatchSampler without steps= is endless")
        if self.variable:
            raise TypeError(f"PackedBatchSampler: packer '{self.packer.name}' chooses its micro-batch count per step")
        return max(0, self.steps * self.micro_batches - self.position)

    def __iter__(self):
        while True:
            if self._plan is None or self._next_mb >= self._plan.micro_batches:
                if self.steps is not None and self.packer.next_step >= self.steps:
                    return
                base = self.position
                self._plan = self.packer.pack()
                self._next_mb, self._base = 0, base
                self._history.append(_Entry(self._plan.step, self.packer.checkpoint(), self._plan,
                                            base + self._plan.micro_batches))
            m = self._next_mb
            self._next_mb += 1
            yield self.micro_batch(self._plan, m)

    def micro_batch(self, plan, m):
        """[MicroBatchInfo, Segment, ...] of this rank's micro-batch m of `plan`."""
        n = self.documents_per_epoch or (1 << 62)
        start = self._base if plan is self._plan else plan.step * self.micro_batches
        info = MicroBatchInfo(plan.step, self.dp_rank, m, start + m)
        new = tuple.__new__  # namedtuple's own __new__ costs a Python call per segment
        segs = plan.micro_batch(self.dp_rank, m)
        if plan.merged:
            raise ValueError(f"PackedBatchSampler: packer '{self.packer.name}' merged samples over DP replicas "
                             "(SlimPack's DP-Merge: a sample sharded over a group of replicas as a CP group); "
                             "set packing.slimpack_dp_merge = 0 for a per-replica sampler")
        if segs.shape[1] == 5:  # SlimPack slices: q_offset last
            return [info] + [new(Segment, (d % n, o, ln, d, a, q)) for d, o, ln, a, q in segs.tolist()]
        return [info] + [new(Segment, (d % n, o, ln, d, a, 0)) for d, o, ln, a in segs.tolist()]

    def state_dict(self, consumed=None):
        """The sampler's state after `consumed` micro-batches of this rank (default: all it
        has yielded; behind a prefetching DataLoader pass batch["position"] + 1 of the last
        micro-batch trained). `checkpoint` is a `wlb plan --save-state` document; `plan` is
        the step in progress when the position is inside a step."""
        M = self.micro_batches
        p = self.position if consumed is None else _int_arg(consumed, "consumed")
        if p < 0:
            raise ValueError(f"consumed: must be >= 0 (got {p})")
        if p > self.position:
            raise ValueError(f"consumed: {p} micro-batches, but the sampler has yielded only {self.position}")
        # the step whose end is p, or the step p is inside of
        entry, step, m = None, None, 0
        for e in self._history:
            start = e.end - (e.plan.micro_batches if e.plan is not None else 0)
            if e.end == p:
                entry, step, m = e, e.step + 1, 0
            elif e.plan is not None and start < p < e.end:
                entry, step, m = e, e.step, p - start
        if entry is None:
            raise ValueError(f"consumed: position {p} is older than the sampler's history of "
                             f"{self._history.maxlen - 1} steps; create the sampler with a larger history=")
        return {
            "format": SAMPLER_FORMAT,
            "version": 1,
            "packer": self.packer.name,
            "dp": self.deck.dp,
            "dp_rank": self.dp_rank,
            "micro_batches": M,
            "position": p,
            "step": step,
            "micro_batch": m,
            "checkpoint": entry.checkpoint.to_dict(),
            "plan": entry.plan.to_json() if m else None,
        }

    def load_state_dict(self, state):
        """Continue exactly after the saved position: no document lost or repeated. A state
        saved on another DP rank of the same run works too (the plan is the same)."""
        if not isinstance(state, dict) or state.get("format") != SAMPLER_FORMAT or state.get("version") != 1:
            raise ValueError("sampler state: not a wlb-sampler-state version 1 dictionary")
        M = self.micro_batches
        for key, have in (("dp", self.deck.dp), ("micro_batches", M), ("packer", self.packer.name)):
            if state.get(key) != have:
                raise ValueError(f"sampler state: saved with {key} = {state.get(key)!r}, this sampler has {have!r}")
        p = int(state["position"])
        step, m = (int(state["step"]), int(state["micro_batch"])) if "step" in state else divmod(p, M)
        plan = None
        if m:
            if state.get("plan") is None:
                raise ValueError(f"sampler state: position {p} is inside step {step} but no plan was saved")
            plan = _wlb.Plan.from_json(state["plan"], self.packer.cost)
            if plan.step != step or plan.dp != self.deck.dp or not (plan.micro_batches == M or
                                                                   self.variable and plan.micro_batches > m):
                raise ValueError(f"sampler state: the saved plan is step {plan.step} ({plan.dp} x {plan.micro_batches}),"
                                 f" expected step {step} ({self.deck.dp} x {M})")
        # all or nothing: a state refused after the packer took its checkpoint would leave the
        # packer rewound under this sampler's position (steps packed twice)
        before = self.packer.checkpoint()
        try:
            self.packer.load_state_dict(state["checkpoint"])
            if self.packer.next_step != (step + 1 if m else step):
                raise ValueError(f"sampler state: the checkpoint continues at step {self.packer.next_step}, "
                                 f"position {p} needs step {step + 1 if m else step}")
        except BaseException:
            self.packer.load_state_dict(before)
            raise
        self._reset(plan, m if m else M, p - m)


class SegmentDataset(Dataset):
    """Wraps a map-style dataset of token sequences (lists, NumPy arrays or tensors) for the
    sampler's items: Segment -> (Segment, tokens[offset : offset + length + 1]) — one token
    more when the document has it, the label of the segment's last token;
    MicroBatchInfo -> itself; an int -> dataset[int]."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        if isinstance(key, MicroBatchInfo):
            return key
        if not isinstance(key, Segment):
            return self.dataset[key]
        doc = self.dataset[key.index]
        toks = doc[key.offset:key.offset + key.length + 1]
        t = toks.to(torch.long) if torch.is_tensor(toks) else torch.as_tensor(np.asarray(toks, dtype=np.int64))
        if t.numel() < key.length:
            raise ValueError(f"dataset item {key.index} has {len(doc)} tokens, but the sampler's lengths say document "
                             f"{key.doc} has at least {key.offset + key.length}: are the lengths in dataset order?")
        return key, t


def pack_segments(segments, tokens, ignore_index=-100):
    """Packed tensors of segments laid back to back (THD layout, no padding):
    input_ids, labels (the next token of the same document, ignore_index after a
    document's last token), position_ids (restarting at 0 in every segment; a slice's
    continue its keys' positions: q_offset, q_offset + 1, ...), cu_seqlens (int32, k + 1
    entries, FlashAttention / TransformerEngine varlen convention) and max_seqlen.
    `tokens[i]` holds segment i's tokens, optionally one more (its label).

    For SlimPack slices (Segment.q_offset > 0) the varlen pairs of a per-document KV cache:
    cu_seqlens_q (= cu_seqlens, the queries) and cu_seqlens_k (each segment's keys: its
    q_offset cached tokens, then its own), max_seqlen_q / max_seqlen_k, and per segment
    q_range / k_range ([k, 2] int64, document token ranges [begin, end) of its queries and
    of its keys, the key prefix being [k_begin, q_begin)). Causal bottom-right: query i of
    a segment sees its first q_offset + i + 1 keys. `sliced` says whether any segment is a
    slice; without slices the pairs equal cu_seqlens."""
    lengths = torch.tensor([s.length for s in segments], dtype=torch.long)
    q_off = torch.tensor([getattr(s, "q_offset", 0) for s in segments], dtype=torch.long)
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    if len(segments):
        cu[1:] = torch.cumsum(lengths, 0)
        ids = torch.cat([t[:s.length] for s, t in zip(segments, tokens)])
        fill = torch.full((1,), ignore_index, dtype=torch.long)
        labels = torch.cat([t[1:s.length + 1] if t.numel() > s.length else torch.cat((t[1:s.length], fill))
                            for s, t in zip(segments, tokens)])
    else:
        ids = torch.zeros(0, dtype=torch.long)
        labels = torch.zeros(0, dtype=torch.long)
    total = int(cu[-1])
    positions = torch.arange(total, dtype=torch.long) - torch.repeat_interleave(cu[:-1].long() - q_off, lengths)
    cu_k = torch.zeros(len(segments) + 1, dtype=torch.int32)
    if len(segments):
        cu_k[1:] = torch.cumsum(lengths + q_off, 0)
    offsets = torch.tensor([s.offset for s in segments], dtype=torch.long)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seqlens": cu,
        "max_seqlen": int(lengths.max()) if len(segments) else 0,
        "num_tokens": total,
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu_k,
        "max_seqlen_q": int(lengths.max()) if len(segments) else 0,
        "max_seqlen_k": int((lengths + q_off).max()) if len(segments) else 0,
        "q_range": torch.stack((offsets, offsets + lengths), 1).reshape(-1, 2),
        "k_range": torch.stack((offsets - q_off, offsets + lengths), 1).reshape(-1, 2),
        "sliced": bool((q_off > 0).any()),
    }


class PackedCollate:
    """collate_fn for SegmentDataset items of one micro-batch: pack_segments' tensors plus
    segments, step, dp_rank, micro_batch and position. An empty micro-batch gives
    zero-length tensors and cu_seqlens = [0].

    With a shard_planner (wlb.ShardPlanner) and cp_rank, the micro-batch is CP-sharded and
    the batch adds this rank's view: cp_index (packed positions of its tokens, local
    order), cp_input_ids / cp_labels / cp_position_ids (the packed tensors at cp_index),
    cp_kv_index (packed position of each KV-buffer slot), its attention pieces as
    cp_cu_seqlens_q (queries back to back) with cp_kv_begin / cp_kv_len (each piece's keys
    in the KV buffer, causal bottom-right), and shard_plan (the wlb.ShardPlan, with .comm)."""

    def __init__(self, shard_planner=None, cp_rank=None, ignore_index=-100):
        if (shard_planner is None) != (cp_rank is None):
            raise ValueError("PackedCollate: give both shard_planner and cp_rank, or neither")
        if cp_rank is not None:
            cp_rank = _int_arg(cp_rank, "cp_rank")
        if shard_planner is not None and not 0 <= cp_rank < shard_planner.cp:
            raise IndexError(f"cp_rank: {cp_rank} is out of range [0, {shard_planner.cp})")
        self.planner = shard_planner
        self.cp_rank = cp_rank
        self.ignore_index = ignore_index

    def __call__(self, items):
        info, segments, tokens = None, [], []
        for it in items:
            if isinstance(it, MicroBatchInfo):
                info = it
            else:
                segments.append(it[0])
                tokens.append(it[1])
        if self.planner is not None and any(getattr(s, "q_offset", 0) for s in segments):
            raise ValueError("PackedCollate: CP sharding of SlimPack slices is not supported (their queries attend to "
                             "keys of earlier micro-batches); use it without shard_planner")
        batch = pack_segments(segments, tokens, self.ignore_index)
        batch["segments"] = segments
        for k in MicroBatchInfo._fields:
            batch[k] = getattr(info, k) if info is not None else None
        if self.planner is not None:
            batch.update(self.shard(segments, batch))
        return batch

    def shard(self, segments, batch):
        """The CP rank's view of a packed micro-batch (see the class documentation)."""
        segs = np.array([[s.doc, s.offset, s.length, s.arrival] for s in segments], dtype=np.int64).reshape(-1, 4)
        plan = self.planner.plan(segs)
        r = self.cp_rank
        index = torch.from_numpy(plan.token_index(r))
        pieces = plan.pieces(r)
        cu_q = torch.zeros(len(pieces["q_len"]) + 1, dtype=torch.int32)
        cu_q[1:] = torch.from_numpy(np.cumsum(pieces["q_len"]))
        return {
            "cp_rank": r,
            "cp_index": index,
            "cp_input_ids": batch["input_ids"][index],
            "cp_labels": batch["labels"][index],
            "cp_position_ids": batch["position_ids"][index],
            "cp_kv_index": torch.from_numpy(plan.kv_index(r)),
            "cp_cu_seqlens_q": cu_q,
            "cp_kv_begin": torch.from_numpy(pieces["kv_begin"]),
            "cp_kv_len": torch.from_numpy(pieces["kv_len"]),
            "shard_plan": plan,
        }


def make_loader(dataset, sampler, collate=None, **kwargs):
    """A DataLoader over `dataset` (token sequences) driven by a PackedBatchSampler."""
    return DataLoader(SegmentDataset(dataset), batch_sampler=sampler, collate_fn=collate or PackedCollate(), **kwargs)
