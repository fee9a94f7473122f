"""bench/torch_step.py, the PyTorch peer of `wlb run`, on the CPU: a tiny deck -> `wlb plan`
-> the script, whose JSON must carry the plan's tokens and wlb's FLOP convention; the
synthetic tokens against hand computation with Python ints; the model's pieces (custom
RMSNorm / SwiGLU / chunked cross-entropy backward, RoPE, per-segment GQA attention) against
plain autograd and loops; and the Llama-3-8B deck's memory arithmetic. No timing is
asserted."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from wlb_test_helpers import ROOT, deck_path, read_jsonl  # noqa: E402

SCRIPT = os.path.join(ROOT, "bench", "torch_step.py")


def load_script():
    spec = importlib.util.spec_from_file_location("torch_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ts = load_script()

TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, vocab=256)
TINY_DECK = """\
[model]
hidden = 64
heads = 4
kv_heads = 2
ffn = 128
layers = 2
vocab = 256

[mesh]
dp = 2

[data]
source = "generator"
preset = "long_context_128k"
seed = 11
context_window = 512
length_scale = 0.01

[packing]
micro_batches = 2
"""


# ---- synthetic tokens --------------------------------------------------------------------

M64 = (1 << 64) - 1


def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def token_by_hand(seed, doc, pos, vocab):
    key = ((doc << 32) & M64) ^ pos
    return mix64((mix64(seed ^ 0x746F6B656E73) + key) & M64) % vocab


# (seed, doc, pos, vocab) -> token, worked out with Python ints (token_by_hand above)
KNOWN_TOKENS = [((2026, 0, 0, 128256), 91126),
                ((1234, 7, 100, 256), 76),
                ((2**40 + 3, 2**31 + 5, 123456, 32000), 3095)]


def test_synthetic_tokens_known_values():
    for (seed, doc, pos, vocab), token in KNOWN_TOKENS:
        assert token_by_hand(seed, doc, pos, vocab) == token
        assert ts.synthetic_tokens(seed, [doc], [pos], vocab).tolist() == [token]
    # vectorised over documents and positions, including a doc id past 2^32 (the shift wraps)
    docs, pos = [0, 5, 5, 2**33 + 1], [0, 3, 700, 9]
    got = ts.synthetic_tokens(9_200_000_000_000_000_000, docs, pos, 128256)
    assert got.dtype == np.int64
    assert got.tolist() == [token_by_hand(9_200_000_000_000_000_000, d, p, 128256) for d, p in zip(docs, pos)]


def test_micro_batch_tokens_targets_positions():
    # a segment in the middle of document 3 (offset 40) and a whole document 9
    mb = ts.MicroBatch([(3, 40, 5), (9, 0, 3)], seed=5, vocab=256)
    doc3 = [token_by_hand(5, 3, 40 + i, 256) for i in range(5)]
    doc9 = [token_by_hand(5, 9, i, 256) for i in range(3)]
    assert mb.tokens.tolist() == doc3 + doc9
    # the next token of the same segment; the segment's last token has none
    assert mb.targets.tolist() == doc3[1:] + [ts.IGNORE] + doc9[1:] + [ts.IGNORE]
    assert mb.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert mb.cu_seqlens.tolist() == [0, 5, 8] and mb.predicted == 6 and mb.max_len == 5


# ---- FLOPs -------------------------------------------------------------------------------


def flops_by_hand(lengths, hidden, heads, kv_heads, ffn, layers, vocab):
    """wlb's convention written out again: per layer attention fwd 4*D*heads*n(n+1)/2 (bwd 2.5x),
    linear fwd 2n(QKV + O + SwiGLU) (bwd 2x); LM head fwd 2*n*h*vocab once (bwd 2x)."""
    D = hidden // heads
    total = 0
    for n in lengths:
        attn_fwd = 4 * D * heads * n * (n + 1) // 2
        qkv = hidden * (heads * D) + 2 * hidden * (kv_heads * D)
        lin_fwd = 2 * n * (qkv + heads * D * hidden + 3 * hidden * ffn)
        total += layers * (attn_fwd * 7 // 2 + lin_fwd * 3) + 3 * 2 * n * hidden * vocab
    return total


def test_useful_flops_convention():
    f = ts.useful_flops([(100, 0), (7, 0)], 4096, 32, 8, 14336, 4, 128256)
    assert f["total"] == pytest.approx(flops_by_hand([100, 7], 4096, 32, 8, 14336, 4, 128256), rel=1e-12)
    assert f["total"] == pytest.approx(f["layers"] + f["head"], rel=1e-15)
    # a SlimPack slice: n queries after q0 keys of its document -> pairs n*q0 + n(n+1)/2
    g = ts.useful_flops([(10, 30)], 64, 4, 2, 128, 1, 256)
    assert g["attention"] == pytest.approx(3.5 * 4 * (10 * 30 + 55) * 16 * 4, rel=1e-15)


# ---- the script end to end -----------------------------------------------------------------


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


@pytest.fixture(scope="module")
def tiny_plan(cli, tmp_path_factory):
    d = tmp_path_factory.mktemp("torch_step")
    deck = d / "tiny.toml"
    deck.write_text(TINY_DECK)
    plan = d / "plan.jsonl"
    proc = cli("plan", deck, "--steps", 3, "--out", plan)
    assert proc.returncode == 0, proc.stderr
    return d, deck, plan


def replica_lengths(step, replica):
    return [seg[2] for mb in step["replicas"][replica] for seg in mb]


def test_script_on_a_wlb_plan(tiny_plan):
    d, deck, plan = tiny_plan
    out = d / "out.json"
    proc = run_script("--plan", plan, "--deck", deck, "--device", "cpu", "--dtype", "fp32", "--no-compile",
                      "--steps", 2, "--warmup", 1, "--replica", 1, "--threads", 2, "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attention: " in proc.stdout and "measured 2 steps" in proc.stdout
    doc = json.loads(out.read_text())
    steps = [x for x in read_jsonl(plan) if x["type"] == "step"]
    assert doc["schema"] == "wlb-torch-step/1"
    assert doc["config"]["model"]["layers"] == 2 and doc["config"]["replica"] == 1
    assert doc["meta"]["torch"] == torch.__version__
    # varlen_attn is CUDA-only: on the CPU the per-segment path runs (SDPA, or matmuls before torch 2.0)
    assert doc["attention"]["kind"] == "sdpa"
    assert doc["plan"]["steps"] == [0, 1, 2]
    assert doc["plan"]["step_tokens"] == [s["metrics"]["tokens"] for s in steps]
    assert [w["step"] for w in doc["warmup_steps"]] == [0]
    assert [m["step"] for m in doc["measured"]] == [1, 2]
    for m, step in zip(doc["measured"], steps[1:]):
        lengths = replica_lengths(step, 1)
        assert m["tokens"] == sum(lengths) > 0
        assert m["predicted"] == sum(n - 1 for n in lengths)
        assert m["micro_batches"] == 2 and m["segments"] == len(lengths)
        assert m["flops"]["total"] == pytest.approx(flops_by_hand(lengths, **TINY), rel=1e-12)
        assert m["loss"] is not None and math.isfinite(m["loss"]) and 0 < m["loss"] < 2 * math.log(256)
        assert m["seconds"] > 0
    s = doc["summary"]
    assert s["measured_steps"] == 2 and s["tokens"] == sum(m["tokens"] for m in doc["measured"])
    assert s["mfu"] is None  # CPU: no MFU
    assert set(s["tokens_per_s"]) == {"min", "median", "max", "overall"}


def test_slimpack_slices_are_refused(tiny_plan, tmp_path):
    d, deck, plan = tiny_plan
    lines = plan.read_text().splitlines()
    step = json.loads(lines[1])
    seg = step["replicas"][0][0][0]
    step["replicas"][0][0][0] = seg[:4] + [3]  # q_offset 3
    lines[1] = json.dumps(step)
    bad = tmp_path / "sliced.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    proc = run_script("--plan", bad, "--deck", deck, "--device", "cpu", "--steps", 1, "--warmup", 0)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "q_offset 3" in proc.stderr and "SlimPack" in proc.stderr


def test_too_few_plan_steps(tiny_plan):
    d, deck, plan = tiny_plan
    proc = run_script("--plan", plan, "--deck", deck, "--device", "cpu", "--steps", 3, "--warmup", 1)
    assert proc.returncode == 2 and "3 step lines" in proc.stderr, proc.stderr


# ---- the model's pieces ------------------------------------------------------------------


def tiny_trainer(dtype=torch.float32, **model):
    cfg = ts.ModelConfig({"model": dict(TINY, **model), "data": {"seed": 3}}, "tiny.toml")
    attn = ts.Attention(torch, cfg, torch.device("cpu"), dtype, "sdpa")
    return cfg, ts.Trainer(torch, cfg, torch.device("cpu"), dtype, attn, False, 5)


def test_custom_backwards_match_autograd():
    ops = ts.build_ops(torch)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(16, dtype=torch.float64, generator=gen, requires_grad=True)
    a3 = torch.randn(9, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(9, 16, dtype=torch.float64, generator=gen)
    for custom, plain, inputs in ((ops.rmsnorm, ops.rmsnorm_plain, (x, g)), (ops.swiglu, ops.swiglu_plain, (x, a3))):
        y1 = custom(*inputs)
        y2 = plain(*inputs)
        torch.testing.assert_close(y1, y2)
        torch.testing.assert_close(torch.autograd.grad(y1, inputs, dy), torch.autograd.grad(y2, inputs, dy))
    # the chunked LM head + cross-entropy: chunks of 3 rows, two rows without a target
    w = torch.randn(16, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    t = torch.tensor([1, 4, ts.IGNORE, 10, 0, 3, 3, ts.IGNORE, 7])
    loss = ops.LinearCrossEntropyFn.apply(x, w, t, 3, torch.float64)
    ref = torch.nn.functional.cross_entropy(x @ w, t, ignore_index=ts.IGNORE, reduction="sum")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(0.5 * loss, (x, w)), torch.autograd.grad(0.5 * ref, (x, w)))


def test_rope_rotates_pairs_by_position():
    cfg, tr = tiny_trainer()
    D, half = cfg.head_dim, cfg.head_dim // 2
    tr.ensure_rope(40)
    pos = torch.tensor([0, 1, 39, 5])
    q = torch.randn(4, cfg.heads, D, generator=torch.Generator().manual_seed(1))
    got = tr.ops.rope(q, tr.cos_tab[pos].unsqueeze(1), tr.sin_tab[pos].unsqueeze(1))
    want = q.clone()
    for i, p in enumerate(pos.tolist()):
        for d in range(half):
            ang = p * cfg.rope_theta ** (-2.0 * d / D)
            a, b = q[i, :, d], q[i, :, d + half]
            want[i, :, d] = a * math.cos(ang) - b * math.sin(ang)
            want[i, :, d + half] = a * math.sin(ang) + b * math.cos(ang)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_is_causal_per_segment_with_gqa():
    cfg, tr = tiny_trainer()
    H, K, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    lens = [5, 1, 7]
    mb = ts.MicroBatch([(0, 0, n) for n in lens], seed=1, vocab=256).to(torch, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lens), h, D, dtype=torch.float64, generator=gen) for h in (H, K, K))
    got = tr.attn(q, k, v, mb)
    want = torch.zeros_like(q)
    start = 0
    for n in lens:
        for i in range(start, start + n):
            for h in range(H):
                kv = h // (H // K)
                s = torch.stack([q[i, h] @ k[j, kv] for j in range(start, i + 1)]) / math.sqrt(D)
                p = torch.softmax(s, 0)
                want[i, h] = sum(p[j - start] * v[j, kv] for j in range(start, i + 1))
        start += n
    torch.testing.assert_close(got, want)


def test_packed_micro_batch_equals_its_segments_alone():
    """Document masking and positions restarting per segment: the packed loss and gradients
    are the sums of each segment's own."""
    cfg, tr = tiny_trainer()
    segs = [(4, 0, 6), (2, 10, 9), (8, 3, 1), (1, 0, 4)]
    dev = torch.device("cpu")
    tr.ensure_rope(16)
    params = list(tr.model.parameters())

    def loss_and_grads(segments):
        mb = ts.MicroBatch(segments, cfg.seed, cfg.vocab).to(torch, dev)
        loss = tr.loss_sum(mb)
        return loss.detach(), torch.autograd.grad(loss, params)

    packed, packed_grads = loss_and_grads(segs)
    parts = [loss_and_grads([s]) for s in segs]
    torch.testing.assert_close(packed, sum(p[0] for p in parts))
    for i, gp in enumerate(packed_grads):
        torch.testing.assert_close(gp, sum(p[1][i] for p in parts), rtol=1e-4, atol=1e-6)


def test_bf16_autocast_step_on_cpu():
    """--dtype bf16 keeps FP32 parameters (the master weights) and BF16 activations."""
    cfg, tr = tiny_trainer(torch.bfloat16)
    mb = ts.MicroBatch([(1, 0, 12), (2, 0, 20)], cfg.seed, cfg.vocab)
    tr.ensure_rope(mb.max_len)
    loss = tr.step([mb.to(torch, torch.device("cpu"))])
    assert math.isfinite(loss.item()) and loss.item() > 0
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())


# ---- the Llama-3-8B deck -----------------------------------------------------------------


def test_run_gpu_8b_deck_layers_are_the_memory_estimate(cli):
    import tomllib

    path = deck_path("run_gpu_8b.toml")
    assert cli("validate", path).returncode == 0
    with open(path, "rb") as f:
        deck = tomllib.load(f)
    m, T = deck["model"], deck["data"]["context_window"]
    h, D = m["hidden"], m["hidden"] // m["heads"]
    kvw = m["kv_heads"] * D
    per_layer = h * (h + 2 * kvw) + h * h + 3 * h * m["ffn"]
    act = T * ((4 * h + 2 * h + 2 * kvw + 3 * m["ffn"]) * 2 + 4 * m["heads"] + 2 * 4)
    budget = 0.9 * 80 * 2**30

    def total(layers):
        return 18 * (2 * m["vocab"] * h) + layers * (18 * per_layer + act)

    assert (m["hidden"], m["heads"], m["kv_heads"], D, m["ffn"], m["vocab"]) == (4096, 32, 8, 128, 14336, 128256)
    assert total(m["layers"]) <= budget < total(m["layers"] + 1)
    assert round(total(m["layers"]) / 2**30, 2) == 66.27  # the figure the deck's comment gives


def test_run_gpu_8b_deck_plans(cli, tmp_path):
    proc = cli("plan", deck_path("run_gpu_8b.toml"), "--steps", 2, "--out", tmp_path / "p.jsonl")
    assert proc.returncode == 0, proc.stderr
    for packer in ("original", "fixed_greedy", "wlb"):
        header = read_jsonl(tmp_path / f"p.{packer}.jsonl")[0]
        assert header["context_window"] == 65536 and header["micro_batches"] == 4


def test_bad_deck_is_exit_2(tmp_path):
    deck = tmp_path / "bad.toml"
    deck.write_text("[model]\nhidden = 100\nheads = 3\n")
    plan = tmp_path / "p.jsonl"
    plan.write_text('{"type":"header","format":"wlb-plan","dp":1}\n')
    proc = run_script("--plan", plan, "--deck", deck, "--device", "cpu")
    assert proc.returncode == 2 and "model.heads (3) must divide model.hidden (100)" in proc.stderr
