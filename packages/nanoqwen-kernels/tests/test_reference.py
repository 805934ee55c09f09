"""CPU: the torch INT4 decoder in reference.py agrees with nanoqwen_format's numpy reference, bit for
bit, for every group size, symmetric and asymmetric, on fresh random weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nanoqwen_kernels import reference as R

int4 = pytest.importorskip("nanoqwen_format.int4")


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape", [(8, 128), (40, 384), (136, 1024)])
def test_torch_int4_decoder_matches_format_reference(group_size, symmetric, shape):
    rng = np.random.default_rng(abs(hash((group_size, symmetric, shape))) % 2**32)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 2.0)
    qt = int4.quantize_rtn(w, group_size, symmetric)
    qweight = torch.from_numpy(qt.qweight.view(np.int32))
    assert np.array_equal(R.unpack_int4(qweight).numpy(), int4.unpack(qt))
    scales = torch.from_numpy(qt.scales).view(torch.bfloat16)
    zeros = None if qt.zeros is None else torch.from_numpy(qt.zeros)
    assert np.array_equal(R.dequantize_int4(qweight, scales, zeros, group_size).numpy(), int4.dequantize(qt))


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


def test_sampling_mask_reference_small_case():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, -1.0])
    assert R.sampling_mask(logits, 1.0, 2, 1.0).tolist() == [True, False, True, True, False]  # ties kept
    assert R.sampling_mask(logits, 1.0, 0, 0.01).tolist() == [True, False, False, False, False]
    probs = R.sampling_probs(logits, 1.0, 0, 1.0)
    assert torch.allclose(probs, torch.softmax(logits.double(), 0))
