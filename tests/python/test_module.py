"""The wlb module against the wlb command: the same plans, checkpoints, shard plans and
error messages for the same deck and seed; conservation across a checkpoint and restore."""

import json
import os
import pickle

import numpy as np
import pytest

import wlb
from wlb_test_helpers import cli_error, deck_path, normalise_step, read_jsonl, tiles_documents

LENGTHS_DECK = deck_path("plan_lengths_file.toml")  # text source, dp 2 x M 4
SMOKE_DECK = deck_path("plan_smoke.toml")  # generator, dp 1 x M 4


def module_steps(packer, steps):
    return [packer.pack() for _ in range(steps)]


def cli_plans(cli, tmp_path, deck, packers, steps, *extra):
    """{packer: (header, [step lines])} of one `wlb plan` call over several packers."""
    out = tmp_path / "plan.jsonl"
    args = [a for p in packers for a in ("--packer", p)]
    proc = cli("plan", deck, *args, "--steps", steps, "--out", out, *extra)
    assert proc.returncode == 0, proc.stderr
    result = {}
    for p in packers:
        lines = read_jsonl(tmp_path / (f"plan.{p}.jsonl" if len(packers) > 1 else "plan.jsonl"))
        result[p] = (lines[0], [x for x in lines if x["type"] == "step"])
    return result


@pytest.fixture(scope="module")
def lengths_file_plans(cli, tmp_path_factory):
    return cli_plans(cli, tmp_path_factory.mktemp("plans"), LENGTHS_DECK, wlb.packer_names(), 20)


@pytest.mark.parametrize("packer", wlb.packer_names())
def test_plans_equal_cli_on_a_length_file(lengths_file_plans, packer):
    header, steps = lengths_file_plans[packer]
    p = wlb.Packer(wlb.Deck(LENGTHS_DECK), packer)
    assert p.header() == header
    assert len(steps) == 20
    for plan, line in zip(module_steps(p, 20), steps):
        assert normalise_step(plan.to_json()) == normalise_step(line)


def test_plans_equal_cli_on_a_generator_with_overrides(cli, tmp_path):
    packers = ["original", "fixed_greedy", "best_fit", "wlb"]
    sets = {"data.seed": 7, "mesh.dp": 2, "packing.window": 2, "data.preset": "pile", "data.length_scale": 1.5}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    plans = cli_plans(cli, tmp_path, SMOKE_DECK, packers, 25, *args)
    deck = wlb.Deck(SMOKE_DECK, sets)
    assert deck.dp == 2 and deck["data.preset"] == "pile" and deck.seed == 7
    for packer in packers:
        header, steps = plans[packer]
        p = wlb.Packer(deck, packer)
        assert p.header() == header
        for plan, line in zip(module_steps(p, 25), steps):
            assert normalise_step(plan.to_json()) == normalise_step(line)


def write_deck(tmp_path, body):
    path = tmp_path / "deck.toml"
    path.write_text(body)
    return str(path)


def test_megatron_source_equals_cli(cli, tmp_path):
    rng = np.random.default_rng(3)
    lengths = np.concatenate((rng.integers(1, 3000, 300), [9000, 20000, 4096]))  # some longer than S
    idx = str(tmp_path / "corpus.idx")
    wlb.write_megatron_idx(idx, lengths)
    assert np.array_equal(wlb.read_megatron_idx(idx), lengths)
    deck = write_deck(tmp_path, f"""
[data]
source = "megatron"
path = "{idx}"
context_window = 4096
s_max = 5120
[mesh]
dp = 2
[packing]
micro_batches = 2
""")
    plans = cli_plans(cli, tmp_path, deck, ["wlb", "original", "fixed_greedy"], 30)
    for packer, (header, steps) in plans.items():
        assert header["documents_per_epoch"] == len(lengths)
        p = wlb.Packer(wlb.Deck(deck), packer)
        assert p.documents_per_epoch == len(lengths)
        for plan, line in zip(module_steps(p, 30), steps):
            assert normalise_step(plan.to_json()) == normalise_step(line)


def test_array_source_equals_the_file_source():
    deck = wlb.Deck(LENGTHS_DECK)
    lengths = wlb.read_text_lengths(os.path.join(os.path.dirname(LENGTHS_DECK), "lengths", "example_lengths.txt"))
    a, b = wlb.Packer(deck), wlb.Packer(deck, lengths=lengths, source_name="dataset")
    assert b.documents_per_epoch == a.documents_per_epoch == len(lengths)
    for _ in range(40):
        pa, pb = a.pack(), b.pack()
        assert np.array_equal(pa.segments, pb.segments) and np.array_equal(pa.offsets, pb.offsets)
        assert np.array_equal(pa.delayed, pb.delayed)
        assert np.array_equal(pa.documents.lengths, pb.documents.lengths)
    assert b.describe_source() == "dataset"


def test_plan_arrays_agree_with_the_json():
    p = wlb.Packer(wlb.Deck(LENGTHS_DECK), "wlb")
    for _ in range(5):
        plan = p.pack()
        j = plan.to_json()
        M = plan.micro_batches
        assert plan.dp == 2 and M == 4 and len(plan.offsets) == 2 * M + 1
        for r in range(plan.dp):
            for m in range(M):
                seg = plan.micro_batch(r, m)
                assert seg.tolist() == j["replicas"][r][m]
                assert seg.tolist() == plan.segments[plan.offsets[r * M + m]:plan.offsets[r * M + m + 1]].tolist()
                assert plan.tokens[r * M + m] == seg[:, 2].sum()
                assert plan.replicas[r][m].tolist() == seg.tolist()
                assert seg[:, 2].sum() <= p.capacity
        assert plan.delayed.tolist() == j["delayed"]
        assert plan.incoming == len(plan.documents) == j["incoming"]
        assert plan.metrics == j["metrics"]
    with pytest.raises(IndexError):
        plan.micro_batch(2, 0)
    back = wlb.Plan.from_json(plan.to_json(), p.cost)
    assert np.array_equal(back.segments, plan.segments) and back.metrics["imbalance"] == plan.metrics["imbalance"]


def test_state_dict_is_the_cli_checkpoint(cli, tmp_path):
    packers = wlb.packer_names()
    window = ["--set", "packing.window=2"]  # fixed_greedy then holds a window across steps
    deck = wlb.Deck(LENGTHS_DECK, ["packing.window=2"])
    saved = tmp_path / "cli-state.json"
    every = [a for p in packers for a in ("--packer", p)]
    assert cli("plan", LENGTHS_DECK, *every, "--steps", 10, "--save-state", saved, *window).returncode == 0
    cli_state = json.loads(saved.read_text())
    resumed = cli_plans(cli, tmp_path, LENGTHS_DECK, packers, 10, "--resume", saved, *window)
    merged = {"format": "wlb-plan-state", "version": 1, "packers": {}}
    for packer in packers:
        p = wlb.Packer(deck, packer)
        module_steps(p, 10)
        state = p.state_dict()
        # the same document as the CLI's, key for key
        assert state["packers"][packer] == cli_state["packers"][packer]
        assert {k: v for k, v in state.items() if k != "packers"} == \
            {k: v for k, v in cli_state.items() if k != "packers"}
        merged["packers"][packer] = state["packers"][packer]
        # the module continues from the CLI's file as the CLI's --resume does
        q = wlb.Packer(deck, packer)
        q.load_state_dict(cli_state)
        assert q.next_step == 10
        for plan, line in zip(module_steps(q, 10), resumed[packer][1]):
            assert normalise_step(plan.to_json()) == normalise_step(line)
    # and the CLI resumes from the module's states
    mine = tmp_path / "module-state.json"
    mine.write_text(json.dumps(merged))
    (tmp_path / "again").mkdir()
    again = cli_plans(cli, tmp_path / "again", LENGTHS_DECK, packers, 10, "--resume", mine, *window)
    for packer in packers:
        assert [normalise_step(x) for x in again[packer][1]] == [normalise_step(x) for x in resumed[packer][1]]


@pytest.mark.parametrize("packer,deck_file,steps", [
    ("original", "plan_smoke.toml", 400),
    ("fixed_greedy", "plan_smoke.toml", 400),
    ("best_fit", "plan_smoke.toml", 400),
    ("wlb", "plan_smoke.toml", 400),
    ("fixed_optimal", "plan_lengths_file.toml", 60),  # CBC closes every step of this one quickly
])
def test_conservation_across_checkpoint_and_restore(packer, deck_file, steps):
    overrides = {"packing.window": 3} if packer == "fixed_greedy" else {}
    deck = wlb.Deck(deck_path(deck_file), overrides)
    p = wlb.Packer(deck, packer)
    checker = wlb.ConservationChecker(p.capacity)
    reference = wlb.Packer(deck, packer)  # never restarted
    trained, lengths = [], {}
    for t in range(steps):
        if t == steps // 2:  # simulated restart: a new object from the saved state
            state = json.loads(json.dumps(p.state_dict()))
            p = wlb.Packer(deck, packer)
            p.load_state_dict(state)
        plan = p.pack()
        ref = reference.pack()
        assert np.array_equal(plan.segments, ref.segments) and np.array_equal(plan.delayed, ref.delayed)
        docs = plan.documents
        checker.add_incoming(docs)
        checker.add_plan(plan)
        lengths.update(zip(docs.ids.tolist(), docs.lengths.tolist()))
        trained.append(plan.segments)
        tokens = plan.tokens
        assert tokens.max(initial=0) <= p.capacity
    held = p.held_segments()
    assert held[:, 2].sum() == p.pending_tokens
    assert checker.ok(p.pending_tokens), checker.report(p.pending_tokens)
    assert checker.duplicated == checker.unknown == checker.early == checker.unreported == 0
    assert checker.lost_tokens(p.pending_tokens) == 0
    # the same with NumPy alone: trained + held segments tile every arrived document once
    assert tiles_documents(np.concatenate(trained + [held]), lengths) == []
    # a restored checker starts from the held segments
    q = wlb.Packer(deck, packer)
    q.load_state_dict(p.state_dict())
    c2 = wlb.ConservationChecker(q.capacity)
    c2.add_held(q.held_segments())
    for _ in range(5):
        plan = q.pack()
        c2.add_incoming(plan.documents)
        c2.add_plan(plan)
    assert c2.ok(q.pending_tokens), c2.report(q.pending_tokens)


def test_shard_plans_equal_cli(cli, tmp_path):
    sets = {"mesh.cp": 2, "cp.strategy": "hybrid", "cp.comm": "sharding_aware"}
    out = tmp_path / "shard.jsonl"
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    proc = cli("shard", SMOKE_DECK, "--steps", 2, "--packer", "wlb", "--out", out, "--comm-plans", *args)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in read_jsonl(out) if x["type"] == "micro_batch"]
    deck = wlb.Deck(SMOKE_DECK, sets)
    packer = wlb.Packer(deck, "wlb")
    planner = wlb.ShardPlanner(deck)
    assert (planner.strategy, planner.comm, planner.cp) == ("hybrid", "sharding_aware", 2)
    plans = module_steps(packer, 2)
    assert len(lines) == 2 * deck.dp * deck.micro_batches
    for line in lines:
        segs = plans[line["step"]].micro_batch(line["replica"], line["index"])
        sp = planner.plan(segs)
        assert sp.to_json() == line["plan"]
        assert sp.comm.to_json() == line["comm_plan"]
        assert sp.metrics == line["metrics"]
        sp.validate()
        # per-rank token indices partition the micro-batch and invert owner/local_index
        T = int(segs[:, 2].sum())
        idx = [sp.token_index(r) for r in range(sp.cp)]
        assert np.array_equal(np.sort(np.concatenate(idx)), np.arange(T))
        for r in range(sp.cp):
            assert np.all(sp.owner[idx[r]] == r)
            assert np.array_equal(sp.local_index[idx[r]], np.arange(len(idx[r])))
            assert len(idx[r]) == sp.rank_tokens[r] == sp.pieces(r)["q_len"].sum()
            assert len(sp.kv_index(r)) == sp.kv_tokens[r]
            assert np.array_equal(sp.all_gather_kv_index(r),
                                  np.concatenate([sp.comm.gather_displs[s] + np.arange(b, b + n)
                                                  for s, b, n, _ in sp.kv_runs(r)]))


def test_run_summary_equals_cli(cli, tmp_path):
    summary = tmp_path / "summary.json"
    assert cli("plan", SMOKE_DECK, "--packer", "wlb", "--steps", 40, "--summary-json", summary).returncode == 0
    want = json.loads(summary.read_text())[0]["summary"]
    p = wlb.Packer(wlb.Deck(SMOKE_DECK), "wlb")
    s = wlb.RunSummary()
    for _ in range(40):
        s.add(p.pack())
    got = s.to_dict()
    for k in want:
        if "plan_us" not in k:
            assert got[k] == pytest.approx(want[k], rel=1e-12), k
    plan = p.pack()
    assert wlb.compute_metrics(plan, p.cost) == plan.metrics


def test_cost_model():
    deck = wlb.Deck(SMOKE_DECK)
    c = wlb.CostModel(deck)
    lengths = np.array([1, 100, 4096, 8192])
    assert np.allclose(c.segment_work(lengths), [c.segment_work(int(x)) for x in lengths])
    assert c.segment_work(8192) > 2 * c.segment_work(4096)  # quadratic attention
    assert c.attn_seconds(0, 100, "bwd") > c.attn_seconds(0, 100, "fwd")
    with pytest.raises(ValueError, match="phase"):
        c.attn_seconds(0, 100, "sideways")
    profile = os.path.join(deck_path("profiles"), "h100-sxm.json")
    h = wlb.CostModel.from_profile(profile, deck)
    via_deck = wlb.CostModel(wlb.Deck(SMOKE_DECK, {"hardware.profile": profile}))
    assert h.segment_work(8192) == via_deck.segment_work(8192) != c.segment_work(8192)


def test_cli_and_module_raise_the_same_messages(cli, tmp_path):
    def same(proc, call, strip=None):
        want = cli_error(proc)
        with pytest.raises(ValueError) as e:
            call()
        got = str(e.value)
        if strip:  # the CLI names the file, the module its argument
            want, got = want.replace(strip[0], "X"), got.replace(strip[1], "X")
        assert got == want

    deck = wlb.Deck(SMOKE_DECK)
    same(cli("plan", SMOKE_DECK, "--packer", "nope"), lambda: wlb.Packer(deck, "nope"), ("--packer", "name"))
    same(cli("plan", SMOKE_DECK, "--set", "mesh.dpp=2"), lambda: wlb.Deck(SMOKE_DECK, ["mesh.dpp=2"]))
    same(cli("plan", SMOKE_DECK, "--set", "mesh.dp=0"), lambda: wlb.Deck(SMOKE_DECK, {"mesh.dp": 0}))
    same(cli("plan", SMOKE_DECK, "--set", 'cp.strategy="diagonal"'),
         lambda: wlb.Deck(SMOKE_DECK, {"cp.strategy": "diagonal"}))
    same(cli("shard", SMOKE_DECK, "--strategy", "nope"), lambda: wlb.ShardPlanner(deck, strategy="nope"))
    # a truncated Megatron index: the byte offset is named
    idx = str(tmp_path / "bad.idx")
    wlb.write_megatron_idx(idx, [5, 6, 7])
    with open(idx, "r+b") as f:
        f.truncate(40)
    bad = write_deck(tmp_path, f'[data]\nsource = "megatron"\npath = "{idx}"\n')
    same(cli("plan", bad), lambda: wlb.read_megatron_idx(idx))
    same(cli("plan", bad), lambda: wlb.Packer(wlb.Deck(bad)))
    # checkpoints: another packer, another stream
    state = tmp_path / "state.json"
    assert cli("plan", SMOKE_DECK, "--packer", "original", "--steps", 3, "--save-state", state).returncode == 0
    same(cli("plan", SMOKE_DECK, "--packer", "wlb", "--resume", state),
         lambda: wlb.Packer(deck, "wlb").load_state_dict(json.loads(state.read_text())),
         strip=(f"--resume {state}", "state_dict"))
    same(cli("plan", SMOKE_DECK, "--packer", "original", "--set", "data.seed=9", "--resume", state),
         lambda: wlb.Packer(wlb.Deck(SMOKE_DECK, {"data.seed": 9}), "original").load_state_dict(
             json.loads(state.read_text())),
         strip=(str(state), "state_dict"))


def test_bad_arguments_raise_value_error():
    deck = wlb.Deck(SMOKE_DECK)
    p = wlb.Packer(deck)
    p.pack()
    with pytest.raises(ValueError, match="asked for step 5 but the next step is 1"):
        p.pack(5)
    before = p.state_dict()
    with pytest.raises(ValueError, match="not a wlb-plan-state"):
        p.load_state_dict({"format": "something"})
    assert p.state_dict() == before  # a failed restore leaves the packer as it was
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0"):
        wlb.Packer(deck, lengths=[5, 0, 3])
    with pytest.raises(ValueError, match="CP degree must be >= 1"):
        wlb.ShardPlanner(deck, cp=0)
    with pytest.raises(ValueError, match="length >= 1"):
        wlb.ShardPlanner(deck).plan(np.array([[0, 0, 0, 0]]))
    with pytest.raises(KeyError, match="did you mean 'data.seed'"):
        deck["data.sead"]
    with pytest.raises(ValueError, match="cannot write a object"):
        wlb.Deck(SMOKE_DECK, {"mesh.dp": object()})
    with pytest.raises(ValueError, match="cannot open deck"):
        wlb.Deck("no-such-deck.toml")
    # a sweeping deck is no one deck: its base is not a case (overrides pin the swept keys)
    sweep = "[data]\ns_max = 2048\n[sweep]\n\"data.context_window\" = [1024, 2048]\n"
    with pytest.raises(ValueError, match="data.context_window"):
        wlb.Deck.from_toml(sweep, "sweep.toml")
    assert wlb.Deck.from_toml(sweep, "sweep.toml", {"data.context_window": 1024})["data.s_max"] == 2048


def test_deck_round_trip():
    deck = wlb.Deck(SMOKE_DECK, {"packing.outlier_thresholds": [1024, 2048], "data.length_scale": 0.5})
    assert deck["packing.outlier_thresholds"] == [1024, 2048]
    assert deck["data.length_scale"] == 0.5
    with open(SMOKE_DECK) as f:
        text = f.read()
    again = wlb.Deck.from_toml(text, name=SMOKE_DECK, overrides=deck.overrides)
    assert again.to_dict() == deck.to_dict()
    assert "[packing]" in deck.to_toml()
    more = deck.with_overrides({"mesh.dp": 3})
    assert more.dp == 3 and more["packing.outlier_thresholds"] == [1024, 2048] and deck.dp == 1
    assert wlb.Deck()["data.context_window"] == 131072  # the defaults


def test_slimpack_slices_carry_q_offset():
    """SlimPack slices come out as (n, 5) arrays whose last column is q_offset (the plan
    JSON's 5-element rows), go back in through the same arrays, and whole-segment plans keep
    (n, 4)."""
    deck = wlb.Deck(SMOKE_DECK, {"packing.micro_batches": 4})
    p = wlb.Packer(deck, "slimpack")
    sliced = 0
    for _ in range(6):
        plan = p.pack()
        j = plan.to_json()
        segs = plan.segments
        assert segs.shape[1] in (4, 5)
        if segs.shape[1] == 5:
            sliced += 1
            q = segs[:, 4]
            assert ((q == 0) | (q == segs[:, 1])).all()
            M = plan.micro_batches
            for r in range(plan.dp):
                for m in range(M):
                    mb = plan.micro_batch(r, m)
                    want = [row + [0] * (5 - len(row)) for row in j["replicas"][r][m]]
                    assert mb.reshape(-1, 5).tolist() == want
        back = wlb.Plan.from_json(j, p.cost)
        assert np.array_equal(back.segments, segs)
    assert sliced > 0, "the smoke deck should make slimpack cut at least one document"
    assert wlb.Packer(deck, "wlb").pack().segments.shape[1] == 4
    with pytest.raises(ValueError, match="q_offset"):
        wlb.ConservationChecker(p.capacity).add_held(np.array([[0, 4, 8, 0, 9]], dtype=np.int64))


def test_bad_values_are_refused_not_coerced():
    deck = wlb.Deck(SMOKE_DECK)
    # None where an object is needed: TypeError, not a crash
    for call in (lambda: wlb.Packer(None), lambda: wlb.CostModel(None), lambda: wlb.ShardPlanner(None),
                 lambda: wlb.compute_metrics(wlb.Packer(deck).pack(), None)):
        with pytest.raises(TypeError):
            call()
    # floats and uint64 beyond int64 are not truncated or wrapped into lengths
    with pytest.raises(TypeError):
        wlb.Packer(deck, lengths=[5.5, 3.0])
    with pytest.raises(TypeError):
        wlb.Packer(deck, lengths=np.array([2**63], dtype=np.uint64))
    with pytest.raises(ValueError, match="not in"):
        wlb.Documents([0], [10**12], [0])
    with pytest.raises(ValueError, match="given twice"):
        wlb.Documents([3, 3], [10, 20], [0, 0])
    p = wlb.Packer(deck)
    with pytest.raises(ValueError, match="arrives at step 4, after step 2"):
        p.pack_documents(wlb.Documents([0], [100], [4]), 2)
    p.pack_documents(wlb.Documents([0], [100], [2]), 2)
    with pytest.raises(ValueError, match="steps must increase"):
        p.pack_documents(wlb.Documents([1], [100], [1]), 1)
    # pack() after pack_documents: its source is at step 0, after step 2 was packed (a step
    # repeated or a step back would plan the held documents twice or early)
    with pytest.raises(ValueError, match="pack: step 0 after step 2: steps must increase"):
        p.pack()
    q = wlb.Packer(deck)
    q.pack(), q.pack()
    with pytest.raises(ValueError, match="pack_documents: step 1 after step 1"):
        q.pack_documents(wlb.Documents([10**6], [100], [1]), 1)
    # a document the packer still holds, given again, would be planned twice (in one plan)
    w = wlb.Packer(wlb.Deck(SMOKE_DECK), "wlb")
    w.pack_documents(wlb.Documents([7, 8], [7000, 100], [0, 0]), 0)
    assert 7 in w.held_segments()[:, 0]
    with pytest.raises(ValueError, match="document 7 is still held by the packer"):
        w.pack_documents(wlb.Documents([7], [7000], [1]), 1)
    w.pack_documents(wlb.Documents([9], [10], [1]), 1)  # the refused call changed nothing


def test_packer_refuses_a_second_thread_while_it_packs():
    """pack() lets go of the GIL: load_state_dict from another thread then replaced the packer
    under it (a crash); now it raises RuntimeError, and every plan is whole."""
    import threading

    p = wlb.Packer(wlb.Deck(SMOKE_DECK, {"mesh.dp": 4, "packing.micro_batches": 8}), "wlb")
    state = p.state_dict()
    stop, refused = [False], []

    def loader():
        while not stop[0]:
            try:
                p.load_state_dict(state)
            except RuntimeError as e:
                refused.append(str(e))

    t = threading.Thread(target=loader)
    t.start()
    try:
        for _ in range(300):
            plan = p.pack()
            assert plan.dp == 4
    finally:
        stop[0] = True
        t.join()
    assert all("packing in another thread" in m for m in refused)


def test_integer_scalars_are_not_truncated():
    """Scalars take ints and NumPy integers only: int() would make 2.9 -> 2, True -> 1."""
    deck = wlb.Deck(SMOKE_DECK)
    cost = wlb.CostModel(deck)
    assert cost.segment_work(np.int32(7)) == cost.segment_work(np.array(7)) == cost.segment_work(7)
    plan = wlb.Packer(deck).pack()
    for call in (lambda: cost.segment_work(np.array([1.5])), lambda: cost.segment_work(np.float32(3.7)),
                 lambda: cost.segment_work(True), lambda: cost.kv_bytes(np.array([2.9])),
                 lambda: cost.attn_seconds(np.array(0.5), np.array([100.9])),
                 lambda: wlb.ShardPlanner(deck, cp=np.array([2.5])), lambda: wlb.ShardPlanner(deck, cp=True),
                 lambda: plan.micro_batch(np.array(0.9), 0), lambda: wlb.Packer(deck).pack(np.array(0.7)),
                 lambda: wlb.ShardPlanner(deck, cp=2**70)):
        with pytest.raises(TypeError):
            call()
    assert wlb.ShardPlanner(deck, cp=np.int64(4)).cp == 4
    with pytest.raises(ValueError, match="tokens = -5"):
        cost.kv_bytes(-5)
    with pytest.raises(ValueError, match="CP degree"):
        wlb.ShardPlanner(deck, cp=2**40)
    with pytest.raises(ValueError, match="capacity = 0"):
        wlb.ConservationChecker(0)
    with pytest.raises(ValueError, match="1180591620717411303424 is not a 64-bit integer"):
        wlb.Deck(None, {"mesh.dp": 2**70})


def test_shard_arguments_are_range_checked():
    deck = wlb.Deck(SMOKE_DECK)
    planner = wlb.ShardPlanner(deck, cp=2, comm="sharding_aware")
    # a segment longer than any document would size buffers the planner fills token by token
    for segs in (np.array([2**31]), np.array([[0, 2**31 - 10, 20, 0]]), np.array([[-7, 0, 5, 0]])):
        with pytest.raises(ValueError, match="offset \\+ length"):
            planner.plan(segs)
    plan = planner.plan(np.array([5000, 60]))
    for call in (lambda: plan.comm.transfers_from(9), lambda: plan.comm.transfers_to(-1)):
        with pytest.raises(IndexError, match="CP rank"):
            call()
    assert all(isinstance(i, int) for i in plan.comm.transfers_from(1))


def test_plan_from_json_takes_the_line_or_its_dict(tmp_path):
    plan = wlb.Packer(wlb.Deck(SMOKE_DECK)).pack()
    line = json.dumps(plan.to_json())
    for given in (line, line.encode(), plan.to_json()):
        assert wlb.Plan.from_json(given).segments.tolist() == plan.segments.tolist()
    with pytest.raises(ValueError, match="not JSON"):
        wlb.Plan.from_json("{nope")


def test_a_length_source_state_names_what_is_missing():
    with pytest.raises(ValueError, match="no 'next_step'"):
        wlb.LengthSource(wlb.Deck(SMOKE_DECK)).load_state_dict({"x": 1})


def test_a_checkpoint_with_impossible_fields_is_refused():
    p = wlb.Packer(wlb.Deck(LENGTHS_DECK), "wlb")
    p.pack()
    good = p.state_dict()
    for edit, says in ((lambda s: s["source"]["extra"].__setitem__("cursor", -3), "cursor"),
                       (lambda s: s["source"].__setitem__("held", 10**15), "held"),
                       (lambda s: s["source"].__setitem__("next_step", -1), "next_step"),
                       (lambda s: s["source"].__setitem__("next_step", 10**15), "past next_id"),
                       (lambda s: s["source"].__setitem__("next_id", 2**63 - 3), "next_id")):
        bad = json.loads(json.dumps(good))
        edit(bad["packers"]["wlb"])
        with pytest.raises(ValueError, match=says):
            p.load_state_dict(bad)
        assert p.state_dict() == good  # nothing half-loaded


def test_slimpack_capacity_is_s_max():
    deck = wlb.Deck(SMOKE_DECK, {"packing.strategy": "slimpack", "data.s_max": 10240})
    p = wlb.Packer(deck, lengths=np.array([100000]))
    assert p.capacity == 10240
    plan = p.pack()
    c = wlb.ConservationChecker(p.capacity)
    c.add_incoming(plan.documents)
    c.add_plan(plan)
    assert c.over_capacity == 0


def test_plan_file_keeps_what_each_step_recorded(cli, tmp_path):
    out = tmp_path / "p.jsonl"
    proc = cli("plan", SMOKE_DECK, "--packer", "wlb", "--steps", 3, "--out", out)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in read_jsonl(out) if x["type"] == "step"]
    _, plans = wlb.read_plan_file(str(out))
    for line, plan in zip(lines, plans):
        assert plan.incoming == line["incoming"] > 0
        assert plan.plan_us == line["metrics"]["plan_us"] > 0
    with pytest.raises(ValueError):
        wlb.Plan.from_json({})


def test_cost_model_refuses_impossible_token_counts():
    cost = wlb.CostModel(wlb.Deck(SMOKE_DECK))
    for call in (lambda: cost.segment_work(-100), lambda: cost.linear_seconds(-1),
                 lambda: cost.attn_seconds(0, 2**62), lambda: cost.segment_work(np.array([[1, 2]]))):
        with pytest.raises(ValueError):
            call()
    assert cost.segment_work(0) == 0


def test_sliced_shard_plan_survives_pickling():
    deck = wlb.Deck(SMOKE_DECK, {"mesh.cp": 2})
    planner = wlb.ShardPlanner(deck, "per_document")
    # a slice: queries [100, 300) of a document whose first 100 tokens are its keys only
    plan = planner.plan(np.array([[7, 100, 200, 0, 100]]))
    again = pickle.loads(pickle.dumps(plan))
    assert again.to_json() == plan.to_json()


def test_deck_is_what_was_read(tmp_path, monkeypatch):
    """A deck named by a relative path keeps working after a chdir (its relative data.path
    resolves against its folder), and a pickled deck is the text read, not the file now."""
    import pathlib
    import shutil

    shutil.copytree(os.path.join(os.path.dirname(LENGTHS_DECK), "lengths"), tmp_path / "inputs" / "lengths")
    shutil.copy(LENGTHS_DECK, tmp_path / "inputs")
    monkeypatch.chdir(tmp_path / "inputs")
    deck = wlb.Deck("plan_lengths_file.toml")
    again = wlb.Deck(pathlib.Path("plan_lengths_file.toml"))  # os.PathLike too
    assert again["packing.micro_batches"] == deck["packing.micro_batches"] == 4
    monkeypatch.chdir(tmp_path)
    plan = wlb.Packer(deck.with_overrides({"mesh.cp": 2})).pack()
    assert plan.dp == 2
    (tmp_path / "inputs" / "plan_lengths_file.toml").write_text("[packing]\nmicro_batches = 8\n")
    worker = pickle.loads(pickle.dumps(deck))
    assert worker["packing.micro_batches"] == 4
    assert np.array_equal(wlb.Packer(worker).pack().segments, wlb.Packer(deck).pack().segments)
