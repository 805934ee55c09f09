"""CPU: the checks of reference.py fail when they should: NaN (an unwritten, poisoned element), an
element or a row past its bound. (The model math the references import, the INT4/INT8 codec, RMSNorm,
RoPE, attention and the sampling masks, is tested in packages/nanoqwen-model: the codec bit for bit
against nanoqwen-format's numpy reference, the forward against HF transformers. The per-row attention
bound is tested against the kernel's roundings in test_attention_reference.py.)"""

from __future__ import annotations

import pytest
import torch
from nanoqwen_kernels import reference as R


def test_assert_close_catches_nan_and_error():
    ref = torch.randn(64)
    R.assert_close(ref.to(torch.bfloat16), ref)
    bad = ref.to(torch.bfloat16).clone()
    bad[3] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        R.assert_close(bad, ref)
    off = ref.to(torch.bfloat16).clone()
    off[5] += 0.5
    with pytest.raises(AssertionError, match="elements off"):
        R.assert_close(off, ref)


def test_assert_rows_close_is_relative_to_each_row():
    """A row 1e-3 the size of the others is held to the same relative bound as they are."""
    ref = torch.randn(3, 5, 64)
    ref[1, 2] *= 1e-3
    R.assert_rows_close(ref.to(torch.bfloat16), ref, R.ATTENTION_ROW)  # one bf16 rounding: <= 2^-8
    off = ref.to(torch.bfloat16).clone()
    off[1, 2] += 0.05 * ref[1, 2].norm() / 8  # 5% of that row's norm: ~1e-4 of the others'
    with pytest.raises(AssertionError, match=r"1/15 rows off; worst \[1, 2\]"):
        R.assert_rows_close(off, ref, R.ATTENTION_ROW)
    nan = ref.to(torch.bfloat16).clone()
    nan[2, 4, 63] = float("nan")
    with pytest.raises(AssertionError, match=r"NaN .* first at \[2, 4\]"):
        R.assert_rows_close(nan, ref, R.ATTENTION_ROW)
