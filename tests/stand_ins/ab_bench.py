"""A stand-in bench command for tests/test_bench_ab.py: records one timed row (with a gpu_ms
extra) and one rate row whose figures depend on its setting ($AB_X, or `--x VALUE` when given)
and on how many runs came before it (the lines of $AB_LOG, to which it appends its setting, and
"+$AB_Y" where that is set), then writes them with --json."""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from report import print_summary, record  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--json", required=True)
p.add_argument("--x", default=None)
args = p.parse_args()
setting = args.x or os.environ["AB_X"]
if setting == "boom":
    sys.exit("stand-in failure")
log = Path(os.environ["AB_LOG"])
calls = len(log.read_text().splitlines()) if log.exists() else 0
with log.open("a") as f:
    f.write(setting + (f"+{os.environ['AB_Y']}" if "AB_Y" in os.environ else "") + "\n")
ms = {"a": 2.0, "b": 1.5}[setting] + 0.01 * calls
record("step", "p50", ms, None, "ms", {"gpu_ms": ms - 0.1, "florist_pct": {"p50": ms, "p99": ms + 1, "n": 200}})
record("batch", "emb/s", 100.0 / ms, None, "emb/s")
print_summary(args.json)
