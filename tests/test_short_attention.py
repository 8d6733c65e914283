"""The short-sequence attention kernel (florist/kernels/short_attention.py) against its reference,
and the "auto" backend's choice of it (florist/layers/attention.py).

* CPU: every case below runs through Triton's interpreter (3.9 or later) in one subprocess (`TRITON_INTERPRET`
  must be set before triton is imported); running this file as a script does that and prints
  {case: "ok" | failure text} as JSON. Small sizes: the interpreter is slow.
* GPU (skipped without CUDA): the same cases compiled, at larger sizes, bf16 included; replay
  from a CUDA graph.
* Everywhere: the dispatch rule of "auto" (a pure function of the batch's host values) and the
  "triton" backend's fallback to the reference on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from florist.engine.batch import HostBatch, pack, to_device, views
from florist.engine.graph_runner import bucket
from florist.kernels import short_attention as short
from florist.layers import attention

ROOT = Path(__file__).resolve().parent.parent
# The kernel rounds the softmax weights to the input dtype before the P @ V product (as flash
# attention does); the reference keeps them in fp32. fp32 runs the products in IEEE fp32.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _qkv(gen, num_tokens, hq, hkv, d, dtype, device, scale=1.0):
    """q [T, Hq, D], k/v [T, Hkv, D] as strided views into one fused qkv output (as the models
    pass them: only the last dim is contiguous)."""
    qkv = (torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen) * scale).to(dtype).to(device)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d), v.view(num_tokens, hkv, d)


def _max_score(q, k, scale: float) -> float:
    """max |q . k| * scale in base 2 (log2(e) folded in, as the kernel computes), over every
    query/key pair of a head and its kv head (a bound: pairs of different sequences included)."""
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    return torch.einsum("thd,shd->hts", q.float(), kk).abs().max().item() * scale * 1.4426950408889634


def _run_poisoned(fn):
    """Calls fn with torch.empty returning NaN-filled floating tensors, so rows the kernel left
    unwritten show up (fresh memory is often zero on the CPU)."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned
    try:
        return fn()
    finally:
        torch.empty = real_empty


def _case(dtype, lens, hq, hkv, d, causal, *, pad=0, max_seqlen=None, nonfinite=False, scale=1.0, launch=None):
    """`lens` may hold zeros (the empty tail of a padded bucket); `pad` tokens follow the last
    sequence; `max_seqlen` may exceed the longest sequence (a graph bucket's bound); `launch`:
    tile / warp / stage overrides, as `bench/attention.py --sweep` passes them."""

    def case(gen, device, big):
        # GPU-sized: three times the tokens (one-token sequences stay one token), and a bound
        # above the longest sequence stays above it
        sizes = [n * 3 if big and n > 1 else n for n in lens]
        at_least = max_seqlen * 3 if big and max_seqlen else max_seqlen
        t = sum(sizes) + pad
        q, k, v = _qkv(gen, t, hq, hkv, d, dtype, device, scale)
        if nonfinite:  # the padding holds garbage: real rows must not see it
            for x in (q, k, v):
                x[t - pad :, :, 0], x[t - 1, :, -1] = float("nan"), float("inf")
        cu = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
        bound = max(at_least or 0, max(sizes))
        out = _run_poisoned(lambda: short.short_attention_triton(q, k, v, cu, bound, causal, d**-0.5, **(launch or {})))
        ref = short.short_attention_ref(q, k, v, cu, causal, d**-0.5)
        assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
        real = slice(0, t - pad)
        assert torch.isfinite(out[real]).all(), "non-finite values in real rows"
        assert torch.equal(out[t - pad :].cpu(), torch.zeros_like(out[t - pad :]).cpu()), "padding rows are not zero"
        rtol, atol = TOLERANCES[dtype]
        if dtype == torch.float32:
            # A score s carries ~|s| * 2^-23 of rounding that depends on the product's summation
            # order (a GPU's IEEE fp32 tensor-core sums differ from torch's); in an exponent that
            # moves a softmax weight by as much, relative. So large scores widen fp32's bound:
            # on the H200 the large-scores case (|s| up to ~400 in base 2) is off by 6e-5 at
            # outputs of RMS ~8; this bound is ~1e-3 there.
            slack = 4 * _max_score(q, k, d**-0.5) * 2.0**-23
            rtol, atol = max(rtol, slack), max(atol, slack * v.float().pow(2).mean().sqrt().item())
        torch.testing.assert_close(out[real].cpu(), ref[real].cpu(), rtol=rtol, atol=atol)

    return case


def _same_bits_across_grid_orders(dtype, lens, hq, hkv, d, causal, *, pad=0, launch=None):
    """The grid with its slots axis last (`seq_last`, FLORIST_SHORT_SEQ_LAST) gives the same
    bits as the default order: each program's work is the same, only its place in the grid moves."""

    def case(gen, device, big):
        sizes = [n * 3 if big and n > 1 else n for n in lens]
        t = sum(sizes) + pad
        q, k, v = _qkv(gen, t, hq, hkv, d, dtype, device)
        if pad:
            for x in (q, k, v):
                x[t - pad :, :, 0] = float("nan")
        cu = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
        run = lambda last: _run_poisoned(lambda: short.short_attention_triton(q, k, v, cu, max(sizes), causal, d**-0.5,  # noqa: E731
                                                                            seq_last=last, **(launch or {})))
        a, b = run(False), run(True)
        assert torch.equal(a.cpu(), b.cpu())
        assert torch.equal(a[t - pad :].cpu(), torch.zeros_like(a[t - pad :]).cpu())

    return case


def _build_cases():
    cases = {}
    ragged = [1, 7, 33, 100]
    for name, dtype in DTYPES.items():
        for causal in (True, False):
            kind = "causal" if causal else "bidir"
            cases[f"{name}-{kind}-gqa-D32-ragged-padded"] = _case(dtype, ragged, 4, 2, 32, causal, pad=5)
            cases[f"{name}-{kind}-mha-D128"] = _case(dtype, [7, 33], 2, 2, 128, causal)
            cases[f"{name}-{kind}-gqa-D24"] = _case(dtype, [33, 1, 7], 4, 2, 24, causal, pad=3)
        cases[f"{name}-bucket-tail"] = _case(dtype, [7, 33, 24, 0, 0], 2, 1, 32, False, max_seqlen=64)  # as pack() lays it out
        cases[f"{name}-nan-inf-padding"] = _case(dtype, [7, 33], 4, 2, 32, True, pad=9, nonfinite=True)
        cases[f"{name}-large-scores"] = _case(dtype, [100], 2, 2, 64, True, scale=8.0)  # online-softmax rescaling
    cases["fp16-one-token"] = _case(torch.float16, [1], 2, 1, 128, True, pad=63)  # a 64-token bucket with one real token
    # Tile overrides (bench/attention.py --sweep): query and key tiles other than the defaults.
    cases["fp16-causal-tiles-16x16"] = _case(torch.float16, [1, 7, 33, 100], 4, 2, 32, True, launch=dict(blocks=(16, 16), num_warps=2, num_stages=1))
    # Head widths under the tile's (D = 24 in 32 columns) over several whole key tiles: the head-dim
    # mask must hold on every tile, not only on the diagonal or partial one.
    cases["fp16-causal-D24-tiles-16x16"] = _case(torch.float16, [100, 7, 49], 4, 2, 24, True, pad=3, launch=dict(blocks=(16, 16), num_warps=2, num_stages=2))
    cases["fp32-bidir-D24-tiles-16x32"] = _case(torch.float32, [100, 7, 64], 4, 2, 24, False, pad=3, launch=dict(blocks=(16, 32), pack_groups=True))
    cases["fp32-bidir-tiles-64x128"] = _case(torch.float32, [7, 33, 100], 2, 1, 64, False, pad=3, launch=dict(blocks=(64, 128), num_warps=8, num_stages=3))
    # the batch tiles launch_config picks for many tokens (MiniLM-like heads; Qwen3-like grouped heads)
    cases["fp16-bidir-tiles-128x64"] = _case(torch.float16, [7, 33, 130, 100, 0], 2, 2, 32, False, pad=3, launch=dict(blocks=(128, 64), num_warps=4, num_stages=3))
    cases["bf16-causal-batch-packed-32x64"] = _case(torch.bfloat16, [7, 33, 128, 100, 0], 4, 2, 128, True, pad=5, launch=dict(blocks=(32, 64), pack_groups=True))
    cases["bf16-bidir-batch-packed-32x32"] = _case(torch.bfloat16, [7, 33, 256, 100, 0, 1], 4, 2, 128, False, pad=5, launch=dict(blocks=(32, 32), pack_groups=True))
    cases["fp32-causal-batch-packed-32x32"] = _case(torch.float32, [7, 33, 70, 0, 1], 4, 2, 128, True, pad=5, launch=dict(blocks=(32, 32), pack_groups=True))
    # One program per kv head, its query heads packed into the rows (pack_groups).
    for name, dtype in DTYPES.items():
        cases[f"{name}-causal-packed-groups"] = _case(dtype, [1, 7, 33, 100], 4, 2, 32, True, pad=5, launch=dict(pack_groups=True))
        cases[f"{name}-bidir-packed-groups-4"] = _case(dtype, [7, 33, 0], 8, 2, 24, False, pad=3, launch=dict(pack_groups=True, blocks=(16, 32)))
    cases["fp16-packed-groups-nan-inf-padding"] = _case(torch.float16, [7, 33], 4, 2, 32, True, pad=9, nonfinite=True, launch=dict(pack_groups=True))
    # The lean key loop (launch_config's choice for narrow heads in large batches: the scale in the
    # exponent's multiply-add, bidirectional masks on partial tiles only): sequences of whole and
    # partial tiles, empty slots, padding, NaN / inf garbage, large scores and grouped heads.
    lean = dict(blocks=(128, 64), num_warps=4, num_stages=3, lean=True)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        cases[f"{name}-bidir-tiles-128x64-lean"] = _case(dtype, [7, 33, 130, 100, 0], 2, 2, 32, False, pad=3, launch=lean)
        cases[f"{name}-causal-lean"] = _case(dtype, [1, 7, 33, 100], 4, 2, 32, True, pad=5, launch=dict(lean=True))
        cases[f"{name}-nan-inf-padding-lean"] = _case(dtype, [7, 33], 4, 2, 32, False, pad=9, nonfinite=True, launch=lean)
        cases[f"{name}-large-scores-lean"] = _case(dtype, [100, 64], 2, 2, 64, False, scale=8.0, launch=lean)
    # ... under a register cap (FLORIST_SHORT_LEAN_LAUNCH's MAXNREG; the sweep's --maxnreg), which spills
    cases["fp16-bidir-tiles-128x64-lean-capped"] = _case(torch.float16, [7, 33, 130, 100, 0], 2, 2, 32, False, pad=3,
                                                         launch=dict(lean, maxnreg=96))
    # The slots axis last (FLORIST_SHORT_SEQ_LAST): a graph bucket's one sequence and its dummy,
    # with padding, packed heads and the one-sequence tiles; and against the default order's bits.
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        cases[f"{name}-causal-seq-last-bucket"] = _case(dtype, [100, 0], 4, 2, 128, True, pad=7, nonfinite=True,
                                                        launch=dict(seq_last=True, blocks=(32, 64), pack_groups=True))
        cases[f"{name}-bidir-seq-last-one-sequence"] = _case(dtype, [33], 2, 1, 32, False, launch=dict(seq_last=True))
        cases[f"{name}-causal-seq-last-same-bits"] = _same_bits_across_grid_orders(dtype, [70, 0], 4, 2, 64, True, pad=5,
                                                                                   launch=dict(blocks=(16, 32)))
    cases["fp16-causal-seq-last-ragged"] = _case(torch.float16, [7, 33, 100], 4, 2, 32, True, pad=3, launch=dict(seq_last=True))
    return cases


CASES = _build_cases()
# Triton's interpreter multiplies bf16 tiles wrongly in tl.dot (docs/kernels.md): GPU only.
INTERPRETER_SKIPS = {name for name in CASES if name.startswith("bf16-")}


def run_cases(device: str, big: bool, names) -> dict[str, str]:
    results = {}
    for i, name in enumerate(names):
        try:
            CASES[name](torch.Generator().manual_seed(i), device, big)
            results[name] = "ok"
        except Exception:  # noqa: BLE001  (reported per case)
            results[name] = traceback.format_exc()[-3000:]
    return results


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):  # as tests/interpreted.py
        pytest.skip("Triton < 3.9's interpreter cannot take a loop trip count loaded from memory (compiled kernels can)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, __file__], check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_short_attention_interpreted(case, interpreted_results):
    if case in INTERPRETER_SKIPS:
        pytest.skip("GPU only (INTERPRETER_SKIPS says why)")
    assert interpreted_results[case] == "ok", f"{case}:\n{interpreted_results[case]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_short_attention_gpu(case):
    result = run_cases("cuda", True, [case])[case]
    assert result == "ok", result


SLOTS_LAST_BOUND = (1 << 28) - 1  # FLORIST_SHORT_SINGLE_SLOTS_LAST_MAX_WORK of the H100 run: Qwen3's 448-token bucket, not its 512


@pytest.mark.gpu
@pytest.mark.parametrize("length, choice", [(100, "triton"), (300, "triton_slots_last"), (448, "triton_slots_last")])
def test_short_attention_replays_from_a_cuda_graph(length, choice, monkeypatch):
    """"auto" in a graph bucket of one Qwen3-0.6B-like causal sequence (16 / 8 heads of 128), as
    the engine captures it (with the slots-last bound of the H100 run): the grid order it picks,
    then replays on fresh inputs."""
    monkeypatch.setattr(attention, "SHORT_SINGLE_SLOTS_LAST_MAX_WORK", SLOTS_LAST_BOUND)
    gen = torch.Generator().manual_seed(0)
    host = HostBatch.from_sequences([[1] * length])
    tokens, seqs, max_seqlen, exact = bucket(host)
    q, k, v = _qkv(gen, tokens, 16, 8, 128, torch.bfloat16, "cuda")
    batch = views(torch.from_numpy(pack(host, tokens, seqs)).cuda(), tokens, seqs, False, max_seqlen=max_seqlen,
                  seq_lens_host=(), single_sequence=True, has_padding=not exact)
    assert attention.auto_choice(batch, tokens, True, True, 16 * 128, 128) == choice
    fn = attention.select_backend("auto", torch.device("cuda"))
    fn(q, k, v, batch, True, 128**-0.5)  # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, k, v, batch, True, 128**-0.5)
    for _ in range(2):
        fresh = _qkv(gen, tokens, 16, 8, 128, torch.bfloat16, "cuda")
        for static, new in zip((q, k, v), fresh):
            static.copy_(new)
        graph.replay()
        ref = short.short_attention_ref(q, k, v, batch.cu_seqlens, True, 128**-0.5)
        torch.testing.assert_close(out[:length], ref[:length], rtol=2e-2, atol=2e-2)


# -- dispatch ------------------------------------------------------------------------------------
def _graph_batch(lens):
    """The padded batch the graph runner builds for these sequence lengths."""
    host = HostBatch.from_sequences([[1] * n for n in lens])
    tokens, seqs, max_seqlen, exact = bucket(host)
    return views(torch.from_numpy(pack(host, tokens, seqs)), tokens, seqs, False, max_seqlen=max_seqlen,
                 seq_lens_host=(), single_sequence=seqs == 2, has_padding=not exact)


QWEN3, MINILM = (16, 128), (12, 32)  # query heads, head_dim


def _choice(batch, causal=True, short_kernel=True, geometry=QWEN3):
    heads, head_dim = geometry
    return attention.auto_choice(batch, batch.num_tokens, causal, short_kernel, heads * head_dim, head_dim)


def _eager_batch(lens):
    return to_device(HostBatch.from_sequences([[1] * n for n in lens]), torch.device("cpu"))


def test_auto_takes_the_short_kernel_where_it_was_measured_faster():
    qwen3, minilm = QWEN3, MINILM
    for causal in (True, False):
        for make in (_eager_batch, _graph_batch):
            # one sequence: while tokens x max_seqlen x width stays small
            assert _choice(make([128]), causal, geometry=qwen3) == "triton"
            assert _choice(make([1]), causal, geometry=qwen3) == "triton"
            assert _choice(make([256]), causal, geometry=minilm) == "triton"
            assert (_choice(make([512]), causal, geometry=minilm) == "triton") == causal
            assert _choice(make([100]), causal, geometry=qwen3) == "triton"  # graph bucket: 128 tokens, longest 128
            # causal work counts half: Qwen3's causal 256 tokens take the kernel, bidirectional not
            assert (_choice(make([256]), causal, geometry=qwen3) == "triton") == causal
            assert (_choice(make([200]), causal, geometry=qwen3) == "triton") == causal
            # past it cuDNN (SHORT_SINGLE_SLOTS_LAST_MAX_WORK is off by default)
            for n in (257, 384, 512):
                assert not _choice(make([n]), causal, geometry=qwen3).startswith("triton")
            # ragged batches, whatever the width
            assert _choice(make([100, 7, 33]), causal, geometry=qwen3) == "triton"
            assert _choice(make([200, 150, 180, 90]), causal, geometry=qwen3) == "triton"
            assert _choice(make([4096, 512, 3000]), causal, geometry=qwen3) == "triton"
            assert _choice(make([4097, 5]), causal, geometry=qwen3) == "varlen"  # past SHORT_RAGGED_MAX_SEQLEN
    # Equal lengths run eagerly as one dense SDPA call (faster there, e.g. Qwen3 100 x 512); a
    # graph bucket's batch is never of equal lengths (its dummy holds the padding), so it takes
    # the kernel, however many sequences it holds.
    assert _choice(_eager_batch([128] * 8)) == "sdpa_batched"
    assert _choice(_eager_batch([128] * 8), geometry=MINILM) == "sdpa_batched"
    assert _choice(_eager_batch([512] * 100)) == "sdpa_batched"
    assert _choice(_graph_batch([128] * 8)) == "triton"
    assert _choice(_graph_batch([256] * 100), geometry=MINILM) == "triton"
    assert _choice(_eager_batch([300, 5])) == "triton"
    # One sequence above both work bounds, as before.
    assert _choice(_eager_batch([512])) == "sdpa_batched"
    assert _choice(_graph_batch([480])) == "sdpa_single"  # causal single sequence over the bucket
    assert _choice(_graph_batch([480]), causal=False) == "varlen"
    assert _choice(_graph_batch([257]), causal=False) == "varlen"
    # Where the kernel does not apply (no triton, an unsupported layout), as before.
    assert _choice(_eager_batch([128]), short_kernel=False) == "sdpa_batched"
    assert _choice(_graph_batch([100]), short_kernel=False) == "sdpa_single"
    assert _choice(_graph_batch([100, 7]), short_kernel=False) == "varlen"


def test_the_single_sequence_bound_moves_with_its_environment_variable(monkeypatch):
    """FLORIST_SHORT_SINGLE_MAX_WORK (for A/B runs): read at import; 2^29 gives Qwen3's 1 x 512
    to the kernel, and a value that is no whole number is refused by name."""
    def bound_at_import(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "FLORIST_SHORT_SINGLE_MAX_WORK": value}
        return subprocess.run([sys.executable, "-c", "from florist.layers import attention; print(attention.SHORT_SINGLE_MAX_WORK)"],
                              check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    proc = bound_at_import(str(1 << 29))
    assert proc.returncode == 0, proc.stderr[-2000:]
    bound = int(proc.stdout.split()[-1])
    assert bound == 1 << 29
    assert _choice(_graph_batch([512])) != "triton"
    monkeypatch.setattr(attention, "SHORT_SINGLE_MAX_WORK", bound)
    assert _choice(_graph_batch([512])) == "triton"
    bad = bound_at_import("lots")
    assert bad.returncode != 0 and "FLORIST_SHORT_SINGLE_MAX_WORK" in bad.stderr, bad.stderr[-2000:]


def test_the_ragged_bound_moves_with_its_environment_variable(monkeypatch):
    """FLORIST_SHORT_RAGGED_MAX_SEQLEN (for A/B runs): read at import; 0 sends every ragged batch
    to varlen, single sequences keep their own bound."""
    env = {**os.environ, "FLORIST_SHORT_RAGGED_MAX_SEQLEN": "0"}
    proc = subprocess.run([sys.executable, "-c", "from florist.layers import attention; print(attention.SHORT_RAGGED_MAX_SEQLEN)"],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == 0
    assert _choice(_graph_batch([100, 7, 33])) == "triton"
    monkeypatch.setattr(attention, "SHORT_RAGGED_MAX_SEQLEN", 0)
    assert _choice(_graph_batch([100, 7, 33])) == "varlen"
    assert _choice(_graph_batch([256] * 100), geometry=MINILM) == "varlen"
    assert _choice(_graph_batch([100])) == "triton"  # one sequence: SHORT_SINGLE_MAX_WORK decides


def test_the_slots_go_last_in_the_grid_only_when_asked(monkeypatch):
    """FLORIST_SHORT_SEQ_LAST (for A/B runs; off by default): read at import; it puts the slots
    axis last for launches of at most two slots (a graph bucket's one sequence and its dummy)."""
    if "FLORIST_SHORT_SEQ_LAST" not in os.environ:
        assert not short.SEQ_LAST_ENABLED and not short.seq_last_default(2)
    assert short.launch_grid(16, 2, 8, False) == (16, 2, 8) and short.launch_grid(16, 2, 8, True) == (16, 8, 2)
    code = "from florist.kernels import short_attention as s; print([s.seq_last_default(b) for b in (1, 2, 3, 100)])"
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env={**os.environ, "FLORIST_SHORT_SEQ_LAST": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "[True, True, False, False]"


def test_the_lean_launch_moves_with_its_environment_variable(monkeypatch):
    """FLORIST_SHORT_LEAN_LAUNCH=WARPS:MAXNREG (for A/B runs): read at import; the lean batch tiles
    take those warps and that register cap, other tiles keep theirs, and a bad value is refused by
    name."""
    pytest.importorskip("triton")
    code = ("from florist.kernels import short_attention as s; "
            "print(s.launch_config(256, 32, 1, 25600, 128)); print(s.launch_config(512, 32, 1))")
    env = {**os.environ, "FLORIST_SHORT_LEAN_LAUNCH": "8:128"}
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lean, other = proc.stdout.strip().splitlines()[-2:]
    assert "'num_warps': 8" in lean and "'maxnreg': 128" in lean
    assert "'num_warps': 4" in other and "maxnreg" not in other
    monkeypatch.delenv("FLORIST_SHORT_LEAN_LAUNCH", raising=False)
    assert short._lean_launch_from_env() == (4, 0)  # the default: the sweep's 4 warps, no cap
    for bad in ("lots", "4", "3:0", "4:8", "4:300"):
        monkeypatch.setenv("FLORIST_SHORT_LEAN_LAUNCH", bad)
        with pytest.raises(ValueError, match="FLORIST_SHORT_LEAN_LAUNCH"):
            short._lean_launch_from_env()


def test_launch_config_follows_the_sweep():
    pytest.importorskip("triton")
    # wide heads (Qwen3): one short sequence (in a graph bucket: it and its dummy) takes 16-row tiles
    assert short.launch_config(128, 128, 2) == dict(blocks=(16, 128), num_warps=4, num_stages=2, pack_groups=False)
    assert short.launch_config(128, 128, 2, 128, 2) == short.launch_config(128, 128, 2)
    assert short.launch_config(40, 128, 2)["blocks"] == (16, 64)  # key tiles no wider than the sequence bucket
    # ... anything else 32 x 64 tiles with the grouped heads packed, short sequences in a batch too
    assert short.launch_config(512, 128, 2) == dict(blocks=(32, 64), num_warps=4, num_stages=3, pack_groups=True)
    assert short.launch_config(512, 128, 2, 8192, 16) == dict(blocks=(32, 64), num_warps=4, num_stages=3, pack_groups=True)
    # ... with 32-key tiles for batches of >= 4,096 tokens of sequences of <= 256 tokens
    assert short.launch_config(128, 128, 2, 12800, 128) == dict(blocks=(32, 32), num_warps=4, num_stages=3, pack_groups=True)
    assert short.launch_config(256, 128, 2, 8192, 64)["blocks"] == (32, 32)
    assert short.launch_config(128, 128, 2, 4096, 64)["blocks"] == (32, 32)
    assert short.launch_config(257, 128, 2, 8192, 64)["blocks"] == (32, 64)  # longer sequences
    assert short.launch_config(256, 128, 2, 2048, 16)["blocks"] == (32, 64)  # fewer tokens
    assert short.launch_config(128, 128, 2, 1024, 16)["blocks"] == (32, 64)
    assert short.launch_config(20, 128, 2, 512, 16)["blocks"] == (32, 32)
    assert short.launch_config(512, 128, 1)["pack_groups"] is False  # nothing to pack without grouped heads
    # narrow heads (MiniLM): 64 x 128 tiles, 128 x 64 for batches of >= 4,096 tokens of sequences of >= 128
    assert short.launch_config(512, 32, 1) == dict(blocks=(64, 128), num_warps=4, num_stages=3, pack_groups=False)
    assert short.launch_config(20, 32, 1)["blocks"] == (32, 32)
    assert short.launch_config(256, 32, 1, 25600, 128) == dict(blocks=(128, 64), num_warps=4, num_stages=3, pack_groups=False,
                                                               lean=short.LEAN_ENABLED)
    assert "lean" not in short.launch_config(256, 32, 1, 2048, 16)  # only the large batches' tiles were measured with it
    assert short.launch_config(128, 32, 1, 4096, 64)["blocks"] == (128, 64)
    assert short.launch_config(256, 32, 1, 2048, 16)["blocks"] == (64, 128)  # fewer tokens
    assert short.launch_config(64, 32, 1, 6400, 128)["blocks"] == (64, 64)  # shorter sequences


def test_auto_backend_calls_the_kernel(monkeypatch):
    """The wiring: on a short batch "auto" launches short_attention_triton (faked here: no CUDA)."""
    calls = []

    def fake_kernel(q, k, v, cu_seqlens, max_seqlen, causal, scale, **options):
        calls.append((q.shape, max_seqlen, causal, options))
        return torch.zeros_like(q)

    monkeypatch.setattr(short, "applies", lambda *args: True)
    monkeypatch.setattr(short, "short_attention_triton", fake_kernel)
    fn = attention.select_backend("auto", torch.device("cpu"))
    q, k, v = _qkv(torch.Generator().manual_seed(0), 128, 4, 2, 32, torch.float32, "cpu")
    fn(q, k, v, _graph_batch([100]), False, 32**-0.5)
    assert calls == [((128, 4, 32), 128, False, {})]
    # one causal sequence of wide heads past SHORT_SINGLE_MAX_WORK, under the slots-last bound
    monkeypatch.setattr(attention, "SHORT_SINGLE_SLOTS_LAST_MAX_WORK", SLOTS_LAST_BOUND)
    q, k, v = _qkv(torch.Generator().manual_seed(0), 320, 16, 8, 128, torch.float32, "cpu")
    fn(q, k, v, _graph_batch([300]), True, 128**-0.5)
    assert calls[1] == ((320, 16, 128), 320, True, {"seq_last": True})


def test_the_slots_last_bound_moves_with_its_environment_variable(monkeypatch):
    """FLORIST_SHORT_SINGLE_SLOTS_LAST_MAX_WORK: read at import, 0 (off) unless set; past
    SHORT_SINGLE_MAX_WORK, one causal sequence of heads wider than 64 takes the kernel with its
    slots last up to that work; a value that is no whole number is refused by name."""
    def bound_at_import(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "FLORIST_SHORT_SINGLE_SLOTS_LAST_MAX_WORK": value}
        return subprocess.run([sys.executable, "-c", "from florist.layers import attention; print(attention.SHORT_SINGLE_SLOTS_LAST_MAX_WORK)"],
                              check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    if "FLORIST_SHORT_SINGLE_SLOTS_LAST_MAX_WORK" not in os.environ:
        assert attention.SHORT_SINGLE_SLOTS_LAST_MAX_WORK == 0
    proc = bound_at_import(str(SLOTS_LAST_BOUND))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == SLOTS_LAST_BOUND
    monkeypatch.setattr(attention, "SHORT_SINGLE_SLOTS_LAST_MAX_WORK", 0)
    assert _choice(_graph_batch([384])) == "sdpa_single"
    monkeypatch.setattr(attention, "SHORT_SINGLE_SLOTS_LAST_MAX_WORK", SLOTS_LAST_BOUND)
    for causal in (True, False):
        for make in (_eager_batch, _graph_batch):
            assert _choice(make([128]), causal) == "triton"  # SHORT_SINGLE_MAX_WORK's range is not this bound's
            for n in (257, 300, 384, 448):
                choice = _choice(make([n]), causal)
                assert choice == "triton_slots_last" if causal else not choice.startswith("triton")
                assert not _choice(make([n]), causal, geometry=(32, 64)).startswith("triton")  # the same width in heads of 64
            assert not _choice(make([512]), causal).startswith("triton")
            assert _choice(make([100, 300]), causal) == "triton"  # ragged batches: the grid order
    assert not _choice(_graph_batch([449])).startswith("triton")  # the 512-token bucket
    bad = bound_at_import("lots")
    assert bad.returncode != 0 and "FLORIST_SHORT_SINGLE_SLOTS_LAST_MAX_WORK" in bad.stderr, bad.stderr[-2000:]


def test_triton_backend_takes_the_reference_on_cpu():
    gen = torch.Generator().manual_seed(1)
    batch = _graph_batch([7, 33, 20])
    q, k, v = _qkv(gen, batch.num_tokens, 4, 2, 32, torch.float32, "cpu")
    for causal in (True, False):
        out = attention.select_backend("triton", torch.device("cpu"))(q, k, v, batch, causal, 0.2)
        sdpa = attention.select_backend("sdpa", torch.device("cpu"))(q, k, v, batch, causal, 0.2)
        torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


def test_reference_zeroes_rows_outside_every_sequence():
    q, k, v = _qkv(torch.Generator().manual_seed(2), 10, 2, 1, 8, torch.float32, "cpu")
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = short.short_attention_ref(q, k, v, cu, True, 1.0)
    assert torch.equal(out[7:], torch.zeros(3, 2, 8)) and torch.equal(out[0, :, :], v[0].repeat(2, 1))


if __name__ == "__main__":
    names = [n for n in CASES if n not in INTERPRETER_SKIPS]
    print(json.dumps(run_cases("cpu", False, names)))
