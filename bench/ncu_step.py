"""One engine step under Nsight Compute: each kernel's hardware counters, by kernel name.

    python bench/ncu_step.py                          # Qwen3-0.6B 1 x 128 and 1 x 512, ncu started here
    python bench/ncu_step.py --shapes 1x128 --keep /tmp/ncu
    python bench/ncu_step.py --summarize FILE.csv     # the table again from a saved report
    python bench/ncu_step.py --geometry minilm-l6 --shapes 100x256 --pipes   # + each kernel's busiest pipes
    python bench/ncu_step.py --kernels short_attention --pipes               # only the kernels matching a name

bench/profile_kernels.py says how long each kernel of a step takes; this says why: for every
kernel of one step (CUDA-graph replays included, each graph node profiled on its own) the DRAM
and L2 bytes it moved, its DRAM / L2 / SM throughput as a share of the device's peak, its grid,
registers and shared memory, the occupancy it reached and where its warps stalled. ncu runs each
kernel alone, several times over (a pass per group of counters) with caches flushed before each
pass, so its durations are a kernel's time alone from a cold L2, without the overlap that
programmatic dependent launch gives in the step: compare kernels with each other and with their
floors, not with the step's time.

Without --summarize the script starts `ncu` (Nsight Compute's command line, on PATH or under
/usr/local/cuda/bin) on itself in its worker mode: the model is built and each shape's graph
captured and warmed up, then one step per shape runs between cudaProfilerStart and
cudaProfilerStop, which `--profile-from-start off` makes the only profiled range. The clocks are
left alone (`--clock-control none`). The raw CSV of each shape is written under --keep (default:
a temporary directory) and summarised: per kernel and launch shape (grid, block, shared memory), launches in the step, mean duration, DRAM
and L2 bytes, throughputs, grid, registers, shared memory, achieved occupancy and the three
largest stall reasons (cycles per issued instruction a warp spent stalled on each).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "MemoryWorkloadAnalysis", "WarpStateStats")

# Raw metric names read from the report; absent ones print as "-".
DURATION = "gpu__time_duration.sum"
DRAM_READ, DRAM_WRITE = "dram__bytes_read.sum", "dram__bytes_write.sum"
L2_BYTES = "lts__t_bytes.sum"
DRAM_PCT = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
L2_PCT = "lts__throughput.avg.pct_of_peak_sustained_elapsed"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
GRID, BLOCK = "launch__grid_size", "launch__block_size"
REGISTERS = "launch__registers_per_thread"
SMEM = ("launch__shared_mem_per_block_dynamic", "launch__shared_mem_per_block_static")
WAVES = "launch__waves_per_multiprocessor"
# Asked for by name besides the sections (not every section collects them).
METRICS = (DURATION, DRAM_READ, DRAM_WRITE, L2_BYTES, WAVES)
STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)(?:_per_issue_active)?\.ratio$")
# With --pipes: ComputeWorkloadAnalysis too, and each kernel's busiest pipes (share of the cycles
# its SMs were active): tensor cores, FMA, ALU, XU (MUFU: exp2, reciprocals, conversions), LSU...
PIPE_SECTION = "ComputeWorkloadAnalysis"
PIPE = re.compile(r"^sm__((?:inst_executed_)?pipe_\w+?)(?:_cycles_active)?\.avg\.pct_of_peak_sustained_active$")


def parse_shape(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is SEQUENCESxTOKENS, e.g. 1x128")
    return int(m.group(1)), int(m.group(2))


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if not text or text in ("n/a", "N/A"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def read_raw_csv(path: Path) -> tuple[list[dict[str, str]], dict[str, str]]:
    """ncu's `--page raw --csv` report -> (one dict per kernel launch, the units row).
    ncu may print its own lines (==PROF== ...) before the header; they are skipped."""
    lines = path.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError(f"{path}: no ncu CSV header (a line starting with \"ID\"); was the step profiled?")
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        return [], {}
    units = rows[0] if not rows[0].get("ID", "").strip().isdigit() else {}
    return [r for r in rows if r.get("ID", "").strip().isdigit()], units


def short_name(kernel: str) -> str:
    """A launch's kernel name without template arguments or parameters, at most 60 characters."""
    name = re.sub(r"\(.*$", "", kernel.strip())
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    name = "".join(out).split("::")[-1] or kernel
    return name[:60]


def _in_base(value: float | None, unit: str, kind: str) -> float | None:
    """Durations to us and byte counts to bytes, whatever unit ncu printed."""
    if value is None:
        return None
    unit = unit.strip().lower()
    if kind == "time":
        return value * {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}.get(unit, 1e-3)
    scale = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "kibyte": 1024, "mibyte": 2**20, "gibyte": 2**30}
    return value * scale.get(unit, 1)


def summarize(rows: list[dict[str, str]], units: dict[str, str]) -> list[dict]:
    """One entry per kernel and launch shape (name, grid in three dimensions, block, dynamic
    shared memory: a kernel serving products of different tilings gets a line for each), in order
    of total time: counts and the means of its launches."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        shape = (r.get("Grid Size", "") or r.get(GRID, ""), r.get(BLOCK, ""), r.get(SMEM[0], ""))
        groups[(short_name(r.get("Kernel Name", "?")), *shape)].append(r)

    def mean(rs: list[dict], metric: str, kind: str = "") -> float | None:
        vals = [_number(r.get(metric, "")) for r in rs]
        vals = [v for v in vals if v is not None]
        if not vals:
            return None
        v = sum(vals) / len(vals)
        return _in_base(v, units.get(metric, ""), kind) if kind else v

    stall_cols = [(m.group(1), c) for c in (rows[0].keys() if rows else ()) if (m := STALL.match(c))]
    pipe_cols = [(m.group(1), c) for c in (rows[0].keys() if rows else ()) if (m := PIPE.match(c))]
    out = []
    for (name, grid3, *_), rs in groups.items():
        stalls = sorted(((reason, mean(rs, col)) for reason, col in stall_cols), key=lambda kv: -(kv[1] or 0))
        pipes = sorted(((pipe, mean(rs, col)) for pipe, col in pipe_cols), key=lambda kv: -(kv[1] or 0))
        smem = [mean(rs, m, "bytes") for m in SMEM]
        out.append({
            "name": name, "grid3": grid3.replace(" ", ""), "launches": len(rs), "us": mean(rs, DURATION, "time"),
            "dram_bytes": _sum_opt(mean(rs, DRAM_READ, "bytes"), mean(rs, DRAM_WRITE, "bytes")),
            "l2_bytes": mean(rs, L2_BYTES, "bytes"), "dram_pct": mean(rs, DRAM_PCT), "l2_pct": mean(rs, L2_PCT),
            "sm_pct": mean(rs, SM_PCT), "occupancy_pct": mean(rs, OCCUPANCY), "grid": mean(rs, GRID), "block": mean(rs, BLOCK),
            "registers": mean(rs, REGISTERS), "smem_kb": None if all(s is None for s in smem) else sum(s or 0 for s in smem) / 1024,
            "waves": mean(rs, WAVES), "stalls": [(k, v) for k, v in stalls[:3] if v], "pipes": [(k, v) for k, v in pipes[:4] if v],
        })
    out.sort(key=lambda e: -(e["us"] or 0) * e["launches"])
    return out


def _sum_opt(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else (a or 0) + (b or 0)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_summary(entries: list[dict], title: str) -> None:
    total = sum((e["us"] or 0) * e["launches"] for e in entries)
    print(f"\n== {title}: {sum(e['launches'] for e in entries)} kernels, {total:.1f} us of kernel time alone (ncu, cold L2)")
    print(f"{'n':>4s} {'us avg':>7s} {'DRAM MB':>8s} {'L2 MB':>7s} {'DRAM%':>6s} {'L2%':>5s} {'SM%':>5s} {'occ%':>5s} {'grid':>6s} "
          f"{'thr':>4s} {'regs':>4s} {'smemKB':>6s}  kernel; top stalls (cycles per issue)")
    for e in entries:
        stalls = ", ".join(f"{k} {v:.1f}" for k, v in e["stalls"])
        if e.get("pipes"):
            stalls += "; pipes % " + ", ".join(f"{k} {v:.0f}" for k, v in e["pipes"])
        print(f"{e['launches']:4d} {_fmt(e['us'], '7.2f')} {_fmt(e['dram_bytes'] and e['dram_bytes'] / 1e6, '8.2f')} "
              f"{_fmt(e['l2_bytes'] and e['l2_bytes'] / 1e6, '7.2f')} {_fmt(e['dram_pct'], '6.1f')} {_fmt(e['l2_pct'], '5.1f')} "
              f"{_fmt(e['sm_pct'], '5.1f')} {_fmt(e['occupancy_pct'], '5.1f')} {_fmt(e['grid'], '6.0f')} {_fmt(e['block'], '4.0f')} "
              f"{_fmt(e['registers'], '4.0f')} {_fmt(e['smem_kb'], '6.1f')}  {e['name']} {e['grid3']}; {stalls}", flush=True)


def find_ncu() -> str | None:
    default = "/usr/local/cuda/bin/ncu"
    return shutil.which("ncu") or (default if os.path.exists(default) else None)


# -- the worker: one profiled step per shape ---------------------------------------------------------


def worker(geometry: str, shape: tuple[int, int], warmup: int) -> int:
    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from geometries import make_model

    from florist import Engine
    from florist.engine.batch import HostBatch

    tmp = Path(tempfile.mkdtemp(prefix="florist-ncu-"))
    dtype = torch.float16 if geometry.startswith("minilm") else torch.bfloat16
    engine = Engine.from_pretrained(make_model(tmp / geometry, geometry, dtype=dtype), device="cuda", dtype=dtype)
    rng = np.random.default_rng(0)
    n, length = shape
    host = HostBatch.from_sequences([rng.integers(0, engine.info.vocab_size, length).astype(np.int32) for _ in range(n)])
    for _ in range(warmup):  # the graph captured and replayed, the allocator warm
        engine.step(host).numpy()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    engine.step(host).numpy()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def ncu_command(ncu: str, args, n: int, length: int) -> list[str]:
    """The ncu command line that profiles one step of n sequences of `length` tokens (only the
    kernels whose function name matches --kernels, where given)."""
    sections = SECTIONS + ((PIPE_SECTION,) if args.pipes else ())
    only = ["--kernel-name-base", "function", "--kernel-name", f"regex:{args.kernels}"] if args.kernels else []
    return [ncu, "--profile-from-start", "off", "--clock-control", "none", "--graph-profiling", "node", *only, "--csv", "--page", "raw",
            "--print-units", "base", *[a for s in sections for a in ("--section", s)], "--metrics", ",".join(METRICS),
            sys.executable, __file__, "--worker", "--geometry", args.geometry, "--shapes", f"{n}x{length}", "--warmup", str(args.warmup)]


def profile(args) -> int:
    ncu = find_ncu()
    if ncu is None:
        print("bench/ncu_step.py needs Nsight Compute's `ncu` on PATH (or /usr/local/cuda/bin/ncu)", file=sys.stderr)
        return 1
    keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="florist-ncu-report-"))
    keep.mkdir(parents=True, exist_ok=True)
    status = 0
    for n, length in args.shapes:
        out = keep / f"{args.geometry}-{n}x{length}.csv"
        cmd = ncu_command(ncu, args, n, length)
        print(f"-- {' '.join(cmd)}", flush=True)
        with open(out, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            print(f"ncu failed ({proc.returncode}) for {n}x{length}:\n{proc.stderr[-3000:]}", file=sys.stderr)
            status = 1
            continue
        try:
            rows, units = read_raw_csv(out)
        except ValueError as e:
            print(f"{e}\n{proc.stderr[-2000:]}", file=sys.stderr)
            status = 1
            continue
        print_summary(summarize(rows, units), f"{args.geometry} {n} x {length} ({out})")
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="qwen3-0.6b", help="bench/geometries.py geometry (default qwen3-0.6b)")
    ap.add_argument("--shapes", type=lambda s: [parse_shape(x) for x in s.split(",") if x.strip()], default=[(1, 128), (1, 512)],
                    help="comma list of SEQUENCESxTOKENS (default 1x128,1x512)")
    ap.add_argument("--warmup", type=int, default=5, help="unprofiled steps first (default 5: the graph is captured on the second)")
    ap.add_argument("--pipes", action="store_true", help="collect ComputeWorkloadAnalysis too and print each kernel's busiest pipes")
    ap.add_argument("--kernels", metavar="REGEX", help="profile only the kernels whose function name matches (e.g. short_attention): faster")
    ap.add_argument("--keep", metavar="DIR", help="write the raw ncu CSV of each shape here (default: a temporary directory)")
    ap.add_argument("--summarize", metavar="CSV", type=Path, help="print the table of a saved report and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the process ncu profiles
    args = ap.parse_args()
    if args.summarize:
        rows, units = read_raw_csv(args.summarize)
        print_summary(summarize(rows, units), str(args.summarize))
        return 0
    if args.worker:
        return worker(args.geometry, args.shapes[0], args.warmup)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("bench/ncu_step.py needs a CUDA GPU (use --summarize to read a saved report)", file=sys.stderr)
        return 1
    return profile(args)


if __name__ == "__main__":
    sys.exit(main())
