"""SlimPack plans in PyTorch: PackedCollate's varlen pairs of slices against hand-computed
tensors, the sampler's variable MicroPack count and its state, and training on a slimpack
plan against the unsliced plan of the same documents (examples/torch_train.py's model,
its forward with a per-document KV cache): the same loss and parameters within FP32
tolerance."""

import copy
import importlib.util
import itertools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import wlb  # noqa: E402
from wlb_test_helpers import ROOT, deck_path  # noqa: E402
from wlb.torch import MicroBatchInfo, PackedBatchSampler, PackedCollate, Segment, SegmentDataset  # noqa: E402


def load_example():
    spec = importlib.util.spec_from_file_location("torch_train", os.path.join(ROOT, "examples", "torch_train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ex = load_example()


def test_collate_slices_hand_computed():
    docs = [list(range(100, 110)), [7, 8, 9]]
    items = [MicroBatchInfo(step=0, dp_rank=0, micro_batch=1, position=1),
             Segment(index=0, offset=6, length=4, doc=10, arrival=0, q_offset=6),  # the last slice of doc 10
             Segment(index=1, offset=0, length=3, doc=11, arrival=0)]  # a whole document
    ds = SegmentDataset(docs)
    b = PackedCollate()([ds[x] for x in items])
    assert b["input_ids"].tolist() == [106, 107, 108, 109, 7, 8, 9]
    assert b["labels"].tolist() == [107, 108, 109, -100, 8, 9, -100]
    assert b["position_ids"].tolist() == [6, 7, 8, 9, 0, 1, 2]  # a slice keeps its document's positions
    assert b["cu_seqlens_q"].tolist() == b["cu_seqlens"].tolist() == [0, 4, 7]
    assert b["cu_seqlens_k"].dtype == torch.int32 and b["cu_seqlens_k"].tolist() == [0, 10, 13]
    assert (b["max_seqlen_q"], b["max_seqlen_k"]) == (4, 10)
    assert b["q_range"].tolist() == [[6, 10], [0, 3]]
    assert b["k_range"].tolist() == [[0, 10], [0, 3]]
    assert b["sliced"]
    plain = PackedCollate()([ds[x] for x in items[:1] + items[2:]])
    assert not plain["sliced"] and plain["cu_seqlens_k"].tolist() == plain["cu_seqlens"].tolist() == [0, 3]
    with pytest.raises(ValueError, match="CP sharding of SlimPack slices"):
        PackedCollate(wlb.ShardPlanner(wlb.Deck(deck_path("plan_smoke.toml")), cp=2), 0)([ds[x] for x in items])


def recurrence_docs(lengths, vocab, seed):
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(0, vocab)) + int(rng.integers(1, 5)) * np.arange(n)) % vocab for n in lengths]


VOCAB = 32
# A small model's cost model; 4 long documents in 24 mean that most steps slice.
DECK = {"model.hidden": 64, "model.heads": 4, "model.kv_heads": 4, "model.ffn": 256, "model.layers": 2,
        "model.vocab": VOCAB, "data.context_window": 512, "data.s_max": 640, "packing.micro_batches": 2,
        "packing.slimpack_dp_merge": 0, "mesh.pp": 2}


def slim_sampler(lengths, steps):
    return PackedBatchSampler(wlb.Deck(overrides=DECK), lengths=lengths, steps=steps,
                              packer="slimpack")


def lengths_for_test():
    rng = np.random.default_rng(3)
    return [int(x) for x in np.where(rng.random(60) < 0.2, rng.integers(300, 512, 60), rng.integers(5, 80, 60))]


def test_sampler_yields_slices_with_a_varying_count_and_resumes():
    lengths = lengths_for_test()
    s = slim_sampler(lengths, 6)
    items = list(s)
    ref = wlb.Packer(wlb.Deck(overrides=DECK), "slimpack", None, np.array(lengths))
    pos, counts, sliced = 0, set(), 0
    for t in range(6):
        plan = ref.pack()
        counts.add(plan.micro_batches)
        assert plan.memory["partition"] == "flops" and plan.memory["held"].size == 0  # ample memory here
        for m in range(plan.micro_batches):
            info, *segs = items[pos]
            assert info == MicroBatchInfo(t, 0, m, pos)
            want = plan.micro_batch(0, m).tolist()
            assert len(segs) == len(want)
            assert [[x.doc, x.offset, x.length, x.arrival, x.q_offset][:len(w)] for x, w in zip(segs, want)] == want
            sliced += sum(x.q_offset > 0 for x in segs)
            pos += 1
    assert pos == len(items) and sliced > 0
    assert all(c % 2 == 0 for c in counts)  # multiples of mesh.pp
    with pytest.raises(TypeError, match="chooses its micro-batch count"):
        len(s)
    # stop inside a step and at a step's end; a new sampler continues exactly there
    for consumed in (3, s.position - s.micro_batches_of(5)):
        a = slim_sampler(lengths, 6)
        head = list(itertools.islice(iter(a), consumed + 2))
        b = slim_sampler(lengths, 6)
        b.load_state_dict(a.state_dict(consumed=consumed))
        assert b.position == consumed
        assert head[:consumed] + list(b) == items


def train(model, batches, forward, lr=0.05):
    """SGD steps over [(micro-batches of one step)]: each micro-batch's summed loss over
    the step's trained tokens, backward per micro-batch (retaining the graph for later
    slices), one update per step. Returns the per-step losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in batches:
        tokens = sum(int((b["labels"] != -100).sum()) for b in step)
        cache, total = {}, 0.0
        for b in step:
            if not b["num_tokens"]:
                continue
            loss = torch.nn.functional.cross_entropy(forward(model, b, cache), b["labels"], ignore_index=-100,
                                                     reduction="sum")
            (loss / tokens).backward(retain_graph=True)
            total += float(loss)
        opt.step()
        opt.zero_grad()
        losses.append(total / tokens)
    return losses


def test_training_on_a_slimpack_plan_matches_the_unsliced_plan():
    lengths = lengths_for_test()
    dataset = recurrence_docs(lengths, VOCAB, 5)
    ds = SegmentDataset(dataset)
    collate = PackedCollate()
    s = slim_sampler(lengths, 4)
    sliced_steps, whole_steps, slices = [], [], 0
    for t, group in itertools.groupby(s, key=lambda it: it[0].step):
        group = list(group)
        sliced_steps.append([collate([ds[x] for x in it]) for it in group])
        slices += sum(x.q_offset > 0 for it in group for x in it[1:])
        # the unsliced plan of the same documents: each document whole, one per micro-batch
        docs = sorted({(x.index, x.doc, x.arrival) for it in group for x in it[1:]})
        whole_steps.append([collate([ds[MicroBatchInfo(t, 0, i, i)], ds[Segment(ix, 0, lengths[ix], d, a)]])
                            for i, (ix, d, a) in enumerate(docs)])
        covered = sorted((x.doc, x.offset, x.length) for it in group for x in it[1:])
        assert sum(ln for _, _, ln in covered) == sum(lengths[ix] for ix, _, _ in docs)  # every token once
    assert slices > 0
    torch.manual_seed(0)
    base = ex.TinyLM(VOCAB, 64, 4, 2, 2, 512)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    sliced = train(a, sliced_steps, ex.forward_cached)
    whole = train(b, whole_steps, lambda m, batch, cache: m(
        batch["input_ids"], batch["position_ids"],
        lambda q, k, v: ex.document_attention(q, k, v, batch["cu_seqlens"])))
    assert sliced == pytest.approx(whole, rel=1e-5)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), base.parameters()))  # it trained
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_example_trains_with_slimpack(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "torch_train.py"), "--steps", "2",
                           "--window", "256", "--packer", "slimpack", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("step ")] == ["0", "1"]
