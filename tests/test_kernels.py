"""Fused Triton kernels against their torch references (florist/kernels/).

* CPU (CI): every case of tests/kernel_cases.py runs through Triton's interpreter in one
  subprocess (TRITON_INTERPRET must be set before triton is imported), small sizes.
* GPU (skipped without CUDA): the same cases compiled for the device at larger sizes, plus
  dispatch and CUDA-graph capture of the public ops.
* Everywhere: the public ops fall back to the reference on CPU, and the package imports and runs
  without triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernel_cases
from florist.kernels import activation, norms, rotary

ROOT = Path(__file__).resolve().parent.parent


def _subprocess_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    pytest.importorskip("triton")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kernel_cases.py")],
        env=_subprocess_env(TRITON_INTERPRET="1"),
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(kernel_cases.CASES))
def test_kernel_matches_reference_interpreted(case, interpreted_results):
    if case in kernel_cases.INTERPRETER_SKIPS:
        pytest.skip("GPU only (kernel_cases.INTERPRETER_SKIPS says why)")
    assert interpreted_results[case] == "ok", f"{case}:\n{interpreted_results[case]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(kernel_cases.CASES))
def test_kernel_matches_reference_gpu(case):
    kernel_cases.run_case(case, "cuda", big=True)


# ---------------------------------------------------------------------------------------------
# dispatch


def _sample_inputs(device: str, dtype=torch.bfloat16):
    g = kernel_cases.Inputs(device, seed=0)
    q, k = g.qkv_views(13, 16, 8, 128, dtype)
    return {
        "x": g.randn(13, 1024, dtype=dtype), "res": g.randn(13, 1024, dtype=dtype),
        "w": g.randn(1024, dtype=dtype), "b": g.randn(1024, dtype=dtype),
        "q": q, "k": k, "qw": g.randn(128, dtype=dtype), "kw": g.randn(128, dtype=dtype),
        "pos": g.positions(13, 64), "cache": kernel_cases.cos_sin_cache(64, 128, device),
        "gate_up": g.randn(13, 2 * 3072, dtype=dtype),
    }


def _public_vs_impl(t, impl: str):
    """Pairs (public op output, output of `impl` = "ref" or "triton") over every op."""
    eps = kernel_cases.EPS
    calls = [
        (norms.rms_norm, "rms_norm", (t["x"], t["w"], eps)),
        (norms.add_rms_norm, "add_rms_norm", (t["x"], t["res"], t["w"], eps)),
        (norms.add_layer_norm, "add_layer_norm", (t["x"], t["res"], t["w"], t["b"], eps)),
        (norms.add_layer_norm, "add_layer_norm", (t["x"], None, t["w"], t["b"], eps)),
        (rotary.apply_rotary, "apply_rotary", (t["q"], t["k"], t["pos"], t["cache"])),
        (rotary.qk_norm_rope, "qk_norm_rope", (t["q"], t["k"], t["qw"], t["kw"], eps, t["pos"], t["cache"])),
        (activation.silu_and_mul, "silu_and_mul", (t["gate_up"],)),
    ]
    for public, name, args in calls:
        module = sys.modules[public.__module__]
        yield name, public(*args), getattr(module, f"{name}_{impl}")(*args)


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_uses_reference(dtype):
    for name, got, want in _public_vs_impl(_sample_inputs("cpu", dtype), "ref"):
        for a, e in zip(_flat(got), _flat(want)):
            assert torch.equal(a, e), name


def test_tma_products_are_picked_only_where_measured():
    """`pick_tma`'s table (Qwen3-0.6B's products on the H200: `bench/gemm.py --tma --sweep`) and its
    guards: the Hopper form only where `tma` is allowed, only for the shapes and row ranges it
    won, never with a K that does not split into whole blocks; off Hopper `tma_applies` is False."""
    from florist.kernels import skinny_gemm as sg

    gate_up, qkv, o, down = (6144, 1024), (4096, 1024), (1024, 2048), (1024, 3072)
    tma = lambda m, shape, **kw: (c := sg.pick_config(m, *shape, tma=True, **kw)) is not None and c.tma  # noqa: E731
    assert [m for m in (1, 16, 32, 40, 64, 100, 128, 192, 256, 320, 512, 576, 1024) if tma(m, gate_up, silu_mul=True)] == [40, 64, 100, 128, 256, 320, 512]
    assert [m for m in (16, 40, 64, 128, 192, 256, 384, 448, 449, 512, 576) if tma(m, qkv)] == [40, 64, 128, 449, 512]
    assert [m for m in (1, 64, 65, 128, 129, 192, 256, 257, 512) if tma(m, o, deferred=True) and tma(m, down, deferred=True)] == [65, 128, 129, 192, 256]
    assert not any(tma(128, shape) for shape in (o, down))  # not deferred: the reduction would be a launch of its own
    assert not tma(128, (6144, 1000), silu_mul=True) and not tma(128, (1024, 2000), deferred=True)  # K not whole blocks
    for m, shape, kw in ((128, gate_up, {"silu_mul": True}), (64, qkv, {}), (128, down, {"deferred": True})):
        config = sg.pick_config(m, *shape, **kw)  # tma=False: never the Hopper form
        assert config is None or not config.tma
    x, w = torch.zeros(128, 1024, dtype=torch.bfloat16), torch.zeros(6144, 1024, dtype=torch.bfloat16)
    assert not sg.tma_applies(x, w, silu_mul=True)  # CPU tensors


def test_tma_config_rules_come_before_the_table(monkeypatch):
    """FLORIST_TMA_CONFIG (for A/B runs): its rules parse, bad ones are refused with the form in
    the message, the first rule matching a product's kind and rows wins over `pick_tma`'s table
    (off included), other kinds and rows keep the table, and a rule's K must split into whole blocks."""
    from florist.kernels import skinny_gemm as sg

    G = sg.GemmConfig
    assert sg.parse_tma_rules("pick") == sg.parse_tma_rules(" ") == ()
    rules = sg.parse_tma_rules("narrow:257-512=128x128x64/4/8/4; swiglu:129-192=off;wide:1-64=64X32x128/1/4/3")
    assert rules == (sg.TmaRule("narrow", 257, 512, G(128, 128, 64, 4, 8, 4, tma=True)), sg.TmaRule("swiglu", 129, 192, None),
                     sg.TmaRule("wide", 1, 64, G(64, 32, 128, 1, 4, 3, tma=True)))
    for bad, says in (("narrow:257-512", "KIND:LO-HI="), ("qkv:1-64=off", "KIND must be"), ("wide:64-1=off", "LO <= HI"),
                      ("wide:1-64=96x32x64/1/4/3", "powers of two"), ("wide:1-64=64x32x64/1/3/3", "WARPS"), ("wide:1-6x=off", "KIND:LO-HI=")):
        with pytest.raises(ValueError, match=says):
            sg.parse_tma_rules(bad)

    o, down, gate_up, qkv = (1024, 2048), (1024, 3072), (6144, 1024), (4096, 1024)
    table = {m: sg.pick_tma(m, *gate_up, silu_mul=True) for m in (128, 160, 320)}
    assert sg.pick_tma(384, *o, deferred=True) is None and table[160] is None
    monkeypatch.setattr(sg, "TMA_RULES", rules + (sg.TmaRule("narrow", 300, 400, None),))
    assert sg.pick_tma(384, *o, deferred=True) == sg.pick_tma(512, *down, deferred=True) == G(128, 128, 64, 4, 8, 4, tma=True)
    assert sg.pick_tma(384, *o) is None  # not deferred: not the narrow kind
    assert sg.pick_tma(256, *o, deferred=True) == sg._tma_table(256, "narrow")  # rows outside every rule: the table
    assert sg.pick_tma(160, *gate_up, silu_mul=True) is None and sg.pick_tma(128, *gate_up, silu_mul=True) == table[128]
    assert sg.pick_tma(64, *qkv) == G(64, 32, 128, 1, 4, 3, tma=True)
    assert sg.pick_tma(300, 1024, 2112, deferred=True) is None  # 2112 is not whole 4 x 64 blocks
    proc = subprocess.run([sys.executable, "-c", "from florist.kernels import skinny_gemm as sg; print(sg.pick_tma(384, 1024, 2048, deferred=True))"],
                          env={**os.environ, "FLORIST_TMA_CONFIG": "narrow:257-512=128x128x64/4/8/4"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "block_m=128, block_n=128, block_k=64, split_k=4" in proc.stdout, proc.stderr[-2000:]


def test_qk_norm_rope_reference_is_the_composition():
    """The fused op's reference is exactly what Qwen3Attention did before: rms_norm, then rotary."""
    t = _sample_inputs("cpu")
    eps = kernel_cases.EPS
    want = rotary.apply_rotary(norms.rms_norm(t["q"], t["qw"], eps), norms.rms_norm(t["k"], t["kw"], eps), t["pos"], t["cache"])
    got = rotary.qk_norm_rope(t["q"], t["k"], t["qw"], t["kw"], eps, t["pos"], t["cache"])
    for a, e in zip(got, want):
        assert torch.equal(a, e)


def test_package_imports_and_runs_without_triton():
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from florist.kernels import activation, norms, rotary\n"
        "import florist.models.qwen3\n"
        "assert norms.triton is None and rotary.triton is None and activation.triton is None\n"
        "x, w = torch.randn(3, 8), torch.ones(8)\n"
        "assert torch.equal(norms.rms_norm(x, w, 1e-6), norms.rms_norm_ref(x, w, 1e-6))\n"
        "assert activation.silu_and_mul(x).shape == (3, 4)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=_subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_dispatches_to_triton(dtype):
    for name, got, want in _public_vs_impl(_sample_inputs("cuda", dtype), "triton"):
        for a, e in zip(_flat(got), _flat(want)):
            assert torch.equal(a, e), name


@pytest.mark.gpu
def test_public_ops_capture_in_cuda_graph():
    """The wrappers make no host syncs: capture all ops in one graph, refill the inputs, replay."""
    static = _sample_inputs("cuda")
    eps = kernel_cases.EPS

    def forward(t):
        h, summed = norms.add_rms_norm(t["x"], t["res"], t["w"], eps)
        q, k = rotary.qk_norm_rope(t["q"], t["k"], t["qw"], t["kw"], eps, t["pos"], t["cache"])
        q2, k2 = rotary.apply_rotary(t["q"], t["k"], t["pos"], t["cache"])
        return [norms.rms_norm(h, t["w"], eps), summed, norms.add_layer_norm(h, summed, t["w"], t["b"], eps),
                q, k, q2, k2, activation.silu_and_mul(t["gate_up"])]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(static)  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward(static)

    fresh = _sample_inputs("cuda")
    g = kernel_cases.Inputs("cuda", seed=1)
    for name, tensor in fresh.items():
        if tensor.is_floating_point() and name != "cache":
            fresh[name] = g.randn(*tensor.shape, dtype=tensor.dtype)
    fresh["pos"] = g.positions(13, 64)
    for name in static:
        static[name].copy_(fresh[name])
    graph.replay()
    for a, e in zip(outs, forward(fresh)):
        assert torch.equal(a, e)


def test_pdl_launch_args_off_the_gpu(monkeypatch):
    """Programmatic dependent launch never applies to CPU tensors: the kernels get PDL=False and
    no launch option."""
    from florist.kernels import pdl

    for mode in pdl.MODES:
        monkeypatch.setattr(pdl, "MODE", mode)
        assert pdl.launch_args(torch.zeros(1)) == {"PDL": False}


@pytest.mark.parametrize("value, mode", [("", "wait"), ("wait", "wait"), (" Wait", "wait"), ("off", "off"), ("OFF", "off"),
                                         ("late", "late"), ("Late-Loops", "late-loops"), ("early", "error")])
def test_pdl_mode_from_the_environment(value, mode):
    script = "from florist.kernels import pdl; print(pdl.MODE)"
    env = _subprocess_env()
    env.pop("FLORIST_PDL", None)
    if value:
        env["FLORIST_PDL"] = value
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if mode == "error":
        assert proc.returncode != 0 and "FLORIST_PDL='early'" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == mode


def _prefill_layer_chain(rows: int, seed: int):
    """A Qwen3-0.6B layer's florist kernels in the order the model launches them for one sequence
    of `rows` tokens (the products as `skinny_gemm` picks them: the TMA product for qkv and
    gate/up at 33-128 rows), on fresh random inputs."""
    from florist.kernels.short_attention import short_attention
    from florist.kernels.skinny_gemm import skinny_gemm
    from florist.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    hidden, heads, kv_heads, dim, inter, eps = 1024, 16, 8, 128, 3072, 1e-6
    t = {"x": rnd(rows, hidden), "res": rnd(rows, hidden), "w1": rnd(hidden), "w2": rnd(hidden), "w3": rnd(hidden),
         "qkv": rnd((heads + 2 * kv_heads) * dim, hidden, scale=0.03), "qw": rnd(dim), "kw": rnd(dim),
         "o": rnd(hidden, heads * dim, scale=0.02), "gate_up": rnd(2 * inter, hidden, scale=0.03), "down": rnd(hidden, inter, scale=0.02),
         "pos": torch.arange(rows, device="cuda"), "cu": torch.tensor([0, rows], dtype=torch.int32, device="cuda"),
         "cache": RotaryEmbedding(dim, 4096, 1e6).cos_sin_cache.cuda()}

    def forward(t):
        h, res = norms.add_rms_norm(t["x"], t["res"], t["w1"], eps)
        q, k, v = skinny_gemm(h, t["qkv"]).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k = rotary.qk_norm_rope(q.view(rows, heads, dim), k.view(rows, kv_heads, dim), t["qw"], t["kw"], eps, t["pos"], t["cache"])
        a = short_attention(q, k, v.view(rows, kv_heads, dim), t["cu"], rows, True, dim ** -0.5)
        h, res = norms.add_rms_norm(skinny_gemm(a.view(rows, heads * dim), t["o"], defer_reduce=True), res, t["w2"], eps)
        act = skinny_gemm(h, t["gate_up"], silu_mul=True)
        out, res = norms.add_rms_norm(skinny_gemm(act, t["down"], defer_reduce=True), res, t["w3"], eps)
        return [q, k, a, h, act, out, res]

    return t, forward


def _bert_layer_chain(rows: int, seed: int):
    """all-MiniLM-L6-v2's kernels for `rows` tokens in sequences of at most 128 (one sequence up
    to 128 rows), fp16: embeddings + LayerNorm, a layer (qkv and o with their bias, short
    attention, LayerNorm + residual, the up product with GELU, down, LayerNorm + residual) and
    mean pooling, on fresh inputs; the products as the model's layers run them (cuBLAS, the
    skinny kernel, or the wide kernel for qkv and up from 12,800 rows)."""
    from florist.kernels import wide_gemm
    from florist.kernels.embeddings import embed_layer_norm
    from florist.kernels.pooling import segment_mean
    from florist.kernels.short_attention import short_attention
    from florist.kernels.skinny_gemm import skinny_gemm

    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.float16)

    hidden, heads, dim, inter, eps = 384, 12, 32, 1536, 1e-12
    seqlen = min(rows, 128)  # rows a multiple of it: no pooling span split, whose atomic adds have no fixed order
    t = {"ids": torch.randint(0, 1000, (rows,), generator=g, device="cuda", dtype=torch.int32),
         "pos": torch.arange(rows, device="cuda", dtype=torch.int32) % seqlen, "types": torch.zeros(rows, device="cuda", dtype=torch.int32),
         "word": rnd(1000, hidden), "pos_table": rnd(512, hidden), "type_table": rnd(2, hidden),
         "qkv": rnd(3 * hidden, hidden, scale=0.05), "qkv_b": rnd(3 * hidden, scale=0.1), "o": rnd(hidden, hidden, scale=0.05),
         "o_b": rnd(hidden, scale=0.1), "up": rnd(inter, hidden, scale=0.05), "up_b": rnd(inter, scale=0.1),
         "down": rnd(hidden, inter, scale=0.03), "down_b": rnd(hidden, scale=0.1),
         **{f"ln{i}_{p}": rnd(hidden, scale=0.2) + (1 if p == "w" else 0) for i in range(3) for p in ("w", "b")},
         "cu": torch.arange(0, rows + 1, seqlen, dtype=torch.int32, device="cuda")}

    def forward(t):
        x = embed_layer_norm(t["ids"], t["pos"], t["types"], t["word"], t["pos_table"], t["type_table"], t["ln0_w"], t["ln0_b"], eps)
        # The wide kernel's products where the model's layers take them (qkv and up from 12,800 rows).
        qkv = wide_gemm.linear(x, t["qkv"], t["qkv_b"], gelu=False)
        if qkv is None:
            qkv = torch.nn.functional.linear(x, t["qkv"], t["qkv_b"])
        q, k, v = qkv.view(rows, 3, heads, dim).unbind(1)
        a = short_attention(q, k, v, t["cu"], seqlen, False, dim ** -0.5).view(rows, hidden)
        h = norms.add_layer_norm(torch.nn.functional.linear(a, t["o"], t["o_b"]), x, t["ln1_w"], t["ln1_b"], eps)
        act = wide_gemm.linear(h, t["up"], t["up_b"], gelu=True)
        if act is None:
            act = skinny_gemm(h, t["up"], t["up_b"], gelu=True)
        out = norms.add_layer_norm(torch.nn.functional.linear(act, t["down"], t["down_b"]), h, t["ln2_w"], t["ln2_b"], eps)
        return [x, a, h, act, out, segment_mean(out, t["ids"], t["cu"], seqlen)]

    return t, forward


@pytest.mark.gpu(capability=(9, 0))
@pytest.mark.parametrize("mode", ["wait", "late", "late-loops"])
@pytest.mark.parametrize("chain, rows", [("qwen3", 37), ("qwen3", 128), ("bert", 37), ("bert", 128), ("bert", 12800)])
def test_pdl_gives_the_same_bits(chain, rows, mode, monkeypatch):
    """A prefill layer's kernels launched with programmatic dependent launch give the bits they
    give without it: eagerly, and replayed in a CUDA graph on fresh inputs; with the successors
    let in early too (`late`, `late-loops`)."""
    from florist.kernels import pdl

    if pdl.gdc_wait is None:
        pytest.skip("this Triton has no grid dependency control")
    make = _prefill_layer_chain if chain == "qwen3" else _bert_layer_chain
    monkeypatch.setattr(pdl, "MODE", "off")
    static, forward = make(rows, seed=0)
    fresh, _ = make(rows, seed=1)
    want_static, want_fresh = forward(static), forward(fresh)
    monkeypatch.setattr(pdl, "MODE", mode)
    assert pdl.launch_args(static["word" if chain == "bert" else "x"])["PDL"] == {"wait": True, "late": 2, "late-loops": 3}[mode]
    for a, e in zip(forward(static), want_static):
        assert torch.equal(a, e), "eager"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward(static)
    for name in static:
        static[name].copy_(fresh[name])
    graph.replay()
    for a, e in zip(outs, want_fresh):
        assert torch.equal(a, e), "graph replay"


def _hopper_ptx(fn, names_types: list[tuple[str, str]], const: dict, pdl_on: bool | int, num_warps: int = 4) -> list[str]:
    """`fn` compiled for sm_90 by Triton's own compiler (no GPU needed), its PTX lines."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = {**const, "PDL": pdl_on}
    signature = {**dict(names_types), **{k: "constexpr" for k in const}}
    src = ASTSource(fn=fn, signature=signature, constexprs={(list(signature).index(k),): v for k, v in const.items()})
    options = dict(num_warps=num_warps, **({"launch_pdl": True} if pdl_on else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"].splitlines()


def _assert_waits_first(lines: list[str], pdl_on: bool | int, one_pass: bool = False, loop_loads: str = "") -> None:
    """With PDL: one `griddepcontrol.wait`, before the first global load. Under `wait` (PDL True)
    no `launch_dependents`: the successor launches as the programs exit. Under `late` (2) one, for
    a kernel with a main loop after the loop's last load, for a one-pass kernel right after the wait
    (`one_pass`); under `late-loops` (3) the former only. Without PDL: no grid dependency control.
    `loop_loads`: what marks the main loop's loads, where the epilogue loads too (the trigger then
    comes after the last of those, not of every load)."""
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    trigger = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    loads = [i for i, line in enumerate(lines) if "ld.global" in line or "cp.async" in line]
    assert loads
    assert len(wait) == (1 if pdl_on else 0)
    if pdl_on:
        assert wait[0] < loads[0]
    if pdl_on is True or not pdl_on or (pdl_on == 3 and one_pass):
        assert not trigger
    elif one_pass:
        assert len(trigger) == 1 and wait[0] < trigger[0] < loads[0]
    else:
        last = [i for i in loads if loop_loads in lines[i]][-1]
        assert len(trigger) == 1 and wait[0] < last < trigger[0]


@pytest.mark.parametrize("pdl_on", [True, False, 2, 3])
def test_pdl_product_compiles_for_hopper(pdl_on):
    """The product kernel compiles for sm_90 with and without PDL (no GPU needed: Triton's own
    compiler, to PTX); with it, `griddepcontrol.wait` comes before the first load, and the
    successor is let in early only under `late` / `late-loops`, after the K loop's last load."""
    from florist.kernels.skinny_gemm import _gemm_kernel

    names = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_split", "unused", "up_offset"]
    types = ["*bf16", "*bf16", "*bf16", "*fp32"] + ["i32"] * 9
    const = dict(K_PER_SPLIT=768, BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, PARTIAL=True, HAS_BIAS=False, SILU_MUL=False, GELU=False,
                 EVEN_K=True)
    _assert_waits_first(_hopper_ptx(_gemm_kernel, list(zip(names, types)), const, pdl_on), pdl_on)


@pytest.mark.parametrize("pdl_on", [True, False, 2, 3])
@pytest.mark.parametrize("kernel", ["layer_norm", "embed_layer_norm", "segment_mean", "gelu"])
def test_pdl_bert_kernels_compile_for_hopper(kernel, pdl_on):
    """BERT's own kernels (LayerNorm + residual, embeddings + LayerNorm, mean pooling, the exact
    GELU) wait under PDL like the rest of a layer's Triton kernels: the wait before their first load."""
    from florist.kernels import embeddings, pooling

    if kernel == "layer_norm":
        fn = norms._layer_norm_kernel
        args = [(n, "*fp16") for n in ("x_ptr", "res_ptr", "w_ptr", "b_ptr", "add_ptr", "out_ptr")]
        args += [(n, "i32") for n in ("num_rows", "num_heads", "stride_xt", "stride_xh", "stride_rt", "stride_rh", "n_cols")] + [("eps", "fp32")]
        const = dict(HAS_RESIDUAL=True, HAS_ADD=True, BLOCK_ROWS=4, BLOCK_COLS=512)
    elif kernel == "embed_layer_norm":
        fn = embeddings._embed_layer_norm_kernel
        args = [(n, "*i32") for n in ("ids_ptr", "pos_ids_ptr", "type_ids_ptr")]
        args += [(n, "*fp16") for n in ("word_ptr", "pos_ptr", "types_ptr", "w_ptr", "b_ptr", "out_ptr")]
        args += [("num_tokens", "i32"), ("H", "i32"), ("eps", "fp32")]
        const = dict(HAS_TYPES=True, BLOCK_ROWS=4, BLOCK_COLS=512)
    elif kernel == "gelu":
        fn = activation._gelu_kernel
        args = [("x_ptr", "*fp16"), ("out_ptr", "*fp16"), ("n", "i32")]
        const = dict(BLOCK=4096)
    else:
        fn = pooling._segment_mean_kernel
        args = [("x_ptr", "*fp16"), ("cu_ptr", "*i32"), ("out_ptr", "*fp32"), ("H", "i32"), ("stride_t", "i32")]
        const = dict(SPAN=256, BLOCK_T=32, BLOCK_H=128, ATOMIC=True, SQRT_LEN=False)
    _assert_waits_first(_hopper_ptx(fn, args, const, pdl_on), pdl_on, one_pass=kernel != "segment_mean")


@pytest.mark.parametrize("pdl_on", [True, 2, 3])
@pytest.mark.parametrize("kernel", ["rms_norm_partials", "rope", "short_attention", "tma_gemm", "tma_gemm_swiglu", "qkv_rope"])
def test_pdl_qwen3_kernels_compile_for_hopper(kernel, pdl_on):
    """The kernels of the Qwen3 step at 128 tokens (and the qkv + rotary product of 129-512) let
    their successor in where `_assert_waits_first` says: the norm and rotary right after their wait
    under `late`, the attention and the TMA products after their loops under `late` and `late-loops`."""
    from florist.kernels import qkv_rope, short_attention, skinny_gemm

    if kernel == "rms_norm_partials":
        fn = norms._rms_norm_kernel
        args = [("x_ptr", "*fp32")] + [(n, "*bf16") for n in ("res_ptr", "w_ptr", "out_ptr", "sum_ptr", "b_ptr")]
        args += [(n, "i32") for n in ("num_rows", "num_heads", "stride_xt", "stride_xh", "stride_rt", "stride_rh", "stride_split", "n_cols")]
        args += [("eps", "fp32")]
        const = dict(HAS_RESIDUAL=True, SPLIT_K=4, HAS_BIAS=False, BLOCK_ROWS=1, BLOCK_COLS=1024)
    elif kernel == "rope":
        fn = rotary._rope_kernel
        args = [(n, "*bf16") for n in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")] + [("pos_ptr", "*i64"), ("cache_ptr", "*fp32")]
        args += [(n, "*bf16") for n in ("q_w_ptr", "k_w_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")] + [("slot_ptr", "*i64")]
        args += [(n, "i32") for n in ("num_q_heads", "num_k_heads", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                                      "stride_vh", "stride_cache", "half_dim")] + [("eps", "fp32")]
        const = dict(NORM=True, STORE_KV=False, BLOCK_Q_HEADS=16, BLOCK_K_HEADS=8, BLOCK_HALF=64)
    elif kernel == "short_attention":
        fn = short_attention._short_attention_kernel
        args = [(n, "*bf16") for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")] + [("cu_ptr", "*i32"), ("num_tokens", "i32"), ("qk_scale", "fp32")]
        args += [(n, "i32") for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh")]
        const = dict(GROUPS=2, HEADS=1, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=32, BLOCK_N=64, CAUSAL=True, IEEE=False, FMA_SCALE=False,
                     MASK_TAIL=False, SEQ_LAST=False)
    elif kernel == "qkv_rope":
        fn = qkv_rope._qkv_rope_kernel
        args = [("x_desc", "tensordesc<bf16[64, 128]>"), ("w_desc", "tensordesc<bf16[128, 128]>"), ("out_ptr", "*bf16"), ("pos_ptr", "*i64"),
                ("cache_ptr", "*fp32"), ("q_w_ptr", "*bf16"), ("k_w_ptr", "*bf16")]
        args += [(n, "i32") for n in ("M", "N", "K", "stride_cache")] + [("eps", "fp32")] + [(n, "i32") for n in ("num_q_heads", "num_k_heads")]
        const = dict(BLOCK_M=64, HEAD_DIM=128, BLOCK_K=128)
    else:
        swiglu = kernel == "tma_gemm_swiglu"
        fn = skinny_gemm._tma_gemm_kernel
        w_box = "tensordesc<bf16[2, 32, 128]>" if swiglu else "tensordesc<bf16[64, 128]>"
        args = [("x_desc", "tensordesc<bf16[64, 128]>"), ("w_desc", w_box), ("out_ptr", "*bf16")]
        args += [(n, "i32") for n in ("M", "N", "K_PER_SPLIT")]
        const = dict(BLOCK_M=64, BLOCK_N=32 if swiglu else 64, BLOCK_K=128, PARTIAL=False, SILU_MUL=swiglu)
    # qkv + rotary loads the positions, cos/sin and norm weights after its loop: the trigger follows the loop's TMA loads
    _assert_waits_first(_hopper_ptx(fn, args, const, pdl_on), pdl_on, one_pass=kernel in ("rms_norm_partials", "rope"),
                        loop_loads="cp.async.bulk.tensor" if kernel == "qkv_rope" else "")


def test_norm_row_blocking():
    """A norm program takes ~2k elements, a warp per 256 of them, but for the measured shapes:
    RMSNorms of 1,024 columns (Qwen3-0.6B's hidden size) one row to an 8-warp program, the same
    for every RMSNorm path (plain, split-K partials, the product's fused norm: their bits agree only so), and
    LayerNorms of 257-512 columns (MiniLM's 384) two rows to a one-warp program."""
    assert norms._row_blocking(1024) == norms._row_blocking(1000) == (1, 1024, 8)
    assert norms._row_blocking(1024, layer_norm=True) == (2, 1024, 8)  # not measured: the formula
    assert norms._row_blocking(384, layer_norm=True) == norms._row_blocking(512, layer_norm=True) == (2, 512, 1)
    assert norms._row_blocking(384) == (4, 512, 8)  # RMSNorms of 384 keep the formula
    assert norms._row_blocking(256, layer_norm=True) == (8, 256, 8)
    assert norms._row_blocking(128) == (16, 128, 8)  # QK-norm over head_dim
    assert norms._row_blocking(2048) == (1, 2048, 8) and norms._row_blocking(4096) == (1, 4096, 16)


def test_pooling_configuration():
    """Mean pooling reads as many rows a load as the longest sequence has (16-256), in 64-column
    programs, a few sequences of 257-1,024 tokens in 64-token spans; FLORIST_POOL_CONFIG's text
    form parses, and bad ones are refused."""
    from florist.kernels.pooling import BEFORE, PoolConfig, pick

    assert pick(1, 384, 2) == PoolConfig(16, 16, 64, 4)
    assert pick(100, 384, 2) == PoolConfig(128, 128, 64, 4)
    assert pick(129, 1024, 128) == PoolConfig(256, 256, 64, 4)
    assert pick(512, 1024, 2) == PoolConfig(64, 64, 64, 4)  # 32 programs unsplit: split in spans
    assert pick(512, 1024, 128) == PoolConfig(256, 256, 64, 4)
    assert pick(4096, 1024, 2) == PoolConfig(256, 256, 64, 4)
    assert PoolConfig.parse("256x32x128x4") == BEFORE
    for bad in ("256x32x128", "256x48x128x4", "16x32x64x4", "ax32x64x4"):
        with pytest.raises(ValueError, match="SPANxBLOCK_TxBLOCK_HxWARPS"):
            PoolConfig.parse(bad)


@pytest.mark.parametrize("preset, expected", [(None, "1"), ("0", "0")])
def test_fp_fusion_default_is_kept(preset, expected):
    """florist.kernels keeps Triton's fused multiply-add default (what every kernel was measured
    and checked with) unless the environment already chose."""
    env = {k: v for k, v in _subprocess_env().items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if preset is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = preset
    code = "import os, florist.kernels; print(os.environ['TRITON_DEFAULT_FP_FUSION'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == expected


# ---------------------------------------------------------------------------------------------
# the exact GELU over every input


def _every_finite(dtype: torch.dtype) -> torch.Tensor:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return every[torch.isfinite(every.float())]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, most_off", [(torch.float16, 40), (torch.bfloat16, 16)])
def test_gelu_is_the_exact_gelu_for_every_input(dtype, most_off):
    """Every finite fp16 / bf16 input: the pass rounds to the float64 exact GELU but for a few
    inputs (33 fp16 and 8 bf16 on the H200): by one unit in the last place where the exact result
    is a normal number, toward zero where it is subnormal (bf16 below x ~ -13, where the fp32
    arithmetic's 1 - Phi(|x|) is itself subnormal)."""
    every = _every_finite(dtype).cuda()
    got, want = activation.gelu_triton(every), activation.gelu_exact_ref(every.cpu()).cuda()
    off = got != want  # -0 and +0 compare equal

    def ordered(t):  # sign-magnitude bits -> integers in the order of the values
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    normal = want.abs() >= torch.finfo(dtype).tiny
    ulps = (ordered(got) - ordered(want))[off & normal].abs()
    assert int(off.sum()) <= most_off, int(off.sum())
    assert ulps.numel() == 0 or int(ulps.max()) <= 1, ulps.tolist()[:20]
    flushed = off & ~normal
    assert (got[flushed].abs() <= want[flushed].abs()).all() and not (got[flushed] * want[flushed] < 0).any()


@pytest.mark.gpu
def test_gelu_approximate_instructions_give_the_same_bits():
    """rcp.approx.ftz / ex2.approx.ftz (the default) against div.full / exp2
    (FLORIST_GELU_APPROX_MUFU=0, a fresh process): the same fp16 and bf16 results for every finite input."""
    script = (
        "import sys, torch\n"
        "from florist.kernels import activation\n"
        "out = {}\n"
        "for dt in (torch.float16, torch.bfloat16):\n"
        "    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dt)\n"
        "    every = every[torch.isfinite(every.float())].cuda()\n"
        "    out[str(dt)] = activation.gelu_triton(every).cpu()\n"
        "torch.save(out, sys.argv[1])\n"
    )
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting in ("1", "0"):
            path = os.path.join(tmp, f"gelu{setting}.pt")
            proc = subprocess.run([sys.executable, "-c", script, path], env=_subprocess_env(FLORIST_GELU_APPROX_MUFU=setting),
                                  cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-4000:]
            results.append(torch.load(path))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_gelu_takes_inline_ptx_only_where_it_compiles():
    """The MUFU instructions are NVIDIA PTX: off under the interpreter, on a ROCm build and with
    FLORIST_GELU_APPROX_MUFU=0; on otherwise (read at import, so each setting in a fresh process)."""
    pytest.importorskip("triton")

    def ptx(hip: str | None = None, **env: str) -> str:
        script = f"import torch\ntorch.version.hip = {hip!r}\nfrom florist.kernels import activation\nprint(activation._PTX)\n"
        base = {k: v for k, v in _subprocess_env().items() if k not in ("TRITON_INTERPRET", "FLORIST_GELU_APPROX_MUFU")}
        proc = subprocess.run([sys.executable, "-c", script], env={**base, **env}, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip()

    assert ptx() == "True"
    assert ptx(hip="6.2") == "False"
    assert ptx(TRITON_INTERPRET="1") == "False"
    assert ptx(FLORIST_GELU_APPROX_MUFU="0") == "False"
