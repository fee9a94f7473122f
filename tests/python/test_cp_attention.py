"""wlb.torch's context-parallel attention over gloo process groups (2 and 4 CPU processes)
against single-process attention: outputs, LSE and Q/K/V gradients within 1e-5 (FP32) for
every shard strategy (and PyTorch's head-tail through ShardPlan.from_ranges), both comm
modes, GQA; the bytes each rank moved equal its comm plan's; a rank whose tensors miss its
plan makes every rank raise the same error, and the group keeps working."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import wlb  # noqa: E402
from cp_workers import dense_reference, make_planner, spawn, worker  # noqa: E402
from wlb.torch import CPAttentionPlan, document_attention  # noqa: E402

TOL = 1e-5
STRATEGIES = ["per_sequence", "per_document", "adaptive", "whole_document", "hybrid"]
# a long document, mid-sized ones and short ones (hybrid shards the long one over a
# subgroup at 4 ranks; per_sequence cuts inside documents; a 1-token document)
LENGTHS = [150, 7, 61, 1, 33, 90, 18, 45]


def cases(world):
    out = []
    for strategy in STRATEGIES:
        for comm in ("allgather", "sharding_aware"):
            out.append({"name": f"{strategy}/{comm}/gqa", "strategy": strategy, "comm": comm, "lengths": LENGTHS,
                        "heads": 4, "kv_heads": 2, "head_dim": 8, "seed": len(out)})
    for comm in ("allgather", "sharding_aware"):
        out.append({"name": f"head_tail/{comm}", "strategy": "per_document", "comm": comm, "head_tail": True,
                    "lengths": LENGTHS, "heads": 2, "kv_heads": 2, "head_dim": 8, "seed": 40})
        out.append({"name": f"per_document/{comm}/mha/prepared", "strategy": "per_document", "comm": comm,
                    "lengths": [300, 5, 12], "heads": 3, "kv_heads": 3, "head_dim": 4, "prepared": True, "seed": 41})
        # fewer tokens than ranks: some ranks hold nothing and still take part
        out.append({"name": f"per_sequence/{comm}/tiny", "strategy": "per_sequence", "comm": comm,
                    "lengths": [1, 2], "heads": 4, "kv_heads": 1, "head_dim": 8, "seed": 42})
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"cp{world}")
    codes = spawn(worker, world, (cases(world), str(out)))
    ranks = []
    for r in range(world):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (exit codes {codes})"
        res = json.loads(path.read_text())
        assert "exception" not in res, f"rank {r}:\n{res['exception']}"
        ranks.append(res)
    assert codes == [0] * world
    return world, ranks


def test_matches_single_process_attention(results):
    world, ranks = results
    names = [c["name"] for c in cases(world)]
    for res in ranks:
        got = res["cases"] + [res["after"]]
        assert [c["name"] for c in res["cases"]] == names
        for c in got:
            for key in ("o", "lse", "dq", "dk", "dv"):
                assert c[key] <= TOL, (res["rank"], c["name"], key, c[key])
    # every token trained somewhere, and the plans are what their names say
    for i, name in enumerate(names):
        assert sum(res["cases"][i]["tokens"] for res in ranks) == sum(cases(world)[i]["lengths"]), name
    applied = {c["name"]: c["strategy"] for c in ranks[0]["cases"]}
    assert applied["head_tail/allgather"] == "head_tail"
    assert applied["adaptive/allgather/gqa"] in ("per_sequence", "per_document")
    if world == 4:  # the hybrid plan shards some segment (over a subgroup or all ranks)
        assert ranks[0]["cases"][names.index("hybrid/sharding_aware/gqa")]["sharded_segments"] > 0


def test_bytes_equal_the_comm_plan(results):
    world, ranks = results
    for res in ranks:
        for c in res["cases"]:
            assert c["bytes"] == pytest.approx(c["plan_bytes"], abs=0), (res["rank"], c["name"])
    # sharding-aware moves less than all-gather (hybrid may keep every segment whole: nothing)
    names = [c["name"] for c in ranks[0]["cases"]]
    for strategy in ("per_document", "hybrid"):
        ag, sa = (sum(res["cases"][names.index(f"{strategy}/{comm}/gqa")]["bytes"][0] for res in ranks)
                  for comm in ("allgather", "sharding_aware"))
        assert sa < ag and (sa > 0 or strategy == "hybrid"), (strategy, sa, ag)


def test_plan_mismatch_raises_on_every_rank(results):
    world, ranks = results
    for name in ("short_rank", "other_plan", "wrong_cp", "bad_heads"):
        msgs = [res["errors"][name] for res in ranks]
        assert all(m is not None for m in msgs), (name, msgs)
        assert len(set(msgs)) == 1, (name, msgs)  # the same message everywhere
        assert msgs[0].startswith("wlb context-parallel attention: "), msgs[0]
    last = world - 1
    assert f"CP rank {last}: q, k, v hold" in ranks[0]["errors"]["short_rank"]
    assert f"the plan is for {world - 1 if world > 2 else 1} CP ranks, the process group has {world}" in \
        ranks[0]["errors"]["wrong_cp"]
    assert "CP rank 0: q, k: 3 query heads are not a multiple of 2 KV heads" in ranks[0]["errors"]["bad_heads"]
    assert "CP rank 0" in ranks[0]["errors"]["other_plan"]


def test_document_attention_single_process():
    torch.manual_seed(3)
    lengths = [5, 300, 1, 64]
    T = sum(lengths)
    cu = torch.tensor(np.concatenate(([0], np.cumsum(lengths))), dtype=torch.int32)
    q, k, v = (torch.randn(T, h, 8, requires_grad=True) for h in (6, 2, 2))
    o, lse = document_attention(q, k, v, cu)
    ro, rlse = dense_reference(q, k, v, lengths, 8 ** -0.5)
    assert float((o - ro).abs().max()) <= TOL and float((lse - rlse).abs().max()) <= TOL
    w = torch.randn_like(o)
    g = torch.autograd.grad((o * w).sum() + lse.sum(), (q, k, v))
    rg = torch.autograd.grad((ro * w).sum() + rlse.sum(), (q, k, v))
    assert max(float((a - b).abs().max()) for a, b in zip(g, rg)) <= TOL
    with pytest.raises(ValueError, match="cu_seqlens"):
        document_attention(q, k, v, torch.tensor([0, 5, 7]))
    with pytest.raises(TypeError, match="cu_seqlens: expected integer offsets"):
        document_attention(q, k, v, cu.double())  # never truncated
    # an explicit scale is used as given, 0 too (uniform weights over each causal prefix)
    o0, _ = document_attention(q, k, v, cu, softmax_scale=0.0)
    ro0, _ = dense_reference(q, k, v, lengths, 0.0)
    assert float((o0 - ro0).abs().max()) <= TOL
    with pytest.raises(ValueError, match="softmax_scale: must be finite"):
        document_attention(q, k, v, cu, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="query heads are not a multiple"):
        document_attention(torch.randn(T, 3, 8), k, v, cu)


def test_from_ranges_reproduces_the_planner():
    planner, _ = make_planner(4, "hybrid", "sharding_aware", 4, 2, 8)
    lengths = np.array(LENGTHS, dtype=np.int64)
    plan = planner.plan(lengths)
    ranges = [[r, s, q0, n] for r in range(4) for s, q0, n in
              zip(*(plan.pieces(r)[key].tolist() for key in ("segment", "q_offset", "q_len")))]
    again = wlb.ShardPlan.from_ranges(lengths, np.array(ranges), 4, planner.cost, "sharding_aware", "hybrid")
    a, b = plan.to_json(), again.to_json()
    a.pop("sharded_segments"), b.pop("sharded_segments")
    assert a == b
    assert again.comm.to_json() == plan.comm.to_json()
    assert again.metrics["ranks"] == plan.metrics["ranks"]
    again.validate()
    with pytest.raises(ValueError, match="segment 0 token 10 is on two ranks"):
        wlb.ShardPlan.from_ranges([20], np.array([[0, 0, 0, 15], [1, 0, 10, 10]]), 2, planner.cost)
    with pytest.raises(ValueError, match="segment 0 token 15 is on no rank"):
        wlb.ShardPlan.from_ranges([20], np.array([[0, 0, 0, 15]]), 2, planner.cost)
    with pytest.raises(ValueError, match=r"ranges\[0\]: rank 2 is out of range \[0, 2\)"):
        wlb.ShardPlan.from_ranges([20], np.array([[2, 0, 0, 20]]), 2, planner.cost)
    # an offset + length past int64 is outside the segment, not a wrapped token index
    with pytest.raises(ValueError, match=r"ranges\[1\]: queries at 5, 9223372036854775805 long, are empty or outside"):
        wlb.ShardPlan.from_ranges([20], np.array([[0, 0, 0, 5], [1, 0, 5, 2**63 - 3]]), 2, planner.cost)


def test_prepared_plan_pickles_and_checks_its_rank():
    import pickle

    planner, _ = make_planner(2, "per_document", "sharding_aware", 2, 2, 4)
    plan = planner.plan(np.array([30, 11]))
    prep = pickle.loads(pickle.dumps(CPAttentionPlan(plan, 1)))
    assert prep.rank == 1 and prep.tokens == len(plan.token_index(1)) and prep.mode == "sharding_aware"
    with pytest.raises(IndexError, match="CP rank 2 out of range"):
        CPAttentionPlan(plan, 2)
