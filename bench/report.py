"""What every bench script shares: one row per measurement, florist beside the baseline, with
the speedup computed the same way everywhere (baseline / florist for times, florist / baseline
for rates), printed as it is measured and kept for the summary and the JSON file."""

from __future__ import annotations

import collections
import os

import torch

ROWS: list[dict] = []


def florist_env() -> dict[str, str]:
    """The FLORIST_* variables of this process (A/B switches such as FLORIST_PDL): a run's
    figures hold for these settings, so every bench prints or records them."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLORIST_")}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def record(scenario: str, metric: str, florist_value: float, baseline: float | None, unit: str, extra: dict | None = None) -> None:
    higher_better = unit.endswith("/s")
    ratio = None
    if baseline:
        ratio = florist_value / baseline if higher_better else baseline / florist_value
    ROWS.append({"scenario": scenario, "metric": metric, "florist": florist_value, "transformers": baseline, "unit": unit, "speedup": ratio, **(extra or {})})
    b = f"{baseline:12.3f}" if baseline is not None else " " * 12
    r = f"{ratio:8.2f}x" if ratio is not None else ""
    print(f"{scenario:44s} {metric:12s} {florist_value:10.3f} {b} {unit:9s} {r}", flush=True)


def percentiles(ms: list[float]) -> dict:
    import numpy as np

    a = np.asarray(ms)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)), "max": float(a.max()), "n": len(ms)}


def time_calls(fn, n: int, warmup: int) -> list[float]:
    """Host wall time of `n` calls of `fn` (each waits for its own result), in ms, after `warmup`."""
    import time

    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def print_summary(json_path: str | None = None) -> None:
    """Every row recorded so far, once more at the end of a run (and to `json_path` as JSON)."""
    import json
    from pathlib import Path

    if json_path:
        Path(json_path).write_text(json.dumps(ROWS, indent=1, default=str))
    print("\n== summary ==")
    for r in ROWS:
        s = f"{r['speedup']:.2f}x" if r["speedup"] else ""
        b = f"{r['transformers']:.3f}" if r["transformers"] is not None else "-"
        print(f"{r['scenario']:48s} {r['metric']:9s} florist {r['florist']:10.3f}  transformers {b:>10s} {r['unit']:9s} {s}")


def print_kernel_table(prof, steps: int, title: str, rows: int = 22) -> None:
    """Device kernels of a torch profiler run over `steps` steps, by name: launches per step,
    average us, us per step (kernels replayed from CUDA graphs included)."""
    agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = agg[e.name[:70]]
            entry[0] += 1
            entry[1] += e.device_time
    kernels = sum(v[0] for v in agg.values()) / steps
    total_us = sum(v[1] for v in agg.values()) / steps
    print(f"\n== {title}: {kernels:.0f} kernels/step, {total_us:.1f} us/step of kernel time")
    for name, (count, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"{count / steps:7.1f}/step {us / count:8.2f} us avg {us / steps:9.1f} us/step  {name}")


def critical_path(spans: list[tuple[str, float, float]], steps: int) -> tuple[list[float], dict[str, list]]:
    """What each kernel adds to a step's end: `spans` are device (name, start, end) times in us,
    in any order, of `steps` steps that ran one after another with idle time between them (the
    steps - 1 longest stretches with nothing running are taken as the breaks between steps).
    Within a step, taken by start time, a kernel ending after every earlier one moves the step's
    end by the difference ("added"); the part of that which the device spent with nothing of the
    step running before the kernel started is its "idle" share (a launch boundary, or the host
    late with the work). Under programmatic dependent launch a kernel starts before its
    predecessor ends and its own duration includes the wait, so durations overlap; the added
    times do not, and sum to the step's span. Returns (each step's span, {name: [launches, added
    us, idle us]} summed over the steps)."""
    spans = sorted(spans, key=lambda s: s[1])
    gaps, frontier = [], float("-inf")
    for i, (_, start, end) in enumerate(spans):
        if i:
            gaps.append((start - frontier, i))
        frontier = max(frontier, end)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[: max(0, steps - 1)])
    totals: list[float] = []
    agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for a, b in zip([0] + cuts, cuts + [len(spans)]):
        frontier = spans[a][1]
        for name, start, end in spans[a:b]:
            entry = agg[name]
            entry[0] += 1
            entry[1] += max(0.0, end - frontier)
            entry[2] += max(0.0, start - frontier)
            frontier = max(frontier, end)
        totals.append(frontier - spans[a][1])
    return totals, agg


def print_critical_path(prof, steps: int, title: str, rows: int = 16) -> None:
    """`critical_path` of a torch profiler run over `steps` steps separated by idle time: per
    kernel name, launches per step and the us per step it added to the step's end, of which idle."""
    import statistics

    spans = [(e.name[:70], e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not spans:
        return
    totals, agg = critical_path(spans, steps)
    idle = sum(v[2] for v in agg.values()) / steps
    print(f"\n== {title}, critical path: {steps} steps, span p50 {statistics.median(totals):.1f} us, of which idle {idle:.1f} us a step")
    for name, (count, added, idle_us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"{count / steps:7.1f}/step {added / steps:9.1f} us added {idle_us / steps:7.1f} idle  {name}")
