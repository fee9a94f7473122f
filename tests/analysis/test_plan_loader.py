"""The PyTorch loader printed in docs/plan-format.md, run as written on a real plan.

The code block is taken from the document itself, so the document cannot drift from what
works: a fixed_greedy plan has empty micro-batches, which the loader once crashed on."""

import json
import os
import re
import subprocess

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def wlb_binary():
    b = os.environ.get("WLB_BUILD_DIR", os.path.join(ROOT, "build"))
    path = os.path.join(b, "bin", "wlb")
    if not os.path.exists(path):
        pytest.skip("wlb not built")
    return path


def loader_class():
    with open(os.path.join(ROOT, "docs", "plan-format.md")) as f:
        text = f.read()
    block = re.search(r"## Consuming it from PyTorch\s+```python\n(.*?)```", text, re.S)
    assert block, "docs/plan-format.md lost its PyTorch loader"
    scope = {}
    exec(compile(block.group(1), "docs/plan-format.md", "exec"), scope)
    return scope["PlanDataset"]


class Store:
    """Token store of the loader's contract: tokens(doc) -> the document's token ids."""

    def __init__(self, lengths):
        self.lengths = lengths

    def tokens(self, doc):
        return list(range(doc * 7, doc * 7 + self.lengths[doc]))


def test_loader_handles_empty_micro_batches(tmp_path):
    plan = tmp_path / "plan.jsonl"
    deck = os.path.join(ROOT, "inputs", "plan_lengths_file.toml")
    # a two-batch window leaves micro-batches empty while it buffers
    subprocess.run([wlb_binary(), "plan", deck, "--packer", "fixed_greedy", "--steps", "12", "--set", "packing.window=2",
                    "--out", str(plan)],
                   check=True, capture_output=True, cwd=ROOT)
    lines = [json.loads(x) for x in plan.read_text().splitlines()]
    header, steps = lines[0], [x for x in lines if x["type"] == "step"]
    empty = sum(1 for s in steps for rep in s["replicas"] for mb in rep if not mb)
    assert empty > 0, "the plan should exercise empty micro-batches"
    # document lengths from the segments (a split document's pieces add up)
    lengths = {}
    for s in steps:
        for rep in s["replicas"]:
            for mb in rep:
                for doc, off, length, _ in mb:
                    lengths[doc] = max(lengths.get(doc, 0), off + length)
    n = header["documents_per_epoch"]
    store = Store({d % n if n else d: l for d, l in lengths.items()})
    dataset = loader_class()(str(plan), store, dp_rank=0)
    items = list(dataset)
    per_step = header["micro_batches"]
    assert len(items) == per_step * len(steps)  # every slot, empty ones included
    for (ids, pos, cu), mb in zip(items, (mb for s in steps for mb in s["replicas"][0])):
        assert ids.shape == pos.shape
        assert int(cu[-1]) == ids.numel() == sum(seg[2] for seg in mb)
        if not mb:
            assert ids.numel() == 0 and cu.tolist() == [0]
            continue
        # positions restart at every segment; tokens are the segment's slice
        for k, (doc, off, length, _) in enumerate(mb):
            b, e = int(cu[k]), int(cu[k + 1])
            assert pos[b:e].tolist() == list(range(length))
            d = doc % n if n else doc
            assert ids[b:e].tolist() == store.tokens(d)[off:off + length]


def test_loader_positions_of_slimpack_slices(tmp_path):
    """slimpack segments carry a fifth field, q_offset: the loader unpacks it and continues
    the slice's positions after the keys of its document before it."""
    plan = tmp_path / "plan.jsonl"
    deck = os.path.join(ROOT, "inputs", "plan_lengths_file.toml")
    subprocess.run([wlb_binary(), "plan", deck, "--packer", "slimpack", "--steps", "6", "--out", str(plan)],
                   check=True, capture_output=True, cwd=ROOT)
    lines = [json.loads(x) for x in plan.read_text().splitlines()]
    header, steps = lines[0], [x for x in lines if x["type"] == "step"]
    mbs = [mb for s in steps for mb in s["replicas"][0]]
    assert any(len(seg) == 5 for mb in mbs for seg in mb), "the plan should hold slices"
    lengths = {}
    for s in steps:
        for rep in s["replicas"]:
            for mb in rep:
                for seg in mb:
                    lengths[seg[0]] = max(lengths.get(seg[0], 0), seg[1] + seg[2])
    n = header["documents_per_epoch"]
    store = Store({d % n if n else d: l for d, l in lengths.items()})
    items = list(loader_class()(str(plan), store, dp_rank=0))
    assert len(items) == len(mbs)  # slimpack's micro-batch count varies by step
    for (ids, pos, cu), mb in zip(items, mbs):
        for k, seg in enumerate(mb):
            doc, off, length = seg[:3]
            q_off = seg[4] if len(seg) == 5 else 0
            b, e = int(cu[k]), int(cu[k + 1])
            assert pos[b:e].tolist() == list(range(q_off, q_off + length))
            d = doc % n if n else doc
            assert ids[b:e].tolist() == store.tokens(d)[off:off + length]
