"""The GEMM plan sweep (nanoqwen_bench.kernels.sweep_gemm_plans): its candidates are every plan that
fits, the table's measured plans are among them, and its report names the fastest plan per class as a
`gemm.MEASURED_PLANS` entry."""

from __future__ import annotations

from nanoqwen_bench.kernels import sweep_gemm_plans as sweep
from nanoqwen_bench.kernels.bench_gemm import MODEL_SHAPES
from nanoqwen_kernels import gemm


def test_candidates_cover_k_fit_and_include_the_measured_plans():
    for model, shapes in MODEL_SHAPES.items():
        for _name, n, k in shapes:
            for c in sweep.CLASSES:
                plans = sweep.candidate_plans(n, k, c)
                keys = {(p.kernel, p.n_tiles, p.splits) for p in plans}
                assert len(keys) == len(plans), (model, n, k, c)  # distinct after with_splits' rounding
                for p in plans:
                    assert p.max_m == c and 8 * p.n_tiles <= c
                    assert p.shared_bytes(False) <= gemm.MAX_SHARED_BYTES
                    assert p.splits * p.kc >= k // 128 > (p.splits - 1) * p.kc
                assert {"mma", "wgmma"} <= {p.kernel for p in plans}
                assert gemm.MEASURED_PLANS[(132, n, k, 128, c)] in keys, (model, n, k, c)


def test_markdown_names_the_fastest_plan_and_the_planned_ratio():
    row = {"model": "7b", "shape": "o", "n": 3584, "k": 3584, "m": 64}
    rows = [row | {"kernel": "mma", "n_tiles": 4, "splits": 4, "us": 18.0, "planned": True},
            row | {"kernel": "wgmma", "n_tiles": 2, "splits": 1, "us": 12.0, "planned": False}]
    md = sweep.markdown({"date": "2026-12-07", "device": "GPU", "sms": 132, "rows": rows})
    assert "| 7b | o | 64 | mma NT=4 S=4 | 18.0 | wgmma NT=2 S=1 | 12.0 | 1.50 |" in md
    assert '(132, 3584, 3584, 128, 64): ("wgmma", 2, 1),' in md
