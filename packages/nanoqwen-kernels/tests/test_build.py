"""CPU CI: every kernel family in the registry compiles with nvcc for sm_90a, and hot kernels use no
local memory (zero stack frame, no spill stores or loads in ptxas's report).

Needs only `nvcc` (no GPU); skips with a reason when it is not installed. Also unit-tests the ptxas
report parser and the cache key, so a silently broken parser cannot pass the spill check.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from nanoqwen_kernels import build
from nanoqwen_kernels.specs import SPECS

needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed on this machine")

_REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'hot_a' for 'sm_90a'
ptxas info    : Function properties for hot_a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 380 bytes cmem[0]
ptxas info    : Compiling entry function 'cold_b' for 'sm_90a'
ptxas info    : Function properties for cold_b
    24 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 380 bytes cmem[0]
"""


def test_parse_ptxas_report():
    res = build.parse_ptxas_report(_REPORT)
    assert set(res) == {"hot_a", "cold_b"}
    assert res["hot_a"] == build.KernelResources("hot_a", 40, 0, 0, 0)
    assert not res["hot_a"].uses_local_memory
    assert res["cold_b"] == build.KernelResources("cold_b", 255, 24, 8, 4)
    assert res["cold_b"].uses_local_memory


def test_source_hash_tracks_options_and_is_stable():
    spec = next(iter(SPECS.values()))
    assert build.source_hash(spec) == build.source_hash(spec)
    other = dataclasses.replace(spec, options=spec.options + ("-DNQ_TEST_ONLY=1",))
    assert build.source_hash(other) != build.source_hash(spec)


def test_spec_rejects_missing_source():
    with pytest.raises(ValueError, match="not found"):
        build.KernelSpec(name="x", sources=("no_such_file.cu",))


def test_every_source_file_is_in_a_spec():
    """A .cu file that no spec builds would escape CI: each entry file belongs to exactly one family of
    specs.py (`BASE_FAMILIES`: the compile-option builds that benchmarks register at run time are variants
    of those families)."""
    from nanoqwen_kernels.specs import BASE_FAMILIES

    listed = [s for name in BASE_FAMILIES for s in SPECS[name].sources]
    assert len(listed) == len(set(listed))
    on_disk = {p.name for p in build.CSRC_DIR.glob("*.cu")}
    assert on_disk == set(listed)


@needs_nvcc
@pytest.mark.parametrize("family", sorted(SPECS))
def test_family_compiles_without_local_memory(family, tmp_path):
    spec = SPECS[family]
    cubin, report = build.compile_nvcc(spec, tmp_path)
    assert cubin.stat().st_size > 0
    missing = [k for k in spec.hot_kernels if k not in report]
    assert not missing, f"hot kernels not found in ptxas report: {missing}; report has {sorted(report)}"
    bad = {k: report[k] for k in spec.hot_kernels if report[k].uses_local_memory}
    assert not bad, f"hot kernels use local memory (stack frame / spills): {bad}"
    if spec.programmatic:  # launched with programmatic dependent launch: every kernel must wait
        entries = ptx_entries(build.ptx_of(spec, tmp_path))
        assert set(report) <= set(entries), "every kernel in ptxas's report has a PTX entry"
        no_wait = [name for name, body in entries.items()
                   if "griddepcontrol.wait" not in body or "griddepcontrol.launch_dependents" not in body]
        assert not no_wait, f"{family}: kernels without pdl_wait or launch_dependents: {no_wait}"


def ptx_entries(ptx: str) -> dict[str, str]:
    """Each `.entry` of a PTX module: its name -> its text up to the next entry."""
    parts = re.split(r"^\.visible \.entry (\w+)\(", ptx, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_ptx_entries_splits_at_each_entry():
    ptx = ".version 8.0\n.visible .entry a(\n x;\n griddepcontrol.wait;\n}\n.visible .entry b(\n y;\n}\n"
    e = ptx_entries(ptx)
    assert set(e) == {"a", "b"} and "griddepcontrol.wait" in e["a"] and "griddepcontrol" not in e["b"]
