"""Fixtures of the benchmark tests: an sm_90 device and a seeded generator per test (the GPU tests of
the benchmark kernels). The root conftest.py provides the real test model (`qwen05b_packed`)."""

from __future__ import annotations

import zlib

import pytest
import torch


@pytest.fixture
def device():
    """The current CUDA device, checked to be sm_90 (the kernels' only target)."""
    from nanoqwen_kernels.launch import require_sm90

    dev = torch.device("cuda", torch.cuda.current_device())
    require_sm90(dev)
    return dev


@pytest.fixture
def gen(request, device):
    """A CUDA generator seeded from the test's name: fresh random data per test, reproducible."""
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g
