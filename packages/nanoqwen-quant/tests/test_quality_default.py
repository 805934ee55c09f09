"""The default recipe of `nanoqwen-quant pack` (`PackOptions()`: GPTQ asym g128, 65,536 calibration tokens
of the chat text, chosen by the HumanEval pass rate in bench/RESULTS.md) and its quality on the
real Qwen2.5-Coder-0.5B, measured as nanoqwen_bench.quality.run_quality measures the GPU table: held-out
perplexity within +4% of the `--method none` pack (the proxy goal for the 0.5B) and greedy
next-token agreement with it. The calibration-free recipe (`--method rtn`) is tested on the real 0.5B
on the CPU, in CI: test_quality_rtn_asym.py.

The quality test runs on the GPU only (`nox -s gpu_tests`; about 60 s of pack on a Hopper GPU, two
8,192-token evaluations of a few seconds; under 2 minutes in all). On a CPU the same pack takes about 2
minutes per layer.
"""

from __future__ import annotations

import nanoqwen_format as nqf
import pytest
from nanoqwen_quant.calib import heldout_text
from nanoqwen_quant.evaluate import evaluate
from nanoqwen_quant.options import PackOptions
from nanoqwen_quant.pack import pack
from nanoqwen_quant.sources import open_source

# The GPU table's evaluation (bench/RESULTS.md, run_quality.py --eval-tokens 8192 --seq-len 1024, its
# text heldout_text(6 * eval_tokens)): the GPU test re-measures its gptq-asym-chat row of the 0.5B.
EVAL_TOKENS = 8192
SEQ_LEN = 1024
SCORED = 8 * (SEQ_LEN - 1)  # 8 windows of 1,024 tokens, each scoring 1,023 next-token positions
# The goal for the 0.5B: held-out perplexity within +4% of none. Measured for this recipe on these
# tokens: +2.86% (bench/RESULTS.md, "Quality of the INT4 recipes").
# The goal itself is the bound, not the measurement plus a margin.
PPL_GOAL = 0.04
# Agreement measured in that row: 90.98%. A rerun on the same machine image differs from the table only by
# fp32 summation order (cuBLAS reductions in the GPTQ sweep, the Hessians and the evaluation), which can
# flip a code's rounding or an argmax only where two values are within rounding of each other; we allow 1
# point (82 of the 8,184 positions) for that. The bound still separates the recipe from the
# calibration-free ones on the same tokens (RTN asym 88.28%, RTN sym 85.31%). (The chat text is built
# from the running Python's standard library: the row was measured with Python 3.12.)
AGREEMENT_MIN = 0.9098 - 0.01


def test_default_options_are_gptq_asym_g128_on_the_chat_text():
    o = PackOptions()
    assert (o.method, o.symmetric, o.group_size, o.clip, o.clip_act, o.awq, o.lm_head) == \
        ("gptq", False, 128, False, False, False, "bf16")
    assert (o.calib_tokens, o.calib_seq_len, o.calib_paths, o.calib_text) == (65536, 2048, None, None)
    assert o.calibrated and o.chat_calibration  # 32 windows of the chat text
    o.validate()  # the defaults are a valid recipe as they stand
    g = o.gptq
    assert (g.group_size, g.symmetric, g.act_order, g.static_groups) == (128, False, True, True)
    assert not PackOptions(calib_text="code").chat_calibration
    assert not PackOptions(calib_paths=["x"]).chat_calibration


@pytest.mark.gpu
@pytest.mark.model
def test_default_recipe_quality_on_real_05b_gpu(qwen05b_gguf, qwen05b_packed, tmp_path):
    opts = PackOptions()  # the default recipe: "auto" resolves to the GPU here
    assert opts.resolved_device().type == "cuda"
    out = tmp_path / "default.nanoqwen"
    summary = pack(open_source(str(qwen05b_gguf)), out, opts, log=lambda m: None)
    print(f"default recipe pack: {summary.seconds:.1f} s on {summary.device}")
    assert summary.device.startswith("cuda")
    with nqf.open(out) as f:  # the GPTQ path ran, with the default calibration: the chat text
        q = f.metadata["quantization"]
        assert (q["method"], q["symmetric"], q["group_size"], q["clip"], q["awq"]) == \
            ("gptq", False, 128, False, False)
        assert (q["calibration"]["tokens"], q["calibration"]["seq_len"]) == (65536, 2048)
        assert q["calibration"]["source"].startswith("chat:python-stdlib ")
    r = evaluate(out, heldout_text(6 * EVAL_TOKENS), reference=qwen05b_packed("none"), seq_len=SEQ_LEN,
                 max_tokens=EVAL_TOKENS, device="cuda")
    print(f"default recipe: ppl {r.perplexity:.4f} vs none {r.reference_perplexity:.4f} "
          f"({100 * r.ppl_delta:+.2f}%), agreement {100 * r.agreement:.2f}%, eval {r.seconds:.1f} s")
    assert r.tokens == SCORED and r.device.startswith("cuda")
    assert r.ppl_delta <= PPL_GOAL
    assert r.agreement >= AGREEMENT_MIN
