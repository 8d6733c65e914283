"""The one-launch Qwen3 decode layer (florist/kernels/decode_layer.py) against the unfused layer's
references: under Triton's interpreter on the CPU (each stage a launch of its own, and one
program running every stage through the grid barrier), compiled on CUDA (skipped without it)."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

from florist.kernels import decode_layer

CASES = """
import math
import torch
from florist.kernels import decode_layer as dl

TOL = {torch.bfloat16: 4e-2, torch.float16: 8e-3}


def make(g, rows, hidden, heads, kv_heads, head_dim, inter, slots, max_len, dtype, device, poison=True):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    w = dl.LayerWeights(
        input_norm=1 + rand(hidden, scale=0.3), qkv=rand((heads + 2 * kv_heads) * head_dim, hidden, scale=hidden**-0.5),
        q_norm=1 + rand(head_dim, scale=0.3), k_norm=1 + rand(head_dim, scale=0.3), o=rand(hidden, heads * head_dim, scale=(heads * head_dim)**-0.5),
        post_norm=1 + rand(hidden, scale=0.3), gate_up=rand(2 * inter, hidden, scale=hidden**-0.5), down=rand(hidden, inter, scale=inter**-0.5),
        eps=1e-6, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    resid = rand(rows, hidden, scale=2.0)
    k_cache, v_cache = rand(slots, max_len, kv_heads, head_dim), rand(slots, max_len, kv_heads, head_dim)
    slot_ids = torch.randperm(slots, generator=g)[:rows]
    lens = torch.randint(1, max_len + 1, (rows,), generator=g, dtype=torch.int32)
    lens[0] = 1
    if rows > 1:
        lens[1] = max_len
    for b in range(rows if poison else 0):  # rows from this step's position on hold NaN / inf: written before read, or never read
        k_cache[slot_ids[b], int(lens[b]) - 1 :] = float("nan")
        v_cache[slot_ids[b], int(lens[b]) - 1 :] = float("inf")
    angles = torch.rand(max_len, head_dim // 2, generator=g) * 50
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    to = lambda t: t.to(device)
    w = dl.LayerWeights(**{f: (to(v) if isinstance(v, torch.Tensor) else v) for f, v in vars(w).items()})
    return w, to(resid), to(cos_sin), to(k_cache), to(v_cache), to(slot_ids), to(lens)


def reference(w, resid, cos_sin, k_cache, v_cache, slot_ids, lens, scale):
    # fp32 math on the CPU, from the same (rounded) inputs; the caches are written in place
    cpu = dl.LayerWeights(**{f: (v.float().cpu() if isinstance(v, torch.Tensor) else v) for f, v in vars(w).items()})
    # (the reference's masked attention would turn the NaN / inf of unread rows into NaN: zeroed here)
    k, v = (torch.nan_to_num(c.float().cpu(), nan=0.0, posinf=0.0) for c in (k_cache, v_cache))
    out = dl.qwen3_decode_layer_ref(resid.float().cpu(), cpu, cos_sin.cpu(), k, v, slot_ids.cpu(), lens.cpu(), scale)
    return out, k, v


def written(cache, slot_ids, lens):
    return torch.stack([cache[int(s), int(n) - 1] for s, n in zip(slot_ids.cpu(), lens.cpu())]).float().cpu()


def check(device):
    g = torch.Generator().manual_seed(0)
    shapes = [  # rows, hidden, q heads, kv heads, head_dim, intermediate, slots, max_len
        (1, 64, 4, 2, 32, 96, 3, 40),
        (3, 48, 2, 1, 32, 80, 4, 33),   # hidden and intermediate not powers of two
        (2, 64, 6, 2, 64, 64, 3, 150),  # group 3, contexts long enough to split
    ]
    if device == "cuda":
        shapes += [(rows, 1024, 16, 8, 128, 3072, 6, 300) for rows in (1, 2)]  # Qwen3-0.6B
    # NOTE: the local interpreter rounds fp32 -> bf16 by truncation: bf16 runs compiled only.
    # Each (shape, dtype, config, stages) is a compile of its own: on CUDA fp16 runs on the first
    # shape only, and the stages apart (5 compiles) on the first shape and Qwen3's one row only.
    cases = [(s, torch.float16) for s in shapes[:1]] + [(s, torch.bfloat16) for s in shapes] if device == "cuda" else \
        [(s, torch.float16) for s in shapes]
    configs = [dl.LayerConfig(programs=4, min_split_keys=16, qkv_block_n=16, o_block_n=8, mlp_block_n=16, down_block_n=8),
               dl.LayerConfig(programs=3, min_split_keys=8, qkv_block_n=8, o_block_n=16, mlp_block_n=8, down_block_n=16)]
    if device == "cuda":
        configs = [dl.LayerConfig(), dl.LayerConfig(min_split_keys=16, mlp_block_n=32, num_warps=16, programs=100)]
    for shape, dtype in cases:
        w, resid, cos_sin, k_cache, v_cache, slot_ids, lens = make(g, *shape, dtype, device)
        scale = shape[4] ** -0.5
        assert dl._shapes_fit(resid, w, cos_sin, k_cache, v_cache)
        want, want_k, want_v = reference(w, resid, cos_sin, k_cache, v_cache, slot_ids, lens, scale)
        runs = [(c, True) for c in configs] if device == "cpu" else [(c, False) for c in configs]
        if device == "cuda" and (shape == shapes[0] or shape[:2] == (1, 1024)):
            runs.append((configs[0], True))
        first = None
        for config, apart in runs:
            kc, vc = k_cache.clone(), v_cache.clone()
            out = dl.qwen3_decode_layer_triton(resid, w, cos_sin, kc, vc, slot_ids, lens, scale, config, stages_apart=apart)
            tag = f"{dtype} {shape} {config} apart={apart}"
            assert out.shape == resid.shape and out.dtype == dtype, tag
            assert torch.isfinite(out).all(), tag + ": stale NaN/inf leaked into the output"
            torch.testing.assert_close(out.float().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype], msg=lambda m: f"{tag}: {m}")
            torch.testing.assert_close(written(kc, slot_ids, lens), written(want_k, slot_ids, lens), rtol=TOL[dtype], atol=TOL[dtype])
            torch.testing.assert_close(written(vc, slot_ids, lens), written(want_v, slot_ids, lens), rtol=TOL[dtype], atol=TOL[dtype])
            assert not dl._attention_counters.get(resid.device, 1).any(), "merge counters back at zero"
            assert not dl._barriers.get(resid.device, 2).any(), "barrier words back at rest"
            if first is None:
                first = out
            elif config == configs[0]:
                assert torch.equal(out, first), tag + ": one launch and the stages apart give the same bits"
    print("decode layer ok")


def check_one_program(device):
    # One program runs every stage in one launch: the grid barrier's code path on the interpreter.
    g = torch.Generator().manual_seed(1)
    w, resid, cos_sin, k_cache, v_cache, slot_ids, lens = make(g, 2, 64, 4, 2, 32, 96, 3, 40, torch.float16, device)
    want, _, _ = reference(w, resid, cos_sin, k_cache, v_cache, slot_ids, lens, 32**-0.5)
    config = dl.LayerConfig(programs=1, min_split_keys=8, qkv_block_n=16, o_block_n=16, mlp_block_n=32, down_block_n=16)
    out = dl.qwen3_decode_layer_triton(resid, w, cos_sin, k_cache.clone(), v_cache.clone(), slot_ids, lens, 32**-0.5, config, stages_apart=False)
    torch.testing.assert_close(out.float().cpu(), want, rtol=TOL[torch.float16], atol=TOL[torch.float16])
    bar = dl._barriers.get(resid.device, 2)
    assert not bar.any(), f"the barrier words are back at 0 for the next launch: {bar.tolist()}"
    print("decode layer one program ok")


def check_stack(device):
    # Three layers of their own weights and caches in one launch (one program on the interpreter,
    # so the grid barrier's code runs there too) and as launches per layer and stage, against the
    # per-layer references; the caches each layer writes are its own.
    g = torch.Generator().manual_seed(4)
    shape = (1, 1024, 16, 8, 128, 3072, 4, 300) if device == "cuda" else (2, 64, 4, 2, 32, 96, 3, 40)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    layers = [make(g, *shape, dtype, device) for _ in range(3)]
    resid, cos_sin, slot_ids, lens = layers[0][1], layers[0][2], layers[0][5], layers[0][6]
    for layer in layers:  # every layer's cache poisoned where layer 0's is: at and past this step's positions
        for cache, poison in ((layer[3], float("nan")), (layer[4], float("inf"))):
            cache.nan_to_num_(nan=0.5, posinf=0.5)
            for b in range(shape[0]):
                cache[slot_ids[b], int(lens[b]) - 1 :] = poison
    scale = shape[4] ** -0.5
    want, want_caches = resid, []
    for w, _, _, k_cache, v_cache, _, _ in layers:
        # the same positions as layer 0's (one step of one batch): poison at and past them
        want, k, v = reference(w, want.to(dtype), cos_sin, k_cache, v_cache, slot_ids, lens, scale)
        want_caches.append((k, v))
    ws = [w for w, *_ in layers]
    programs = None if device == "cuda" else 1
    outs = []
    for apart in (False, True):
        kcs = [l[3].clone() for l in layers]
        vcs = [l[4].clone() for l in layers]
        stack = dl.DecodeStack.build(ws, kcs, vcs)
        out = dl.qwen3_decode_layers_triton(resid, stack, cos_sin, slot_ids, lens, scale, dl.LayerConfig(programs=programs, min_split_keys=16),
                                            stages_apart=apart)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float().cpu(), want, rtol=TOL[dtype] * 2, atol=TOL[dtype] * 2, msg=lambda m: f"apart={apart}: {m}")
        for (k, v), kc, vc in zip(want_caches, kcs, vcs):
            torch.testing.assert_close(written(kc, slot_ids, lens), written(k, slot_ids, lens), rtol=TOL[dtype] * 2, atol=TOL[dtype] * 2)
            torch.testing.assert_close(written(vc, slot_ids, lens), written(v, slot_ids, lens), rtol=TOL[dtype] * 2, atol=TOL[dtype] * 2)
        assert not dl._barriers.get(resid.device, 2).any(), "barrier words back at rest"
        outs.append(out.clone())
    assert torch.equal(outs[0], outs[1]), "one launch and the stages apart give the same bits"
    print("decode layer stack ok")


def check_graph(device):
    # Captured in a CUDA graph and replayed: the same bits as eager, step after step.
    g = torch.Generator().manual_seed(2)
    w, resid, cos_sin, k_cache, v_cache, slot_ids, lens = make(g, 1, 1024, 16, 8, 128, 3072, 4, 300, torch.bfloat16, device)
    scale = 128**-0.5
    eager = dl.qwen3_decode_layer_triton(resid, w, cos_sin, k_cache.clone(), v_cache.clone(), slot_ids, lens, scale)
    kc, vc = k_cache.clone(), v_cache.clone()
    stack = dl.DecodeStack.build([w], [kc], [vc])  # its pointer table is made before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dl.qwen3_decode_layers_triton(resid, stack, cos_sin, slot_ids, lens, scale)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    print("decode layer graph ok")
"""


CHECKS = {"check": "decode layer ok", "check_one_program": "decode layer one program ok", "check_stack": "decode layer stack ok"}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_decode_layer_interpreted(check):
    run_interpreted(CASES, f"{check}('cpu')", CHECKS[check], timeout=900)


@pytest.mark.gpu
@pytest.mark.parametrize("check", sorted(CHECKS) + ["check_graph"])
def test_decode_layer_compiled(check):
    namespace: dict = {}
    exec(CASES, namespace)
    namespace[check]("cuda")


def test_decode_layer_is_for_one_row_on_cuda_only():
    # On the CPU (and for more rows than MAX_ROWS) the model runs its unfused layers, whose
    # composition is the reference: it writes this step's k/v and stays finite.
    namespace: dict = {}
    exec(CASES, namespace)
    g = torch.Generator().manual_seed(3)
    w, resid, cos_sin, k_cache, v_cache, slot_ids, lens = namespace["make"](g, 2, 64, 4, 2, 32, 96, 3, 40, torch.float32, "cpu", poison=False)
    assert not decode_layer.applies(resid) and not decode_layer.applies(resid[:1])
    kc = k_cache.clone()
    got = decode_layer.qwen3_decode_layer_ref(resid, w, cos_sin, kc, v_cache.clone(), slot_ids, lens, 0.2)
    assert torch.isfinite(got).all() and not torch.equal(kc, k_cache)


def test_decode_stack_checks_every_layer():
    # The kernel reads layer tensors through pointers it declares 16-byte aligned: a misaligned or
    # misshapen layer anywhere in the stack makes it not fit (the model then runs the unfused layers).
    namespace: dict = {}
    exec(CASES, namespace)
    g = torch.Generator().manual_seed(5)
    layers = [namespace["make"](g, 1, 64, 4, 2, 32, 96, 3, 40, torch.float16, "cpu", poison=False) for _ in range(3)]
    resid, cos_sin = layers[0][1], layers[0][2]
    ws, ks, vs = [l[0] for l in layers], [l[3] for l in layers], [l[4] for l in layers]
    assert decode_layer.DecodeStack.build(ws, ks, vs).fits(resid, cos_sin)
    shifted = torch.empty(ws[2].o.numel() + 1, dtype=torch.float16)[1:].view_as(ws[2].o)  # 2 bytes off
    shifted.copy_(ws[2].o)
    misaligned = [*ws[:2], decode_layer.LayerWeights(**{**vars(ws[2]), "o": shifted})]
    assert not decode_layer.DecodeStack.build(misaligned, ks, vs).fits(resid, cos_sin)
    odd = [*ws[:2], decode_layer.LayerWeights(**{**vars(ws[2]), "down": ws[2].down[:, :-1].contiguous()})]
    with pytest.raises(ValueError, match="one geometry"):
        decode_layer.DecodeStack.build(odd, ks, vs)


def test_programs_never_outnumber_the_sms_this_process_holds(monkeypatch):
    # All programs must be resident at once (the grid barrier): under CUDA MPS with a thread
    # percentage the process holds only that share of the SMs.
    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    for share, want in ((None, 132), ("50", 66), ("12.5", 16), ("0.1", 1), ("200", 132), ("lots", 1)):
        decode_layer._sm_count.cache_clear()
        if share is None:
            monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
        else:
            monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", share)
        assert decode_layer._sm_count(0) == want, share
    decode_layer._sm_count.cache_clear()
