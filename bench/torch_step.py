#!/usr/bin/env python3
"""PyTorch peer of `wlb run`: wlb's model trained in PyTorch on the same packed batches.

What it measures
----------------
Training steps of the model that `wlb run` and `wlb train` execute, written as a PyTorch
user would, on one device, fed the micro-batches of ONE data-parallel replica of a wlb
plan (docs/plan-format.md: `wlb plan DECK --out PLAN.jsonl`, or the plan.STRATEGY.jsonl
that `wlb run DECK` writes into its output directory). A step is: for every micro-batch of
the replica, forward + backward (gradients accumulated in the parameters' .grad), then
one AdamW step and zero_grad. Whole steps are timed (CUDA events on the current stream,
perf_counter on the CPU) after the warm-up steps; the report gives per-step seconds,
tokens/s (the replica's tokens / step time), useful TFLOP/s under wlb's FLOP convention
(below) and, on CUDA, MFU against H100_BF16_DENSE_TFLOPS, with min / median / max over the
measured steps and the overall rate (all measured tokens / all measured seconds, wlb
run's accounting: the plan's drain steps, if measured, count like any other).

Not timed: reading the plan, generating the synthetic tokens and copying them to the
device (done for every step before the first one runs), and the RoPE cos/sin table (one
table up to the longest position; each micro-batch gathers its rows inside the step).

The model (wlb's, src/train/llama.cpp)
--------------------------------------
token embedding [vocab][hidden]; per layer:
    xn = RMSNorm(x; g1)          y = x / sqrt(mean(x^2) + 1e-5) * g
    Q, K, V = xn Wq, xn Wk, xn Wv                          (no biases)
    RoPE on Q and K: pairs (d, d + D/2) of each head rotated by pos * theta^(-2d/D),
        a' = a cos - b sin, b' = a sin + b cos; pos restarts at 0 in every segment
    O = causal attention inside each segment only (GQA: query head h reads KV head
        h // (heads / kv_heads); scale 1/sqrt(D))
    h = x + O Wo;  hn = RMSNorm(h; g2);  y = h + (silu(hn W1) * (hn W3)) W2
final RMSNorm, LM head [hidden][vocab] (untied), cross-entropy: token i of a segment
predicts token i+1 of the same segment; a segment's last token predicts nothing. The
step's loss = sum of CE over its predicted tokens / their count (micro-batch losses are
scaled by that count before backward, so the gradient is the step loss's gradient).
Segments with q_offset > 0 (SlimPack slices) are refused (exit 2).

Tokens are synthetic, the numbers wlb run uses (synthetic_tokens below); weights are
normal(0, 0.02) matrices and unit norm gains under torch.manual_seed(data.seed) (not
compared with wlb's numbers). AdamW with the deck's [train] lr, beta1, beta2,
weight_decay (decay on matrices and the embedding, not the norm gains), eps 1e-8, a
constant learning rate, no gradient clipping; fused=True on CUDA when torch has it.

Precision
---------
--dtype bf16: torch.autocast(bfloat16) over FP32 parameters (the FP32 master weights);
autocast's per-forward BF16 weight copies are the BF16 working weights; FP32 gradients and
AdamW state, so 2 + 4 + 4 + 8 = 18 bytes per parameter as in the deck's memory estimate.
Activations are BF16 (the residual stream too); RMSNorm, softmax statistics and the
cross-entropy are computed in FP32. --dtype fp32: plain FP32 everywhere (TF32 off).

Memory: in eager mode RMSNorm and SwiGLU are autograd Functions, so with varlen_attn a
layer keeps exactly what wlb keeps (x, xn1, h, hn, q, k, v, o, a1, a3, s and the FP32 rstd
and softmax LSE; the per-segment SDPA path also keeps each segment's output and any
expanded K/V), and the LM head + cross-entropy never holds the whole [tokens][vocab] logits: it
runs in chunks of --loss-chunk tokens and computes its input and weight gradients chunk by
chunk during the forward (no recomputation; the FLOPs are the same 3 GEMMs). With
--compile the per-token parts of a layer (norms, projections, RoPE, MLP) go through
torch.compile(dynamic=True) written with plain ops, so Inductor fuses them and chooses
what to keep; attention and the loss stay eager.

Attention kernels (--attn; what ran is printed and written to the JSON):
    varlen  torch.nn.attention.varlen.varlen_attn on packed [tokens, heads, D] with int32
            cu_seq offsets (PyTorch 2.10+, CUDA, BF16); causal through is_causal=True or
            window_size=(-1, 0), whichever its signature has; GQA natively when it has
            enable_gqa or a probe against a float64 reference passes, else KV expanded.
    sdpa    one F.scaled_dot_product_attention(is_causal=True) call per segment (GQA via
            enable_gqa when torch accepts it, else KV heads expanded); on a torch without
            scaled_dot_product_attention (before 2.0) the same per-segment loop computes
            softmax(Q K^T / sqrt(D) + causal mask) V with matmuls ("sdpa/math").
    auto    (default) varlen when it is available for the device and dtype, else sdpa.

FLOP convention (wlb's model/throughput.cpp usefulFlops, plus the LM head)
-------------------------------------------------------------------------
per segment of n tokens with q_offset q0, per layer:
    attention forward  4 * pairs * D * heads,  pairs = n*q0 + n*(n+1)/2;  backward 2.5x
    linear forward     2 * n * (h*(qw + 2*kvw) + qw*h + 3*h*ffn),  qw = heads*D,
                       kvw = kv_heads*D;  backward 2x
and once per token (not per layer) the LM head: forward 2*n*h*vocab, backward 2x.
Useful TFLOP/s = those FLOPs / step seconds / 1e12 (whatever a kernel computes beyond
that is not counted). wlb run's own "useful TFLOP/s" counts the layers only; the JSON
gives both parts (layers, head) so either can be compared.

Usage
-----
    wlb plan inputs/run_gpu_8b.toml --steps 7 --out plan.jsonl     # or use wlb run's plan
    python3 bench/torch_step.py --plan plan.wlb.jsonl --deck inputs/run_gpu_8b.toml \\
        --warmup 1 --steps 6 --json torch_step.json

Needs numpy, PyTorch (CUDA for the GPU figures; torch.compile 2.x; varlen_attn 2.10+) and
Python 3.11+ (tomllib; or the tomli package).
"""

import argparse
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np

SCHEMA = "wlb-torch-step/1"
# Dense (no sparsity) BF16 tensor-core peak of the H100 SXM5 80 GB, from NVIDIA's datasheet.
H100_BF16_DENSE_TFLOPS = 989.0
RMS_EPS = 1e-5
ATTN_BWD_FACTOR = 2.5    # model::kAttnBwdFactor
LINEAR_BWD_FACTOR = 2.0  # model::kLinearBwdFactor
IGNORE = -100            # target of a segment's last token

# The deck keys this script reads and their defaults (src/core/deck_schema.cpp).
DECK_DEFAULTS = {
    "model": {"hidden": 512, "heads": 8, "kv_heads": 8, "ffn": 1408, "layers": 2, "vocab": 32000},
    "data": {"seed": 1234},
    "train": {"rope_theta": 10000.0, "lr": 0.003, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1},
}

FLOP_CONVENTION = (
    "per segment (n tokens, q_offset q0) and layer: attention fwd 4*pairs*D*heads with "
    "pairs = n*q0 + n*(n+1)/2, bwd 2.5x fwd; linear fwd 2*n*(h*(qw+2*kvw) + qw*h + 3*h*ffn), "
    "bwd 2x fwd; plus the LM head once per token: fwd 2*n*h*vocab, bwd 2x fwd; "
    "TFLOP/s = FLOP / seconds / 1e12")


class InputError(Exception):
    """Bad input (plan, deck, options): printed and exit 2."""


def log(*parts):
    print(*parts, flush=True)


def write_atomic(path, text):
    """Write text to path via a temporary name in the same directory, then rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ----------------------------------------------------------------------------- tokens

_U64 = np.uint64


def _mix64(z):
    z = z + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def synthetic_tokens(seed, doc, pos, vocab):
    """The synthetic token ids wlb run uses, vectorised over doc and pos (numpy int64).

    All arithmetic is unsigned 64-bit, modulo 2^64:
        mix64(z): z += 0x9e3779b97f4a7c15
                  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
                  z = (z ^ (z >> 27)) * 0x94d049bb133111eb
                  return z ^ (z >> 31)
        key(doc, pos)          = (doc << 32) ^ pos
        token(seed, doc, pos)  = mix64(mix64(seed ^ 0x746f6b656e73) + key(doc, pos)) % vocab
    where pos is the token's position in its DOCUMENT (segment offset + index in the
    segment) and seed = the deck's data.seed.
    """
    doc = np.asarray(doc, dtype=np.uint64)
    pos = np.asarray(pos, dtype=np.uint64)
    with np.errstate(over="ignore"):
        base = _mix64(np.asarray(seed, dtype=np.uint64) ^ _U64(0x746F6B656E73))
        key = (doc << _U64(32)) ^ pos
        return (_mix64(base + key) % _U64(vocab)).astype(np.int64)


# ----------------------------------------------------------------------------- FLOPs


def useful_flops(segments, hidden, heads, kv_heads, ffn, layers, vocab):
    """Useful FLOPs of one step's segments under wlb's convention, forward + backward.

    segments: iterable of (length n, q_offset q0). Per segment and layer (wlb's
    model/throughput.cpp usefulFlops, CostModel::attnFlops / linearFlops with tp = 1):
        attention: forward 4 * pairs * D * heads with pairs = n*q0 + n*(n+1)/2, backward
                   2.5x forward
        linear:    forward 2 * n * (h*(qw + 2*kvw) + qw*h + 3*h*ffn), qw = heads*D,
                   kvw = kv_heads*D (QKV, output projection, SwiGLU), backward 2x forward
    plus the LM head once per token (not per layer): forward 2*n*h*vocab, backward 2x.
    Returns {"attention", "linear", "layers" (= attention + linear), "head", "total"}.
    """
    h = hidden
    D = hidden // heads
    qw, kvw = heads * D, kv_heads * D
    attn = lin = head = 0.0
    for n, q0 in segments:
        n, q0 = int(n), int(q0)
        if n <= 0:
            continue
        pairs = n * q0 + n * (n + 1) // 2
        attn += (1.0 + ATTN_BWD_FACTOR) * 4.0 * pairs * D * heads
        lin += (1.0 + LINEAR_BWD_FACTOR) * 2.0 * n * (h * (qw + 2 * kvw) + qw * h + 3 * h * ffn)
        head += (1.0 + LINEAR_BWD_FACTOR) * 2.0 * n * h * vocab
    attn *= layers
    lin *= layers
    return {"attention": attn, "linear": lin, "layers": attn + lin, "head": head,
            "total": attn + lin + head}


# ----------------------------------------------------------------------------- inputs


def load_toml(path):
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise InputError("reading the deck needs Python 3.11+ (tomllib) or the tomli package") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise InputError(f"cannot read the deck {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{path}: not valid TOML ({e})") from None


class ModelConfig:
    def __init__(self, deck, path, layers_override=None):
        def get(table, key):
            value = deck.get(table, {}).get(key, DECK_DEFAULTS[table][key])
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{path}: {table}.{key} must be a number, got {value!r}")
            return value

        for key in ("hidden", "heads", "kv_heads", "ffn", "layers", "vocab"):
            value = get("model", key)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{path}: model.{key} must be a positive integer, got {value!r}")
            setattr(self, key, value)
        if layers_override is not None:
            if layers_override < 1:
                raise InputError(f"--layers must be >= 1, got {layers_override}")
            self.layers = layers_override
        if self.hidden % self.heads:
            raise InputError(f"{path}: model.heads ({self.heads}) must divide model.hidden ({self.hidden})")
        if self.heads % self.kv_heads:
            raise InputError(f"{path}: model.kv_heads ({self.kv_heads}) must divide model.heads ({self.heads})")
        self.head_dim = self.hidden // self.heads
        if self.head_dim % 2:
            raise InputError(f"{path}: head_dim = hidden / heads = {self.head_dim} must be even (RoPE pairs)")
        self.seed = int(get("data", "seed"))
        self.rope_theta = float(get("train", "rope_theta"))
        self.lr = float(get("train", "lr"))
        self.beta1 = float(get("train", "beta1"))
        self.beta2 = float(get("train", "beta2"))
        self.weight_decay = float(get("train", "weight_decay"))
        self.name = deck.get("model", {}).get("name", "")

    def parameters(self):
        h, D = self.hidden, self.head_dim
        per_layer = (h * (self.heads * D + 2 * self.kv_heads * D) + self.heads * D * h
                     + 3 * h * self.ffn + 2 * h)
        return self.layers * per_layer + 2 * self.vocab * h + h

    def to_json(self):
        keys = ("name", "hidden", "heads", "kv_heads", "head_dim", "ffn", "layers", "vocab", "seed",
                "rope_theta", "lr", "beta1", "beta2", "weight_decay")
        out = {k: getattr(self, k) for k in keys}
        out["parameters"] = self.parameters()
        return out


def read_plan(path):
    """(header, step records) of a wlb plan JSONL file (docs/plan-format.md)."""
    header, steps = None, []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read the plan {path}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise InputError(f"{path}:{lineno}: a plan line must be a JSON object")
            if header is None:
                if rec.get("type") != "header" or rec.get("format") != "wlb-plan":
                    raise InputError(f"{path}:{lineno}: the first line must be a wlb-plan header "
                                     "(written by `wlb plan --out` or `wlb run`)")
                header = rec
            elif rec.get("type") == "step":
                rec["_line"] = lineno
                steps.append(rec)
    if header is None:
        raise InputError(f"{path}: empty plan")
    return header, steps


def replica_segments(path, step, replica):
    """The micro-batches of one replica in one step: lists of (doc, offset, length)."""
    where = f"{path}:{step['_line']}"
    replicas = step.get("replicas")
    if not isinstance(replicas, list) or replica >= len(replicas):
        n = len(replicas) if isinstance(replicas, list) else 0
        raise InputError(f"{where}: step {step.get('step')} has {n} replicas; --replica {replica} is not one")
    out = []
    for m, mb in enumerate(replicas[replica]):
        segs = []
        for seg in mb:
            if (not isinstance(seg, list) or len(seg) not in (4, 5)
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in seg)):
                raise InputError(f"{where}: replica {replica} micro-batch {m}: a segment must be "
                                 f"[doc, offset, length, arrival(, q_offset)] integers, got {seg!r}")
            doc, off, length = seg[0], seg[1], seg[2]
            q0 = seg[4] if len(seg) == 5 else 0
            if q0 != 0:
                raise InputError(f"{where}: replica {replica} micro-batch {m}: segment {seg} has q_offset "
                                 f"{q0} (a SlimPack slice attending to an earlier slice's keys); this "
                                 "script runs whole-segment attention only")
            if doc < 0 or off < 0 or length < 1:
                raise InputError(f"{where}: replica {replica} micro-batch {m}: bad segment {seg}")
            segs.append((doc, off, length))
        out.append(segs)
    return out


class MicroBatch:
    """One micro-batch's packed host arrays (THD layout: segments one after another)."""

    def __init__(self, segments, seed, vocab):
        self.segments = segments
        self.lengths = [n for _, _, n in segments]
        self.n = sum(self.lengths)
        toks, tgts, pos = [], [], []
        for doc, off, n in segments:
            i = np.arange(n, dtype=np.int64)
            t = synthetic_tokens(seed, doc, off + i, vocab)
            toks.append(t)
            tgts.append(np.concatenate([t[1:], np.array([IGNORE], dtype=np.int64)]))
            pos.append(i)
        cat = (lambda xs: np.concatenate(xs)) if segments else (lambda xs: np.zeros(0, np.int64))
        self.tokens, self.targets, self.positions = cat(toks), cat(tgts), cat(pos)
        self.predicted = sum(n - 1 for n in self.lengths)
        self.cu_seqlens = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.max_len = max(self.lengths, default=0)

    def to(self, torch, device):
        """Device tensors of this micro-batch (a dict)."""
        long = lambda a: torch.as_tensor(a, dtype=torch.long).to(device)  # noqa: E731
        return {
            "n": self.n,
            "tokens": long(self.tokens),
            "targets": long(self.targets),
            "positions": long(self.positions),
            "cu_seqlens": torch.as_tensor(self.cu_seqlens, dtype=torch.int32).to(device),
            "bounds": [(int(a), int(b)) for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])],
            "max_len": self.max_len,
            "predicted": self.predicted,
        }


# ----------------------------------------------------------------------------- model

def build_ops(torch):
    """The model's building blocks (a namespace), defined once torch is imported."""
    F = torch.nn.functional

    def up(t):
        """t in FP32 if it is a 16-bit float, else as it is (FP32 or FP64)."""
        return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t

    def rows(n, width, budget=1 << 28):
        """Row-chunk size whose FP32 temporaries of `width` columns stay near `budget` bytes."""
        return max(1, min(n, budget // (4 * max(1, width))))

    class RMSNormFn(torch.autograd.Function):
        """y = x / sqrt(mean(x^2) + eps) * g in FP32, output in x's dtype; keeps x and rstd."""

        @staticmethod
        def forward(ctx, x, g, eps):
            xf = up(x)
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = (xf * rstd * up(g)).to(x.dtype)
            ctx.save_for_backward(x, g, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, g, rstd = ctx.saved_tensors
            dx = torch.empty_like(x)
            gf = up(g)
            dg = torch.zeros_like(gf)
            step = rows(x.shape[0], x.shape[1])
            for a in range(0, x.shape[0], step):
                b = min(a + step, x.shape[0])
                r = rstd[a:b]
                xhat = up(x[a:b]) * r
                dyf = up(dy[a:b])
                dg += (dyf * xhat).sum(0)
                dxhat = dyf * gf
                dx[a:b] = (r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
            return dx, dg.to(g.dtype), None

    class SwiGLUFn(torch.autograd.Function):
        """s = silu(a1) * a3; keeps a1 and a3 (the backward recomputes silu elementwise)."""

        @staticmethod
        def forward(ctx, a1, a3):
            ctx.save_for_backward(a1, a3)
            return F.silu(a1) * a3

        @staticmethod
        def backward(ctx, ds):
            a1, a3 = ctx.saved_tensors
            da1, da3 = torch.empty_like(a1), torch.empty_like(a3)
            step = rows(a1.shape[0], a1.shape[1])
            for a in range(0, a1.shape[0], step):
                b = min(a + step, a1.shape[0])
                x = up(a1[a:b])
                sig = torch.sigmoid(x)
                dsf = up(ds[a:b])
                da3[a:b] = (dsf * x * sig).to(a3.dtype)
                da1[a:b] = (dsf * up(a3[a:b]) * sig * (1 + x * (1 - sig))).to(a1.dtype)
            return da1, da3

    class LinearCrossEntropyFn(torch.autograd.Function):
        """Sum over rows with a target (>= 0) of cross-entropy(x @ w, target).

        The [rows][vocab] logits exist one chunk of rows at a time: each chunk's logits,
        log-sum-exp, loss and d(logits) = softmax - onehot are computed in FP32, and the
        chunk's input gradient and weight-gradient contribution immediately (matmuls in
        compute_dtype); the backward only scales the kept gradients. Same FLOPs as
        forward + backward of a plain head, no recomputation.
        """

        @staticmethod
        def forward(ctx, x, w, targets, chunk, compute_dtype):
            with torch.autocast(device_type=x.device.type, enabled=False):
                xc, wc = x.to(compute_dtype), w.to(compute_dtype)
                dx = torch.empty_like(xc)
                acc = torch.promote_types(compute_dtype, torch.float32)
                dw = torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32), device=w.device)
                total = torch.zeros((), dtype=acc, device=x.device)
                n = x.shape[0]
                for a in range(0, n, chunk):
                    b = min(a + chunk, n)
                    logits = up(xc[a:b] @ wc)
                    t = targets[a:b]
                    valid = t >= 0
                    tt = torch.where(valid, t, torch.zeros_like(t))
                    lse = torch.logsumexp(logits, dim=-1)
                    picked = logits.gather(1, tt[:, None])[:, 0]
                    total += torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
                    g = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                    g[torch.arange(b - a, device=g.device), tt] -= 1.0
                    g.mul_(valid[:, None].to(g.dtype))
                    gc = g.to(compute_dtype)
                    del logits, g
                    dx[a:b] = gc @ wc.t()
                    dw.add_(xc[a:b].t() @ gc)
                ctx.save_for_backward(dx, dw)
                ctx.dtypes = (x.dtype, w.dtype)
            return total

        @staticmethod
        def backward(ctx, grad):
            dx, dw = ctx.saved_tensors
            return (dx * grad).to(ctx.dtypes[0]), (dw * grad).to(ctx.dtypes[1]), None, None, None

    def rmsnorm_plain(x, g, eps=RMS_EPS):
        xf = up(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * up(g)).to(x.dtype)

    def swiglu_plain(a1, a3):
        return F.silu(a1) * a3

    def rope(t, cos, sin):
        """Rotate pairs (d, d + D/2): a' = a cos - b sin, b' = a sin + b cos."""
        half = t.shape[-1] // 2
        rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * cos + rotated * sin

    class Ops:
        pass

    ops = Ops()
    ops.RMSNormFn, ops.SwiGLUFn, ops.LinearCrossEntropyFn = RMSNormFn, SwiGLUFn, LinearCrossEntropyFn
    ops.rmsnorm = lambda x, g: RMSNormFn.apply(x, g, RMS_EPS)
    ops.swiglu = SwiGLUFn.apply
    ops.rmsnorm_plain, ops.swiglu_plain, ops.rope = rmsnorm_plain, swiglu_plain, rope
    return ops


def make_model(torch, cfg, device):
    """wlb's model as an nn.Module of FP32 parameters (W stored [in][out]: y = x @ W)."""
    nn = torch.nn
    torch.manual_seed(cfg.seed)
    h, D, F = cfg.hidden, cfg.head_dim, cfg.ffn

    def mat(rows, cols):
        return nn.Parameter(torch.randn(rows, cols, device=device) * 0.02)

    def gain():
        return nn.Parameter(torch.ones(h, device=device))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.g1, self.g2 = gain(), gain()
            self.wq, self.wk, self.wv = mat(h, cfg.heads * D), mat(h, cfg.kv_heads * D), mat(h, cfg.kv_heads * D)
            self.wo = mat(cfg.heads * D, h)
            self.w1, self.w3, self.w2 = mat(h, F), mat(h, F), mat(F, h)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = mat(cfg.vocab, h)
            self.layers = nn.ModuleList([Layer() for _ in range(cfg.layers)])
            self.gf = gain()
            self.head = mat(h, cfg.vocab)

    return Model()


class Attention:
    """Causal attention inside each segment of a packed micro-batch: [T, H, D] -> [T, H, D]."""

    def __init__(self, torch, cfg, device, dtype, requested):
        self.torch, self.cfg = torch, cfg
        self.group = cfg.heads // cfg.kv_heads
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.notes = []
        reasons = []
        if requested in ("auto", "varlen"):
            why = self._setup_varlen(device, dtype)
            if why is None:
                return
            reasons.append(why)
            if requested == "varlen":
                raise InputError(f"--attn varlen: {why}")
        self._setup_sdpa(device, dtype)
        if reasons:
            self.notes.append("varlen not used: " + "; ".join(reasons))

    # -- varlen_attn
    def _setup_varlen(self, device, dtype):
        torch = self.torch
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
        if device.type != "cuda":
            return "varlen_attn runs on CUDA only"
        if dtype != torch.bfloat16:
            return "varlen_attn needs BF16/FP16 inputs (--dtype bf16)"
        params = inspect.signature(varlen_attn).parameters
        self.fn, self.kwargs = varlen_attn, {}
        if "is_causal" in params:
            self.kwargs["is_causal"] = True
            causal = "is_causal=True"
        elif "window_size" in params:
            self.kwargs["window_size"] = (-1, 0)
            causal = "window_size=(-1, 0)"
        else:
            return f"varlen_attn{inspect.signature(varlen_attn)} has neither is_causal nor window_size"
        self.expand = False
        if "enable_gqa" in params:
            self.kwargs["enable_gqa"] = True
            gqa = "enable_gqa=True"
        elif self.group > 1:
            ok, why = self._probe_varlen(device, dtype)
            self.expand = not ok
            gqa = "native GQA (" + why + ")" if ok else "KV heads expanded (" + why + ")"
        else:
            gqa = "no GQA (heads == kv_heads)"
        self.kind = "varlen"
        self.name = f"varlen_attn ({causal}, {gqa})"
        self.call = self._varlen
        return None

    def _varlen(self, q, k, v, mb):
        if self.expand:
            k = k.repeat_interleave(self.group, dim=1)
            v = v.repeat_interleave(self.group, dim=1)
        cu = mb["cu_seqlens"]
        return self.fn(q, k, v, cu, cu, mb["max_len"], mb["max_len"], **self.kwargs)

    def _probe_varlen(self, device, dtype):
        """Native GQA through varlen_attn on two small documents against float64."""
        torch = self.torch
        gen = torch.Generator(device=device)
        gen.manual_seed(7)
        lens, D, H, K = [100, 60], self.cfg.head_dim, self.cfg.heads, self.cfg.kv_heads
        T = sum(lens)
        q, k, v = (torch.randn((T, h, D), device=device, generator=gen, dtype=dtype) for h in (H, K, K))
        mb = {"cu_seqlens": torch.tensor([0, lens[0], T], dtype=torch.int32, device=device),
              "max_len": max(lens), "bounds": [(0, lens[0]), (lens[0], T)]}
        try:
            out = self.fn(q, k, v, mb["cu_seqlens"], mb["cu_seqlens"], mb["max_len"], mb["max_len"],
                          **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - any refusal means "expand"
            return False, f"native GQA call failed: {type(exc).__name__}"
        ref = self._math(q.double(), k.double(), v.double(), mb)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        if not math.isfinite(err) or err > 5e-2:
            return False, f"native GQA rel err {err:.1e} against float64"
        return True, f"probe rel err {err:.1e} against float64"

    # -- per-segment SDPA (or matmuls)
    def _setup_sdpa(self, device, dtype):
        torch = self.torch
        self.kind = "sdpa"
        self.sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        self.call = self._per_segment
        if self.sdpa is None:
            self.sdpa_gqa = False
            self.name = (f"sdpa/math: per-segment softmax(QK^T/sqrt(D) + causal mask) V with matmuls "
                         f"(torch {torch.__version__} has no scaled_dot_product_attention), KV heads expanded")
            return
        self.sdpa_gqa = False
        if self.group > 1:
            try:
                x = torch.zeros((1, self.cfg.heads, 2, 8), device=device, dtype=dtype)
                y = torch.zeros((1, self.cfg.kv_heads, 2, 8), device=device, dtype=dtype)
                self.sdpa(x, y, y, is_causal=True, enable_gqa=True)
                self.sdpa_gqa = True
            except (TypeError, RuntimeError):
                pass
        gqa = ("enable_gqa=True" if self.sdpa_gqa else "KV heads expanded") if self.group > 1 else "no GQA"
        self.name = f"sdpa: one F.scaled_dot_product_attention(is_causal=True) call per segment, {gqa}"

    def _math(self, q, k, v, mb):
        torch = self.torch
        outs = []
        for a, b in mb["bounds"]:
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
            ks = ks.repeat_interleave(self.group, dim=0)
            vs = vs.repeat_interleave(self.group, dim=0)
            s = qs @ ks.transpose(1, 2)
            s = (s.float() if s.dtype in (torch.bfloat16, torch.float16) else s) * self.scale  # FP32 or FP64
            mask = torch.ones((b - a, b - a), dtype=torch.bool, device=q.device).triu(1)
            p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1).to(vs.dtype)
            outs.append((p @ vs).transpose(0, 1))
        return torch.cat(outs, 0) if outs else q.new_zeros(q.shape)

    def _per_segment(self, q, k, v, mb):
        if self.sdpa is None:
            return self._math(q, k, v, mb)
        outs = []
        for a, b in mb["bounds"]:
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L, D]
            if self.sdpa_gqa:
                o = self.sdpa(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                if self.group > 1:
                    ks = ks.repeat_interleave(self.group, dim=1)
                    vs = vs.repeat_interleave(self.group, dim=1)
                o = self.sdpa(qs, ks, vs, is_causal=True)
            outs.append(o[0].transpose(0, 1))
        return self.torch.cat(outs, 0) if outs else q.new_zeros(q.shape)

    def __call__(self, q, k, v, mb):
        return self.call(q, k, v, mb)


class Trainer:
    """Forward/backward of micro-batches and the AdamW step."""

    def __init__(self, torch, cfg, device, dtype, attn, compile_layers, loss_chunk):
        self.torch, self.cfg, self.device, self.dtype = torch, cfg, device, dtype
        self.ops = build_ops(torch)
        self.model = make_model(torch, cfg, device)
        self.attn = attn
        self.loss_chunk = loss_chunk
        self.autocast = dtype != torch.float32
        # RoPE table up to the longest position (float64 angles, as wlb computes them).
        self.rope_len = 0
        self.cos_tab = self.sin_tab = None
        H, K, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        ops = self.ops
        norm = ops.rmsnorm_plain if compile_layers else ops.rmsnorm
        swiglu = ops.swiglu_plain if compile_layers else ops.swiglu
        rope = ops.rope

        def pre(x, g1, wq, wk, wv, cos, sin):
            xn = norm(x, g1)
            q = (xn @ wq).view(-1, H, D)
            k = (xn @ wk).view(-1, K, D)
            v = (xn @ wv).view(-1, K, D)
            return rope(q, cos, sin), rope(k, cos, sin), v

        def post(x, o, wo, g2, w1, w3, w2):
            h = x + o.reshape(o.shape[0], H * D) @ wo
            hn = norm(h, g2)
            return h + swiglu(hn @ w1, hn @ w3) @ w2

        if compile_layers:
            pre = torch.compile(pre, dynamic=True)
            post = torch.compile(post, dynamic=True)
        self.pre, self.post = pre, post

        decay = [p for n, p in self.model.named_parameters() if not n.split(".")[-1].startswith("g")]
        no_decay = [p for n, p in self.model.named_parameters() if n.split(".")[-1].startswith("g")]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        kw = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": 1e-8}
        self.optimizer_kind = "AdamW"
        params = inspect.signature(torch.optim.AdamW).parameters
        if device.type == "cuda" and "fused" in params:
            try:
                self.optimizer = torch.optim.AdamW(groups, fused=True, **kw)
                self.optimizer_kind = "AdamW(fused=True)"
                return
            except (RuntimeError, TypeError, ValueError):
                pass
        if device.type == "cuda" and "foreach" in params:
            kw["foreach"] = True
            self.optimizer_kind = "AdamW(foreach=True)"
        self.optimizer = torch.optim.AdamW(groups, **kw)

    def ensure_rope(self, max_len):
        torch, D = self.torch, self.cfg.head_dim
        if max_len <= self.rope_len:
            return
        half = D // 2
        inv = self.cfg.rope_theta ** (-2.0 * np.arange(half, dtype=np.float64) / D)
        ang = np.arange(max_len, dtype=np.float64)[:, None] * inv[None, :]
        cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=1)
        sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=1)
        self.cos_tab = torch.as_tensor(cos, dtype=self.dtype).to(self.device)
        self.sin_tab = torch.as_tensor(sin, dtype=self.dtype).to(self.device)
        self.rope_len = max_len

    def autocast_ctx(self):
        torch = self.torch
        if self.autocast:
            return torch.autocast(device_type=self.device.type, dtype=self.dtype)
        return torch.autocast(device_type=self.device.type, enabled=False)

    def loss_sum(self, mb):
        """Sum of the micro-batch's cross-entropy over its predicted tokens (a 0-dim tensor)."""
        torch, m = self.torch, self.model
        pos = mb["positions"]
        cos, sin = self.cos_tab[pos].unsqueeze(1), self.sin_tab[pos].unsqueeze(1)
        with self.autocast_ctx():
            x = torch.nn.functional.embedding(mb["tokens"], m.embed).to(self.dtype)
            for L in m.layers:
                q, k, v = self.pre(x, L.g1, L.wq, L.wk, L.wv, cos, sin)
                o = self.attn(q, k, v, mb)
                x = self.post(x, o, L.wo, L.g2, L.w1, L.w3, L.w2)
            xf = self.ops.rmsnorm(x, m.gf)
            return self.ops.LinearCrossEntropyFn.apply(xf, m.head, mb["targets"], self.loss_chunk, self.dtype)

    def step(self, mbs):
        """One training step over a replica's micro-batches; returns the loss (0-dim tensor) or None."""
        predicted = sum(mb["predicted"] for mb in mbs)
        scale = 1.0 / predicted if predicted > 0 else 1.0
        total = None
        for mb in mbs:
            if mb["n"] == 0:
                continue
            ls = self.loss_sum(mb)
            (ls * scale).backward()
            total = ls.detach() if total is None else total + ls.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return None if total is None or predicted == 0 else total * scale


# ----------------------------------------------------------------------------- run


def spread(values):
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def device_meta(torch, device):
    meta = {
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update({"device_name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                     "memory_bytes": props.total_memory, "cuda": torch.version.cuda})
    return meta


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="PyTorch peer of `wlb run`: wlb's model (RMSNorm, RoPE per segment, causal GQA "
                    "inside segments, SwiGLU, untied LM head) trained on one replica's micro-batches of a "
                    "wlb plan; per-step time, tokens/s and useful TFLOP/s under wlb's FLOP convention.")
    p.add_argument("--plan", required=True, help="plan JSONL (wlb plan --out, or wlb run's plan.STRATEGY.jsonl)")
    p.add_argument("--deck", required=True, help="the deck (TOML) the plan was made from: model shape, data.seed")
    p.add_argument("--steps", type=int, default=0,
                   help="measured steps: the plan steps after the warm-up ones (default 0 = all of them)")
    p.add_argument("--warmup", type=int, default=1,
                   help="the plan's first N steps are run untimed as warm-up (default 1, as wlb run)")
    p.add_argument("--replica", type=int, default=0, help="DP replica whose micro-batches this device runs (default 0)")
    p.add_argument("--layers", type=int, default=None, help="override model.layers")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: autocast BF16 over FP32 master weights (default); fp32: plain FP32, TF32 off")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the per-token parts of each layer (default: on for CUDA when "
                        "torch.compile exists)")
    p.add_argument("--attn", choices=("auto", "varlen", "sdpa"), default="auto",
                   help="attention kernel: varlen_attn, per-segment SDPA, or auto (varlen if available)")
    p.add_argument("--loss-chunk", type=int, default=2048,
                   help="tokens per chunk of the LM head + cross-entropy (default 2048)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--json", metavar="OUT", help="write config, device, per-step times and rates to OUT")
    args = p.parse_args(argv)
    for name in ("steps", "warmup", "replica"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be >= 0")
    if args.loss_chunk < 1:
        p.error("--loss-chunk must be >= 1")
    return args


def run(args):
    deck = load_toml(args.deck)
    cfg = ModelConfig(deck, args.deck, args.layers)
    header, all_steps = read_plan(args.plan)
    dp = header.get("dp", 1)
    if args.replica >= dp:
        raise InputError(f"--replica {args.replica}: the plan has dp = {dp}")
    if header.get("seed") is not None and header["seed"] != cfg.seed:
        log(f"note: the plan's header seed {header['seed']} differs from the deck's data.seed {cfg.seed}; "
            f"tokens use data.seed = {cfg.seed}")
    need = args.warmup + max(args.steps, 1)
    if len(all_steps) < need:
        raise InputError(f"{args.plan}: {len(all_steps)} step lines; --warmup {args.warmup} and --steps "
                         f"{args.steps} need at least {need}")
    measured_n = args.steps or len(all_steps) - args.warmup
    chosen = all_steps[:args.warmup + measured_n]

    host = []
    for rec in chosen:
        mbs = [MicroBatch(segs, cfg.seed, cfg.vocab) for segs in replica_segments(args.plan, rec, args.replica)]
        host.append((rec, mbs))

    try:
        import torch
    except ImportError as exc:
        raise InputError(f"needs PyTorch ({exc})") from None

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device visible to torch")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    compile_layers = args.compile
    if compile_layers is None:
        compile_layers = device.type == "cuda" and hasattr(torch, "compile")
    if compile_layers and not hasattr(torch, "compile"):
        raise InputError(f"--compile: torch {torch.__version__} has no torch.compile")

    meta = device_meta(torch, device)
    attn = Attention(torch, cfg, device, dtype, args.attn)
    trainer = Trainer(torch, cfg, device, dtype, attn, compile_layers, args.loss_chunk)
    trainer.ensure_rope(max([mb.max_len for _, mbs in host for mb in mbs], default=1) or 1)
    batches = [[mb.to(torch, device) for mb in mbs] for _, mbs in host]

    log(f"torch_step: {meta['device_name']} ({device}), torch {torch.__version__}, "
        f"{'bf16 autocast over FP32 master weights' if args.dtype == 'bf16' else 'fp32'}, "
        f"compile {'on' if compile_layers else 'off'}, {trainer.optimizer_kind}")
    log(f"attention: {attn.name}")
    for note in attn.notes:
        log(f"  {note}")
    log(f"model: {cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}/{cfg.kv_heads} (D {cfg.head_dim}), "
        f"ffn {cfg.ffn}, vocab {cfg.vocab}: {cfg.parameters() / 1e6:.4g} M parameters")
    log(f"plan: {args.plan} (packer {header.get('packer')}, dp {dp}, window {header.get('context_window')}); "
        f"replica {args.replica}; warm-up steps {[r['step'] for r, _ in host[:args.warmup]]}, "
        f"measured {len(host) - args.warmup} from step {host[args.warmup][0]['step']}")
    log(f"FLOP convention: {FLOP_CONVENTION}")

    cuda = device.type == "cuda"
    oom = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    records = []
    try:
        for i, ((rec, mbs), dev_mbs) in enumerate(zip(host, batches)):
            warm = i < args.warmup
            if cuda:
                if i == args.warmup:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = trainer.step(dev_mbs)
                end.record()
                if warm:
                    torch.cuda.synchronize()
                timer = (start, end)
            else:
                t0 = time.perf_counter()
                loss = trainer.step(dev_mbs)
                timer = time.perf_counter() - t0
            records.append((rec, mbs, warm, timer, loss))
        if cuda:
            torch.cuda.synchronize()
    except oom as exc:
        log(f"torch_step: out of device memory ({str(exc).splitlines()[0]}); try fewer --layers or a smaller "
            "--loss-chunk")
        return 3

    steps_out, warm_out = [], []
    for rec, mbs, warm, timer, loss in records:
        seconds = timer[0].elapsed_time(timer[1]) / 1e3 if cuda else timer
        tokens = sum(mb.n for mb in mbs)
        flops = useful_flops(((n, 0) for mb in mbs for n in mb.lengths), cfg.hidden, cfg.heads, cfg.kv_heads,
                             cfg.ffn, cfg.layers, cfg.vocab)
        value = None if loss is None else float(loss.item())
        item = {"step": rec.get("step"), "seconds": seconds, "tokens": tokens,
                "predicted": sum(mb.predicted for mb in mbs), "micro_batches": len(mbs),
                "segments": sum(len(mb.lengths) for mb in mbs),
                "plan_tokens": rec.get("metrics", {}).get("tokens"),
                "loss": value if value is None or math.isfinite(value) else None,
                "flops": flops, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                "tflops": flops["total"] / seconds / 1e12 if seconds > 0 else 0.0}
        (warm_out if warm else steps_out).append(item)

    secs = [s["seconds"] for s in steps_out]
    total_s = sum(secs)
    total_tokens = sum(s["tokens"] for s in steps_out)
    total_flops = sum(s["flops"]["total"] for s in steps_out)
    summary = {
        "measured_steps": len(steps_out),
        "seconds": dict(spread(secs), total=total_s),
        "tokens": total_tokens,
        "tokens_per_s": dict(spread([s["tokens_per_s"] for s in steps_out]), overall=total_tokens / total_s),
        "tflops": dict(spread([s["tflops"] for s in steps_out]), overall=total_flops / total_s / 1e12),
        "tflops_layers_only": sum(s["flops"]["layers"] for s in steps_out) / total_s / 1e12,
        "mfu": None,
    }
    if cuda:
        peak = H100_BF16_DENSE_TFLOPS
        summary["mfu"] = {k: v / peak for k, v in summary["tflops"].items()}
        summary["peak_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        summary["peak_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)

    for s in warm_out + steps_out:
        tag = " (warm-up)" if s in warm_out else ""
        loss = "n/a" if s["loss"] is None else f"{s['loss']:.4f}"
        log(f"step {s['step']}{tag}: {s['seconds']:.3f} s  tokens {s['tokens']}  "
            f"{s['tokens_per_s'] / 1e3:.1f} ktok/s  {s['tflops']:.3g} TFLOP/s  loss {loss}")
    tps, tf = summary["tokens_per_s"], summary["tflops"]
    log(f"measured {len(steps_out)} steps, {total_tokens} tokens in {total_s:.3f} s: "
        f"{tps['overall'] / 1e3:.2f} ktok/s (per step min/median/max {tps['min'] / 1e3:.2f} / "
        f"{tps['median'] / 1e3:.2f} / {tps['max'] / 1e3:.2f}), useful {tf['overall']:.3g} TFLOP/s "
        f"({tf['min']:.3g} / {tf['median']:.3g} / {tf['max']:.3g}; layers only "
        f"{summary['tflops_layers_only']:.3g})")
    if cuda:
        mfu = summary["mfu"]
        log(f"MFU {100 * mfu['overall']:.1f}% of {H100_BF16_DENSE_TFLOPS:g} TFLOP/s (H100 SXM datasheet dense "
            f"BF16); peak memory allocated {summary['peak_memory_allocated_bytes'] / 2**30:.2f} GiB, reserved "
            f"{summary['peak_memory_reserved_bytes'] / 2**30:.2f} GiB")

    if args.json:
        doc = {
            "schema": SCHEMA,
            "config": {
                "plan": args.plan, "deck": args.deck, "replica": args.replica, "warmup": args.warmup,
                "steps": len(steps_out), "device": args.device, "dtype": args.dtype, "compile": compile_layers,
                "attn_requested": args.attn, "loss_chunk": args.loss_chunk, "optimizer": trainer.optimizer_kind,
                "model": cfg.to_json(),
            },
            "meta": meta,
            "attention": {"kind": attn.kind, "kernel": attn.name, "notes": attn.notes},
            "plan": {"header": header, "steps": [r["step"] for r, _ in host],
                     "replica_tokens": [sum(mb.n for mb in mbs) for _, mbs in host],
                     "step_tokens": [r.get("metrics", {}).get("tokens") for r, _ in host]},
            "flop_convention": FLOP_CONVENTION,
            "mfu_peak_tflops": H100_BF16_DENSE_TFLOPS if cuda else None,
            "mfu_peak_source": "NVIDIA H100 SXM datasheet, dense BF16 tensor core" if cuda else None,
            "warmup_steps": warm_out,
            "measured": steps_out,
            "summary": summary,
        }
        write_atomic(args.json, json.dumps(doc, indent=1, allow_nan=False) + "\n")
        log(f"wrote {args.json}")
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except InputError as exc:
        print(f"torch_step.py: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
