"""CPU: the pure-Python half of nanoqwen_bench.kernels.decode_ceilings: the ncu CSV
parsers, the stall breakdown, the replay timeline's gaps, the SASS loop counter, the markdown tables,
and `--ncu-summary` end to end on hand-written ncu output (the GPU half runs on the H200 only)."""

from __future__ import annotations

import json

import pytest
from nanoqwen_bench.kernels import decode_ceilings as DC
from nanoqwen_bench.kernels.ceilings import ceilings_report as CR

HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size",'
)
DETAILS_CSV = (
    "==PROF== Connected to process 482\n"
    "[12:00:00] application output line\n"
    + HEAD + '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    '"0","482","python3","h","rms_norm_bf16","1","7","(256, 1, 1)","(1, 1, 1)","0","9.0","Command line",'
    '"gpu__time_duration.sum","nsecond","2,496"\n'
    '"1","482","python3","h","gemv_int4_g128_sym","1","7","(256, 1, 1)","(36, 14, 1)","0","9.0",'
    '"Command line",'
    '"gpu__time_duration.sum","usecond","7.50"\n'
    '"2","482","python3","h","nvjet_hsh_128x256_2cta","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
    '"Command line","gpu__time_duration.sum","nsecond","250,000"\n'
)
RAW_CSV = (
    HEAD + '"gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed",'
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio"\n'
    '"","","","","","","","","","usecond","%","ratio","ratio","ratio"\n'
    '"0","1","python3","h","gemv_int4_g128_sym","1","7","(256, 1, 1)","(296, 2, 1)",'
    '"27.1","43.5","6","1","3"\n'
)


def test_details_csv_durations_in_ns_in_launch_order():
    ks = CR.parse_ncu_csv(DETAILS_CSV)
    assert [k["kernel"] for k in ks] == ["rms_norm_bf16", "gemv_int4_g128_sym", "nvjet_hsh_128x256_2cta"]
    # thousands separators dropped, usecond scaled to ns
    assert [k["metrics"]["gpu__time_duration.sum"] for k in ks] == [2496.0, 7500.0, 250000.0]
    assert ks[1]["grid"] == "(36, 14, 1)"
    with pytest.raises(ValueError, match="no CSV header"):
        CR.parse_ncu_csv("==PROF== nothing was profiled\n")


def test_raw_csv_units_row_and_stall_breakdown():
    (row,) = CR.parse_ncu_raw_csv(RAW_CSV)
    assert row["Kernel Name"] == "gemv_int4_g128_sym" and row["ID"] == 0
    assert row["gpu__time_duration.sum"] == pytest.approx(27100.0)  # usecond -> ns
    assert row["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == 43.5  # % unchanged
    stalls = CR.stall_breakdown(row)
    assert [s[0] for s in stalls] == ["long_scoreboard", "math_pipe_throttle", "selected"]
    assert stalls[0][2] == pytest.approx(0.6)  # 6 of 6 + 3 + 1 cycles
    with pytest.raises(ValueError, match="WarpStateStats"):
        CR.stall_breakdown({"gpu__time_duration.sum": 1.0})


def test_timeline_gaps_exact():
    # three kernels, given out of order: gaps 1000 - 900 = 100 and 1500 - 1400 = 100 ns
    ks = [("gemv_int4_g128_sym(int)", 1000.0, 1400.0), ("rms_norm_bf16", 0.0, 900.0),
          ("nvjet_hsh_128", 1500.0, 2000.0)]
    t = CR.timeline_gaps(ks)
    assert (t["n"], t["span_ns"], t["busy_ns"], t["gap_ns"]) == (3, 2000.0, 1800.0, 200.0)
    assert t["gaps"] == [100.0, 100.0] and t["overlaps"] == 0
    assert set(t["by_transition"]) == {"rms_norm_bf16 -> gemv_int4_g128_sym", "gemv_int4_g128_sym -> nvjet"}
    with pytest.raises(ValueError, match="ends"):
        CR.timeline_gaps([("k", 5.0, 1.0)])


def test_chrome_trace_keeps_gpu_work_only():
    trace = {"traceEvents": [{"cat": "kernel", "name": "a", "ts": 1.0, "dur": 2.0},
                             {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.5, "dur": 9.0},
                             {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 4.0, "dur": 0.5}]}
    assert CR.chrome_trace_kernels(trace) == [("a", 1000.0, 3000.0), ("Memcpy DtoD", 4000.0, 4500.0)]


SASS = """
.text.k:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0010*/                   LDG.E.128 R4, desc[UR6][R2.64] ;
        /*0020*/               @P0 BRA `(.L_x_2) ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
.L_x_2:
        /*0040*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0050*/              @!P1 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
.text.other:
        /*0000*/                   EXIT ;
"""


def test_hot_loop_counts_the_backward_branch_body():
    funcs = CR.parse_sass(SASS)
    assert set(funcs) == {"k", "other"}
    counts, hmma = CR.hot_loop_counts(funcs["k"])
    # the span .L_x_1 .. the BRA back to it, the forward branch's block included
    assert hmma == 2 and counts == {"LDG": 1, "BRA": 2, "HMMA": 2}
    with pytest.raises(ValueError, match="loop"):
        CR.hot_loop_counts(funcs["other"])


def test_md_table_and_report_from_sections():
    assert CR.md_table(["a", "b"], [[1.23456, None], ["x", 12345.6]]).splitlines()[2:] == \
        ["| 1.23 | - |", "| x | 12,346 |"]
    with pytest.raises(ValueError, match="cells"):
        CR.md_table(["a", "b"], [[1]])
    raw = {"meta": {"device": "H200", "date": "d", "torch": "t", "command": "c"},
           "read_bandwidth": {"bytes_per_s": 4.3e12},
           "compute": {"rows": [{"kernel": "gemv_compute_g128_sym", "m": 1, "occupancy_blocks_per_sm": 4,
                                 "registers": 64, "weight_bytes_per_s": 5e12, "over_read_bw": 5e12 / 4.3e12,
                                 "dequant_is_the_wall": True}]},
           "errors": {"decode": "RuntimeError: boom"}}
    md = DC.build_markdown(raw)
    assert "4300 GB/s" in md and "dequant is the wall" in md and "section decode FAILED" in md


def test_compute_rows_of_v2_variants_in_report():
    raw = {"meta": {"device": "H200", "date": "d", "torch": "t", "command": "c"},
           "read_bandwidth": {"bytes_per_s": 4.3e12},
           "compute": {"rows": [
               {"kernel": "gemv_compute_g128_sym_v2", "m": 1, "occupancy_blocks_per_sm": 4, "registers": 64,
                "weight_bytes_per_s": 6.45e12, "over_read_bw": 1.5, "over_v1": 1.47,
                "dequant_is_the_wall": False},
               {"kernel": "gemv_compute_g128_asym_v2", "m": 1, "occupancy_blocks_per_sm": 4, "registers": 64,
                "error": "output differs from gemv_compute_g128_asym's at M=3, reps=1 (12 of 768)"}]}}
    lines = DC.build_markdown(raw).splitlines()
    v2 = next(ln for ln in lines if ln.startswith("| gemv_compute_g128_sym_v2 "))
    assert "| 1.47 |" in v2 and v2.endswith("| no |")
    bad = next(ln for ln in lines if ln.startswith("| gemv_compute_g128_asym_v2 "))
    # a variant that failed the bitwise check shows no rate, only the failure
    assert "CHECK FAILED: output differs" in bad and "| - | - | - |" in bad
    assert any("passed the bitwise check" in ln for ln in lines)


def test_sass_section_counts_each_kernel_and_names_a_refused_cubin(tmp_path, monkeypatch):
    # a stand-in nvdisasm on PATH: prints SASS for good.cubin, fails like the H200's did for the other
    (tmp_path / "sass.txt").write_text(SASS)
    tool = tmp_path / "nvdisasm"
    tool.write_text(f'#!/bin/sh\ncase "$2" in *good.cubin) cat {tmp_path / "sass.txt"};; '
                    '*) echo "nvdisasm fatal : bad cubin" >&2; exit 1;; esac\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/bin:/usr/bin")
    good, bad = tmp_path / "good.cubin", tmp_path / "bad.cubin"
    out = DC.sass_section({"k": good, "gemv_int4_g128_sym": bad, "missing": good})
    assert out["k"]["hmma"] == 2 and out["k"]["per_tile_column"] == 5 * 4  # 5 instructions, 1/4 column
    assert "bad cubin" in out["gemv_int4_g128_sym"]["error"]
    assert "KeyError" in out["missing"]["error"]  # no such function in the cubin
    with pytest.raises(RuntimeError, match="bad cubin"):
        DC.sass_section({"gemv_int4_g128_sym": bad})


def test_ncu_summary_end_to_end(tmp_path):
    raw_dir = tmp_path / "raw"  # where run_ceilings.sh packs the CSVs
    raw_dir.mkdir()
    (raw_dir / "ncu-timeline.csv").write_text(DETAILS_CSV)
    (raw_dir / "ncu_target.json").write_text(json.dumps({"replay_us": 270.0, "layers": 2}))
    (tmp_path / "ncu-gemv-gate_up-raw.csv").write_text(RAW_CSV)
    (tmp_path / "ceilings.json").write_text(json.dumps({"meta": {"device": "H200", "date": "d", "torch": "t",
                                                                  "command": "c"}}))
    s = DC.ncu_summary(tmp_path)
    t = s["timeline"]
    assert t["sum_kernel_us"] == pytest.approx(259.996)  # 2.496 + 7.5 + 250
    assert t["gap_us"] == pytest.approx(270.0 - 259.996)
    assert t["gap_us_per_layer"] == pytest.approx(t["gap_us"] / 2)
    assert t["by_kernel"]["nvjet"]["launches"] == 1
    g = s["gemv"]["gate_up"]
    assert g["duration_us"] == pytest.approx(27.1) and g["stalls"][0][0] == "long_scoreboard"
    # the three GEMVs without a file are named as errors, not left out silently
    assert set(s["errors"]) == {"gemv_qkv", "gemv_o", "gemv_down"}
    merged = json.loads((tmp_path / "ceilings.json").read_text())
    assert merged["ncu"]["timeline"]["kernels"] == 3
    assert "long_scoreboard" in (tmp_path / "ceilings.md").read_text()
