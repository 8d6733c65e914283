"""Every Qwen3 decoder layer of a one-row decode step in one launch.

At batch 1 a decode step is ~28 x 5 kernels that each stream a few MB of weight, and inside a
CUDA graph each costs a few microseconds more than its bytes (docs/kernels.md, "Few rows"). This
kernel runs all layers' stages in one launch of one program per SM, the stages separated by a
grid-wide barrier instead of kernel boundaries. Per layer:

    stage 0  qkv     h = rms_norm(resid) * w_in          qkv[M, Nq + 2 Nkv] = h @ w_qkv.T
    stage 1  attn    QK-norm, rotary, k/v into the cache, attention over it     (decode_attention)
    stage 2  o       mid = attn @ w_o.T + resid
    stage 3  mlp     h2 = rms_norm(mid) * w_post         act[M, I] = silu(h2 @ w_gate.T) * (h2 @ w_up.T)
    stage 4  down    out = act @ w_down.T + mid           (the next layer's resid)

Layers come from a `DecodeStack`: an int64 table of each layer's tensor addresses, from which the
kernel loads the layer's pointers (declared 16-byte aligned, which the host checks: a pointer
loaded from memory otherwise carries no alignment facts and Triton reads 2 bytes at a time, 2x
slower measured). The residual stream ping-pongs between two [M, H] buffers. The layer takes
and returns the residual stream (not a normed h, as the unfused layers pass):
each program normalises the few rows itself where a product needs them (stages 0 and 3), which
costs nothing next to the weight it reads and saves the norm's own stage. The model applies its
final norm after the last layer.

Products (stages 0, 2, 3, 4) tile the output columns: program p takes tiles p, p + P, ... of
[BLOCK_N, K] weight rows, reads each whole (every load of a tile in flight at once), and reduces
along K in fp32 for each of the M rows. A stage's first tile is loaded *before* the wait that
opens it: weights do not depend on the step, so their read overlaps the wait for the stage
before (for stage 0, the previous layer's down projection). Attention items (row, kv head,
context slice) go round the programs the same way; the last slice of a (row, kv head) to finish
merges them (decode_attention's counters).

Barrier. Split in two: `_arrive` (a CTA barrier, so all of the program's stores precede it, then
one release add to a counter whose old value is never read) and `_wait` (spin with acquire loads
until the counter reaches (stage) x P). The next stage's weight is loaded between the two, so its
read overlaps the wait and the arrival does not wait for it (a release waits for the thread's
outstanding loads). The counter only grows within a launch; the last program to leave (a second
counter, `_leave`) puts both words back to 0, so every launch and graph replay finds them at rest.
All programs must be resident at once: the launch never has more programs than the SMs the
process holds (`_sm_count`: MIG slices and CUDA MPS shares included; one program fits on an SM
whenever the kernel compiles), and launches sharing the barrier words
must not run concurrently (one stream).

Under Triton's interpreter the programs run one after another, so a barrier that waits for the
others would never return: there each layer's stage runs as a launch of its own
(`stages_apart=True`, also a GPU option for A/B runs: FLORIST_DECODE_LAYER=apart), and a
one-program launch runs all stages through the barrier code.

Rounding follows the unfused layer: products and sums rounded to the activation dtype where the
unfused layer writes a tensor, the norms rounded as `norms.rms_norm_ref`, SwiGLU computed in
fp32 from the fp32 gate/up sums as the skinny product's epilogue does. The reference
(`qwen3_decode_layer_ref`) composes the torch references of those ops.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from florist.kernels import decode_attention
from florist.kernels.launch_counters import LaunchCounters
from florist.kernels.norms import rms_norm_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is the whole implementation
    triton = None

# NOTE: without triton the kernels below are plain (never called) functions; the annotations are
# strings (`from __future__ import annotations`), which triton.jit reads as constexpr markers.
_jit = triton.jit if triton is not None else (lambda fn: fn)

# FLORIST_DECODE_LAYER=0 keeps decode steps on the unfused layers, =apart runs the fused layer's
# stages as launches of their own (for side-by-side runs).
_MODE = os.environ.get("FLORIST_DECODE_LAYER", "1")
ENABLED = _MODE != "0"
MAX_ROWS = 1  # decode steps of this many rows take the fused layer (at 2 and 4 rows it was slower: docs/benchmarks.md)
_NUM_STAGES = 5


@dataclass(frozen=True)
class LayerConfig:
    """Tile widths (output columns per program and stage), warps, and the context slicing of the
    attention stage."""

    qkv_block_n: int = 32
    o_block_n: int = 8
    mlp_block_n: int = 32
    down_block_n: int = 8
    num_warps: int = 8
    min_split_keys: int = 64
    max_splits: int = 16
    programs: int | None = None  # None: one per SM (never more)
    stages_apart: bool = _MODE == "apart"  # one launch per stage instead of the grid barrier


@dataclass(frozen=True)
class LayerWeights:
    """One Qwen3 decoder layer's tensors, as the model holds them (no biases)."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    o: torch.Tensor  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]: gate rows, then up rows
    down: torch.Tensor  # [H, I]
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int


def qwen3_decode_layer_ref(resid: torch.Tensor, w: LayerWeights, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The unfused layer, op by op (writes this step's k/v into the cache like the kernel)."""
    m = resid.shape[0]
    d, hq, hkv = w.head_dim, w.num_heads, w.num_kv_heads
    h = rms_norm_ref(resid, w.input_norm, w.eps)
    q, k, v = F.linear(h, w.qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
    attn = decode_attention.decode_attention_qk_norm_rope_ref(
        q.reshape(m, hq, d), k.reshape(m, hkv, d), v.reshape(m, hkv, d), w.q_norm, w.k_norm, w.eps, cos_sin_cache,
        k_cache, v_cache, slots, context_lens, scale)
    mid = F.linear(attn.reshape(m, hq * d), w.o) + resid
    gate, up = F.linear(rms_norm_ref(mid, w.post_norm, w.eps), w.gate_up).float().chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(resid.dtype)
    return F.linear(act, w.down) + mid


def applies(resid: torch.Tensor) -> bool:
    """Per step, host-side only (safe in CUDA graphs): Triton on CUDA and 1..MAX_ROWS rows. Whether
    a model's layers fit the kernel is `DecodeStack.fits`, checked once when the stack is built."""
    return ENABLED and triton is not None and resid.is_cuda and resid.dim() == 2 and 0 < resid.shape[0] <= MAX_ROWS


def _shapes_fit(resid, w: LayerWeights, cos_sin_cache, k_cache, v_cache) -> bool:
    """Contiguous tensors of one dtype (fp16/bf16) and device, shaped as the layer's; a
    power-of-two head_dim >= 32 (the attention stage's rotary halves); an fp32 cos | sin cache;
    contiguous [slots, max_len, Hkv, D] caches."""
    if resid.dim() != 2 or resid.dtype not in (torch.float16, torch.bfloat16) or not resid.is_contiguous():
        return False
    hidden, d, hq, hkv = resid.shape[1], w.head_dim, w.num_heads, w.num_kv_heads
    inter = w.down.shape[1] if w.down.dim() == 2 else 0
    shapes = {"input_norm": (hidden,), "post_norm": (hidden,), "qkv": ((hq + 2 * hkv) * d, hidden), "q_norm": (d,), "k_norm": (d,),
              "o": (hidden, hq * d), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    for name, shape in shapes.items():
        t = getattr(w, name)
        if t.shape != shape or t.dtype != resid.dtype or not t.is_contiguous() or t.device != resid.device:
            return False
    return (d >= 32 and d & (d - 1) == 0 and hkv > 0 and hq % hkv == 0
            and k_cache.shape == v_cache.shape and k_cache.dim() == 4 and k_cache.shape[2:] == (hkv, d)
            and k_cache.dtype == v_cache.dtype == resid.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
            and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == d
            and cos_sin_cache.stride(1) == 1
            and all(t.device == resid.device for t in (k_cache, v_cache, cos_sin_cache))
            # the kernel reads the layer tensors through pointers loaded from a table, declared 16-byte aligned
            and all(t.data_ptr() % 16 == 0 for t in (k_cache, v_cache, *(getattr(w, name) for name in shapes))))


# Barrier words ([arrivals, programs out], 0 between launches) and attention merge counters.
_barriers = LaunchCounters("fused decode layer barrier", minimum=2)
_attention_counters = LaunchCounters("fused decode layer attention", minimum=1024)


@functools.cache
def _sm_count(index: int) -> int:
    """SMs this process can hold at once: all of the device's (a MIG slice reports its own), or
    the share that CUDA MPS grants (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). A launch with more
    programs than that would wait forever at its first barrier."""
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if share:
        try:
            sms = max(1, int(sms * min(100.0, float(share)) / 100))
        except ValueError:
            sms = 1  # unreadable: one program is always resident
    return sms


@dataclass(frozen=True)
class DecodeStack:
    """A model's layers for `qwen3_decode_layers_triton`: their tensors' addresses in one int64
    table [len(TABLES), num_layers] on the device (the kernel loads each layer's pointers from
    it), and the tensors themselves, kept alive while the table points at them."""

    layers: tuple[LayerWeights, ...]
    k_caches: tuple[torch.Tensor, ...]
    v_caches: tuple[torch.Tensor, ...]
    table: torch.Tensor

    TABLES = ("input_norm", "qkv", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down")  # then k_cache, v_cache

    @classmethod
    def build(cls, layers, k_caches, v_caches) -> "DecodeStack":
        first = layers[0]
        for w, k, v in zip(layers, k_caches, v_caches, strict=True):
            same = (w.eps, w.num_heads, w.num_kv_heads, w.head_dim, w.down.shape) == (first.eps, first.num_heads, first.num_kv_heads,
                                                                                      first.head_dim, first.down.shape)
            if not same or k.shape != k_caches[0].shape:
                raise ValueError("the fused decode layers need layers of one geometry and caches of one shape")
        device = first.qkv.device
        # NOTE: made on an eager step (the first decode), never while a CUDA graph is captured.
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), "build the decode stack before graph capture"
        rows = [[getattr(w, name).data_ptr() for w in layers] for name in cls.TABLES]
        rows += [[t.data_ptr() for t in k_caches], [t.data_ptr() for t in v_caches]]
        return cls(tuple(layers), tuple(k_caches), tuple(v_caches), torch.tensor(rows, dtype=torch.int64, device=device))

    def fits(self, resid: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
        return all(_shapes_fit(resid, w, cos_sin_cache, k, v) for w, k, v in zip(self.layers, self.k_caches, self.v_caches))


def qwen3_decode_layer_triton(resid, w: LayerWeights, cos_sin_cache, k_cache, v_cache, slots, context_lens, scale: float,
                              config: LayerConfig | None = None, stages_apart: bool | None = None) -> torch.Tensor:
    """One layer through the kernel (a stack of one; `qwen3_decode_layers_triton`)."""
    stack = DecodeStack.build([w], [k_cache], [v_cache])
    return qwen3_decode_layers_triton(resid, stack, cos_sin_cache, slots, context_lens, scale, config, stages_apart)


def qwen3_decode_layers_triton(resid, stack: DecodeStack, cos_sin_cache, slots, context_lens, scale: float,
                               config: LayerConfig | None = None, stages_apart: bool | None = None) -> torch.Tensor:
    """Every layer of `stack` in one launch: resid [M, H] into the first layer -> the residual
    stream out of the last. `stages_apart`: one launch per layer and stage (no grid barrier);
    None: apart under the interpreter, else as `config` says. The stack's layers were checked when
    it was built (`DecodeStack.fits`); here only the step's tensors against its first layer."""
    c = config or LayerConfig()
    w, k_cache = stack.layers[0], stack.k_caches[0]
    assert _shapes_fit(resid, w, cos_sin_cache, k_cache, stack.v_caches[0]), "the fused decode layer does not take these tensors"
    num_layers = len(stack.layers)
    m, hidden = resid.shape
    d, hq, hkv = w.head_dim, w.num_heads, w.num_kv_heads
    inter = w.down.shape[1]
    n_qkv = (hq + 2 * hkv) * d
    device = resid.device
    interpreted = not resid.is_cuda
    if stages_apart is None:
        stages_apart = interpreted or c.stages_apart
    if interpreted:
        programs = c.programs or 4
    else:
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        programs = min(c.programs or sms, sms)  # all resident at once: see the module docstring
    group = hq // hkv
    block_h = max(16, triton.next_power_of_2(group))
    block_n_keys = 64 if d <= 128 else 32
    splits = max(1, min(c.max_splits, programs // (m * hkv)))
    splits = 1 << (splits.bit_length() - 1)
    resid_buf = torch.empty((2, m, hidden), dtype=resid.dtype, device=device)  # layer l reads [l % 2], writes [(l + 1) % 2]
    resid_buf[0].copy_(resid)
    qkv = torch.empty((m, n_qkv), dtype=resid.dtype, device=device)
    attn = torch.empty((m, hq, d), dtype=resid.dtype, device=device)
    mid = torch.empty_like(resid)
    act = torch.empty((m, inter), dtype=resid.dtype, device=device)
    part_acc = torch.empty((m, hkv, splits, block_h, d), dtype=torch.float32, device=device)
    part_ml = torch.empty((m, hkv, splits, 2, block_h), dtype=torch.float32, device=device)
    counters = _attention_counters.get(device, m * hkv)
    barrier = _barriers.get(device, 2)
    args = (resid_buf, stack.table, num_layers, qkv, cos_sin_cache, slots, context_lens, attn, part_acc, part_ml, counters, mid, act,
            barrier, m, hidden, hq * d, hkv * d, inter, k_cache.shape[1], hkv, group, cos_sin_cache.stride(0), w.eps,
            scale * decode_attention._LOG2E, programs)
    meta = dict(HIDDEN_BLOCK=triton.next_power_of_2(hidden), Q_BLOCK=triton.next_power_of_2(hq * d),
                INTER_BLOCK=triton.next_power_of_2(inter), BLOCK_M=triton.next_power_of_2(m), HEAD_DIM=d,
                QKV_BN=c.qkv_block_n, O_BN=c.o_block_n, MLP_BN=c.mlp_block_n, DOWN_BN=c.down_block_n,
                NUM_SPLITS=splits, MIN_SPLIT_KEYS=c.min_split_keys, BLOCK_KEYS=block_n_keys, BLOCK_H=block_h,
                num_warps=c.num_warps)
    if stages_apart:
        for layer in range(num_layers):
            for stage in range(_NUM_STAGES):
                _decode_layers_kernel[(programs,)](*args, layer, layer + 1, FIRST=stage, LAST=stage, BARRIERS=False, **meta)
    else:
        _decode_layers_kernel[(programs,)](*args, 0, num_layers, FIRST=0, LAST=_NUM_STAGES - 1, BARRIERS=True, **meta)
    return resid_buf[num_layers % 2]


@_jit
def _arrive(bar_ptr):
    """This program's stores so far are done; count it in at the barrier (no wait: module docstring)."""
    tl.debug_barrier()  # all of this program's threads have issued their stores
    one = tl.full((1,), 1, tl.int32)
    tl.atomic_add(bar_ptr + tl.zeros((1,), tl.int32), one, sem="release", scope="gpu")  # the old value is never read


@_jit
def _wait(bar_ptr, target):
    """Until `target` arrivals have been counted (every program's, up to this barrier)."""
    now = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while now < target:
        now = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@_jit
def _leave(bar_ptr, num_programs):
    """At the end of a launch that used the barrier: the last program out puts both words back to
    0 for the next launch (every program has passed its last wait before it counts itself out)."""
    tl.debug_barrier()
    first = tl.zeros((1,), tl.int32)
    left = tl.atomic_add(bar_ptr + 1 + first, first + 1, sem="acq_rel", scope="gpu")
    last = left == num_programs - 1
    tl.store(bar_ptr + first, first, mask=last)
    tl.store(bar_ptr + 1 + first, first, mask=last)


@_jit
def _weight_tile(w_ptr, n0, n_rows, k_cols, BN: tl.constexpr, KB: tl.constexpr):
    """w[n0 : n0 + BN, :k_cols] as a [BN, KB] tile (rows >= n_rows and columns >= k_cols read 0)."""
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, KB)
    mask = (rn < n_rows)[:, None] & (rk < k_cols)[None, :]
    return tl.load(w_ptr + rn.to(tl.int64)[:, None] * k_cols + rk[None, :], mask=mask, other=0.0)


@_jit
def _row(x_ptr, row, n, NB: tl.constexpr):
    """Row `row` of a contiguous [*, n] activation written earlier in this launch, in fp32 (read
    through L2: another program wrote it)."""
    c = tl.arange(0, NB)
    return tl.load(x_ptr + row * n + c, mask=c < n, other=0.0, cache_modifier=".cg").to(tl.float32)


@_jit
def _normed_row(x_ptr, w_ptr, row, n, eps, NB: tl.constexpr):
    """rms_norm(x[row]) * w, rounded as norms.rms_norm_ref rounds it, in fp32 [NB] (0 past n)."""
    c = tl.arange(0, NB)
    ok = c < n
    x = tl.load(x_ptr + row * n + c, mask=ok, other=0.0, cache_modifier=".cg")
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    return y.to(x.dtype).to(tl.float32)


@_jit
def _qkv_tile(w, t, resid_ptr, in_w_ptr, qkv_ptr, M, hidden, n_qkv, eps,
              BLOCK_M: tl.constexpr, BN: tl.constexpr, HIDDEN_BLOCK: tl.constexpr):
    rn = t * BN + tl.arange(0, BN)
    wf = w.to(tl.float32)
    for r in tl.static_range(BLOCK_M):
        if r < M:
            h = _normed_row(resid_ptr, in_w_ptr, r, hidden, eps, HIDDEN_BLOCK)
            y = tl.sum(wf * h[None, :], axis=1)
            tl.store(qkv_ptr + r * n_qkv + rn, y.to(qkv_ptr.dtype.element_ty), mask=rn < n_qkv)


@_jit
def _add_tile(w, t, x_ptr, k_cols, res_ptr, out_ptr, M, hidden, BLOCK_M: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr):
    """out[:, tile t] = (x @ w_tile.T rounded) + res[:, tile t], rounded: o_proj and down_proj."""
    rn = t * BN + tl.arange(0, BN)
    n_ok = rn < hidden
    wf = w.to(tl.float32)
    for r in tl.static_range(BLOCK_M):
        if r < M:
            x = _row(x_ptr, r, k_cols, KB)
            y = tl.sum(wf * x[None, :], axis=1).to(out_ptr.dtype.element_ty).to(tl.float32)
            res = tl.load(res_ptr + r * hidden + rn, mask=n_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + r * hidden + rn, (y + res).to(out_ptr.dtype.element_ty), mask=n_ok)


@_jit
def _mlp_tile(w_gate, w_up, t, mid_ptr, post_w_ptr, act_ptr, M, hidden, inter, eps,
              BLOCK_M: tl.constexpr, BN: tl.constexpr, HIDDEN_BLOCK: tl.constexpr):
    rn = t * BN + tl.arange(0, BN)
    gf = w_gate.to(tl.float32)
    uf = w_up.to(tl.float32)
    for r in tl.static_range(BLOCK_M):
        if r < M:
            h = _normed_row(mid_ptr, post_w_ptr, r, hidden, eps, HIDDEN_BLOCK)
            gate = tl.sum(gf * h[None, :], axis=1)
            up = tl.sum(uf * h[None, :], axis=1)
            act = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(act_ptr + r * inter + rn, act.to(act_ptr.dtype.element_ty), mask=rn < inter)


@_jit
def _residual_stage(w_ptr, x_ptr, k_cols, res_ptr, out_ptr, M, hidden, bar_ptr, target, pid, P,
                    BLOCK_M: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr, BARRIERS: tl.constexpr):
    """out = x @ w.T + res over this program's tiles (o_proj, down_proj): the first tile's weight
    is read before the wait for `target` arrivals, and the stage ends with this program's arrival."""
    tiles = tl.cdiv(hidden, BN)
    w = _weight_tile(w_ptr, pid * BN, hidden, k_cols, BN, KB)  # read while the others finish
    if BARRIERS:
        _wait(bar_ptr, target)
    if pid < tiles:
        _add_tile(w, pid, x_ptr, k_cols, res_ptr, out_ptr, M, hidden, BLOCK_M, BN, KB)
    for t in range(pid + P, tiles, P):
        w = _weight_tile(w_ptr, t * BN, hidden, k_cols, BN, KB)
        _add_tile(w, t, x_ptr, k_cols, res_ptr, out_ptr, M, hidden, BLOCK_M, BN, KB)
    if BARRIERS:
        _arrive(bar_ptr)


@_jit
def _layer_ptr(table_ptr, which, num_layers, layer, like_ptr):
    """Layer `layer`'s tensor number `which` of the stack's table, as a pointer like like_ptr's."""
    ptr = tl.load(table_ptr + which * num_layers + layer).to(tl.pointer_type(like_ptr.dtype.element_ty))
    # A pointer loaded from memory carries no alignment facts; without them Triton reads the
    # weights 2 bytes at a time (2x slower, measured). `_shapes_fit` checks the alignment.
    return tl.multiple_of(ptr, 16)


@_jit
def _decode_layers_kernel(buf_ptr, table_ptr, num_layers, qkv_ptr, cos_sin_ptr, slots_ptr, lens_ptr, attn_ptr, part_acc_ptr, part_ml_ptr,
                          counter_ptr, mid_ptr, act_ptr, bar_ptr,
                          M, hidden, n_q, n_kv, inter, max_len, num_kv_heads, group, stride_cs, eps, scale_log2, P,
                          layer_start, layer_end,
                          HIDDEN_BLOCK: tl.constexpr, Q_BLOCK: tl.constexpr, INTER_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                          HEAD_DIM: tl.constexpr, QKV_BN: tl.constexpr, O_BN: tl.constexpr, MLP_BN: tl.constexpr,
                          DOWN_BN: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr,
                          BLOCK_KEYS: tl.constexpr, BLOCK_H: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                          BARRIERS: tl.constexpr):
    """Stages FIRST..LAST of layers layer_start..layer_end-1. BARRIERS (every stage of every
    layer in one launch): each stage ends with `_arrive`, and the next one loads its first weight
    tile, then waits until all P programs have arrived (the g-th barrier of the launch waits for
    g * P arrivals)."""
    pid = tl.program_id(0)
    n_qkv = n_q + 2 * n_kv
    rows = M * hidden
    for layer in range(layer_start, layer_end):
        g = (layer - layer_start) * 5  # barriers before this layer's first stage
        resid_ptr = buf_ptr + (layer % 2) * rows
        out_ptr = buf_ptr + ((layer + 1) % 2) * rows

        # -- stage 0: input norm + qkv projection ----------------------------------------------
        if FIRST <= 0:
            in_w_ptr = _layer_ptr(table_ptr, 0, num_layers, layer, buf_ptr)
            w_qkv_ptr = _layer_ptr(table_ptr, 1, num_layers, layer, buf_ptr)
            qkv_tiles = tl.cdiv(n_qkv, QKV_BN)
            w = _weight_tile(w_qkv_ptr, pid * QKV_BN, n_qkv, hidden, QKV_BN, HIDDEN_BLOCK)
            if BARRIERS:
                if layer > layer_start:
                    _wait(bar_ptr, g * P)
            if pid < qkv_tiles:
                _qkv_tile(w, pid, resid_ptr, in_w_ptr, qkv_ptr, M, hidden, n_qkv, eps, BLOCK_M, QKV_BN, HIDDEN_BLOCK)
            for t in range(pid + P, qkv_tiles, P):
                w = _weight_tile(w_qkv_ptr, t * QKV_BN, n_qkv, hidden, QKV_BN, HIDDEN_BLOCK)
                _qkv_tile(w, t, resid_ptr, in_w_ptr, qkv_ptr, M, hidden, n_qkv, eps, BLOCK_M, QKV_BN, HIDDEN_BLOCK)
            if BARRIERS:
                _arrive(bar_ptr)

        # -- stage 1: QK-norm + rotary + k/v store + attention -----------------------------------
        if FIRST <= 1 and LAST >= 1:
            q_w_ptr = _layer_ptr(table_ptr, 2, num_layers, layer, buf_ptr)
            k_w_ptr = _layer_ptr(table_ptr, 3, num_layers, layer, buf_ptr)
            k_cache_ptr = _layer_ptr(table_ptr, 8, num_layers, layer, buf_ptr)
            v_cache_ptr = _layer_ptr(table_ptr, 9, num_layers, layer, buf_ptr)
            if BARRIERS:
                _wait(bar_ptr, (g + 1) * P)
            items = M * num_kv_heads * NUM_SPLITS
            for item in range(pid, items, P):
                b = item // (num_kv_heads * NUM_SPLITS)
                h = (item // NUM_SPLITS) % num_kv_heads
                s = item % NUM_SPLITS
                decode_attention.decode_program(
                    b, h, s, qkv_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, lens_ptr, attn_ptr, part_acc_ptr, part_ml_ptr, counter_ptr,
                    n_qkv, HEAD_DIM, max_len, num_kv_heads, group, HEAD_DIM, scale_log2,
                    qkv_ptr + n_q, qkv_ptr + n_q + n_kv, q_w_ptr, k_w_ptr, cos_sin_ptr, n_qkv, HEAD_DIM, n_qkv, HEAD_DIM, stride_cs, eps,
                    NUM_SPLITS, MIN_SPLIT_KEYS, BLOCK_KEYS, BLOCK_H, HEAD_DIM, False, True)
            if BARRIERS:
                _arrive(bar_ptr)

        # -- stage 2: o projection + residual ----------------------------------------------------
        if FIRST <= 2 and LAST >= 2:
            w_o_ptr = _layer_ptr(table_ptr, 4, num_layers, layer, buf_ptr)
            _residual_stage(w_o_ptr, attn_ptr, n_q, resid_ptr, mid_ptr, M, hidden, bar_ptr, (g + 2) * P, pid, P,
                            BLOCK_M, O_BN, Q_BLOCK, BARRIERS)

        # -- stage 3: post-attention norm + gate/up + SwiGLU -------------------------------------
        if FIRST <= 3 and LAST >= 3:
            post_w_ptr = _layer_ptr(table_ptr, 5, num_layers, layer, buf_ptr)
            w_gu_ptr = _layer_ptr(table_ptr, 6, num_layers, layer, buf_ptr)
            mlp_tiles = tl.cdiv(inter, MLP_BN)
            w_gate = _weight_tile(w_gu_ptr, pid * MLP_BN, inter, hidden, MLP_BN, HIDDEN_BLOCK)
            w_up = _weight_tile(w_gu_ptr + inter * hidden, pid * MLP_BN, inter, hidden, MLP_BN, HIDDEN_BLOCK)
            if BARRIERS:
                _wait(bar_ptr, (g + 3) * P)
            if pid < mlp_tiles:
                _mlp_tile(w_gate, w_up, pid, mid_ptr, post_w_ptr, act_ptr, M, hidden, inter, eps, BLOCK_M, MLP_BN, HIDDEN_BLOCK)
            for t in range(pid + P, mlp_tiles, P):
                w_gate = _weight_tile(w_gu_ptr, t * MLP_BN, inter, hidden, MLP_BN, HIDDEN_BLOCK)
                w_up = _weight_tile(w_gu_ptr + inter * hidden, t * MLP_BN, inter, hidden, MLP_BN, HIDDEN_BLOCK)
                _mlp_tile(w_gate, w_up, t, mid_ptr, post_w_ptr, act_ptr, M, hidden, inter, eps, BLOCK_M, MLP_BN, HIDDEN_BLOCK)
            if BARRIERS:
                _arrive(bar_ptr)

        # -- stage 4: down projection + residual -------------------------------------------------
        if LAST >= 4:
            w_down_ptr = _layer_ptr(table_ptr, 7, num_layers, layer, buf_ptr)
            # its arrival is what the next layer's qkv stage waits for
            _residual_stage(w_down_ptr, act_ptr, inter, mid_ptr, out_ptr, M, hidden, bar_ptr, (g + 4) * P, pid, P,
                            BLOCK_M, DOWN_BN, INTER_BLOCK, BARRIERS)
    if BARRIERS:
        _leave(bar_ptr, P)
