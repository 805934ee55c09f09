"""GPU: the post-attention block kernel (block.py, csrc/block_int4.cuh) against the three GEMV launches
it replaces (o_proj with the residual epilogue, gate_up with the norm prologue, down with the SiLU input
and the residual epilogue: the engine's decode path for M <= 8, itself tested against the fp32
reference in test_gemv*.py). The checks and the derivation of their bounds are in block_testkit.py,
shared with test_block_emu.py (the same checks on the CPU emulator); here they run on the GPU at the
7B, 0.5B and odd geometries, plus graph replay and compute-sanitizer, which only a GPU has. The int8
build (block.register_int8_mma) runs the same checks against the int8 GEMV build.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from block_testkit import (
    EPS,
    GEOMETRIES,
    LAYOUT_IDS,
    LAYOUTS,
    Layer,
    _half_integers,
    check_block_rejects_what_it_cannot_run,
    check_down_and_determinism,
    check_next_qkv_op,
    check_o_proj_and_gate_up,
    check_randomised_delays_change_nothing,
)
from int4_testkit import same_bits
from nanoqwen_kernels.gemv import norm_stats_shape

pytestmark = pytest.mark.gpu
GEOM_IDS = [g[0] for g in GEOMETRIES]

@pytest.mark.parametrize("geom", GEOMETRIES, ids=GEOM_IDS)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_o_proj_and_gate_up(geom, m, symmetric, scale_dtype, int8, gen, device):
    check_o_proj_and_gate_up(geom, m, symmetric, scale_dtype, gen, device, int8=int8)


@pytest.mark.parametrize("geom", GEOMETRIES, ids=GEOM_IDS)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_down_and_determinism(geom, m, symmetric, scale_dtype, int8, gen, device):
    check_down_and_determinism(geom, m, symmetric, scale_dtype, gen, device, int8=int8)


@pytest.mark.parametrize("geom", GEOMETRIES[:2], ids=GEOM_IDS[:2])
def test_randomised_delays_change_nothing(geom, gen, device):
    check_randomised_delays_change_nothing(geom, gen, device)


@pytest.mark.parametrize("geom", GEOMETRIES, ids=GEOM_IDS)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_next_qkv_op(geom, m, symmetric, scale_dtype, int8, gen, device):
    check_next_qkv_op(geom, m, symmetric, scale_dtype, gen, device, int8=int8)


def test_block_rejects_what_it_cannot_run(gen, device):
    check_block_rejects_what_it_cannot_run(gen, device)


def test_graph_replay_on_new_inputs(gen, device):
    """Captured once; each replay on new inputs gives the eager launch's bits."""
    from nanoqwen_kernels.block import BlockWorkspace, post_attention_block

    layer = Layer(GEOMETRIES[0], 1, False, torch.bfloat16, gen, device)
    plan = layer.plan(device)
    ws = BlockWorkspace.allocate(plan, device)
    attn, resid = layer.attn.clone(), layer.resid0.clone()
    gate_up = torch.empty(1, 2 * layer.inter, dtype=torch.bfloat16, device=device)
    stats = torch.empty(norm_stats_shape(1, layer.h), dtype=torch.float32, device=device)

    def step():
        post_attention_block(attn, layer.w_o, layer.norm_w, EPS, layer.w_gu, layer.w_d, resid, gate_up, stats,
                             ws, plan)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        layer.attn = _half_integers(1, layer.kq, gen, device)
        layer.resid0 = (4 * torch.randn(1, layer.h, generator=gen, device=device)).to(torch.bfloat16)
        attn.copy_(layer.attn)
        resid.copy_(layer.resid0)
        gate_up.fill_(float("nan"))
        stats.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert int(ws.counters.abs().sum()) == 0
        want_resid, want_gu, want_stats = layer.run_block(plan, ws)
        same_bits(resid, want_resid, "graph replay: residual")
        same_bits(gate_up, want_gu, "graph replay: gate_up")
        assert torch.equal(stats, want_stats), "graph replay: statistics"


SANITIZE_SCRIPT = Path(__file__).parents[1] / "bench" / "block" / "sanitize_block.py"

@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "synccheck", "initcheck"])
def test_compute_sanitizer_clean(tool, compute_sanitizer):
    """Out-of-bounds or misaligned accesses (the ring's bulk copies, the partial and statistics slots),
    barrier misuse, reads of memory nothing wrote: each tool judged by its own clean summary line."""
    compute_sanitizer(tool, SANITIZE_SCRIPT, "sanitize_block: OK")
