#!/usr/bin/env python3
"""PyTorch attention baselines: the anchor for wlb's own GPU attention kernels.

What it measures
----------------
Causal grouped-query attention as a PyTorch user would run it on one NVIDIA GPU:
32 query heads, 8 KV heads (query head h reads KV head h // 4), causal within each
document, on three cases

  a  one 8192-token document, head_dim 128
  b  65536 packed tokens of documents whose lengths are read from
     bench/attention_case_b.txt (regenerate with --make-case-b), head_dim 128
  c  case a with head_dim 64
  d  the CP-piece grid: one piece of q queries at the end of a k-key prefix (what
     per-document CP and SlimPack slices make), q in {64, 256, 1024} x k in {16K, 64K,
     128K}, head_dim 128; cells "d:q64k16K" ... Only varlen_bf16 takes pieces with fewer
     queries than keys (cu_seq_q != cu_seq_k, causal mask aligned bottom-right: query i
     of a piece sees keys [0, k - q + i]); the other kernels report it unavailable

with four kernels, forward and backward timed separately:

  sdpa_fp32        F.scaled_dot_product_attention, float32, is_causal=True, backend
                   forced to EFFICIENT_ATTENTION, KV heads expanded 8 -> 32 with
                   repeat_interleave once outside the timed region (so the timed
                   backward is the kernel's and excludes the head sum of dK/dV)
  sdpa_bf16_cudnn  F.scaled_dot_product_attention, bfloat16, is_causal=True, backend
                   forced to CUDNN_ATTENTION, enable_gqa=True (no expansion)
  flex_bf16        torch.compile(flex_attention), bfloat16, enable_gqa=True, one
                   packed sequence with a document-causal BlockMask (plain causal for
                   a and c); the mask is built once, outside the timed region
  varlen_bf16      torch.nn.attention.varlen.varlen_attn on packed [tokens, heads, D]
                   with int32 cu_seq offsets; its causal and GQA options are read from
                   its signature at run time (KV heads are expanded, and the output
                   says so, only when native GQA is refused or gives wrong results)

SDPA has no varlen mode, so for case b both SDPA kernels run one call per document
in a Python loop and the whole loop is timed (labelled "per-document calls").

The forward is the training forward (inputs require grad, so the kernels also
produce what their backward needs). The backward is the autograd backward of the
output for a fixed random grad, excluding the forward: the graph of each input set
is built once and torch.autograd.grad(..., retain_graph=True) is timed per iteration
(if a kernel refuses a retained graph, each iteration runs an untimed forward and
CUDA events bracket the backward alone; the JSON says which).

FLOP convention (useful work only, identical to wlb's cost model and C++ benches)
------------------------------------------------------------------------------
  pairs    = sum over documents of n * (n + 1) / 2     (query, key) pairs kept
             (case d: q * (k - q) + q * (q + 1) / 2)
  forward  = 4 * D * heads * pairs                     heads = 32 query heads
  backward = 2.5 * forward
Rates are useful TFLOP/s = FLOP / time / 1e12, whatever a kernel computes beyond
that (masked tiles, expanded heads, padding).

Timing
------
CUDA events around a loop of calls on the current stream, after time-based warm-up
(and after a first, untimed call that absorbs compilation and cuDNN graph builds).
Each repeat runs enough calls to last about 100 ms (25 ms with --quick); the report
gives the median per-call time over the repeats (>= 5) and its min/max spread. When
one input set (q, k, v as the kernel takes them) is no larger than twice the L2
cache, calls rotate among 3 freshly drawn sets so no call finds its inputs in L2;
otherwise one set is used. Inputs are standard normal, drawn anew per set.

Also measured, as ceilings: an 8192^3 matmul in bfloat16, in float32 with TF32 off
and with TF32 on (torch.backends.cuda.matmul.allow_tf32), and device-to-device copy
bandwidth (bytes read + written per second) of a 1 GiB tensor.

Precision sanity: each kernel's forward output over the first tokens of its case
(1024 for a and c, 2048 for b, document boundaries kept, last document cut; case d: the
piece's first min(q, 256) queries over their whole key prefix) against a float64
reference computed on the GPU from the same inputs; reported as the relative Frobenius
error ||out - ref||_F / ||ref||_F.

Usage
-----
  python3 bench/attention_torch.py [--cases a,b,c,d] [--kernels sdpa_fp32,...]
                                   [--repeats N] [--quick] [--json PATH]
  python3 bench/attention_torch.py --make-case-b     # rewrite the case-b lengths

Needs PyTorch with CUDA (varlen_attn: PyTorch 2.10 or later); --help and
--make-case-b need neither torch nor a GPU (--make-case-b needs numpy).
"""

import argparse
import gc
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time

NUM_Q_HEADS = 32
NUM_KV_HEADS = 8
GQA_GROUP = NUM_Q_HEADS // NUM_KV_HEADS

CASE_B_TOKENS = 65536
CASE_B_SEED = 0
CASE_B_MEDIAN_LEN = 1024  # lognormal median: mean of the underlying normal is ln(1024)
CASE_B_SIGMA = 1.2
CASE_B_MAX_LEN = 32768
CASE_B_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_case_b.txt")

KERNELS = ("sdpa_fp32", "sdpa_bf16_cudnn", "flex_bf16", "varlen_bf16")
CASES = ("a", "b", "c", "d")
GRID_Q = (64, 256, 1024)          # case d: queries of the piece
GRID_K = (16384, 65536, 131072)   # case d: keys of its prefix
L2_FALLBACK_BYTES = 50 * 2**20
MATMUL_N = 8192
COPY_BYTES = 2**30

FLOP_CONVENTION = (
    "pairs = sum over documents of n*(n+1)/2; forward FLOP = 4 * D * 32 query heads * pairs; "
    "backward FLOP = 2.5 * forward; TFLOP/s = FLOP / seconds / 1e12"
)
UNITS = {
    "time_ms": "milliseconds per call",
    "tflops": "useful TFLOP/s (1e12 FLOP per second) under flop_convention; matmul: 2*n^3 FLOP",
    "gbps": "GB/s (1e9 bytes per second), bytes read + written",
    "flop": "FLOP per call",
    "bytes": "bytes",
    "spread_pct": "(max - min) / median of the per-call time, percent",
    "seconds": "wall-clock seconds",
}


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


# ----------------------------------------------------------------------------- case b


def generate_case_b_lengths():
    """The case-b document lengths (see the header of attention_case_b.txt)."""
    import numpy as np

    rng = np.random.default_rng(CASE_B_SEED)
    lens, total = [], 0
    while total < CASE_B_TOKENS:
        n = int(np.rint(rng.lognormal(mean=math.log(CASE_B_MEDIAN_LEN), sigma=CASE_B_SIGMA)))
        n = min(max(n, 1), CASE_B_MAX_LEN, CASE_B_TOKENS - total)
        lens.append(n)
        total += n
    return lens


def make_case_b_file(path):
    lens = generate_case_b_lengths()
    header = (
        "# Case-b document lengths (tokens, one per line; lines starting with '#' are comments)\n"
        "# for bench/attention_torch.py and wlb's GPU attention benchmarks. Generated by\n"
        "# `python3 bench/attention_torch.py --make-case-b`: numpy.random.default_rng(0)\n"
        f"# .lognormal(mean=ln({CASE_B_MEDIAN_LEN}), sigma={CASE_B_SIGMA}) drawn one at a time,"
        " rounded to the nearest\n"
        f"# integer (numpy.rint), clamped to [1, {CASE_B_MAX_LEN}], appended until the sum"
        f" reaches {CASE_B_TOKENS};\n"
        f"# the last length is truncated so the total is exactly {CASE_B_TOKENS}.\n"
        f"# {len(lens)} documents, {sum(lens)} tokens, min {min(lens)},"
        f" median {statistics.median(lens):g}, max {max(lens)}.\n"
    )
    write_atomic(path, header + "".join(f"{n}\n" for n in lens))
    log(f"wrote {path}: {len(lens)} documents, {sum(lens)} tokens, min {min(lens)}, "
        f"median {statistics.median(lens):g}, max {max(lens)}")


def read_case_b_file(path):
    lens = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                n = int(text)
            except ValueError:
                raise SystemExit(f"{path}:{lineno}: not an integer: {text!r}") from None
            if n < 1:
                raise SystemExit(f"{path}:{lineno}: document length must be >= 1, got {n}")
            lens.append(n)
    if sum(lens) != CASE_B_TOKENS:
        raise SystemExit(f"{path}: lengths sum to {sum(lens)}, expected {CASE_B_TOKENS} "
                         "(regenerate with --make-case-b)")
    return lens


# ----------------------------------------------------------------------------- cases


class Case:
    """One attention problem: document lengths (packed in order) and head_dim. With
    q_lens (case d), document i keeps only its last q_lens[i] queries (a CP piece): queries
    are packed by q_lens, keys and values by doc_lens."""

    def __init__(self, name, doc_lens, head_dim, check_tokens, description, q_lens=None):
        self.name = name
        self.doc_lens = list(doc_lens)
        self.q_lens = list(q_lens) if q_lens is not None else list(self.doc_lens)
        self.pieces = any(q != k for q, k in zip(self.q_lens, self.doc_lens))
        self.head_dim = head_dim
        self.tokens = sum(self.doc_lens)      # keys (= queries for whole documents)
        self.q_tokens = sum(self.q_lens)
        self.check_tokens = min(check_tokens, self.q_tokens)
        self.description = description
        self.pairs = sum(q * (k - q) + q * (q + 1) // 2 for q, k in zip(self.q_lens, self.doc_lens))
        self.fwd_flop = 4 * head_dim * NUM_Q_HEADS * self.pairs
        self.bwd_flop = 2.5 * self.fwd_flop

    @property
    def doc_ranges(self):
        start = 0
        for n in self.doc_lens:
            yield start, start + n
            start += n

    def check_lens(self):
        """Document lengths of the first check_tokens tokens (the last one cut)."""
        return truncated_lengths(self.doc_lens, self.check_tokens)

    def to_json(self):
        return {
            "description": self.description,
            "tokens": self.tokens,
            "query_tokens": self.q_tokens,
            "documents": len(self.doc_lens),
            "head_dim": self.head_dim,
            "q_heads": NUM_Q_HEADS,
            "kv_heads": NUM_KV_HEADS,
            "pairs": self.pairs,
            "fwd_flop": self.fwd_flop,
            "bwd_flop": self.bwd_flop,
            "check_tokens": self.check_tokens,
        }


def truncated_lengths(lens, limit):
    out, total = [], 0
    for n in lens:
        if total >= limit:
            break
        out.append(min(n, limit - total))
        total += out[-1]
    return out


def build_cases(names, case_b_path):
    cases = []
    for name in names:
        if name == "a":
            cases.append(Case("a", [8192], 128, 1024, "one 8192-token document, D=128"))
        elif name == "b":
            lens = read_case_b_file(case_b_path)
            cases.append(Case("b", lens, 128, 2048,
                              f"{CASE_B_TOKENS} packed tokens, {len(lens)} documents, D=128"))
        elif name == "c":
            cases.append(Case("c", [8192], 64, 1024, "one 8192-token document, D=64"))
        elif name == "d":
            for q in GRID_Q:
                for k in GRID_K:
                    cases.append(Case(f"d:q{q}k{k // 1024}K", [k], 128, 256,
                                      f"CP piece: {q} queries at the end of a {k}-key prefix, D=128",
                                      q_lens=[q]))
    return cases


# ----------------------------------------------------------------------------- timing


class Settings:
    def __init__(self, repeats, quick):
        self.repeats = repeats
        self.quick = quick
        self.target_ms = 25.0 if quick else 100.0  # per repeat
        self.warmup_ms = 20.0 if quick else 100.0
        self.min_warmup = 1 if quick else 3
        self.max_warmup = 50
        self.max_iters = 200

    def to_json(self):
        return {k: getattr(self, k) for k in
                ("repeats", "quick", "target_ms", "warmup_ms", "min_warmup", "max_iters")}


def time_calls(torch, run, settings, prepare=None):
    """Per-call milliseconds of `run` on the current CUDA stream, one sample per repeat.

    Without `prepare`, CUDA events bracket a loop of `iters` calls run(i). With
    `prepare`, each call is run(prepare(i)); prepare's work is enqueued before the
    start event, events bracket run() alone and the loop's times are summed.
    Returns (samples_ms, iters).
    """
    def once(i):
        run(i if prepare is None else prepare(i))

    call, best_ms, t_begin = 0, float("inf"), time.perf_counter()
    while call < settings.min_warmup or (
            (time.perf_counter() - t_begin) * 1e3 < settings.warmup_ms and call < settings.max_warmup):
        t0 = time.perf_counter()
        once(call)
        torch.cuda.synchronize()
        best_ms = min(best_ms, (time.perf_counter() - t0) * 1e3)
        call += 1
    iters = max(1, min(settings.max_iters, math.ceil(settings.target_ms / max(best_ms, 1e-3))))

    samples = []
    for _ in range(settings.repeats):
        if prepare is None:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run(call)
                call += 1
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            events = []
            for _ in range(iters):
                state = prepare(call)
                call += 1
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                run(state)
                end.record()
                events.append((start, end))
            torch.cuda.synchronize()
            samples.append(sum(s.elapsed_time(e) for s, e in events) / iters)
    return samples, iters


def summarize(samples_ms, iters, work, rate_name, per_ms_to_unit, **extra):
    """Median/min/max of the per-call time and of the rate work/time."""
    med, lo, hi = statistics.median(samples_ms), min(samples_ms), max(samples_ms)
    out = {
        "time_ms": {"median": med, "min": lo, "max": hi},
        rate_name: {"median": work / med * per_ms_to_unit,
                    "min": work / hi * per_ms_to_unit,
                    "max": work / lo * per_ms_to_unit},
        "spread_pct": 100.0 * (hi - lo) / med,
        "repeats": len(samples_ms),
        "iters_per_repeat": iters,
        "samples_ms": samples_ms,
    }
    out.update(extra)
    return out


def tflops_summary(samples_ms, iters, flop, **extra):
    return summarize(samples_ms, iters, flop, "tflops", 1e-9, flop=flop, **extra)


def reason(exc):
    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, Unavailable):
        text = first
    else:
        text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def release(torch):
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- metadata, ceilings


def device_meta(torch):
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    meta = {
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception:  # triton is optional: only flex needs it
        meta["triton"] = None
    return meta


def set_matmul_tf32(torch, enabled):
    torch.backends.cuda.matmul.allow_tf32 = enabled


def measure_ceilings(torch, settings, seed):
    """Matmul TFLOP/s (bf16, fp32 without and with TF32) and D2D copy GB/s."""
    results = {}
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    try:
        tf32_before = bool(torch.backends.cuda.matmul.allow_tf32)
    except Exception:
        tf32_before = False
    n = MATMUL_N
    for key, dtype, tf32 in (("matmul_bf16", torch.bfloat16, None),
                             ("matmul_fp32_tf32_off", torch.float32, False),
                             ("matmul_fp32_tf32_on", torch.float32, True)):
        a = b = c = None
        try:
            a = torch.randn(n, n, device="cuda", dtype=dtype, generator=gen)
            b = torch.randn(n, n, device="cuda", dtype=dtype, generator=gen)
            c = torch.empty(n, n, device="cuda", dtype=dtype)
            if tf32 is not None:
                set_matmul_tf32(torch, tf32)
            samples, iters = time_calls(torch, lambda i: torch.matmul(a, b, out=c), settings)
            results[key] = tflops_summary(
                samples, iters, 2 * n**3, shape=[n, n, n], dtype=str(dtype).replace("torch.", ""),
                allow_tf32=tf32)
        except Exception as exc:
            results[key] = {"status": "unavailable: " + reason(exc)}
        finally:
            set_matmul_tf32(torch, tf32_before)
            a = b = c = None
            release(torch)
    src = dst = None
    try:
        src = torch.randn(COPY_BYTES // 4, device="cuda", generator=gen)
        dst = torch.empty_like(src)
        samples, iters = time_calls(torch, lambda i: dst.copy_(src), settings)
        moved = 2 * COPY_BYTES
        results["copy_d2d"] = summarize(samples, iters, moved, "gbps", 1e-6,
                                        bytes_moved=moved, tensor_bytes=COPY_BYTES)
    except Exception as exc:
        results["copy_d2d"] = {"status": "unavailable: " + reason(exc)}
    finally:
        src = dst = None
        release(torch)
    return results


# ----------------------------------------------------------------------------- reference


def reference_attention(torch, q, k, v, lens):
    """Causal GQA attention per document in the dtype of q ([S, Hq, D]; k, v [S, Hkv, D])."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    outs, start = [], 0
    for n in lens:
        qd = q[start:start + n].transpose(0, 1)
        kd = k[start:start + n].repeat_interleave(group, dim=1).transpose(0, 1)
        vd = v[start:start + n].repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qd @ kd.transpose(1, 2)) * scale
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        outs.append((probs @ vd).transpose(0, 1))
        start += n
    return torch.cat(outs, dim=0)


def reference_piece(torch, q, k, v, nq):
    """Causal GQA attention of the rows of q ([S, Hq, D]), the first S queries of a piece of
    nq queries ending the key prefix k, v ([nk, Hkv, D]): query i sees keys [0, nk - nq + i].
    One head at a time, so a long prefix's score matrix stays small."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    rows, nk = q.shape[0], k.shape[0]
    off = nk - nq
    seen = torch.arange(nk, device=q.device)[None, :] > (off + torch.arange(rows, device=q.device))[:, None]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        scores = (q[:, h] @ k[:, h // group].T) * scale
        probs = scores.masked_fill(seen, float("-inf")).softmax(dim=-1)
        out[:, h] = probs @ v[:, h // group]
    return out


def finite_or_none(value):
    """JSON-safe copy of value: non-finite floats become None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def rel_error(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------- kernels


class Unavailable(RuntimeError):
    pass


class KernelBase:
    """A kernel on one case. Canonical inputs are packed q [T, 32, D], k/v [T, 8, D];
    make_inputs turns them into the kernel's leaf tensors (requires_grad), forward
    returns a list of outputs, output_prefix gives the first S tokens as [S, 32, D]."""

    name = ""
    fp32 = False

    def __init__(self, torch, case):
        self.torch = torch
        self.case = case
        self.label = self.name
        self.notes = []
        self.info = {}
        self.expand_kv = False

    @property
    def dtype(self):
        return self.torch.float32 if self.fp32 else self.torch.bfloat16

    def input_bytes(self):
        kv = NUM_Q_HEADS if self.expand_kv else NUM_KV_HEADS
        rows = self.case.q_tokens * NUM_Q_HEADS + self.case.tokens * 2 * kv
        return rows * self.case.head_dim * (4 if self.fp32 else 2)

    def make_inputs(self, q, k, v):
        raise NotImplementedError

    def forward(self, leaves):
        raise NotImplementedError

    def output_prefix(self, outs, tokens):
        raise NotImplementedError


def bhsd_leaf(x):
    """[n, H, D] -> contiguous [1, H, n, D] leaf that requires grad."""
    return x.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_(True)


class SdpaKernel(KernelBase):
    """F.scaled_dot_product_attention with one forced backend; per-document calls for
    packed cases."""

    def __init__(self, torch, case, backend, expand_kv):
        super().__init__(torch, case)
        if case.pieces:
            raise Unavailable("pieces with fewer queries than keys: varlen_bf16 only")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if not hasattr(SDPBackend, backend):
            raise Unavailable(f"SDPBackend.{backend} does not exist in this torch")
        self.backend = getattr(SDPBackend, backend)
        self.sdpa_kernel = sdpa_kernel
        self.expand_kv = expand_kv
        self.notes.append(f"backend {backend}")
        if expand_kv:
            self.notes.append("KV heads expanded 8->32 (repeat_interleave) once, outside the timed region")
        else:
            self.notes.append("enable_gqa=True, KV not expanded")
        if len(case.doc_lens) > 1:
            self.label += " (per-document calls)"
            self.notes.append(f"one SDPA call per document ({len(case.doc_lens)} calls in a Python "
                              "loop), the whole loop timed; backward is one autograd.grad over all")

    def make_inputs(self, q, k, v):
        leaves = []
        for s, e in self.case.doc_ranges:
            kd, vd = k[s:e], v[s:e]
            if self.expand_kv:
                kd = kd.repeat_interleave(GQA_GROUP, dim=1)
                vd = vd.repeat_interleave(GQA_GROUP, dim=1)
            leaves += [bhsd_leaf(q[s:e]), bhsd_leaf(kd), bhsd_leaf(vd)]
        return leaves

    def forward(self, leaves):
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        kwargs = {} if self.expand_kv else {"enable_gqa": True}
        with self.sdpa_kernel(self.backend):
            return [sdpa(leaves[i], leaves[i + 1], leaves[i + 2], is_causal=True, **kwargs)
                    for i in range(0, len(leaves), 3)]

    def output_prefix(self, outs, tokens):
        parts, have = [], 0
        for o in outs:
            if have >= tokens:
                break
            parts.append(o[0].transpose(0, 1))
            have += o.shape[2]
        return self.torch.cat(parts, dim=0)[:tokens]


class SdpaFp32(SdpaKernel):
    name = "sdpa_fp32"
    fp32 = True

    def __init__(self, torch, case):
        super().__init__(torch, case, "EFFICIENT_ATTENTION", expand_kv=True)


class SdpaBf16Cudnn(SdpaKernel):
    name = "sdpa_bf16_cudnn"

    def __init__(self, torch, case):
        super().__init__(torch, case, "CUDNN_ATTENTION", expand_kv=False)


_COMPILED_FLEX = None


def compiled_flex(torch):
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


class FlexBf16(KernelBase):
    """torch.compile(flex_attention) on one packed sequence with a BlockMask."""

    name = "flex_bf16"

    def __init__(self, torch, case):
        super().__init__(torch, case)
        if case.pieces:
            raise Unavailable("pieces with fewer queries than keys: varlen_bf16 only")
        from torch.nn.attention.flex_attention import create_block_mask

        self.fn = compiled_flex(torch)
        T = case.tokens
        if len(case.doc_lens) == 1:
            def mask_mod(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx
            kind = "causal"
        else:
            doc_id = torch.repeat_interleave(
                torch.arange(len(case.doc_lens), device="cuda", dtype=torch.int32),
                torch.tensor(case.doc_lens, device="cuda"))

            def mask_mod(b, h, q_idx, kv_idx):
                return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)
            kind = "document-causal"
        kwargs = {}
        if "_compile" in inspect.signature(create_block_mask).parameters:
            kwargs["_compile"] = True  # no dense T x T mask in memory
        t0 = time.perf_counter()
        self.block_mask = create_block_mask(mask_mod, None, None, T, T, device="cuda", **kwargs)
        torch.cuda.synchronize()
        self.info["block_mask_s"] = time.perf_counter() - t0
        self.notes.append(f"{kind} BlockMask built once outside the timed region "
                          f"({self.info['block_mask_s']:.1f} s)")
        self.notes.append("torch.compile(flex_attention, dynamic=False), enable_gqa=True")

    def make_inputs(self, q, k, v):
        return [bhsd_leaf(q), bhsd_leaf(k), bhsd_leaf(v)]

    def forward(self, leaves):
        q, k, v = leaves
        return [self.fn(q, k, v, block_mask=self.block_mask, enable_gqa=True)]

    def output_prefix(self, outs, tokens):
        return outs[0][0, :, :tokens].transpose(0, 1)


class VarlenBf16(KernelBase):
    """torch.nn.attention.varlen.varlen_attn on packed [T, H, D] with cu_seq offsets."""

    name = "varlen_bf16"

    def __init__(self, torch, case):
        super().__init__(torch, case)
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as exc:
            raise Unavailable(f"torch.nn.attention.varlen.varlen_attn missing in torch "
                              f"{torch.__version__} ({exc})") from None
        self.fn = varlen_attn
        signature = inspect.signature(varlen_attn)
        params = signature.parameters
        self.info["signature"] = f"varlen_attn{signature}"
        self.kwargs = {}
        if "is_causal" in params:
            self.kwargs["is_causal"] = True
            self.notes.append("causal via is_causal=True")
        elif "window_size" in params:
            self.kwargs["window_size"] = (-1, 0)  # a tuple: varlen_attn compares with (-1, 0)
            self.notes.append("causal via window_size=(-1, 0)")
        else:
            raise Unavailable(f"varlen_attn has neither is_causal nor window_size: {signature}")
        self.cu_q, self.max_q = self.offsets(case.q_lens)
        self.cu_k, self.max_k = self.offsets(case.doc_lens)
        if "enable_gqa" in params:
            self.kwargs["enable_gqa"] = True
            self.notes.append("enable_gqa=True, KV not expanded")
        else:
            ok, why = self.probe_native_gqa()
            self.info["native_gqa_probe"] = why
            self.expand_kv = not ok
            if ok:
                self.notes.append("KV not expanded: 8 KV heads passed as is "
                                  "(no enable_gqa parameter; probe matched a float64 reference)")
            else:
                self.notes.append(f"GQA NOT SUPPORTED ({why}): KV heads expanded 8->32 "
                                  "(repeat_interleave) once, outside the timed region")

    def offsets(self, lens):
        torch = self.torch
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device="cuda"), max(lens)

    def call(self, q, k, v, cu_q, max_q, cu_k=None, max_k=None):
        if cu_k is None:
            cu_k, max_k = cu_q, max_q
        return self.fn(q, k, v, cu_q, cu_k, max_q, max_k, **self.kwargs)

    def probe_native_gqa(self):
        """Forward and backward with 8 KV heads on two small documents against float64."""
        torch = self.torch
        lens, D = [100, 60], self.case.head_dim
        T = sum(lens)
        gen = torch.Generator(device="cuda")
        gen.manual_seed(7)
        shapes = [(T, NUM_Q_HEADS, D), (T, NUM_KV_HEADS, D), (T, NUM_KV_HEADS, D)]
        leaves = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
                  for s in shapes]
        refs = [x.detach().double().requires_grad_(True) for x in leaves]
        cu_seq, max_len = self.offsets(lens)
        try:
            out = self.call(*leaves, cu_seq, max_len)
            grad = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
            got = torch.autograd.grad(out, leaves, grad)
        except Exception as exc:
            return False, "native GQA call failed: " + reason(exc)
        ref = reference_attention(torch, *refs, lens)
        ref_grads = torch.autograd.grad(ref, refs, grad.double())
        with torch.no_grad():
            errors = [rel_error(out, ref)] + [rel_error(g, r) for g, r in zip(got, ref_grads)]
        worst = max(errors)
        if not math.isfinite(worst) or worst > 5e-2:
            return False, f"native GQA gives wrong results (rel err out/dq/dk/dv {errors})"
        return True, f"native GQA ok (rel err out/dq/dk/dv {['%.1e' % e for e in errors]})"

    def make_inputs(self, q, k, v):
        if self.expand_kv:
            k = k.repeat_interleave(GQA_GROUP, dim=1)
            v = v.repeat_interleave(GQA_GROUP, dim=1)
        return [x.contiguous().requires_grad_(True) for x in (q, k, v)]

    def forward(self, leaves):
        return [self.call(*leaves, self.cu_q, self.max_q, self.cu_k, self.max_k)]

    def output_prefix(self, outs, tokens):
        return outs[0][:tokens]


KERNEL_CLASSES = {cls.name: cls for cls in (SdpaFp32, SdpaBf16Cudnn, FlexBf16, VarlenBf16)}


# ----------------------------------------------------------------------------- one case x kernel


def make_input_sets(torch, kernel, n_sets, seed):
    """n_sets input sets in the kernel's layout, and set 0's canonical first tokens."""
    case = kernel.case
    T, TQ, D, S = case.tokens, case.q_tokens, case.head_dim, case.check_tokens
    sets, prefix = [], None
    for i in range(n_sets):
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed + 1000 * i)
        q = torch.randn(TQ, NUM_Q_HEADS, D, device="cuda", dtype=kernel.dtype, generator=gen)
        k = torch.randn(T, NUM_KV_HEADS, D, device="cuda", dtype=kernel.dtype, generator=gen)
        v = torch.randn(T, NUM_KV_HEADS, D, device="cuda", dtype=kernel.dtype, generator=gen)
        if i == 0:
            # a piece's first S queries see up to their whole key prefix
            prefix = (q[:S].clone(), k.clone(), v.clone()) if case.pieces else tuple(x[:S].clone() for x in (q, k, v))
        sets.append(kernel.make_inputs(q, k, v))
        del q, k, v
    return sets, prefix


def measure_backward(torch, kernel, sets, grads, settings, flop):
    outs = [kernel.forward(s) for s in sets]

    def run_retained(i):
        j = i % len(sets)
        torch.autograd.grad(outs[j], sets[j], grads[j], retain_graph=True)

    try:
        samples, iters = time_calls(torch, run_retained, settings)
        return tflops_summary(samples, iters, flop,
                              mode="retained graph, autograd.grad(retain_graph=True) per call")
    except Exception as exc:
        why = reason(exc)
    outs.clear()
    release(torch)

    def prepare(i):
        j = i % len(sets)
        return j, kernel.forward(sets[j])

    def run_fresh(state):
        j, out = state
        torch.autograd.grad(out, sets[j], grads[j])

    samples, iters = time_calls(torch, run_fresh, settings, prepare=prepare)
    return tflops_summary(samples, iters, flop,
                          mode=f"untimed forward per call, events around the backward "
                               f"(retained graph failed: {why})")


def run_case_kernel(torch, case, name, settings, seed, l2_bytes):
    result = {"case": case.name, "kernel": name, "label": name, "status": "ok", "notes": []}
    sets = prefix = outs = grads = None
    try:
        kernel = KERNEL_CLASSES[name](torch, case)
        result["label"], result["notes"], result["info"] = kernel.label, kernel.notes, kernel.info
        set_bytes = kernel.input_bytes()
        n_sets = 3 if set_bytes <= 2 * l2_bytes else 1
        result["input_set_bytes"], result["input_sets"] = set_bytes, n_sets
        sets, prefix = make_input_sets(torch, kernel, n_sets, seed)
        t0 = time.perf_counter()
        outs = kernel.forward(sets[0])
        torch.cuda.synchronize()
        result["first_fwd_s"] = time.perf_counter() - t0
    except Exception as exc:
        result["status"] = "unavailable: " + reason(exc)
        sets = prefix = outs = None
        release(torch)
        return result

    try:  # precision sanity on the first tokens of set 0
        with torch.no_grad():
            got = kernel.output_prefix(outs, case.check_tokens)
            if case.pieces:
                ref = reference_piece(torch, *(x.double() for x in prefix), case.q_lens[0])
            else:
                ref = reference_attention(torch, *(x.double() for x in prefix), case.check_lens())
            result["fwd_rel_err"] = rel_error(got, ref)
            got = ref = None
    except Exception as exc:
        result["fwd_rel_err_status"] = "unavailable: " + reason(exc)
    result["check_tokens"] = case.check_tokens
    prefix = None
    release(torch)

    try:
        result["fwd"] = tflops_summary(
            *time_calls(torch, lambda i: kernel.forward(sets[i % len(sets)]), settings),
            case.fwd_flop, mode="events around a loop of forward calls")
    except Exception as exc:
        result["fwd"] = {"status": "unavailable: " + reason(exc)}
    release(torch)

    try:
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed + 7)
        grads = [[torch.randn(o.shape, device="cuda", dtype=o.dtype, generator=gen) for o in outs]
                 for _ in sets]
        t0 = time.perf_counter()
        torch.autograd.grad(outs, sets[0], grads[0])
        torch.cuda.synchronize()
        result["first_bwd_s"] = time.perf_counter() - t0
        outs = None
        result["bwd"] = measure_backward(torch, kernel, sets, grads, settings, case.bwd_flop)
    except Exception as exc:
        result["bwd"] = {"status": "unavailable: " + reason(exc)}
    sets = outs = grads = kernel = None
    release(torch)
    return result


# ----------------------------------------------------------------------------- report


def fmt_rate(part, key="tflops"):
    if not part or "status" in part:
        return "unavailable"
    return f"{part[key]['median']:.1f}"


def fmt_spread(part):
    if not part or "status" in part:
        return "-"
    return f"{part['spread_pct']:.1f}%"


def describe_result(r):
    if r["status"] != "ok":
        return f"[{r['case']}] {r['label']}: {r['status']}"
    pieces = []
    for key in ("fwd", "bwd"):
        part = r.get(key, {})
        if "status" in part:
            pieces.append(f"{key} {part['status']}")
        else:
            pieces.append(f"{key} {part['time_ms']['median']:.3f} ms = {part['tflops']['median']:.1f} "
                          f"TFLOP/s (spread {part['spread_pct']:.1f}%, {part['repeats']}x"
                          f"{part['iters_per_repeat']})")
    err = r.get("fwd_rel_err")
    pieces.append(f"fwd rel err {err:.2e}" if err is not None else
                  f"fwd rel err {r.get('fwd_rel_err_status', 'n/a')}")
    return f"[{r['case']}] {r['label']}: " + "; ".join(pieces)


def print_ceilings(ceilings):
    for key in ("matmul_bf16", "matmul_fp32_tf32_off", "matmul_fp32_tf32_on"):
        part = ceilings.get(key, {})
        log(f"  {key:22s} {fmt_rate(part):>10s} TFLOP/s  (spread {fmt_spread(part)})"
            + (f"  {part['status']}" if "status" in part else ""))
    part = ceilings.get("copy_d2d", {})
    log(f"  {'copy_d2d':22s} {fmt_rate(part, 'gbps'):>10s} GB/s     (spread {fmt_spread(part)})"
        + (f"  {part['status']}" if "status" in part else ""))


def print_table(results):
    head = f"{'case':12s}  {'kernel':38s} {'fwd TFLOP/s':>11s} {'bwd TFLOP/s':>11s} " \
           f"{'spread fwd/bwd':>15s} {'fwd rel err':>11s}"
    log(head)
    log("-" * len(head))
    for r in results:
        if r["status"] != "ok":
            log(f"{r['case']:12s}  {r['label']:38s} {r['status']}")
            continue
        fwd, bwd = r.get("fwd", {}), r.get("bwd", {})
        err = r.get("fwd_rel_err")
        log(f"{r['case']:12s}  {r['label']:38s} {fmt_rate(fwd):>11s} {fmt_rate(bwd):>11s} "
            f"{fmt_spread(fwd) + '/' + fmt_spread(bwd):>15s} "
            f"{(f'{err:.1e}' if err is not None else 'n/a'):>11s}")
        for key, part in (("fwd", fwd), ("bwd", bwd)):
            if "status" in part:
                log(f"{'':6s}{key} {part['status']}")


# ----------------------------------------------------------------------------- main


def csv_choice(allowed):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return [t for t in allowed if t in items]
    return parse


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="PyTorch attention baselines (SDPA, FlexAttention, varlen_attn) for causal "
                    "GQA (32 query / 8 KV heads) on one GPU: useful TFLOP/s forward and backward, "
                    "plus matmul and copy ceilings. FLOP convention: forward = 4*D*32*sum n(n+1)/2, "
                    "backward = 2.5 x forward.")
    p.add_argument("--cases", type=csv_choice(CASES), default=["a", "b", "c"],
                   help="cases to run: a (8192 tokens, D=128), b (65536 packed tokens, D=128), "
                        "c (8192 tokens, D=64), d (the CP-piece grid, varlen_bf16 only); default a,b,c")
    p.add_argument("--kernels", type=csv_choice(KERNELS), default=list(KERNELS),
                   help=f"kernels to run; default {','.join(KERNELS)}")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per measurement, >= 5 (default 7, 5 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="shorter warm-up and timed loops (about 25 ms per repeat instead of 100 ms)")
    p.add_argument("--json", metavar="PATH",
                   help="write all numbers, units and device/torch metadata to PATH (atomically)")
    p.add_argument("--skip-ceilings", action="store_true",
                   help="do not measure the matmul and copy ceilings")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random inputs (default 1234)")
    p.add_argument("--case-b-file", metavar="PATH", default=CASE_B_FILE,
                   help="case-b document lengths, one per line, '#' comments "
                        "(default: attention_case_b.txt next to this script)")
    p.add_argument("--make-case-b", action="store_true",
                   help="regenerate the case-b lengths file (needs numpy, not torch) and exit")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 5 if args.quick else 7
    if args.repeats < 5:
        p.error("--repeats must be >= 5")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.make_case_b:
        make_case_b_file(args.case_b_file)
        return 0

    cases = build_cases(args.cases, args.case_b_file)
    try:
        import torch
    except ImportError as exc:
        log(f"attention_torch.py: needs PyTorch with CUDA ({exc})")
        return 2

    if not torch.cuda.is_available():
        log("attention_torch.py: no CUDA device visible to torch")
        return 2
    try:  # AOTAutograd's donated buffers refuse backward(retain_graph=True) on compiled graphs
        import torch._functorch.config as functorch_config
        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
    except Exception:
        pass

    settings = Settings(args.repeats, args.quick)
    t_start = time.perf_counter()
    meta = device_meta(torch)
    l2_bytes = meta["l2_cache_bytes"] or L2_FALLBACK_BYTES
    log(f"{meta['gpu']} (sm {meta['compute_capability']}, {meta['sm_count']} SMs, "
        f"L2 {l2_bytes / 2**20:.0f} MiB), torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"cuDNN {meta['cudnn']}, triton {meta['triton']}, Python {meta['python']}")
    log(f"FLOP convention: {FLOP_CONVENTION}")
    for case in cases:
        log(f"case {case.name}: {case.description}; pairs {case.pairs}, fwd {case.fwd_flop / 1e9:.1f} "
            f"GFLOP, bwd {case.bwd_flop / 1e9:.1f} GFLOP")

    ceilings = {}
    if not args.skip_ceilings:
        log("ceilings:")
        ceilings = measure_ceilings(torch, settings, args.seed)
        print_ceilings(ceilings)

    results = []
    for case in cases:
        for name in args.kernels:
            r = run_case_kernel(torch, case, name, settings, args.seed, l2_bytes)
            results.append(r)
            log(describe_result(r))
            for note in r.get("notes", []):
                log(f"    {note}")

    elapsed = time.perf_counter() - t_start
    if args.json:
        doc = {
            "schema": "wlb-attention-torch/1",
            "meta": meta,
            "settings": settings.to_json(),
            "flop_convention": FLOP_CONVENTION,
            "units": UNITS,
            "cases": {c.name: c.to_json() for c in cases},
            "ceilings": ceilings,
            "results": results,
            "elapsed_s": elapsed,
        }
        write_atomic(args.json, json.dumps(finite_or_none(doc), indent=1, allow_nan=False) + "\n")
        log(f"wrote {args.json}")

    log("")
    log(f"{meta['gpu']}, torch {meta['torch']}, cuDNN {meta['cudnn']}; run took {elapsed:.0f} s")
    if ceilings:
        log("ceilings:")
        print_ceilings(ceilings)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
