"""Fused Triton kernels against their torch references on CUDA, Qwen3-0.6B geometry
(hidden 1024, 16 q / 8 kv heads, head_dim 128, intermediate 3072).

    python bench/fused_kernels.py [--tokens 128 512 4096 51200] [--dtype bf16] [--reps 50]
    python bench/fused_kernels.py --decode [--batches 1 8 32] [--contexts 128 512 2048 4096]
    python bench/fused_kernels.py --decode-layer [--batches 1 2 4] [--contexts 256] [--sweep]
    python bench/fused_kernels.py --pooling [--sweep]
    python bench/fused_kernels.py --gelu [--tokens 3200 12800 25600 51200]
    python bench/fused_kernels.py --norms

--norms times the add + norm kernels (florist/kernels/norms.py, embeddings.py) at the shapes the
models run them (all-MiniLM-L6-v2's LayerNorms of 384 columns, Qwen3-0.6B's add + RMSNorm of
1,024, plain and summing four split-K partials) under every row blocking of a grid (rows a
program, warps), each checked against the picked one first: what `norms._row_blocking` picks,
the formula before it, and the best.

--pooling times mean pooling (florist/kernels/pooling.py) over the batches the embedders pool
(all-MiniLM-L6-v2 and pplx-embed widths, graph buckets' empty trailing sequences included):
`pick`'s configuration, the one before it (`pooling.BEFORE`) and the torch reference; with
--sweep every configuration of a grid (rows a load, columns a program, warps, tokens a program),
each checked against the reference first, and the best.

--gelu times the exact GELU pass (florist/kernels/activation.py) on all-MiniLM-L6-v2's
intermediate width (1,536) in fp16 and bf16: F.gelu, the Triton pass, and a copy of the same bytes
(what a pass bound by its bytes would take); first it counts, over every finite fp16 input, how
many results of each differ from the correctly rounded exact GELU.

--decode times decode attention over the slot KV cache instead (one query token per sequence):
florist's one-launch Triton kernel against FlashAttention's split-KV path and the torch
reference, each backend as the engine calls it.

--decode-layer times whole decoder layers of a decode step: the one-launch layer
(florist/kernels/decode_layer.py) against the unfused launches the model runs otherwise
(skinny qkv product, decode attention with QK-norm + rotary, o product + add + RMSNorm, gate/up +
SwiGLU, down product + add + RMSNorm), over 8 layers of distinct weights per call (252 MB, more
than the L2 holds, as a 28-layer model streams its weights from HBM); --sweep adds tile, warp and
context-slice variants of the one launch.

Each op runs inside a CUDA graph (several calls back to back per replay), so the figures are GPU
time without launch overhead, as in the engine's captured forward; the median over replays is
reported per call. The floor is the bytes the fused kernel must move / 4.2 TB/s (the H200's
measured device copy rate). NOTE: at 128-512 tokens the inputs stay in the 50 MB L2 between
back-to-back calls and a single kernel is latency-bound, so the floor means little there.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from florist.kernels import activation, norms, rotary  # noqa: E402

HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE = 1024, 16, 8, 128, 3072
MAX_POSITIONS = 65536
PEAK_BYTES_PER_S = 4.2e12
EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Op:
    name: str
    fused: Callable[[], object]
    reference: Callable[[], object]
    min_bytes: int  # what the fused kernel reads and writes, at least


def make_ops(num_tokens: int, dtype: torch.dtype) -> list[Op]:
    dev = "cuda"
    esize = torch.empty(0, dtype=dtype).element_size()
    x = torch.randn(num_tokens, HIDDEN, device=dev, dtype=dtype)
    res = torch.randn_like(x)
    w, b = torch.randn(HIDDEN, device=dev, dtype=dtype), torch.randn(HIDDEN, device=dev, dtype=dtype)
    # q and k are views into one fused qkv output, exactly as Qwen3Attention hands them over.
    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=dev, dtype=dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(num_tokens, NUM_Q_HEADS, HEAD_DIM), k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    qw, kw = torch.randn(HEAD_DIM, device=dev, dtype=dtype), torch.randn(HEAD_DIM, device=dev, dtype=dtype)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), device=dev, dtype=torch.int32)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    freqs = torch.arange(MAX_POSITIONS, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(dev)
    gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE, device=dev, dtype=dtype)

    rows = num_tokens * HIDDEN * esize
    qk = num_tokens * (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM * esize
    rope_extra = num_tokens * (HEAD_DIM * 4 + 4)  # one fp32 cache row and one position per token
    return [
        Op("rms_norm", lambda: norms.rms_norm_triton(x, w, EPS), lambda: norms.rms_norm_ref(x, w, EPS), 2 * rows),
        Op("add_rms_norm", lambda: norms.add_rms_norm_triton(x, res, w, EPS), lambda: norms.add_rms_norm_ref(x, res, w, EPS), 4 * rows),
        Op("add_layer_norm", lambda: norms.add_layer_norm_triton(x, res, w, b, EPS),
           lambda: norms.add_layer_norm_ref(x, res, w, b, EPS), 3 * rows),
        Op("apply_rotary", lambda: rotary.apply_rotary_triton(q, k, positions, cache),
           lambda: rotary.apply_rotary_ref(q, k, positions, cache), 2 * qk + rope_extra),
        Op("qk_norm_rope", lambda: rotary.qk_norm_rope_triton(q, k, qw, kw, EPS, positions, cache),
           lambda: rotary.qk_norm_rope_ref(q, k, qw, kw, EPS, positions, cache), 2 * qk + rope_extra),
        # What fusing QK-norm into rotary buys over three separate Triton kernels.
        Op("qk_norm_rope (3 kernels)",
           lambda: rotary.apply_rotary_triton(norms.rms_norm_triton(q, qw, EPS), norms.rms_norm_triton(k, kw, EPS), positions, cache),
           lambda: rotary.qk_norm_rope_ref(q, k, qw, kw, EPS, positions, cache), 2 * qk + rope_extra),
        Op("silu_and_mul", lambda: activation.silu_and_mul_triton(gate_up), lambda: activation.silu_and_mul_ref(gate_up),
           3 * num_tokens * INTERMEDIATE * esize),
    ]


def time_in_graph(fn: Callable[[], object], calls_per_replay: int, reps: int) -> float:
    """Median microseconds per call of `fn`, captured `calls_per_replay` times in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, the allocator settles
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_replay):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times_us = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()  # timing needs the result; this is the benchmark loop, not a hot path
        times_us.append(start.elapsed_time(end) * 1e3 / calls_per_replay)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(times_us)


POOL_SHAPES = [  # (name, hidden, dtype, sequence lengths: a graph bucket's empty tail included)
    ("minilm 1 x 32", 384, torch.float16, [32, 0]),
    ("minilm 1 x 128", 384, torch.float16, [128, 0]),
    ("minilm 32 x 128", 384, torch.float16, [128] * 32),
    ("minilm 100 x 256", 384, torch.float16, [256] * 100 + [0] * 28),
    ("pplx 1 x 128", 1024, torch.bfloat16, [128, 0]),
    ("pplx 1 x 512", 1024, torch.bfloat16, [512, 0]),
    ("pplx 100 x U(32..512)", 1024, torch.bfloat16, None),
    ("pplx 1 x 4096", 1024, torch.bfloat16, [4096, 0]),
]


def pool_sweep(max_seqlen: int, h: int):
    from florist.kernels.pooling import PoolConfig, next_power_of_2

    n = next_power_of_2(max_seqlen)
    out = []
    for block_t in (16, 32, 64, 128, 256):
        for block_h in (64, 128, 256):
            for warps in (4, 8):
                if block_t * block_h > 128 * warps * 32 or block_h > 2 * h:  # registers; columns mostly masked
                    continue
                for span in {block_t, 2 * block_t, 4 * block_t, 8 * block_t}:
                    if span <= max(block_t, n) and span <= 1024 and (span == block_t or block_t <= n):
                        out.append(PoolConfig(span, block_t, block_h, warps))
    return sorted(set(out), key=lambda c: (c.block_t, c.block_h, c.num_warps, c.span))


def pooling_rows(reps: int, sweep: bool) -> list[tuple]:
    """(shape, {variant: us}, best configuration) per shape; every variant checked first."""
    from florist.kernels import pooling

    dev, rows = torch.device("cuda"), []
    rng = torch.Generator().manual_seed(0)
    for name, h, dtype, lens in POOL_SHAPES:
        if lens is None:
            lens = torch.randint(32, 513, (100,), generator=rng).tolist() + [0] * 28
        t, max_len = sum(lens), max(lens)
        hidden = torch.randn(t, h, device=dev, dtype=dtype)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        seq_ids = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev)).to(torch.int32)
        want = pooling.segment_mean_ref(hidden, seq_ids, cu)

        def run(cfg):
            return lambda: pooling.segment_mean_triton(hidden, cu, max_len, config=cfg)

        variants = {"picked": pooling.pick(max_len, h, len(lens)), "before": pooling.BEFORE}
        times = {}
        for label, cfg in variants.items():
            torch.testing.assert_close(run(cfg)(), want, rtol=2e-5, atol=2e-5)
            times[label] = time_in_graph(run(cfg), 20, reps)
        times["torch"] = time_in_graph(lambda: pooling.segment_mean_ref(hidden, seq_ids, cu), 20, reps)
        best = None
        if sweep:
            for cfg in pool_sweep(max_len, h):
                torch.testing.assert_close(run(cfg)(), want, rtol=2e-5, atol=2e-5)
                us = time_in_graph(run(cfg), 20, max(10, reps // 3))
                if best is None or us < best[1]:
                    best = (cfg, us)
            times["best"] = best[1]
        floor_us = (t * h * hidden.element_size() + len(lens) * h * 4) / PEAK_BYTES_PER_S * 1e6
        rows.append((name, times, floor_us, best[0] if best else None))
        print(f"{name:<24} " + "  ".join(f"{k} {v:7.2f}" for k, v in times.items()) + f"  floor {floor_us:6.2f} us"
              + (f"  best {best[0]}" if best else ""), flush=True)
        torch.cuda.empty_cache()
    return rows


def gelu_rows(tokens: list[int], reps: int) -> list[tuple]:
    """(rows, dtype, {variant: us}, floor us) per shape, after the exactness count over every finite fp16."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).cuda()
    every = every[torch.isfinite(every)]
    exact = activation.gelu_exact_ref(every)
    bits = lambda t: t.view(torch.int16).int()  # noqa: E731
    for name, got in (("F.gelu", torch.nn.functional.gelu(every)), ("Triton pass", activation.gelu_triton(every))):
        off = got != exact
        print(f"{name:<12} differs from the exact GELU in {int(off.sum())} of {every.numel()} fp16 inputs "
              f"(at most {int((bits(got) - bits(exact)).abs().max())} ulp)")
    rows = []
    for m in tokens:
        for dtype in (torch.float16, torch.bfloat16):
            xs = [torch.randn(m, 1536, device="cuda", dtype=dtype) * 2 for _ in range(2)]
            turn = [0]

            def x():  # two inputs in turn: each call reads from HBM, as the step's does
                turn[0] ^= 1
                return xs[turn[0]]

            torch.testing.assert_close(activation.gelu_triton(xs[0]), activation.gelu_exact_ref(xs[0]), rtol=2e-3, atol=2e-3)
            times = {"F.gelu": time_in_graph(lambda: torch.nn.functional.gelu(x()), 4, reps),
                     "triton": time_in_graph(lambda: activation.gelu_triton(x()), 4, reps),
                     "copy": time_in_graph(lambda: x().clone(), 4, reps)}
            floor_us = 2 * xs[0].numel() * xs[0].element_size() / PEAK_BYTES_PER_S * 1e6
            rows.append((m, dtype, times, floor_us))
            print(f"{m:>6} x 1536 {str(dtype)[6:]:<9} " + "  ".join(f"{k} {v:7.2f}" for k, v in times.items()) + f"  floor {floor_us:6.2f} us", flush=True)
            del xs
            torch.cuda.empty_cache()
    return rows


NORM_SHAPES = [  # (name, kind, rows, columns, dtype)
    ("embeddings + LayerNorm", "embed", 25600, 384, torch.float16),
    ("add + LayerNorm", "layer", 25600, 384, torch.float16),
    ("add + LayerNorm", "layer", 12800, 384, torch.float16),
    ("add + LayerNorm", "layer", 128, 384, torch.float16),
    ("add + RMSNorm", "rms", 16384, 1024, torch.bfloat16),
    ("add + RMSNorm", "rms", 512, 1024, torch.bfloat16),
    ("add + RMSNorm", "rms", 128, 1024, torch.bfloat16),
    ("add + RMSNorm of 4 split-K partials", "partials", 128, 1024, torch.bfloat16),
    ("add + RMSNorm of 4 split-K partials", "partials", 100, 1024, torch.bfloat16),
    ("add + RMSNorm of 4 split-K partials", "partials", 64, 1024, torch.bfloat16),
]


def _formula_blocking(n_cols: int) -> tuple[int, int, int]:
    """The blocking every norm had before `_row_blocking` took measured exceptions."""
    block_cols = 1 << (n_cols - 1).bit_length()
    block_rows = max(1, min(16, 2048 // block_cols))
    return block_rows, block_cols, min(16, max(1, block_rows * block_cols // 256))


def norm_rows(reps: int) -> list[tuple]:
    """(shape, {variant: us}, best (rows, warps)) per shape; every blocking checked against the picked one."""
    from unittest import mock

    from florist.kernels import embeddings
    from florist.kernels.split_k import SplitKPartials

    dev, rows = torch.device("cuda"), []
    for name, kind, m, n, dtype in NORM_SHAPES:
        torch.manual_seed(0)
        # Two input sets in turn where one outgrows half the L2: each call then reads from HBM, as the step's does.
        sets = 2 if m * n * 2 * 3 > 24e6 else 1
        w, b = torch.rand(n, device=dev, dtype=dtype) + 0.5, torch.randn(n, device=dev, dtype=dtype)
        if kind == "embed":
            tables = [torch.randn(r, n, device=dev, dtype=dtype) for r in (30522, 512, 2)]
            ins = [(torch.randint(0, 30522, (m,), device=dev, dtype=torch.int32), torch.arange(m, device=dev, dtype=torch.int32) % 256)
                   for _ in range(sets)]
            call = lambda i: embeddings.embed_layer_norm_triton(*ins[i], None, *tables, w, b, EPS)  # noqa: E731
        elif kind == "partials":
            ins = [(SplitKPartials(torch.randn(4, m, n, device=dev), None, dtype), torch.randn(m, n, device=dev, dtype=dtype))
                   for _ in range(sets)]
            call = lambda i: norms.add_rms_norm_triton(ins[i][0], ins[i][1], w, EPS)  # noqa: E731
        else:
            ins = [(torch.randn(m, n, device=dev, dtype=dtype), torch.randn(m, n, device=dev, dtype=dtype)) for _ in range(sets)]
            if kind == "layer":
                call = lambda i: norms.add_layer_norm_triton(ins[i][0], ins[i][1], w, b, EPS)  # noqa: E731
            else:
                call = lambda i: norms.add_rms_norm_triton(ins[i][0], ins[i][1], w, EPS)  # noqa: E731
        turn = [0]

        def run():
            turn[0] = (turn[0] + 1) % sets
            return call(turn[0])

        picked = norms._row_blocking(n, layer_norm=kind in ("embed", "layer"))
        want = call(0)
        want = want[0] if isinstance(want, tuple) else want
        block_cols = picked[1]
        grid = [(r, wp) for r in (1, 2, 4, 8) for wp in (1, 2, 4, 8, 16) if 2 <= r * block_cols // (32 * wp) <= 64]
        times, best = {}, None
        for blocking in [("picked", picked), ("formula", _formula_blocking(n))] + [(f"{r}x{wp}", (r, block_cols, wp)) for r, wp in grid]:
            label, (r, bc, wp) = blocking
            with mock.patch.object(norms, "_row_blocking", lambda *a, _b=(r, bc, wp), **k: _b):
                got = call(0)
                got = got[0] if isinstance(got, tuple) else got
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
                us = time_in_graph(run, 20, reps)
            if label in ("picked", "formula"):
                times[label] = us
            if best is None or us < best[1]:
                best = ((r, wp), us)
        times["best"] = best[1]
        rows.append((f"{name}, {str(dtype)[6:]}, {m} x {n}", times, picked, best[0]))
        print(f"{rows[-1][0]:<52} " + "  ".join(f"{k} {v:6.2f}" for k, v in times.items())
              + f"  picked {picked[0]}x{picked[2]}  best {best[0][0]}x{best[0][1]}", flush=True)
        del ins
        torch.cuda.empty_cache()
    return rows


def decode_attention_rows(batches: list[int], contexts: list[int], dtype: torch.dtype, reps: int) -> list[tuple]:
    """(batch, context, {backend: us}, max |triton - torch|) per shape; every sequence has
    `context` cached tokens in a cache of max(contexts) positions per slot."""
    from florist.engine.generation.batch import GenerationBatch
    from florist.layers.cached_attention import select_decode_backend

    dev = torch.device("cuda")
    backends = {name: select_decode_backend(name, dev, HEAD_DIM, dtype) for name in ("triton", "flash", "torch")}
    max_len, rows = max(contexts), []
    for batch in batches:
        k_cache = torch.randn(batch + 1, max_len, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=dev, dtype=dtype)
        slots = torch.arange(batch, device=dev)
        for context in contexts:
            lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
            cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
            meta = GenerationBatch(input_ids=cu[:-1], positions=lens - 1, seq_ids=cu[:-1], cu_seqlens=cu, token_type_ids=None,
                                   max_seqlen=1, seq_lens_host=(), decode=True, slot_mapping=slots, slots=slots, context_lens=lens,
                                   cache_starts=torch.arange(batch + 1, dtype=torch.int32, device=dev) * max_len, max_context_len=max_len)
            call = {name: (lambda fn=fn: fn(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)) for name, fn in backends.items()}
            diff = max_abs_diff(call["triton"](), call["torch"]())
            times = {name: time_in_graph(fn, 20, reps) for name, fn in call.items()}
            rows.append((batch, context, times, diff))
            print(f"B={batch:<3} context={context:<5} " + "   ".join(f"{n} {t:8.2f} us" for n, t in times.items()) + f"   max|diff| {diff:.3g}", flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    return rows


def decode_layer_rows(batches: list[int], contexts: list[int], dtype: torch.dtype, reps: int, sweep: bool) -> list[tuple]:
    """(batch, context, variant, us per layer, max |diff| vs the unfused layers) per variant."""
    from florist.kernels import decode_attention, decode_layer, skinny_gemm

    dev, layers, eps = torch.device("cuda"), 8, 1e-6
    inter, n_q, n_kv = INTERMEDIATE, NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM

    def weights() -> decode_layer.LayerWeights:
        def rand(*shape, scale):
            return (torch.randn(*shape, device=dev) * scale).to(dtype)

        return decode_layer.LayerWeights(
            input_norm=1 + rand(HIDDEN, scale=0.1), qkv=rand(n_q + 2 * n_kv, HIDDEN, scale=HIDDEN**-0.5), q_norm=1 + rand(HEAD_DIM, scale=0.1),
            k_norm=1 + rand(HEAD_DIM, scale=0.1), o=rand(HIDDEN, n_q, scale=n_q**-0.5), post_norm=1 + rand(HIDDEN, scale=0.1),
            gate_up=rand(2 * inter, HIDDEN, scale=HIDDEN**-0.5), down=rand(HIDDEN, inter, scale=inter**-0.5), eps=eps,
            num_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)

    layer_weights = [weights() for _ in range(layers)]
    angles = torch.rand(MAX_POSITIONS // 8, HEAD_DIM // 2, device=dev) * 100
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    base = decode_layer.LayerConfig(stages_apart=False)
    variants = {"one launch (8 layers)": base, "stages apart": dataclasses.replace(base, stages_apart=True)}
    if sweep:
        for field, values in (("qkv_block_n", (16,)), ("mlp_block_n", (8, 16)), ("num_warps", (16,)), ("min_split_keys", (32, 128))):
            for value in values:
                variants[f"{field}={value}"] = dataclasses.replace(base, **{field: value})
    rows = []
    for batch in batches:
        for context in contexts:
            caches = [(torch.randn(batch + 1, context, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=dtype),
                       torch.randn(batch + 1, context, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)) for _ in range(layers)]
            slots = torch.arange(batch, device=dev)
            lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
            resid = torch.randn(batch, HIDDEN, device=dev).to(dtype)

            def unfused():
                # The model's decode layers as launched without the fused layer (Qwen3DecoderLayer):
                # input norm once, then per layer qkv, attention (+ QK-norm, rotary, k/v store),
                # o + add + norm, gate/up + SwiGLU, down + add + the next layer's input norm.
                h, res = norms.rms_norm(resid, layer_weights[0].input_norm, eps), resid
                for i, (w, (kc, vc)) in enumerate(zip(layer_weights, caches)):
                    q, k, v = skinny_gemm.skinny_gemm(h, w.qkv).split([n_q, n_kv, n_kv], dim=-1)
                    attn = decode_attention.decode_attention_qk_norm_rope(
                        q.view(batch, NUM_Q_HEADS, HEAD_DIM), k.view(batch, NUM_KV_HEADS, HEAD_DIM), v.view(batch, NUM_KV_HEADS, HEAD_DIM),
                        w.q_norm, w.k_norm, eps, cos_sin, kc, vc, slots, lens, HEAD_DIM**-0.5).reshape(batch, n_q)
                    h, res = _add_norm(attn, w.o, res, w.post_norm)
                    act = skinny_gemm.skinny_gemm(h, w.gate_up, silu_mul=True)
                    h, res = _add_norm(act, w.down, res, layer_weights[(i + 1) % layers].input_norm)
                return res

            def _add_norm(x, weight, res, norm_weight):
                fused = skinny_gemm.skinny_gemm_add_rms_norm(x, weight, None, res, norm_weight, eps)
                return fused if fused is not None else norms.add_rms_norm(skinny_gemm.skinny_gemm(x, weight), res, norm_weight, eps)

            fused_stack = decode_layer.DecodeStack.build(layer_weights, [k for k, _ in caches], [v for _, v in caches])
            singles = [decode_layer.DecodeStack.build([w], [k], [v]) for w, (k, v) in zip(layer_weights, caches)]

            def fused(config, per_layer=False):
                def run():
                    if not per_layer:
                        return decode_layer.qwen3_decode_layers_triton(resid, fused_stack, cos_sin, slots, lens, HEAD_DIM**-0.5, config)
                    res = resid
                    for single in singles:
                        res = decode_layer.qwen3_decode_layers_triton(res, single, cos_sin, slots, lens, HEAD_DIM**-0.5, config)
                    return res
                return run

            want = unfused()
            calls = {"unfused": unfused}
            for name, config in variants.items():
                calls[name] = fused(config)
            calls["one launch per layer"] = fused(base, per_layer=True)
            for name, fn in calls.items():
                diff = max_abs_diff(fn(), want)
                us = time_in_graph(fn, 4, reps) / layers
                rows.append((batch, context, name, us, diff))
                print(f"B={batch:<2} context={context:<5} {name:<22} {us:7.2f} us / layer   max|diff| vs unfused {diff:.3g}", flush=True)
            del caches
            torch.cuda.empty_cache()
    return rows


def max_abs_diff(fused, reference) -> float:
    fused = fused if isinstance(fused, tuple) else (fused,)
    reference = reference if isinstance(reference, tuple) else (reference,)
    return max((a.float() - e.float()).abs().nan_to_num(0.0).max().item() for a, e in zip(fused, reference))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 4096, 51200])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--reps", type=int, default=50, help="graph replays timed per op (median reported)")
    parser.add_argument("--decode", action="store_true", help="time decode attention backends instead")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="default: 128 512 2048 4096 (--decode), 256 (--decode-layer)")
    parser.add_argument("--decode-layer", action="store_true", help="time the one-launch decode layer against the unfused layer")
    parser.add_argument("--sweep", action="store_true", help="--decode-layer / --pooling: also tile / warp / slicing variants")
    parser.add_argument("--pooling", action="store_true", help="time mean pooling's configurations instead")
    parser.add_argument("--gelu", action="store_true", help="time the exact GELU pass instead (--tokens: rows, default 3200 12800 25600 51200)")
    parser.add_argument("--norms", action="store_true", help="time the add + norm kernels' row blockings instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/fused_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  {args.dtype}")
    print(f"floor = bytes moved by the fused kernel / {PEAK_BYTES_PER_S / 1e12:.1f} TB/s; times are GPU us per call (median)\n")
    if args.pooling:
        rows = pooling_rows(args.reps, args.sweep)
        print("\n| batch | picked (us) | before (us) | torch (us) | sweep best (us) | floor (us) | best configuration |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for name, t, floor_us, best in rows:
            best_us = f"{t['best']:.2f}" if "best" in t else "-"
            print(f"| {name} | {t['picked']:.2f} | {t['before']:.2f} | {t['torch']:.2f} | {best_us} | {floor_us:.2f} | {best or '-'} |")
        return 0
    if args.gelu:
        rows = gelu_rows(args.tokens if args.tokens != [128, 512, 4096, 51200] else [3200, 12800, 25600, 51200], args.reps)
        print("\n| rows x 1536 | dtype | F.gelu (us) | Triton pass (us) | copy (us) | floor (us) | F.gelu / pass |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for m, dtype, t, floor_us in rows:
            print(f"| {m} | {str(dtype)[6:]} | {t['F.gelu']:.2f} | {t['triton']:.2f} | {t['copy']:.2f} | {floor_us:.2f} | {t['F.gelu'] / t['triton']:.2f}x |")
        return 0
    if args.norms:
        rows = norm_rows(args.reps)
        print("\n| norm | picked (rows x warps) | us | formula (us) | best (rows x warps) | us |")
        print("|---|---|---:|---:|---|---:|")
        for name, t, picked, best in rows:
            print(f"| {name} | {picked[0]} x {picked[2]} | {t['picked']:.2f} | {t['formula']:.2f} | {best[0]} x {best[1]} | {t['best']:.2f} |")
        return 0
    if args.decode_layer:
        rows = decode_layer_rows(args.batches if args.batches != [1, 8, 32] else [1, 2, 4], args.contexts or [256], dtype, args.reps, args.sweep)
        print("\n| batch | context | variant | us / layer | unfused / variant |")
        print("|---:|---:|---|---:|---:|")
        unfused = {(b, c): us for b, c, name, us, _ in rows if name == "unfused"}
        for batch, context, name, us, _ in rows:
            print(f"| {batch} | {context} | {name} | {us:.2f} | {unfused[(batch, context)] / us:.2f}x |")
        return 0
    if args.decode:
        args.contexts = args.contexts or [128, 512, 2048, 4096]
        print("\n| batch | context | triton (us) | flash (us) | torch (us) | flash / triton |")
        print("|---:|---:|---:|---:|---:|---:|")
        for batch, context, t, _ in decode_attention_rows(args.batches, args.contexts, dtype, args.reps):
            print(f"| {batch} | {context} | {t['triton']:.2f} | {t['flash']:.2f} | {t['torch']:.2f} | {t['flash'] / t['triton']:.2f}x |")
        return 0
    rows = []
    for num_tokens in args.tokens:
        torch.manual_seed(0)
        for op in make_ops(num_tokens, dtype):
            diff = max_abs_diff(op.fused(), op.reference())
            floor_us = op.min_bytes / PEAK_BYTES_PER_S * 1e6
            # Enough calls per replay for ~2 ms of work at the floor, so event overhead vanishes.
            calls = max(2, min(50, math.ceil(2000 / max(floor_us, 1.0))))
            ref_us = time_in_graph(op.reference, calls, args.reps)
            fused_us = time_in_graph(op.fused, calls, args.reps)
            rows.append((op.name, num_tokens, ref_us, fused_us, floor_us, diff))
            print(f"T={num_tokens:<6} {op.name:<26} ref {ref_us:9.2f} us   fused {fused_us:9.2f} us   "
                  f"x{ref_us / fused_us:5.2f}   floor {floor_us:8.2f} us   max|diff| {diff:.3g}", flush=True)
        torch.cuda.empty_cache()

    print("\n| op | tokens | torch ref (us) | fused (us) | speed-up | floor (us) | floor / fused |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, num_tokens, ref_us, fused_us, floor_us, _ in rows:
        print(f"| {name} | {num_tokens} | {ref_us:.2f} | {fused_us:.2f} | {ref_us / fused_us:.2f}x | {floor_us:.2f} | {floor_us / fused_us:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
