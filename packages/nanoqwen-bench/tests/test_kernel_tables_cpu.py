"""The kernel benches' tables without a GPU (their rows are made up here): the GEMV table sets each shape
against its goal by the linear's name (the 1.5B's shapes too) and against tinygemm's and gemlite's times,
and the GEMM table sums them beside nanoqwen's paths (a path not timed at every shape has no sum). What
the benches time is tested on the GPU (test_bench_kernels.py); here, only what their reports say about
given rows."""

from __future__ import annotations

from nanoqwen_bench.kernels import bench_gemm, bench_kernels
from nanoqwen_bench.kernels.bench_kernels import Row

META = {"read_GBps": 3000.0, "copy_GBps": 2600.0, "copy_methods_GBps": {"memcpy_graph": 2600.0},
        "command": "python -m nanoqwen_bench.kernels.bench_kernels", "device": "GPU", "sms": 132,
        "torch": "2.x", "date": "today", "read_bytes": 4 << 30, "read_reps": 30}


def test_gemv_table_compares_each_shape_with_its_goal_and_the_other_int4_kernels():
    assert bench_kernels.goal("1.5b qkv") == bench_kernels.goal("qkv") == 0.70
    assert bench_kernels.goal("1.5b gate_up") == 0.85
    rows = [Row("gemv_int4_g128_sym", "1.5b qkv", 1, "t4 S=1 kc=1", 10.0, 2250.0, 0.8),
            Row("tinygemm_int4_g128", "1.5b qkv", 1, "torch._weight_int4pack_mm", 15.0, 1500.0, 0.6),
            Row("gemlite_int4_g128", "1.5b qkv", 1, "gemlite.GemLiteLinear", 12.0, 1875.0, 0.7),
            Row("gemv_int4_g128_sym", "down", 1, "t4 S=2 kc=1", 20.0, 2400.0, 0.9),
            Row("gemlite_int4_g128", "down", 1, "not timed", 0, 0, 0, "no tuned config")]
    lines = bench_kernels.markdown(META, rows)
    qkv = next(ln for ln in lines if ln.startswith("| 1.5b qkv | 1 |"))
    assert "| 75.0% |" in qkv and "| 70% | yes | 15.0 | 1.50x | 12.0 | 1.20x |" in qkv
    down = next(ln for ln in lines if ln.startswith("| down | 1 |"))
    assert "| 80.0% |" in down and "| 85% | no | - | - | - | - |" in down  # neither baseline timed
    note = "| gemlite_int4_g128 | down | 1 | not timed |"
    assert any(note in ln and "no tuned config" in ln for ln in lines)


def test_gemm_table_sums_the_baselines_beside_the_other_paths():
    def row(shape, m, path, us):
        return {"shape": shape, "n": 1, "k": 1, "m": m, "path": path, "us": us, "tflops": 1.0, "bytes": 1,
                "frac_read_bw": 0.5}

    rows = [row(s, 16, p, us) for s in ("qkv", "o") for p, us in (
        ("int4_gemm", 20.0), ("cublas_bf16", 30.0), ("dequant_gemm", 40.0), ("tinygemm", 25.0))]
    rows.append(row("qkv", 16, "gemlite", 22.0))  # gemlite at one of the two shapes: no sum
    # M = 128: the prefill plan beats both the mma.sync GEMM and dequantize + cuBLAS
    rows += [row(s, 128, p, us) for s in ("qkv", "o") for p, us in (
        ("int4_gemm", 100.0), ("int4_gemm_wgmma128", 45.0), ("cublas_bf16", 30.0), ("dequant_gemm", 60.0))]
    cross = bench_gemm.crossover(rows)
    assert cross[16] == {"int4_gemm": 40.0, "int4_gemm_wgmma128": None,
                         "dequant_gemm": 80.0, "cublas_bf16": 60.0, "tinygemm": 50.0, "gemlite": None,
                         "faster_quantized": "int4_gemm"}
    assert cross[128]["faster_quantized"] == "int4_gemm_wgmma128" and cross[128]["int4_gemm_wgmma128"] == 90.0
    md = bench_gemm.markdown({"date": "today", "device": "GPU", "read_bandwidth_GBps": 3000.0, "rows": rows,
                              "crossover": cross})
    assert "| qkv | 16 | tinygemm | 25.0 | 1.0 | 50.0% | 1.20x |" in md
    header = ("| M | int4_gemm | int4_gemm_wgmma128 | dequant_gemm | cublas_bf16 | tinygemm | gemlite "
              "| faster |")
    assert header in md
    assert "| 16 | 40.0 | - | 80.0 | 60.0 | 50.0 | - | int4_gemm |" in md
    assert "| 128 | 200.0 | 90.0 | 120.0 | 60.0 | - | - | int4_gemm_wgmma128 |" in md


def test_split_sweep_has_each_split_count_once_at_its_evenest():
    """`--split-sweep`'s plans: every split count some tile-columns-per-block value gives, once, each at
    the fewest tile-columns per block that reach it (the evenest split; the last block is never empty)."""
    kt = 18944 // 128
    plans = bench_kernels.sweep_plans(3584, 18944)
    splits = [p.splits for p in plans]
    assert splits == sorted(set(splits)) and splits[-1] == kt
    for p in plans:
        assert p.kc * p.splits >= kt > p.kc * (p.splits - 1)  # covers K; the last split has columns
        assert p.kc == 1 or -(-kt // (p.kc - 1)) > p.splits  # one column fewer per block needs more splits
        assert p.kc <= bench_kernels.gemv.KC_MAX
    assert {(p.splits, p.kc) for p in bench_kernels.sweep_plans(37888, 3584)} >= {(1, 28), (2, 14), (7, 4)}
