"""bench/ncu_step.py: its report reader and table on a report in ncu's raw CSV layout, and its
refusals; the profiling itself needs a GPU and Nsight Compute."""

from __future__ import annotations

import csv
import io
import sys

import pytest
import torch
from bench_scripts import ROOT, run_bench

sys.path.insert(0, str(ROOT / "bench"))
import ncu_step  # noqa: E402

_FIXED = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size", "Grid Size", "Device", "CC"]
_METRICS = {  # metric: unit
    "gpu__time_duration.sum": "nsecond",
    "dram__bytes_read.sum": "byte",
    "dram__bytes_write.sum": "Kbyte",
    "lts__t_bytes.sum": "byte",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "%",
    "launch__grid_size": "",
    "launch__registers_per_thread": "register/thread",
    "launch__shared_mem_per_block_dynamic": "byte/block",
    "launch__shared_mem_per_block_static": "byte/block",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio": "",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "%",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "%",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "%",
}


def _report(launches: list[tuple[str, dict[str, str]]]) -> str:
    buf = io.StringIO()
    buf.write("==PROF== Connected to process 1234 (python3)\n")
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(_FIXED + list(_METRICS))
    w.writerow([""] * len(_FIXED) + list(_METRICS.values()))
    for i, (kernel, values) in enumerate(launches):
        w.writerow([str(i), "1234", "python3", "h", kernel, "1", "7", "(128, 1, 1)", "(64, 2, 1)", "0", "9.0"]
                   + [values.get(m, "") for m in _METRICS])
    buf.write("==PROF== Disconnected from process 1234\n")
    return buf.getvalue()


def _gemm(us_ns: str, read: str, long_sb: str) -> dict[str, str]:
    return {"gpu__time_duration.sum": us_ns, "dram__bytes_read.sum": read, "dram__bytes_write.sum": "1", "lts__t_bytes.sum": "2,000,000",
            "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "40", "launch__grid_size": "128", "launch__registers_per_thread": "168",
            "launch__shared_mem_per_block_dynamic": "2048", "launch__shared_mem_per_block_static": "0",
            "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": long_sb,
            "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "2.5",
            "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "0.5",
            "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio": "0"}


def test_summary_groups_launches_by_kernel_and_converts_units(tmp_path):
    path = tmp_path / "step.csv"
    path.write_text(_report([
        ("_tma_gemm_kernel", _gemm("5000", "8000000", "10")),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(Params)", {"gpu__time_duration.sum": "9000"}),
        ("_tma_gemm_kernel", _gemm("7000", "6000000", "20")),
    ]))
    rows, units = ncu_step.read_raw_csv(path)
    assert len(rows) == 3 and units["gpu__time_duration.sum"] == "nsecond"
    entries = ncu_step.summarize(rows, units)
    gemm = next(e for e in entries if e["name"] == "_tma_gemm_kernel")
    assert gemm["launches"] == 2
    assert gemm["us"] == pytest.approx(6.0)  # ns -> us, the mean of the launches
    assert gemm["dram_bytes"] == pytest.approx(7e6 + 1e3)  # read in bytes + write in Kbyte
    assert gemm["l2_bytes"] == pytest.approx(2e6)  # thousands separators read
    assert gemm["smem_kb"] == pytest.approx(2.0)
    # stalls by cycles per issue, largest first; a zero one is left out of the top three
    assert [k for k, _ in gemm["stalls"]] == ["long_scoreboard", "barrier", "wait"]
    assert gemm["stalls"][0][1] == pytest.approx(15.0)
    cutlass = next(e for e in entries if e is not gemm)
    assert cutlass["name"] == "Kernel2" and cutlass["us"] == pytest.approx(9.0) and cutlass["dram_bytes"] is None
    assert entries[0] is gemm  # ordered by total time: 12 us against 9


def test_summarize_mode_prints_the_table(tmp_path):
    path = tmp_path / "step.csv"
    path.write_text(_report([("rms_norm_kernel", _gemm("2000", "500000", "3"))]))
    proc = run_bench("ncu_step.py", "--summarize", str(path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 kernels, 2.0 us of kernel time alone" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if "rms_norm_kernel" in x)
    assert "long_scoreboard 3.0" in line and " 128 " in line


def test_busiest_pipes_are_listed_where_the_report_has_them(tmp_path):
    path = tmp_path / "step.csv"
    attention = {"gpu__time_duration.sum": "50000", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "12.5",
                 "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "61", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "0"}
    path.write_text(_report([("_short_attention_kernel", attention), ("rms_norm_kernel", _gemm("2000", "500000", "3"))]))
    rows, units = ncu_step.read_raw_csv(path)
    entries = {e["name"]: e for e in ncu_step.summarize(rows, units)}
    # busiest first, a zero left out; a launch without the counters lists none
    assert entries["_short_attention_kernel"]["pipes"] == [("inst_executed_pipe_xu", 61.0), ("pipe_tensor_op_hmma", 12.5)]
    assert entries["rms_norm_kernel"]["pipes"] == []
    proc = run_bench("ncu_step.py", "--summarize", str(path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if "_short_attention_kernel" in x)
    assert "pipes % inst_executed_pipe_xu 61, pipe_tensor_op_hmma 12" in line


def test_the_ncu_command_takes_the_sections_and_the_kernel_filter():
    import argparse

    args = argparse.Namespace(pipes=False, kernels=None, geometry="minilm-l6", warmup=5)
    cmd = ncu_step.ncu_command("ncu", args, 100, 256)
    assert "ComputeWorkloadAnalysis" not in cmd and "--kernel-name" not in cmd
    assert cmd[cmd.index("--shapes") + 1] == "100x256" and cmd[cmd.index("--geometry") + 1] == "minilm-l6"
    args.pipes, args.kernels = True, "short_attention"
    cmd = ncu_step.ncu_command("ncu", args, 1, 128)
    assert "ComputeWorkloadAnalysis" in cmd and cmd[cmd.index("--kernel-name") + 1] == "regex:short_attention"
    assert cmd.index("--kernel-name") < cmd.index(sys.executable)  # an ncu option, not the worker's


def test_a_file_without_a_report_is_refused(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("==ERROR== no kernels were profiled\n")
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu_step.read_raw_csv(path)


def test_shapes_are_checked():
    proc = run_bench("ncu_step.py", "--shapes", "1x128,abc", "--summarize", "x.csv", timeout=120)
    assert proc.returncode == 2 and "a shape is SEQUENCESxTOKENS" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_refuses_without_cuda():
    proc = run_bench("ncu_step.py", timeout=120)
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
