"""Fixtures of the nanoqwen-format tests; the builders live in nqf_testkit.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from nqf_testkit import write_container  # noqa: E402


@pytest.fixture
def container(tmp_path):
    """(path, tensors) of a freshly written valid container."""
    path = tmp_path / "model.nanoqwen"
    return path, write_container(path)


@pytest.fixture(scope="session")
def container_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("c") / "model.nanoqwen"
    write_container(path)
    return path.read_bytes()
