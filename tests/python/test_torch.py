"""wlb.torch: the collate against hand-computed tensors, the sampler against the packer,
its state across a simulated restart (behind a prefetching DataLoader too), CP views, and
the Megatron dataset reader."""

import io
import itertools
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import wlb  # noqa: E402
from wlb_test_helpers import deck_path, tiles_documents  # noqa: E402
from wlb.torch import (  # noqa: E402
    MegatronDataset,
    MicroBatchInfo,
    PackedBatchSampler,
    PackedCollate,
    Segment,
    SegmentDataset,
    make_loader,
    write_megatron_dataset,
)

LENGTHS_DECK = deck_path("plan_lengths_file.toml")  # text source, dp 2 x M 4, 8K window


def token_dataset(lengths):
    """Document i = [i * 1000, i * 1000 + 1, ...]: every token says where it came from."""
    return [np.arange(i * 1000, i * 1000 + n, dtype=np.int64) for i, n in enumerate(lengths)]


# ---- collate -----------------------------------------------------------------------------

HAND_DOCS = [list(range(100, 110)), [7, 8, 9], [1, 2, 3, 4, 5, 6]]
HAND_ITEMS = [MicroBatchInfo(step=3, dp_rank=0, micro_batch=1, position=13),
              Segment(index=0, offset=4, length=4, doc=10, arrival=2),  # middle of a document
              Segment(index=1, offset=0, length=3, doc=11, arrival=3),  # a whole document
              Segment(index=2, offset=1, length=5, doc=12, arrival=3)]  # the tail of a document


def hand_batch(collate):
    ds = SegmentDataset(HAND_DOCS)
    return collate([ds[x] for x in HAND_ITEMS])


def test_collate_hand_computed():
    b = hand_batch(PackedCollate())
    assert b["input_ids"].tolist() == [104, 105, 106, 107, 7, 8, 9, 2, 3, 4, 5, 6]
    # the next token of the same document; -100 after a document's last token
    assert b["labels"].tolist() == [105, 106, 107, 108, 8, 9, -100, 3, 4, 5, 6, -100]
    assert b["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    assert b["cu_seqlens"].dtype == torch.int32 and b["cu_seqlens"].tolist() == [0, 4, 7, 12]
    assert b["max_seqlen"] == 5 and b["num_tokens"] == 12
    assert b["input_ids"].dtype == b["labels"].dtype == b["position_ids"].dtype == torch.long
    assert (b["step"], b["dp_rank"], b["micro_batch"], b["position"]) == (3, 0, 1, 13)
    assert [s.doc for s in b["segments"]] == [10, 11, 12]


def test_collate_cp_rank_view_hand_computed():
    deck = wlb.Deck(LENGTHS_DECK)
    planner = wlb.ShardPlanner(deck, strategy="per_sequence", cp=2)
    # per_sequence, T = 12, 2C = 4 chunks of 3: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    r0, r1 = hand_batch(PackedCollate(planner, 0)), hand_batch(PackedCollate(planner, 1))
    assert r0["cp_index"].tolist() == [0, 1, 2, 9, 10, 11]
    assert r1["cp_index"].tolist() == [3, 4, 5, 6, 7, 8]
    assert r0["cp_input_ids"].tolist() == [104, 105, 106, 4, 5, 6]
    assert r0["cp_labels"].tolist() == [105, 106, 107, 5, 6, -100]
    assert r0["cp_position_ids"].tolist() == [0, 1, 2, 2, 3, 4]
    # rank 0's pieces: segment 0 queries [0, 3), segment 2 queries [2, 5) with keys [0, 5)
    assert r0["cp_cu_seqlens_q"].tolist() == [0, 3, 6]
    assert r0["cp_kv_len"].tolist() == [3, 5] and r0["cp_kv_begin"].tolist() == [0, 3]
    assert r0["cp_kv_index"].tolist() == [0, 1, 2, 7, 8, 9, 10, 11]
    # rank 1: the tail of segment 0, segment 1 whole, the head of segment 2
    assert r1["cp_kv_len"].tolist() == [4, 3, 2]
    assert r1["cp_kv_index"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert r1["cp_cu_seqlens_q"].tolist() == [0, 1, 4, 6]
    assert r0["shard_plan"].strategy == "per_sequence"


def test_collate_empty_micro_batch():
    info = MicroBatchInfo(0, 0, 2, 2)
    for collate in (PackedCollate(), PackedCollate(wlb.ShardPlanner(wlb.Deck(LENGTHS_DECK), cp=2), 1)):
        b = collate([info])
        assert b["input_ids"].shape == b["labels"].shape == b["position_ids"].shape == (0,)
        assert b["cu_seqlens"].tolist() == [0] and b["max_seqlen"] == 0 and b["num_tokens"] == 0
        assert b["micro_batch"] == 2 and b["segments"] == []
        if "cp_index" in b:
            assert b["cp_index"].numel() == 0 and b["cp_cu_seqlens_q"].tolist() == [0]


# ---- sampler -----------------------------------------------------------------------------

def lengths_of_deck():
    return wlb.read_text_lengths(deck_path("lengths/example_lengths.txt"))


def run_sampler(sampler, count=None):
    """The next `count` items (all with None): exactly count are taken from the sampler."""
    return list(itertools.islice(iter(sampler), count))


def test_sampler_yields_the_packers_micro_batches():
    deck = wlb.Deck(LENGTHS_DECK, {"packing.strategy": "fixed_greedy", "packing.window": 2})
    samplers = [PackedBatchSampler(deck, dp_rank=r, steps=6) for r in range(deck.dp)]
    assert len(samplers[0]) == 6 * deck.micro_batches
    items = [run_sampler(s) for s in samplers]
    reference = wlb.Packer(deck)
    n = reference.documents_per_epoch
    empty = 0
    for t in range(6):
        plan = reference.pack()
        for r in range(deck.dp):
            for m in range(deck.micro_batches):
                info, *segs = items[r][t * deck.micro_batches + m]
                assert info == MicroBatchInfo(t, r, m, t * deck.micro_batches + m)
                want = plan.micro_batch(r, m)
                assert [(s.doc, s.offset, s.length, s.arrival) for s in segs] == [tuple(x) for x in want.tolist()]
                assert all(s.index == s.doc % n for s in segs)
                empty += not segs
    assert empty > 0  # the two-batch window leaves the first step empty
    assert len(samplers[0]) == 0 and run_sampler(samplers[0]) == []


def segments_of(items):
    return [[tuple(s) for s in it[1:]] for it in items]


@pytest.mark.parametrize("packer", ["wlb", "fixed_greedy", "original"])
@pytest.mark.parametrize("consumed,yielded", [(21, 23), (24, 24), (16, 19)])
def test_sampler_restart_loses_and_repeats_nothing(packer, consumed, yielded):
    """A trainer stops after `consumed` micro-batches while a prefetching loader had taken
    `yielded`; a new process restores the saved state and continues."""
    overrides = {"packing.strategy": packer, "packing.window": 2}
    deck = wlb.Deck(LENGTHS_DECK, overrides)
    lengths = lengths_of_deck()
    steps, M = 20, deck.micro_batches
    whole = [run_sampler(PackedBatchSampler(deck, dp_rank=r, steps=steps)) for r in range(deck.dp)]
    resumed = []
    for r in range(deck.dp):
        first = PackedBatchSampler(deck, dp_rank=r, steps=steps)
        before = run_sampler(first, yielded)
        state = first.state_dict(consumed=consumed)
        if r == 0 and packer == "wlb":
            # outliers wait in the packer's queues: the state must carry them
            assert len(first.packer.held_segments()) > 0
        buf = io.BytesIO()
        torch.save({"sampler": state}, buf)  # the trainer's checkpoint
        buf.seek(0)
        second = PackedBatchSampler(wlb.Deck(LENGTHS_DECK, overrides), dp_rank=r, steps=steps)
        second.load_state_dict(torch.load(buf)["sampler"])
        assert second.position == consumed and len(second) == steps * M - consumed
        resumed.append(before[:consumed] + run_sampler(second))
    for r in range(deck.dp):
        assert [it[0] for it in resumed[r]] == [it[0] for it in whole[r]]
        assert segments_of(resumed[r]) == segments_of(whole[r])
    # nothing lost or repeated: trained segments (every rank) + what the packer still holds
    # tile every document that arrived
    reference = wlb.Packer(deck)
    arrived = {}
    for _ in range(steps):
        docs = reference.pack().documents
        arrived.update(zip(docs.ids.tolist(), docs.lengths.tolist()))
    trained = [[s.doc, s.offset, s.length, s.arrival] for r in range(deck.dp) for it in resumed[r] for s in it[1:]]
    held = second.packer.held_segments()
    assert tiles_documents(np.array(trained + held.tolist()), arrived) == []
    for s in (Segment(*x) for r in range(deck.dp) for it in resumed[r] for x in it[1:]):
        assert lengths[s.index] >= s.offset + s.length


def test_sampler_state_from_another_rank_and_errors():
    deck = wlb.Deck(LENGTHS_DECK)
    a = PackedBatchSampler(deck, dp_rank=0, steps=10, history=1)
    run_sampler(a, 18)
    state = a.state_dict()
    b = PackedBatchSampler(deck, dp_rank=1, steps=10)
    b.load_state_dict(state)  # the plan is the same on every rank; b yields rank 1's part
    c = PackedBatchSampler(deck, dp_rank=1, steps=10)
    assert run_sampler(b) == run_sampler(c)[18:]
    with pytest.raises(ValueError, match="has yielded only 18"):
        a.state_dict(consumed=19)
    with pytest.raises(TypeError, match="consumed: expected an integer"):
        a.state_dict(consumed=17.9)  # never truncated to 17
    with pytest.raises(ValueError, match="history: must be >= 1"):
        PackedBatchSampler(deck, history=0)
    # a refused state leaves the sampler as it was: it goes on where it stood
    d, e = PackedBatchSampler(deck, steps=10), PackedBatchSampler(deck, steps=10)
    run_sampler(d, 16), run_sampler(e, 16)
    bad = dict(d.state_dict(consumed=8), step=7)
    with pytest.raises(ValueError, match="the checkpoint continues at step"):
        d.load_state_dict(bad)
    assert run_sampler(d, 10) == run_sampler(e, 10)
    with pytest.raises(ValueError, match="older than the sampler's history"):
        a.state_dict(consumed=3)
    with pytest.raises(ValueError, match="dp_rank: 2 is out of range"):
        PackedBatchSampler(deck, dp_rank=2)
    with pytest.raises(ValueError, match="give lengths="):
        PackedBatchSampler(wlb.Deck(deck_path("plan_smoke.toml")))
    with pytest.raises(ValueError, match="not a wlb-sampler-state"):
        b.load_state_dict({"format": "x"})
    with pytest.raises(ValueError, match="saved with micro_batches = 4"):
        PackedBatchSampler(wlb.Deck(LENGTHS_DECK, {"packing.micro_batches": 2})).load_state_dict(state)
    with pytest.raises(TypeError, match="endless"):
        len(PackedBatchSampler(deck))
    with pytest.raises(IndexError, match="cp_rank: 2 is out of range"):
        PackedCollate(wlb.ShardPlanner(deck, cp=2), 2)
    # floats and booleans are refused, never truncated into lengths or ranks
    smoke = wlb.Deck(deck_path("plan_smoke.toml"))
    for lengths in (np.array([10.7, 20.2]), [True, True], np.array([2**63 + 5], dtype=np.uint64)):
        with pytest.raises(TypeError):
            PackedBatchSampler(smoke, lengths=lengths)
    for kwargs in ({"dp_rank": 1.7}, {"dp_rank": True}, {"steps": 2.5}, {"history": 1.5}):
        with pytest.raises(TypeError, match=next(iter(kwargs))):
            PackedBatchSampler(deck, **kwargs)
    with pytest.raises(TypeError, match="cp_rank"):
        PackedCollate(wlb.ShardPlanner(deck, cp=2), 1.0)


def test_sampler_over_lengths_and_a_generator_deck():
    lengths = np.random.default_rng(5).integers(1, 3000, 500)
    deck = wlb.Deck(deck_path("plan_smoke.toml"))  # a generator deck: the lengths replace it
    s = PackedBatchSampler(deck, lengths=lengths, steps=5)
    items = run_sampler(s)
    assert len(items) == 5 * deck.micro_batches
    assert s.documents_per_epoch == 500
    for it in items:
        assert sum(x.length for x in it[1:]) <= deck.s_max
        for x in it[1:]:
            assert x.index == x.doc % 500 and x.offset + x.length <= lengths[x.index]


def test_sampler_yields_slimpack_slices():
    # tests/python/test_torch_slices.py trains them
    lengths = np.random.default_rng(5).integers(1, 30000, 500)
    s = PackedBatchSampler(wlb.Deck(deck_path("plan_smoke.toml")), lengths=lengths, steps=20, packer="slimpack")
    segs = [x for it in run_sampler(s) for x in it[1:]]
    assert any(x.q_offset > 0 for x in segs) and all(x.q_offset in (0, x.offset) for x in segs)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_restart(workers):
    deck = wlb.Deck(LENGTHS_DECK, {"mesh.cp": 2, "cp.strategy": "hybrid"})
    data = token_dataset(lengths_of_deck())
    planner = wlb.ShardPlanner(deck)
    steps = 6

    def loader(sampler, rank):
        return make_loader(data, sampler, PackedCollate(planner, rank), num_workers=workers)

    full = [b for b in loader(PackedBatchSampler(deck, steps=steps), 1)]
    assert len(full) == steps * deck.micro_batches
    sampler = PackedBatchSampler(deck, steps=steps)
    got = []
    for b in loader(sampler, 1):
        got.append(b)
        if len(got) == 10:
            break  # the loader has prefetched past this
    state = pickle.loads(pickle.dumps(sampler.state_dict(consumed=got[-1]["position"] + 1)))
    again = PackedBatchSampler(deck, steps=steps)
    again.load_state_dict(state)
    got += list(loader(again, 1))
    assert len(got) == len(full)
    for a, b in zip(got, full):
        assert a["position"] == b["position"]
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "cp_index", "cp_input_ids", "cp_kv_index"):
            assert torch.equal(a[key], b[key]), key
        assert a["shard_plan"].to_json() == b["shard_plan"].to_json()
        # tokens are the documents' own: token // 1000 is the dataset index
        for seg, k in zip(a["segments"], range(len(a["segments"]))):
            lo, hi = int(a["cu_seqlens"][k]), int(a["cu_seqlens"][k + 1])
            assert a["input_ids"][lo:hi].tolist() == list(range(seg.index * 1000 + seg.offset,
                                                                 seg.index * 1000 + seg.offset + seg.length))


def test_cp_views_partition_every_micro_batch():
    deck = wlb.Deck(LENGTHS_DECK, {"mesh.cp": 4})
    data = token_dataset(lengths_of_deck())
    for strategy in wlb.sharding_names():
        planner = wlb.ShardPlanner(deck, strategy=strategy)
        collates = [PackedCollate(planner, r) for r in range(4)]
        for items in run_sampler(PackedBatchSampler(deck, steps=2), 8):
            fetched = [SegmentDataset(data)[x] for x in items]
            views = [c(fetched) for c in collates]
            T = views[0]["num_tokens"]
            idx = torch.cat([v["cp_index"] for v in views])
            assert sorted(idx.tolist()) == list(range(T))
            for v in views:
                assert torch.equal(v["cp_input_ids"], v["input_ids"][v["cp_index"]])
                assert int(v["cp_cu_seqlens_q"][-1]) == v["cp_index"].numel()


# ---- Megatron dataset --------------------------------------------------------------------

def test_megatron_dataset_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50000, n) for n in (5, 0, 300, 1, 77)]  # an empty document is skipped
    prefix = write_megatron_dataset(tmp_path / "c", docs, dtype=np.uint16)
    ds = MegatronDataset(prefix)
    assert ds.lengths.tolist() == [5, 300, 1, 77] == wlb.read_megatron_idx(str(tmp_path / "c.idx")).tolist()
    assert ds.dtype == np.uint16 and len(ds) == 4
    for got, want in zip((ds[i] for i in range(4)), [d for d in docs if len(d)]):
        assert got.tolist() == want.tolist()
    with pytest.raises(IndexError):
        ds[4]


def test_megatron_dataset_of_no_documents(tmp_path):
    # `wlb data prepare`'s validation split without --valid-fraction: an empty dataset, not an
    # error (as a length source it is refused: nothing to pack)
    prefix = write_megatron_dataset(tmp_path / "v", [[]])
    ds = MegatronDataset(prefix)
    assert len(ds) == 0 and ds.lengths.tolist() == []
    with pytest.raises(IndexError):
        ds[0]
    with pytest.raises(ValueError, match="no non-empty documents"):
        wlb.read_megatron_idx(prefix + ".idx")


def test_megatron_documents_of_several_sequences(tmp_path):
    # two documents of two sequences each, stored out of order in the .bin
    sizes = np.array([3, 2, 4, 1], dtype="<i4")
    tokens = {0: [1, 2, 3], 1: [4, 5], 2: [6, 7, 8, 9], 3: [10]}
    order = [2, 0, 3, 1]
    pointers, blob, at = {}, [], 0
    for s in order:
        pointers[s] = at
        blob += tokens[s]
        at += 4 * len(tokens[s])
    (tmp_path / "m.bin").write_bytes(np.array(blob, dtype="<i4").tobytes())
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + np.array([1], "<u8").tobytes() + bytes([4]))
        f.write(np.array([4, 3], "<u8").tobytes() + sizes.tobytes())
        f.write(np.array([pointers[s] for s in range(4)], "<i8").tobytes() + np.array([0, 2, 4], "<i8").tobytes())
    ds = MegatronDataset(tmp_path / "m")
    assert ds.lengths.tolist() == [5, 5]
    assert ds[0].tolist() == [1, 2, 3, 4, 5] and ds[1].tolist() == [6, 7, 8, 9, 10]


def test_megatron_deck_drives_the_sampler(tmp_path):
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 1000, n) for n in rng.integers(1, 900, 400)]
    prefix = write_megatron_dataset(tmp_path / "corpus", docs)
    deck = wlb.Deck(overrides={"data.source": "megatron", "data.path": prefix + ".idx", "data.context_window": 1024,
                               "data.s_max": 1280, "packing.micro_batches": 3, "mesh.cp": 2})
    ds = MegatronDataset(prefix)
    batches = list(make_loader(ds, PackedBatchSampler(deck, steps=4), PackedCollate(wlb.ShardPlanner(deck), 0)))
    assert len(batches) == 12
    for b in batches:
        for k, seg in enumerate(b["segments"]):
            lo, hi = int(b["cu_seqlens"][k]), int(b["cu_seqlens"][k + 1])
            assert b["input_ids"][lo:hi].tolist() == docs[seg.index][seg.offset:seg.offset + seg.length].tolist()
    with pytest.raises(ValueError, match="bad magic"):
        (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" * 8)
        (tmp_path / "bad.bin").write_bytes(b"")
        MegatronDataset(tmp_path / "bad")
