"""The calibration-free recipe (`--method rtn`: RTN asym g128; bench/RESULTS.md) keeps the real
Qwen2.5-Coder-0.5B's quality on a CI-sized text, measured as nanoqwen_bench.quality.run_quality measures it:
held-out perplexity within +4% of the `--method none` pack and greedy next-token agreement with it above
a threshold derived from the table.
(The default recipe, GPTQ on the chat text, is tested on the GPU: test_quality_default.py.)

Cheap: RTN needs no calibration, so both containers are the session's cached `qwen05b_packed` packs
(`--method rtn` with every other option at its default: asym, g128); the cost is two 2,048-token
evaluations on CPU (~40 s each on an idle 2-core machine).
"""

from __future__ import annotations

import nanoqwen_format as nqf
import pytest
from nanoqwen_quant.calib import heldout_text
from nanoqwen_quant.evaluate import evaluate
from nanoqwen_quant.options import PackOptions

pytestmark = [pytest.mark.model, pytest.mark.slow]

# The evaluation of nanoqwen_bench.quality.run_quality --eval-tokens 2048 --seq-len 1024 (its text is
# heldout_text(6 * eval_tokens)), so this test re-measures a row of the table on the same tokens.
EVAL_TOKENS = 2048
SEQ_LEN = 1024
# The goal for the 0.5B: held-out perplexity within +4% of none (measured: +2.42% on these 2,048
# tokens). On 8,192 tokens (the GPU table, bench/RESULTS.md) the same recipe measured +4.59%:
# this test guards the recipe against regressions on a CI-sized text; it does not prove the goal, which
# this recipe misses on 8,192 tokens (the default, GPTQ on the chat text, meets it there: +2.86%).
PPL_GOAL = 0.04
# Agreement measured in the table (bench/RESULTS.md, 0.5B on CPU): 91.59% for RTN asym g128,
# 90.13% for the old default (RTN g128 sym). The measurement is deterministic up to fp32 summation order
# (another BLAS or thread count), which can flip only positions whose top two logits are within
# rounding of each other; we allow 1 point (20 of the 2,046 scored positions) for that, which still
# separates the recipe from RTN sym.
AGREEMENT_MIN = 0.9159 - 0.01


def test_rtn_recipe_is_calibration_free_asym_g128():
    o = PackOptions(method="rtn")  # what qwen05b_packed("rtn") packs: every other option at its default
    assert (o.method, o.symmetric, o.group_size, o.clip, o.awq) == ("rtn", False, 128, False, False)
    assert not o.calibrated  # what makes the CI pack cheap (no calibrated layer loop)


def test_rtn_asym_recipe_quality_on_real_05b(qwen05b_packed):
    none, rtn = qwen05b_packed("none"), qwen05b_packed("rtn")
    with nqf.open(rtn) as f:
        q = f.metadata["quantization"]
        assert (q["method"], q["symmetric"], q["group_size"], q["clip"], q["awq"]) == \
            ("rtn", False, 128, False, False)
    r = evaluate(rtn, heldout_text(6 * EVAL_TOKENS), reference=none, seq_len=SEQ_LEN,
                 max_tokens=EVAL_TOKENS, device="cpu")
    print(f"rtn asym g128: ppl {r.perplexity:.4f} vs none {r.reference_perplexity:.4f} "
          f"({100 * r.ppl_delta:+.2f}%), agreement {100 * r.agreement:.2f}%")
    assert r.tokens == EVAL_TOKENS - 2  # two windows of 1,024, each scoring 1,023 positions
    assert r.ppl_delta < PPL_GOAL
    assert r.agreement > AGREEMENT_MIN
