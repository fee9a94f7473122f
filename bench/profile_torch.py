#!/usr/bin/env python3
"""Measure a wlb hardware profile on a GPU with PyTorch: the kernels a PyTorch trainer runs.

Writes the profile JSON that the cost model reads (docs/profile-format.md, format
"wlb-hardware-profile" version 1), like `wlb profile` does for wlb's own CPU kernels, but
timing PyTorch's BF16 kernels on one GPU for one model's TP-sharded shapes. A deck then
uses it with `[hardware] profile = "FILE"` or `--set hardware.profile=FILE`.

What it measures
----------------
attention (fields attention.fwd / attention.bwd)
    BF16 causal grouped-query attention of ONE TP rank: heads/tp query heads and
    max(1, kv_heads/tp) KV heads (KV heads are replicated when kv_heads < tp), head_dim
    from the deck (hidden / heads) or --head-dim. One cell per (q, k) of the grid: a
    *piece* of q queries whose keys are the k >= q tokens of its document prefix, causal
    aligned bottom-right (query j of the piece sees keys [0, k - q + j]), exactly the
    pieces `wlb profile` times (src/profile/profiler.cpp) and the cost model prices
    (CostModel::attnSeconds looks the table up at (q, q0 + q)). Forward and backward are
    timed separately; the backward is autograd's backward of the attention output for a
    fixed random output gradient (graph retained, forward not timed).

    Kernel: torch.nn.attention.varlen.varlen_attn on packed [tokens, heads, D] with int32
    cu_seq offsets (causal through is_causal=True or window_size=(-1, 0), whichever its
    signature has; GQA passed natively, KV expanded only if native GQA fails the check).
    Before any timing every kernel is checked against a float64 reference (output and
    dq, dk, dv) on a small square piece and a small piece with q < k; a kernel that fails
    (e.g. top-left instead of bottom-right alignment) is not used for that kind of cell and
    the next one of the chain is tried:
        varlen_attn -> SDPA + causal_lower_right (flash / efficient, chosen by PyTorch)
                    -> SDPA cuDNN backend, enable_gqa, explicit bottom-right bool mask
                    -> SDPA default dispatch, enable_gqa, explicit bool mask
    (--kernel sdpa-cudnn / sdpa-flash start the chain at that SDPA kernel instead; on
    square cells the SDPA kernels use is_causal=True.) The JSON records which kernel
    measured every cell: attention.fwd.kernels / attention.bwd.kernels (same shape as
    gflops; extra keys the wlb reader ignores) and measured.attention.cells.

    Throughput convention (identical to `wlb profile` and the cost model):
        padded pairs(q, k) = paddedPairs from src/attention/flops.hpp with the profile's
                             tile_q x tile_k (every query tile visits every key tile up to
                             the limit of its last valid row, counted as whole tiles)
        forward FLOPs      = 4 * padded pairs * head_dim * (heads / tp)
        backward FLOPs     = 2.5 * forward FLOPs
        gflops[i][j]       = FLOPs of one piece / seconds per piece / 1e9
    Cells with k < q hold the value at k = q (the cost model ignores them).

    Batching: one piece does not fill a GPU, so each timed call runs B identical,
    independent pieces (B sequences of one varlen call, or batch B for SDPA), with
    B = ceil(--tokens / q) (default 16384 query tokens per call, i.e. at least
    tokens/tile_q x heads query-tile blocks), capped by a memory budget (--max-mem-gb) for
    long key prefixes; per-piece time = call time / B. A call whose GPU time is not well
    above the host time to issue it (launch-bound: Python/autograd overhead, not the
    kernel) is re-measured with 2B, 4B, up to 8B pieces. `wlb profile` does the same on
    the CPU with B = 4e6 / padded pairs. B of every cell is in measured.attention.cells.

linear_gflops
    BF16 torch.matmul of the layer's TP-sharded GEMMs for --gemm-tokens tokens (default
    16384), with the shapes the cost model counts (CostModel::linearFlops):
        qkv  [T, h] x [h, (heads + 2 kv_heads) * head_dim / tp]   (column parallel)
        o    [T, heads * head_dim / tp] x [.., h]                  (row parallel)
        fc1  [T, h] x [h, 2 ffn / tp]     (SwiGLU gate and up, fused as in Megatron)
        fc2  [T, ffn / tp] x [.., h]
    Forward y = x W^T (nn.Linear layout); backward dgrad dy W and wgrad dy^T x are timed
    too. The format has one linear throughput, used for forward and backward alike, so
    linear_gflops = FLOP-weighted harmonic mean (total FLOPs / total time) of the forward
    GEMMs (--linear-from step: of forward + dgrad + wgrad). All GEMMs are in measured.gemm.

Carried over from the base profile (--base, default: the profile the deck names)
    links (tp/cp/pp/dp bandwidth, latency), topology, memory_gb and peak_gflops (the
    datasheet peak; without a base: peak = measured 8192^3 BF16 matmul, memory = device
    memory). One GPU cannot measure links; notes and measured.fields_* say which field
    came from where. attention_efficiency is not written (1.0): calibrate it from run
    traces like linear_gflops (docs/performance.md, docs/profile-format.md).

Timing
------
CUDA events around a loop of calls on the current stream, after a first untimed call
(cuDNN graph builds, allocations) and a time-based warm-up; each repeat runs enough calls
to last --target-ms; the value kept is the MEDIAN per-call time over --repeats repeats
(`wlb profile` keeps the best of its repetitions). Calls reuse one input set (warm caches,
like `wlb profile`). Inputs are standard normal BF16 (never zeros), seeded.

Grid
----
Default q_lens 16, 64, 256, 1024, 4096, 16384, 65536 and k_lens 16, 64, 256, 1024, 4096,
16384, 65536, 131072: `wlb profile`'s default grid (q up to 4096, k up to 16384) extended
by the same x4 steps to the 64K/128K windows of the paper decks (the cost model clamps
outside the grid). --quick uses `wlb profile --quick`'s grid (q 16, 128, 1024; k 16, 128,
1024, 4096) with fewer repeats (a smoke run, not a profile to use). --q-lens / --k-lens
override. Estimated 1-2 minutes on an H100 for the default grid and a paper deck (35
measured cells, the largest q=65536 k=131072 about 2 s; GEMMs a few seconds).

Usage
-----
    python3 bench/profile_torch.py --deck inputs/paper/7b-128k.toml \\
        --out inputs/profiles/h100-torch-7b-tp8.json
    python3 bench/profile_torch.py --heads 32 --kv-heads 8 --hidden 4096 --ffn 14336 \\
        --tp 8 --base inputs/profiles/h100-sxm.json --out prof.json --name h100-llama3-8b
    wlb simulate inputs/paper/7b-128k.toml --set hardware.profile=inputs/profiles/h100-torch-7b-tp8.json

--base defaults to the profile the deck's [hardware] profile names (resolved like wlb:
relative to the deck, then the working directory, then the repository root).

--dry-run is FORMAT VALIDATION ONLY: it needs neither torch nor a GPU, measures nothing,
and fills every "measured" field from a simple synthetic roofline formula (clearly
labelled "source": "dry-run (not measured)", name prefixed "dry-run-"), so that the JSON
writer can be checked against wlb's own reader (`wlb simulate DECK --set
hardware.profile=THAT_FILE`). Never use a dry-run file as a profile.

Needs Python 3.11+ for --deck (tomllib; or the tomli package) and PyTorch 2.x with CUDA
for a real run (varlen_attn: PyTorch 2.10 or later; SDPA fallbacks otherwise).
"""

import argparse
import datetime
import gc
import inspect
import json
import math
import os
import platform
import re
import statistics
import sys
import time

FORMAT = "wlb-hardware-profile"
SCRIPT = "bench/profile_torch.py"
DRY_RUN_SOURCE = "dry-run (not measured)"

DEFAULT_Q_LENS = [16, 64, 256, 1024, 4096, 16384, 65536]
DEFAULT_K_LENS = [16, 64, 256, 1024, 4096, 16384, 65536, 131072]
QUICK_Q_LENS = [16, 128, 1024]
QUICK_K_LENS = [16, 128, 1024, 4096]

ATTN_BWD_FACTOR = 2.5      # model::kAttnBwdFactor
MASK_LIMIT = 1 << 30       # largest explicit q x k bool mask an SDPA fallback may build
PROBE_TOL = 5e-2           # relative Frobenius error against float64 (bf16 gives ~3e-3)
LAUNCH_BOUND = 0.7         # host issue time / GPU time above which a call is launch-bound
MAX_GROWTH = 8             # launch-bound cells may use up to 8x the pieces --tokens gives

# `[model]` / `[mesh]` defaults of wlb decks (src/core/deck.hpp).
DECK_DEFAULTS = {"name": "small", "hidden": 512, "heads": 8, "kv_heads": 8, "ffn": 1408, "tp": 1}

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


class Unavailable(RuntimeError):
    """A kernel (or one variant of it) cannot run a cell or failed its check."""


# ----------------------------------------------------------------------------- FLOPs


def padded_pairs(nq, nk, tile_q, tile_k):
    """Port of wlb::attention::paddedPairs (src/attention/flops.hpp): pairs the tiled kernel
    visits for a piece of nq queries over nk >= nq keys, bottom-right causal: for each query
    tile, every key tile up to the limit of its last valid row, as whole tile_q x tile_k."""
    off = nk - nq
    pairs = 0
    for q0 in range(0, nq, tile_q):
        last = min(q0 + tile_q, nq) - 1
        ktiles = (off + last) // tile_k + 1
        pairs += ktiles * tile_q * tile_k
    return pairs


def useful_pairs(nq, nk):
    """wlb::attention::usefulPairs: nq*(nk-nq) + nq*(nq+1)/2."""
    return nq * (nk - nq) + nq * (nq + 1) // 2


def forward_flops(pairs, heads, head_dim):
    return 4.0 * pairs * heads * head_dim


# ----------------------------------------------------------------------------- shapes


class Shapes:
    """The model's shapes and the per-TP-rank shapes the kernels run."""

    def __init__(self, name, hidden, heads, kv_heads, head_dim, ffn, tp):
        self.name, self.hidden, self.heads, self.kv_heads = name, hidden, heads, kv_heads
        self.head_dim, self.ffn, self.tp = head_dim, ffn, tp
        for key in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "tp"):
            if getattr(self, key) < 1:
                raise SystemExit(f"profile_torch.py: {key} must be >= 1, got {getattr(self, key)}")
        if heads % kv_heads:
            raise SystemExit(f"profile_torch.py: kv_heads = {kv_heads} must divide heads = {heads}")
        if heads % tp:
            raise SystemExit(f"profile_torch.py: tp = {tp} must divide heads = {heads}")
        self.heads_local = heads // tp
        # KV heads per rank: sharded when tp divides kv_heads, replicated (1) when kv < tp.
        kv = max(1, -(-kv_heads // tp))
        while self.heads_local % kv:
            kv -= 1
        self.kv_local = kv
        self.gemm_notes = []

    def gemms(self):
        """(name, K, N) of the layer's forward GEMMs y[T, N] = x[T, K] W^T on one TP rank,
        counted as CostModel::linearFlops counts them."""
        h, D, tp = self.hidden, self.head_dim, self.tp

        def per_rank(n, what):
            if n % tp:
                self.gemm_notes.append(f"{what} = {n} not divisible by tp = {tp}: rounded")
            return max(1, round(n / tp))

        self.gemm_notes = []
        return [
            ("qkv", h, per_rank((self.heads + 2 * self.kv_heads) * D, "qkv width")),
            ("o", per_rank(self.heads * D, "attention width"), h),
            ("fc1", h, per_rank(2 * self.ffn, "2*ffn")),
            ("fc2", per_rank(self.ffn, "ffn"), h),
        ]

    def to_json(self):
        return {"model": self.name, "hidden": self.hidden, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "ffn": self.ffn,
                "tp": self.tp, "heads_per_rank": self.heads_local,
                "kv_heads_per_rank": self.kv_local}

    def describe(self):
        return (f"{self.name}: hidden {self.hidden}, heads {self.heads}, kv_heads {self.kv_heads}, "
                f"head_dim {self.head_dim}, ffn {self.ffn}, tp {self.tp} -> per rank "
                f"{self.heads_local} query / {self.kv_local} KV heads")


def load_toml(path):
    try:
        import tomllib
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            raise SystemExit("profile_torch.py: --deck needs Python 3.11+ (tomllib) or the tomli "
                             "package; or pass --hidden --heads --kv-heads --ffn --tp") from None
    with open(path, "rb") as f:
        return tomllib.load(f)


def resolve_profile_path(name, deck_path):
    """A deck's [hardware] profile, searched like HardwareProfile::fromDeck."""
    if not name or name == "analytic":
        return None
    if os.path.isabs(name):
        return name if os.path.exists(name) else None
    for base in (os.path.dirname(os.path.abspath(deck_path)), os.getcwd(), REPO_ROOT):
        p = os.path.join(base, name)
        if os.path.exists(p):
            return p
    return None


def shapes_from_args(args):
    deck, deck_profile = {}, None
    if args.deck:
        doc = load_toml(args.deck)
        model, mesh = doc.get("model", {}), doc.get("mesh", {})
        deck = {k: model.get(k, DECK_DEFAULTS[k]) for k in ("name", "hidden", "heads", "kv_heads", "ffn")}
        deck["tp"] = mesh.get("tp", DECK_DEFAULTS["tp"])
        sweep = doc.get("sweep", {})
        touched = [k for k in sweep if k.startswith("model.") or k == "mesh.tp"]
        if touched:
            log(f"warning: {args.deck} sweeps {', '.join(touched)}; using the deck's base values")
        deck_profile = doc.get("hardware", {}).get("profile")
    elif args.hidden is None or args.heads is None or args.ffn is None:
        raise SystemExit("profile_torch.py: give --deck, or at least --hidden --heads --ffn "
                         "(and --kv-heads --tp --head-dim as needed)")

    def pick(key, cli):
        return cli if cli is not None else deck.get(key, DECK_DEFAULTS.get(key))

    hidden, heads = pick("hidden", args.hidden), pick("heads", args.heads)
    kv_heads = pick("kv_heads", args.kv_heads if args.kv_heads is not None else
                    (None if args.deck else heads))
    head_dim = args.head_dim if args.head_dim is not None else hidden // heads
    if args.head_dim is None and hidden % heads:
        raise SystemExit(f"profile_torch.py: heads = {heads} must divide hidden = {hidden} "
                         "(wlb derives head_dim = hidden / heads); or pass --head-dim")
    if args.head_dim is not None and heads * args.head_dim != hidden:
        log(f"warning: heads x head_dim = {heads * args.head_dim} != hidden = {hidden}; wlb decks "
            "derive head_dim = hidden / heads, so the cost model will count other FLOPs")
    name = args.model_name or deck.get("name") or "model"
    shapes = Shapes(str(name), int(hidden), int(heads), int(kv_heads), int(head_dim),
                    int(pick("ffn", args.ffn)), int(pick("tp", args.tp)))
    base = args.base
    if base is None and deck_profile:
        base = resolve_profile_path(deck_profile, args.deck)
        if base is None and deck_profile != "analytic":
            log(f"warning: the deck's profile {deck_profile!r} was not found; no base profile")
    return shapes, base


# ----------------------------------------------------------------------------- base profile


def load_base(path):
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            base = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"profile_torch.py: --base {path}: {exc}") from None
    if not isinstance(base, dict) or base.get("format") != FORMAT or base.get("version") != 1:
        raise SystemExit(f"profile_torch.py: --base {path}: not a {FORMAT} version 1 file")
    return base


# ----------------------------------------------------------------------------- timing


class Settings:
    def __init__(self, repeats, target_ms, warmup_ms):
        self.repeats, self.target_ms, self.warmup_ms = repeats, target_ms, warmup_ms
        self.min_warmup, self.max_warmup, self.max_iters = 2, 30, 1000

    def to_json(self):
        return {"repeats": self.repeats, "target_ms_per_repeat": self.target_ms,
                "warmup_ms": self.warmup_ms, "statistic": "median per-call time over repeats"}


def time_calls(torch, fn, s):
    """Median per-call milliseconds of fn() (CUDA events around loops of calls), the samples,
    calls per repeat, and host/GPU: host time to issue a call over its GPU time, on a short
    loop that cannot fill the launch queue (near 1 = the call is launch-bound, the GPU
    waits for Python)."""
    fn()
    torch.cuda.synchronize()
    est, n, t_begin = float("inf"), 0, time.perf_counter()
    while n < s.min_warmup or ((time.perf_counter() - t_begin) * 1e3 < s.warmup_ms and n < s.max_warmup):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est = min(est, (time.perf_counter() - t0) * 1e3)
        n += 1
    iters = max(1, min(s.max_iters, math.ceil(s.target_ms / max(est, 1e-3))))
    n_probe = max(1, min(16, iters))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    for _ in range(n_probe):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    host_over_gpu = host_ms / max(start.elapsed_time(end), 1e-6)
    samples = []
    for _ in range(s.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples), samples, iters, host_over_gpu


def time_backward_fresh(torch, forward, leaves, grad, s):
    """Fallback when a kernel refuses a retained graph: an untimed forward before every
    call, CUDA events around the backward alone, summed."""
    def sample(iters):
        total = 0.0
        for _ in range(iters):
            out = forward()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.autograd.grad(out, leaves, grad)
            end.record()
            end.synchronize()
            total += start.elapsed_time(end)
        return total / iters

    est = min(sample(1) for _ in range(s.min_warmup + 1))
    iters = max(1, min(100, math.ceil(s.target_ms / max(est, 1e-3))))
    samples = [sample(iters) for _ in range(s.repeats)]
    return statistics.median(samples), samples, iters, None


def spread_pct(samples):
    med = statistics.median(samples)
    return 100.0 * (max(samples) - min(samples)) / med if med > 0 else 0.0


def is_oom(torch, exc):
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def release(torch):
    gc.collect()
    torch.cuda.empty_cache()


def reason(exc):
    first = (str(exc).strip().splitlines() or [""])[0]
    text = first if isinstance(exc, Unavailable) else (f"{type(exc).__name__}: {first}" if first
                                                         else type(exc).__name__)
    return text if len(text) <= 200 else text[:197] + "..."


# ----------------------------------------------------------------------------- kernels


def reference(torch, q, k, v, nq, nk):
    """Float64 bottom-right causal GQA attention on canonical [B, n, heads, D] tensors."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    rows = torch.arange(nq, device=q.device).unsqueeze(1)
    cols = torch.arange(nk, device=q.device).unsqueeze(0)
    allowed = cols <= rows + (nk - nq)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def rel_error(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()


class Kernel:
    """One attention kernel. make() returns (leaves, forward, canon) for B identical pieces:
    leaves q, k, v (requires grad), forward() -> output, canon(t, n) -> [B, n, heads, D]."""

    key = ""
    description = ""

    def __init__(self, torch, shapes):
        self.torch, self.H, self.Hk, self.D = torch, shapes.heads_local, shapes.kv_local, shapes.head_dim
        self.checked = {}    # rect -> expand_kv (bool) or None when unusable
        self.check_log = {}  # rect -> text

    def variants(self):
        return [False, True] if self.Hk < self.H else [False]

    def kv_heads(self, expand):
        return self.H if expand else self.Hk

    def cell_name(self, rect, expand):
        raise NotImplementedError

    def make(self, B, nq, nk, rect, expand, gen):
        raise NotImplementedError

    def randn(self, shape, gen):
        t = self.torch
        return t.randn(shape, device="cuda", dtype=t.bfloat16, generator=gen).requires_grad_(True)

    def usable(self, rect):
        """Check once (per square / rectangular cells) against float64; the first variant
        (native GQA, then expanded KV) that matches is kept."""
        if rect in self.checked:
            return self.checked[rect] is not None
        torch = self.torch
        nq, nk = (96, 200) if rect else (160, 160)
        notes = []
        self.checked[rect] = None
        for expand in self.variants():
            label = "expanded KV" if expand else "native GQA" if self.Hk < self.H else "MHA"
            try:
                gen = torch.Generator(device="cuda")
                gen.manual_seed(11)
                leaves, forward, canon = self.make(2, nq, nk, rect, expand, gen)
                out = forward()
                grad = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
                grads = torch.autograd.grad(out, leaves, grad)
                ref_in = [canon(x.detach(), n).double().requires_grad_(True)
                          for x, n in zip(leaves, (nq, nk, nk))]
                ref = reference(torch, *ref_in, nq, nk)
                ref_grads = torch.autograd.grad(ref, ref_in, canon(grad, nq).double())
                with torch.no_grad():
                    errs = [rel_error(canon(out, nq), ref)] + [
                        rel_error(canon(g, n), r) for g, n, r in zip(grads, (nq, nk, nk), ref_grads)]
                worst = max(errs)
                text = f"{label}: rel err out/dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs)
                if math.isfinite(worst) and worst <= PROBE_TOL:
                    self.checked[rect] = expand
                    notes.append(text + " ok")
                    break
                notes.append(text + " WRONG")
            except Exception as exc:  # a variant the kernel refuses
                notes.append(f"{label}: {reason(exc)}")
            finally:
                release(torch)
        kind = f"q<k piece ({nq}x{nk})" if rect else f"square piece ({nq})"
        self.check_log[rect] = f"{self.key} on {kind}: " + "; ".join(notes)
        log("  check " + self.check_log[rect])
        return self.checked[rect] is not None


class VarlenKernel(Kernel):
    key = "varlen_attn"

    def __init__(self, torch, shapes):
        super().__init__(torch, shapes)
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as exc:
            raise Unavailable(f"torch.nn.attention.varlen.varlen_attn missing in torch "
                              f"{torch.__version__} ({exc})") from None
        self.fn = varlen_attn
        sig = inspect.signature(varlen_attn)
        params = sig.parameters
        self.signature = f"varlen_attn{sig}"
        self.kwargs = {}
        if "is_causal" in params:
            self.kwargs["is_causal"] = True
            causal = "is_causal=True"
        elif "window_size" in params:
            self.kwargs["window_size"] = (-1, 0)
            causal = "window_size=(-1, 0)"
        else:
            raise Unavailable(f"varlen_attn has neither is_causal nor window_size: {sig}")
        self.native_gqa_kw = "enable_gqa" in params
        self.description = (f"torch.nn.attention.varlen.varlen_attn, packed [tokens, heads, D], "
                            f"int32 cu_seq offsets, causal via {causal}")

    def cell_name(self, rect, expand):
        return "varlen_attn" + ("+expand_kv" if expand else "")

    def make(self, B, nq, nk, rect, expand, gen):
        torch, H, D = self.torch, self.H, self.D
        Hk = self.kv_heads(expand)
        q = self.randn((B * nq, H, D), gen)
        k = self.randn((B * nk, Hk, D), gen)
        v = self.randn((B * nk, Hk, D), gen)
        cu_q = (torch.arange(B + 1, device="cuda", dtype=torch.int32) * nq).contiguous()
        cu_k = (torch.arange(B + 1, device="cuda", dtype=torch.int32) * nk).contiguous()
        kw = dict(self.kwargs)
        if self.native_gqa_kw and Hk < H:
            kw["enable_gqa"] = True
        fn = self.fn

        def forward():
            return fn(q, k, v, cu_q, cu_k, nq, nk, **kw)

        def canon(t, n):
            return t.reshape(B, n, t.shape[-2], t.shape[-1])

        return [q, k, v], forward, canon


class SdpaKernel(Kernel):
    """F.scaled_dot_product_attention on [B, heads, n, D]."""

    def __init__(self, torch, shapes, mode):
        super().__init__(torch, shapes)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.mode = mode  # "flash" | "cudnn" | "mask"
        self.sdpa = torch.nn.functional.scaled_dot_product_attention
        self.sdpa_kernel = sdpa_kernel
        # enable_gqa exists since PyTorch 2.5; builtins may hide their signature (then try it).
        self.gqa_kw = ("enable_gqa" in inspect.signature(self.sdpa).parameters
                       if _has_signature(self.sdpa) else True)
        if mode == "flash":
            self.key = "sdpa_flash"
            self.backend = getattr(SDPBackend, "FLASH_ATTENTION", None)
            self.description = ("F.scaled_dot_product_attention: square cells is_causal=True with the "
                                "FLASH_ATTENTION backend; q<k cells attn_mask=causal_lower_right(q, k) "
                                "(torch.nn.attention.bias; PyTorch picks flash or efficient attention)")
        elif mode == "cudnn":
            self.key = "sdpa_cudnn"
            self.backend = getattr(SDPBackend, "CUDNN_ATTENTION", None)
            self.description = ("F.scaled_dot_product_attention, CUDNN_ATTENTION backend: square cells "
                                "is_causal=True; q<k cells an explicit bottom-right bool attn_mask")
        else:
            self.key = "sdpa_mask"
            self.backend = None
            self.description = ("F.scaled_dot_product_attention, PyTorch's default dispatch: square "
                                "cells is_causal=True; q<k cells an explicit bottom-right bool attn_mask")
        if mode != "mask" and self.backend is None:
            raise Unavailable(f"SDPBackend has no {mode} backend in torch {torch.__version__}")

    def cell_name(self, rect, expand):
        name = self.key
        if rect:
            name += "+lower_right" if self.mode == "flash" else "+mask"
        return name + ("+expand_kv" if expand else "")

    def make(self, B, nq, nk, rect, expand, gen):
        torch, H, D = self.torch, self.H, self.D
        Hk = self.kv_heads(expand)
        if rect and self.mode != "flash" and nq * nk > MASK_LIMIT:
            raise Unavailable(f"explicit {nq}x{nk} mask over the {MASK_LIMIT} element limit")
        q = self.randn((B, H, nq, D), gen)
        k = self.randn((B, Hk, nk, D), gen)
        v = self.randn((B, Hk, nk, D), gen)
        kw = {"enable_gqa": True} if (Hk < H and self.gqa_kw) else {}
        sdpa, ctx, backend = self.sdpa, self.sdpa_kernel, self.backend
        if not rect:
            kw["is_causal"] = True
        elif self.mode == "flash":
            from torch.nn.attention.bias import causal_lower_right

            kw["attn_mask"] = causal_lower_right(nq, nk)
        else:
            kw["attn_mask"] = torch.ones(nq, nk, dtype=torch.bool, device="cuda").tril(diagonal=nk - nq)
        force = backend is not None and not (rect and self.mode == "flash")

        def forward():
            if force:
                with ctx(backend):
                    return sdpa(q, k, v, **kw)
            return sdpa(q, k, v, **kw)

        def canon(t, n):
            return t.transpose(1, 2)

        return [q, k, v], forward, canon


def _has_signature(fn):
    try:
        inspect.signature(fn)
        return True
    except (TypeError, ValueError):
        return False


CHAINS = {
    "varlen": ["varlen", "sdpa-flash", "sdpa-cudnn", "sdpa-mask"],
    "sdpa-flash": ["sdpa-flash", "sdpa-cudnn", "sdpa-mask"],
    "sdpa-cudnn": ["sdpa-cudnn", "sdpa-flash", "sdpa-mask"],
}


def build_chain(torch, shapes, first):
    kernels, skipped = [], []
    for key in CHAINS[first]:
        try:
            if key == "varlen":
                kernels.append(VarlenKernel(torch, shapes))
            else:
                kernels.append(SdpaKernel(torch, shapes, key.split("-")[1]))
        except Exception as exc:
            skipped.append(f"{key}: {reason(exc)}")
            log(f"  kernel {key} unavailable: {reason(exc)}")
    if not kernels:
        raise SystemExit("profile_torch.py: no attention kernel available: " + "; ".join(skipped))
    return kernels, skipped


# ----------------------------------------------------------------------------- attention grid


def bytes_per_piece(nq, nk, H, Hk, D):
    """Device bytes of one piece in a timed call: q, out, dO, dq and k, v, dk, dv in BF16,
    plus an FP32 dq accumulator and the log-sum-exp (a generous estimate)."""
    return 2 * (4 * nq * H * D + 4 * nk * Hk * D) + 4 * nq * H * D + 16 * nq * H


def measure_piece(torch, kernel, nq, nk, rect, expand, B, s, seed, tiles):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    leaves, forward, _ = kernel.make(B, nq, nk, rect, expand, gen)
    fwd_ms, fwd_samples, fwd_iters, fwd_host = time_calls(torch, forward, s)
    out = forward()
    grad = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
    mode = "retained graph, autograd.grad(retain_graph=True) per call"
    try:
        bwd_ms, bwd_samples, bwd_iters, bwd_host = time_calls(
            torch, lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), s)
    except Exception as exc:
        if is_oom(torch, exc):
            raise
        out = None
        release(torch)
        mode = f"untimed forward per call, events around the backward ({reason(exc)})"
        bwd_ms, bwd_samples, bwd_iters, bwd_host = time_backward_fresh(torch, forward, leaves, grad, s)
    pairs = padded_pairs(nq, nk, *tiles)
    flops = forward_flops(pairs, kernel.H, kernel.D)  # per piece
    return {
        "q": nq, "k": nk, "kernel": kernel.cell_name(rect, expand), "copies": B,
        "padded_pairs_per_piece": pairs, "useful_pairs_per_piece": useful_pairs(nq, nk),
        "fwd_flop_per_piece": flops,
        "fwd_ms_per_call": fwd_ms, "bwd_ms_per_call": bwd_ms,
        "fwd_gflops": flops * B / (fwd_ms * 1e-3) / 1e9,
        "bwd_gflops": ATTN_BWD_FACTOR * flops * B / (bwd_ms * 1e-3) / 1e9,
        "fwd_spread_pct": spread_pct(fwd_samples), "bwd_spread_pct": spread_pct(bwd_samples),
        "iters_per_repeat": [fwd_iters, bwd_iters], "bwd_mode": mode,
        "host_over_gpu": [fwd_host, bwd_host],
        "launch_bound": any(h is not None and h > LAUNCH_BOUND for h in (fwd_host, bwd_host)),
    }


def measure_cell(torch, kernels, nq, nk, args, s, budget_bytes, tiles, seed):
    rect = nk > nq
    failures = []
    for kernel in kernels:
        if not kernel.usable(rect):
            failures.append(f"{kernel.key}: failed its check")
            continue
        expand = kernel.checked[rect]
        per = bytes_per_piece(nq, nk, kernel.H, kernel.kv_heads(expand), kernel.D)
        B0 = math.ceil(args.tokens / nq)
        B = max(1, min(B0, int(budget_bytes // per)))
        while True:
            try:
                cell = measure_piece(torch, kernel, nq, nk, rect, expand, B, s, seed, tiles)
                if cell["launch_bound"] and B < MAX_GROWTH * B0 and 2 * B * per <= budget_bytes:
                    # The GPU waited for Python: more pieces per call, so that the time is
                    # the kernels' (per-piece throughput is what the table holds).
                    B *= 2
                    log(f"    q={nq} k={nk}: launch-bound (host/GPU {max(h for h in cell['host_over_gpu'] if h is not None):.2f}), "
                        f"retrying with {B} pieces per call")
                    release(torch)
                    continue
                cell["copies_from_tokens"] = B0
                if failures:
                    cell["fallback_from"] = failures
                return cell
            except Exception as exc:
                oom = is_oom(torch, exc)
                release(torch)
                if oom and B > 1:
                    B = max(1, B // 2)
                    log(f"    q={nq} k={nk}: out of memory, retrying with {B} pieces per call")
                    continue
                failures.append(f"{kernel.cell_name(rect, expand)}: {reason(exc)}")
                log(f"    q={nq} k={nk}: {failures[-1]}")
                break
    return {"q": nq, "k": nk, "kernel": None, "failures": failures}


def measure_attention(torch, shapes, args, s, tiles):
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    budget = (args.max_mem_gb * 1e9) if args.max_mem_gb else 0.3 * props.total_memory
    log(f"attention: {shapes.heads_local} query / {shapes.kv_local} KV heads per rank, head_dim "
        f"{shapes.head_dim}, tiles {tiles[0]}x{tiles[1]}, {args.tokens} query tokens per call, "
        f"memory budget {budget / 1e9:.1f} GB per call")
    kernels, skipped = build_chain(torch, shapes, args.kernel)
    rows_f, rows_b, kern_f, cells = [], [], [], []
    seed = args.seed
    for nq in args.q_lens:
        rf, rb, rk = [], [], []
        diag = None
        for nk in args.k_lens:
            if nk < nq or (nk == nq and diag is not None):
                if diag is None:
                    seed += 1
                    diag = measure_cell(torch, kernels, nq, nq, args, s, budget, tiles, seed)
                    cells.append(diag)
                    report_cell(diag)
                c = diag
                copied = nk != nq
            else:
                seed += 1
                c = measure_cell(torch, kernels, nq, nk, args, s, budget, tiles, seed)
                cells.append(c)
                report_cell(c)
                if nk == nq:
                    diag = c
                copied = False
            if c["kernel"] is None:
                rf.append(None)
                rb.append(None)
                rk.append(None)
            else:
                rf.append(c["fwd_gflops"])
                rb.append(c["bwd_gflops"])
                rk.append(c["kernel"] + (" (value at k=q)" if copied else ""))
            release(torch)
        rows_f.append(rf)
        rows_b.append(rb)
        kern_f.append(rk)
    copied = fill_missing(args.q_lens, args.k_lens, rows_f, rows_b, kern_f)
    legend = {k.key: k.description for k in kernels}
    checks = [k.check_log[r] for k in kernels for r in (False, True) if r in k.check_log]
    info = {"kernels": legend, "kernel_checks": checks, "kernels_unavailable": skipped,
            "memory_budget_bytes_per_call": budget, "cells": cells, "not_measured": copied}
    if any(isinstance(k, VarlenKernel) for k in kernels):
        info["varlen_signature"] = next(k.signature for k in kernels if isinstance(k, VarlenKernel))
    return rows_f, rows_b, kern_f, info


def report_cell(c):
    if c["kernel"] is None:
        log(f"  q={c['q']:<6d} k={c['k']:<7d} NOT MEASURED: " + "; ".join(c["failures"]))
        return
    log(f"  q={c['q']:<6d} k={c['k']:<7d} x{c['copies']:<5d} fwd {c['fwd_gflops'] / 1e3:7.1f}  bwd "
        f"{c['bwd_gflops'] / 1e3:7.1f} TFLOP/s (padded)  {c['fwd_ms_per_call']:.3f}/"
        f"{c['bwd_ms_per_call']:.3f} ms  {c['kernel']}")


def fill_missing(q_lens, k_lens, rows_f, rows_b, kern):
    """Cells no kernel could measure take the nearest measured cell of their row (else of
    their column); the kernels matrix says so. The reader needs positive numbers."""
    cells = [(i, j) for i in range(len(q_lens)) for j in range(len(k_lens))]
    have = {(i, j) for i, j in cells if rows_f[i][j] is not None}
    missing = [c for c in cells if c not in have]
    if not missing:
        return []
    if not have:
        raise SystemExit("profile_torch.py: no attention cell could be measured")
    copied = []
    for i, j in missing:
        cands = [(abs(j - jj), i, jj) for ii, jj in have if ii == i]
        if not cands:
            cands = [(abs(i - ii), ii, j) for ii, jj in have if jj == j]
        if not cands:
            cands = [(abs(i - ii) + abs(j - jj), ii, jj) for ii, jj in have]
        _, ii, jj = min(cands)
        rows_f[i][j], rows_b[i][j] = rows_f[ii][jj], rows_b[ii][jj]
        kern[i][j] = f"NOT MEASURED: copied from q={q_lens[ii]} k={k_lens[jj]}"
        copied.append(f"q={q_lens[i]} k={k_lens[j]} <- q={q_lens[ii]} k={k_lens[jj]}")
        log(f"warning: cell q={q_lens[i]} k={k_lens[j]} not measured; copied from "
            f"q={q_lens[ii]} k={k_lens[jj]}")
    return copied


# ----------------------------------------------------------------------------- GEMMs


def measure_gemms(torch, shapes, T, s, seed):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    bf16 = torch.bfloat16
    out = []
    for name, K, N in shapes.gemms():
        x = torch.randn(T, K, device="cuda", dtype=bf16, generator=gen)
        w = torch.randn(N, K, device="cuda", dtype=bf16, generator=gen)
        dy = torch.randn(T, N, device="cuda", dtype=bf16, generator=gen)
        flop = 2.0 * T * K * N
        entry = {"name": name, "tokens": T, "in": K, "out": N, "flop": flop}
        for phase, fn in (("fwd", lambda: torch.matmul(x, w.t())),
                          ("dgrad", lambda: torch.matmul(dy, w)),
                          ("wgrad", lambda: torch.matmul(dy.t(), x))):
            ms, samples, _, _ = time_calls(torch, fn, s)
            entry[f"{phase}_ms"] = ms
            entry[f"{phase}_gflops"] = flop / (ms * 1e-3) / 1e9
            entry[f"{phase}_spread_pct"] = spread_pct(samples)
        log(f"  gemm {name:4s} [{T} x {K}] x [{K} x {N}]: fwd {entry['fwd_gflops'] / 1e3:6.1f}  dgrad "
            f"{entry['dgrad_gflops'] / 1e3:6.1f}  wgrad {entry['wgrad_gflops'] / 1e3:6.1f} TFLOP/s")
        out.append(entry)
        del x, w, dy
        release(torch)
    return out


def harmonic(gemms, phases):
    flop = sum(g["flop"] for g in gemms for _ in phases)
    ms = sum(g[f"{p}_ms"] for g in gemms for p in phases)
    return flop / (ms * 1e-3) / 1e9


def measure_matmul_peak(torch, n, s, seed):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    ms, _, _, _ = time_calls(torch, lambda: torch.matmul(a, b), s)
    del a, b
    release(torch)
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- dry run


def dry_run_tables(q_lens, k_lens, tiles, peak):
    """Synthetic roofline-like values, FORMAT VALIDATION ONLY (nothing is measured):
    fwd = 0.6 peak * q/(q+tile_q) * k/(k+tile_k), bwd = 0.75 fwd; k < q hold k = q."""
    fwd, bwd = [], []
    for q in q_lens:
        rf, rb = [], []
        for k in k_lens:
            kk = max(k, q)
            v = 0.6 * peak * q / (q + tiles[0]) * kk / (kk + tiles[1])
            rf.append(v)
            rb.append(0.75 * v)
        fwd.append(rf)
        bwd.append(rb)
    return fwd, bwd


# ----------------------------------------------------------------------------- output


def rnd(x, digits):
    return round(float(x), digits)


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def gpu_slug(name):
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return slug(m.group(1)) if m else slug(name.replace("NVIDIA", ""))


def write_atomic(path, text):
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_profile(args, shapes, base, base_path, tiles, fwd, bwd, kernels_matrix, linear, peak,
                  memory_gb, measured_fields, base_fields, sources, notes, measured, backend,
                  description, name):
    j = {
        "format": FORMAT,
        "version": 1,
        "name": name,
        "backend": backend,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "source": DRY_RUN_SOURCE if args.dry_run else f"measured by {SCRIPT}",
        "description": description,
        "sources": sources,
        "peak_gflops": rnd(peak, 1),
        "linear_gflops": rnd(linear, 1),
        "tile_q": tiles[0],
        "tile_k": tiles[1],
        "head_dim": shapes.head_dim,
        "attention": {
            "fwd": {"q_lens": args.q_lens, "k_lens": args.k_lens,
                    "gflops": [[rnd(v, 2) for v in row] for row in fwd], "kernels": kernels_matrix},
            "bwd": {"q_lens": args.q_lens, "k_lens": args.k_lens,
                    "gflops": [[rnd(v, 2) for v in row] for row in bwd], "kernels": kernels_matrix},
        },
    }
    if base is not None and "links" in base:
        j["links"] = base["links"]
    if base is not None and "topology" in base:
        j["topology"] = base["topology"]
    if memory_gb:
        j["memory_gb"] = rnd(memory_gb, 1)
    j["notes"] = notes
    measured["fields_measured"] = measured_fields
    measured["fields_from_base"] = base_fields
    if base is not None:
        measured["base_profile"] = {"name": base.get("name"), "file": os.path.basename(base_path),
                                    "sources": base.get("sources", [])}
    j["measured"] = measured
    for row in j["attention"]["fwd"]["gflops"] + j["attention"]["bwd"]["gflops"]:
        for v in row:
            if not (isinstance(v, float) and math.isfinite(v) and v > 0):
                raise SystemExit(f"profile_torch.py: internal error: bad table value {v!r}")
    return j


def summary_table(q_lens, k_lens, fwd, bwd, kern, primary, launch_bound=()):
    lines = ["attention TFLOP/s on padded FLOPs, fwd/bwd (rows q, columns k; "
             + (f"* = not measured by {primary}, " if primary else "")
             + "= = value at k=q, ~ = launch-bound, ! = not measured):"]
    corner = "q \\ k"
    lines.append(f"{corner:>7s} " + " ".join(f"{k:>12d}" for k in k_lens))
    for i, q in enumerate(q_lens):
        cells = []
        for j, k in enumerate(k_lens):
            mark = ""
            name = kern[i][j] or ""
            if name.startswith("NOT MEASURED"):
                mark = "!"
            elif "(value at k=q)" in name:
                mark = "="
            elif (q, k) in launch_bound:
                mark = "~"
            elif primary and not name.startswith(primary):
                mark = "*"
            cells.append(f"{fwd[i][j] / 1e3:.0f}/{bwd[i][j] / 1e3:.0f}{mark}".rjust(12))
        lines.append(f"{q:>7d} " + " ".join(cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def int_list(text):
    try:
        vals = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Measure a wlb hardware profile (docs/profile-format.md) with PyTorch on one "
                    "GPU: BF16 causal GQA attention (varlen_attn / SDPA) over a q x k grid on "
                    "tile-padded FLOPs, and the layer's TP-sharded GEMMs. See the module docstring.")
    g = p.add_argument_group("model shapes (from --deck; explicit flags override)")
    g.add_argument("--deck", metavar="TOML", help="wlb deck: [model] hidden/heads/kv_heads/ffn/name, "
                   "[mesh] tp, [hardware] profile (default --base)")
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int, help="query heads of the whole model")
    g.add_argument("--kv-heads", type=int, help="KV heads of the whole model (default heads)")
    g.add_argument("--head-dim", type=int, help="default hidden / heads (as wlb decks derive it)")
    g.add_argument("--ffn", type=int, help="SwiGLU intermediate size")
    g.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    g.add_argument("--model-name", help="model name for the profile name (default the deck's)")
    p.add_argument("--base", metavar="PROFILE.json",
                   help="profile to carry links/topology/memory_gb/peak_gflops/tiles from "
                        "(default: the deck's [hardware] profile)")
    p.add_argument("--out", required=True, metavar="PATH", help="output profile JSON (atomic write)")
    p.add_argument("--name", help="profile name (default <gpu>-torch-<model>-tp<tp>)")
    p.add_argument("--kernel", choices=sorted(CHAINS), default="varlen",
                   help="first attention kernel of the fallback chain (default varlen)")
    p.add_argument("--q-lens", type=int_list, help="query lengths of the grid (comma-separated)")
    p.add_argument("--k-lens", type=int_list, help="key lengths of the grid (comma-separated)")
    p.add_argument("--tile-q", type=int, help="padding tile, queries (default base's, else 128)")
    p.add_argument("--tile-k", type=int, help="padding tile, keys (default base's, else 64)")
    p.add_argument("--tokens", type=int, default=16384,
                   help="query tokens per timed attention call: B = ceil(tokens / q) pieces (16384)")
    p.add_argument("--max-mem-gb", type=float, default=0.0,
                   help="device memory budget of one attention call (default 30%% of the GPU)")
    p.add_argument("--gemm-tokens", type=int, default=16384, help="tokens T of the GEMMs (16384)")
    p.add_argument("--linear-from", choices=("fwd", "step"), default="fwd",
                   help="linear_gflops from forward GEMMs (default) or forward+dgrad+wgrad")
    p.add_argument("--repeats", type=int, help="timed repeats per measurement (default 7; quick 3)")
    p.add_argument("--target-ms", type=float, help="time per repeat (default 25 ms; quick 10)")
    p.add_argument("--quick", action="store_true", help="wlb profile --quick grid, fewer repeats (smoke)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dry-run", action="store_true",
                   help="FORMAT VALIDATION ONLY: no torch/GPU, synthetic values labelled "
                        f"'{DRY_RUN_SOURCE}'")
    args = p.parse_args(argv)
    if args.q_lens is None:
        args.q_lens = QUICK_Q_LENS if args.quick else DEFAULT_Q_LENS
    if args.k_lens is None:
        args.k_lens = QUICK_K_LENS if args.quick else DEFAULT_K_LENS
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.target_ms is None:
        args.target_ms = 10.0 if args.quick else 25.0
    if args.repeats < 1 or args.tokens < 1 or args.gemm_tokens < 1:
        p.error("--repeats, --tokens and --gemm-tokens must be >= 1")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    t_start = time.perf_counter()
    shapes, base_path = shapes_from_args(args)
    base = load_base(base_path)
    tiles = (args.tile_q or int((base or {}).get("tile_q", 128)),
             args.tile_k or int((base or {}).get("tile_k", 64)))
    if tiles[0] < 1 or tiles[1] < 1:
        raise SystemExit("profile_torch.py: tiles must be positive")
    log(f"model {shapes.describe()}")
    log(f"grid q {args.q_lens}, k {args.k_lens}; base profile: "
        f"{(base.get('name') + ' (' + os.path.basename(base_path) + ')') if base else 'none'}")

    base_fields, measured_fields = [], ["attention.fwd", "attention.bwd", "linear_gflops"]
    if base is not None:
        base_fields += [f for f in ("links", "topology") if f in base]
    peak_from_base = base is not None and "peak_gflops" in base
    mem_from_base = base is not None and "memory_gb" in base
    if peak_from_base:
        base_fields.append("peak_gflops")
    if mem_from_base:
        base_fields.append("memory_gb")
    if args.tile_q is None and base is not None and "tile_q" in base:
        base_fields.append("tile_q/tile_k (padding convention)")

    measured = {"model": shapes.to_json(), "grid": {"q_lens": args.q_lens, "k_lens": args.k_lens},
                "flop_convention": "fwd = 4 * paddedPairs(q, k, tile_q, tile_k) * head_dim * heads/tp; "
                                   "bwd = 2.5 * fwd; gflops per piece (B identical pieces per call)"}
    gemm_shapes = shapes.gemms()

    if args.dry_run:
        log("DRY RUN: format validation only -- nothing is measured, every value is synthetic")
        peak = float(base["peak_gflops"]) if peak_from_base else 989000.0
        fwd, bwd = dry_run_tables(args.q_lens, args.k_lens, tiles, peak)
        kern = [[DRY_RUN_SOURCE] * len(args.k_lens) for _ in args.q_lens]
        linear = 0.6 * peak
        memory_gb = float(base["memory_gb"]) if mem_from_base else 80.0
        measured_fields = []
        backend = "none (dry run, not measured)"
        name = args.name or f"dry-run-{slug(shapes.name)}-tp{shapes.tp}"
        if not name.startswith("dry-run"):
            name = "dry-run-" + name
        description = ("DRY RUN of bench/profile_torch.py: synthetic values for format validation "
                       "only, not measured. Do not use as a profile.")
        sources = [DRY_RUN_SOURCE + ": attention fwd = 0.6 peak q/(q+tile_q) k/(k+tile_k), bwd = "
                   "0.75 fwd, linear = 0.6 peak (format validation only)"]
        measured["gemm"] = [{"name": n, "tokens": args.gemm_tokens, "in": K, "out": N,
                             "source": DRY_RUN_SOURCE} for n, K, N in gemm_shapes]
        notes = [DRY_RUN_SOURCE + ": every number in this file is synthetic; it exists to check "
                 "that wlb reads the format"]
        primary = None
    else:
        try:
            import torch
        except ImportError as exc:
            raise SystemExit(f"profile_torch.py: needs PyTorch with CUDA ({exc}); --dry-run needs neither")
        if not torch.cuda.is_available():
            raise SystemExit("profile_torch.py: no CUDA device visible to torch")
        try:  # AOTAutograd donated buffers refuse retain_graph on compiled graphs
            import torch._functorch.config as functorch_config
            if hasattr(functorch_config, "donated_buffer"):
                functorch_config.donated_buffer = False
        except Exception:
            pass
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        device = {
            "gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count, "memory_bytes": props.total_memory,
            "gpus_visible": torch.cuda.device_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "python": platform.python_version(),
        }
        log(f"{props.name} (sm {props.major}.{props.minor}, {props.multi_processor_count} SMs, "
            f"{props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}")
        if torch.cuda.device_count() > 1:
            log("note: more than one GPU visible; links are not measured (carried from --base)")
        s = Settings(args.repeats, args.target_ms, 20.0 if args.quick else 50.0)
        fwd, bwd, kern, att_info = measure_attention(torch, shapes, args, s, tiles)
        log("gemms:")
        gemms = measure_gemms(torch, shapes, args.gemm_tokens, s, args.seed + 100)
        lin_fwd = harmonic(gemms, ["fwd"])
        lin_step = harmonic(gemms, ["fwd", "dgrad", "wgrad"])
        linear = lin_fwd if args.linear_from == "fwd" else lin_step
        mm_n = 4096 if args.quick else 8192
        mm = measure_matmul_peak(torch, mm_n, s, args.seed + 200)
        log(f"  matmul {mm_n}^3 bf16: {mm / 1e3:.1f} TFLOP/s")
        if peak_from_base:
            peak = float(base["peak_gflops"])
        else:
            peak = mm
            measured_fields.append(f"peak_gflops (achieved {mm_n}^3 BF16 matmul, no datasheet base)")
        if mem_from_base:
            memory_gb = float(base["memory_gb"])
        else:
            memory_gb = props.total_memory / 1e9
            measured_fields.append("memory_gb (device total memory)")
        measured.update({"device": device, "settings": s.to_json(), "attention": att_info,
                         "gemm": gemms, "gemm_notes": shapes.gemm_notes,
                         "linear_gflops_fwd": lin_fwd, "linear_gflops_fwd_dgrad_wgrad": lin_step,
                         f"matmul_{mm_n}_bf16_gflops": mm,
                         "tokens_per_attention_call": args.tokens})
        first_kernel = next((c["kernel"] for c in att_info["cells"] if c.get("kernel")), None)
        primary = first_kernel.split("+")[0] if first_kernel else None
        used = sorted({c["kernel"] for c in att_info["cells"] if c.get("kernel")})
        backend = f"CUDA (PyTorch {torch.__version__}, CUDA {torch.version.cuda}; measured by {SCRIPT})"
        name = args.name or f"{gpu_slug(props.name)}-torch-{slug(shapes.name)}-tp{shapes.tp}"
        description = (f"{props.name}: attention and GEMM throughput of PyTorch {torch.__version__} "
                       f"BF16 kernels measured by {SCRIPT} for {shapes.describe()}"
                       + (f"; links/topology/memory/peak from base profile {base.get('name')}"
                          if base else ""))
        sources = [
            f"measured by {SCRIPT} on {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"cuDNN {device['cudnn']}: attention kernels {', '.join(used)}; median of {s.repeats} repeats "
            f"(CUDA events, about {s.target_ms:g} ms each) after warm-up",
            f"linear: torch.matmul BF16, {args.gemm_tokens} tokens, TP-sharded qkv/o/fc1/fc2 "
            f"(tp {shapes.tp}); linear_gflops = FLOP-weighted harmonic mean of "
            + ("forward GEMMs" if args.linear_from == "fwd" else "forward+dgrad+wgrad GEMMs"),
        ]
        if base is not None:
            sources.append(f"carried over from base profile {base.get('name')} "
                           f"({os.path.basename(base_path)}), not measured: {', '.join(base_fields)} "
                           "(the base's own sources: measured.base_profile.sources)")
        notes = [
            f"attention: BF16, causal bottom-right (query j of a q-query piece sees keys [0, k-q+j]), "
            f"{shapes.heads_local} query / {shapes.kv_local} KV heads per TP rank, head_dim "
            f"{shapes.head_dim}; kernel of every cell in attention.*.kernels; kernel descriptions "
            f"and their float64 checks in measured.attention",
            f"gflops on tile-padded FLOPs ({tiles[0]}x{tiles[1]} tiles, paddedPairs of "
            f"src/attention/flops.hpp), fwd 4*pairs*head_dim*heads, bwd 2.5x fwd, as `wlb profile`",
            f"each cell: B identical pieces per call, B = min(ceil({args.tokens}/q), memory cap); "
            f"per-piece throughput = B * piece FLOPs / call time (B per cell in measured.attention.cells)",
            "cells with k < q hold the value at k = q (ignored by the cost model)",
            f"timing: median of {s.repeats} repeats (wlb profile keeps the best); one input set "
            "reused (warm caches); backward = autograd backward with the forward not timed",
            f"linear_gflops = {linear:.0f} from {args.linear_from} GEMMs (fwd only {lin_fwd:.0f}, "
            f"fwd+dgrad+wgrad {lin_step:.0f}); the cost model uses it for forward and backward "
            "and for the LM head (not measured here)",
            "measured here: " + "; ".join(measured_fields),
            ("carried over from the base profile (not measured): " + ", ".join(base_fields))
            if base_fields else "no base profile: links omitted (wlb defaults apply)",
            "attention_efficiency not set (1.0): calibrate it and linear_gflops from wlb run "
            "traces (docs/performance.md, docs/profile-format.md)",
        ]
        if args.quick:
            notes.append("--quick: wlb profile's quick grid and 3 repeats; a smoke run, not a profile "
                         "to trust")
        if args.q_lens != DEFAULT_Q_LENS or args.k_lens != DEFAULT_K_LENS:
            notes.append(f"grid q {args.q_lens}, k {args.k_lens} (non-default)")
        else:
            notes.append("grid: wlb profile's default q/k points extended by the same x4 steps to "
                         "64K queries / 128K keys (clamped beyond)")
        if shapes.gemm_notes:
            notes += shapes.gemm_notes
        still_bound = [f"q={c['q']} k={c['k']}" for c in att_info["cells"] if c.get("launch_bound")]
        if still_bound:
            notes.append("launch-bound even with 8x the pieces per call (throughput a lower bound): "
                         + ", ".join(still_bound))
        if att_info["not_measured"]:
            notes.append("WARNING: attention cells no kernel could measure, copied from the nearest "
                         "measured cell: " + "; ".join(att_info["not_measured"]))

    profile = build_profile(args, shapes, base, base_path, tiles, fwd, bwd, kern, linear, peak,
                            memory_gb, measured_fields, base_fields, sources, notes, measured,
                            backend, description, name)
    write_atomic(args.out, json.dumps(profile, indent=1, allow_nan=False) + "\n")

    elapsed = time.perf_counter() - t_start
    print(f"\n{name}: {shapes.describe()}")
    bound = set() if args.dry_run else {(c["q"], c["k"]) for c in measured["attention"]["cells"]
                                        if c.get("launch_bound")}
    print(summary_table(args.q_lens, args.k_lens, fwd, bwd, kern, primary, bound))
    print(f"linear_gflops {linear / 1e3:.1f} TFLOP/s ({args.linear_from}); peak_gflops "
          f"{peak / 1e3:.1f} TFLOP/s ({'base' if peak_from_base else 'measured' if not args.dry_run else 'dry run'}); "
          f"tiles {tiles[0]}x{tiles[1]}; memory_gb {memory_gb:.1f}")
    if not args.dry_run:
        for g in measured["gemm"]:
            print(f"  gemm {g['name']:4s} {g['tokens']}x{g['in']}x{g['out']}: fwd {g['fwd_gflops'] / 1e3:.1f}"
                  f"  dgrad {g['dgrad_gflops'] / 1e3:.1f}  wgrad {g['wgrad_gflops'] / 1e3:.1f} TFLOP/s")
    print("measured: " + (", ".join(measured_fields) if measured_fields else "nothing (dry run)"))
    print("from base: " + (", ".join(base_fields) if base_fields else "nothing"))
    print(f"wrote {args.out} in {elapsed:.0f} s"
          + ("  [DRY RUN: synthetic values, format validation only]" if args.dry_run else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
