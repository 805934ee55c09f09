"""GPU: the token-mask cost bench (nanoqwen_bench.engine.bench_mask) runs and gives sane figures."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_mask_bench_runs():
    """The op timing of the mask bench runs and gives positive microseconds."""
    from nanoqwen_bench.engine.bench_mask import token_mask_op_us
    from nanoqwen_model import QWEN25_CODER_05B

    rows = token_mask_op_us(QWEN25_CODER_05B, batches=(1, 3), iters=5)
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["all_ones_us"] > 0 and r["random_us"] > 0 for r in rows)
