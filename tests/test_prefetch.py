"""L2 prefetch (florist/kernels/prefetch.py): a hint that must never change a value.

On CPU it is a no-op. On CUDA (sm_90+) the kernel runs over tensors of odd byte sizes, views
with a storage offset, and inside a captured graph on a side stream, and every tensor keeps its
bits (NaN and inf included)."""

from __future__ import annotations

import pytest
import torch

from florist.kernels import prefetch

CUDA = torch.cuda.is_available()


def test_no_op_on_cpu():
    t = torch.randn(37, 129)
    before = t.clone()
    assert not prefetch.available(t.device)
    prefetch.prefetch_l2([t, t[3:]])
    assert torch.equal(t, before)


needs_sm90 = pytest.mark.skipif(not CUDA or not prefetch.available(torch.device("cuda")), reason="needs CUDA sm_90+ with triton")


@needs_sm90
@pytest.mark.parametrize("shape", [(1,), (7, 3), (4096, 1024), (1023, 1021), (3, 524289)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_values_unchanged(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    t = (torch.randn(shape, device="cuda", generator=g) * 100).to(dtype)
    if dtype.is_floating_point and t.numel() > 2:
        t.view(-1)[0], t.view(-1)[1], t.view(-1)[-1] = float("nan"), float("inf"), float("-inf")
    before = t.clone()
    prefetch.prefetch_l2([t, t.view(-1)[5:], t.view(-1)[: max(1, t.numel() // 3)]])
    torch.cuda.synchronize()
    assert torch.equal(t.view(torch.uint8) if dtype.is_floating_point else t, before.view(torch.uint8) if dtype.is_floating_point else before)


@needs_sm90
def test_in_graph_on_side_stream():
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def step():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch.prefetch_l2([w])
        y = x @ w.T
        main.wait_stream(side)
        return y

    want = x @ w.T
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
