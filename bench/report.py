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
