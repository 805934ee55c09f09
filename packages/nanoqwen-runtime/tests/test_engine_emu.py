"""CPU: the engine's kernel backend computing for real on the kernel emulator (nanoqwen_kernels.testing.emu:
the kernels' own CUDA source compiled for the host), against the fp32 reference: the GEMVs with their fused
prologues and epilogues. The model step's plumbing of
the fused paths (the residual and statistics handed between launches) with the kernels' real outputs.

What is emulated: every gemv, gemm and layer_ops launch (embedding, norms, the INT4 GEMVs with the norm
prologue, the qkv RoPE / K/V epilogue and the residual epilogue, the prefill's dequantisation or its
INT4 GEMMs (the mma.sync kernel), by the prefill chunk); with
`kernel_attention`, also the paged attention (the prefill and decode plans the engine makes, over its
page tables) and the sampler (greedy over the engine's per-row parameter buffers), so that every launch
of a step is the kernels' own code; otherwise those two come from the torch backend (`EmuKernelOps`).

Bound (test_engine_gpu.py's, `engine.agreement`): at every teacher-forced position, |logits - reference|
<= 2 x |torch backend - reference| + one bf16 ulp at the largest logit; the greedy choice equals the
reference's wherever its top-2 gap is at least twice that.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from engine_testkit import TINY, cpu_config
from nanoqwen_runtime.engine import Engine
from nanoqwen_runtime.engine.agreement import noise_bound, reference_decode, teacher_forced
from nanoqwen_runtime.engine.ops_torch import TorchOps
from nanoqwen_runtime.engine.synthetic import write_container
from nanoqwen_runtime.reference import ReferenceModel

STEPS = 8


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_container(tmp_path_factory.mktemp("emu") / "tiny.nanoqwen", TINY, seed=7)


@pytest.fixture(scope="module")
def oracle(tiny_path):
    """(prompts, reference decode, per-prompt bound) with the torch backend as the bound's twin."""
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(10, 500, n)] for n in (70, 81)]
    ref = reference_decode(ReferenceModel.from_file(tiny_path, dtype=torch.float32), prompts, STEPS)
    twin = teacher_forced(Engine.from_file(tiny_path, _config()), prompts, ref.tokens, batch=2)
    return prompts, ref, [noise_bound(ref.logits[p], twin.logits[p]) for p in range(len(prompts))]


def _config(prefill_chunk=256, **kw):
    return cpu_config(prefill_chunk=prefill_chunk, max_batch=2, graph_buckets=(1, 2), **kw)


def _emu_engine(path, monkeypatch, kernel_attention: bool = False, prefill_chunk: int = 256) -> Engine:
    """The CUDA engine's kernel backend on CPU tensors, its launches on the emulator (the caller holds
    `emu.emulated()`); attention and sampling from the torch backend unless `kernel_attention`."""
    from nanoqwen_kernels import attention as kattn
    from nanoqwen_runtime.engine import ops_kernels

    class EmuKernelOps(ops_kernels.KernelOps):
        def __init__(self, geom, cfg, device):
            super().__init__(geom, cfg, device)
            self.torch_ops = TorchOps(geom, device)

        def setup(self, *, max_context_len, max_rows, max_tokens, buckets, step_buffers, context_classes):
            self.max_context_len = max_context_len
            if self._dequantizes(max_tokens):
                self._scratch = torch.empty(self._scratch_numel, dtype=torch.bfloat16, device=self.device)

        def attention_plan(self, **kw):
            return None  # model.py then calls ops.attention

        def attention(self, *args):
            self.torch_ops.attention(*args)

        def sample(self, *args):
            self.torch_ops.sample(*args)

    monkeypatch.setattr(ops_kernels.klaunch, "require_sm90", lambda device: 0)
    if kernel_attention:
        ops_class = ops_kernels.KernelOps
    else:
        ops_class = EmuKernelOps
        monkeypatch.setattr(kattn, "plan_decode", None)  # nothing may plan paged attention here
    monkeypatch.setattr("nanoqwen_runtime.engine.engine.make_ops",
                        lambda config, geom: ops_class(geom, config, torch.device("cpu")))
    cfg = _config(prefill_chunk)
    cfg.backend = "kernels"  # after validation (it wants CUDA)
    from nanoqwen_runtime.engine.loader import load

    model = load(path, "cpu")
    return Engine(model.geometry, model.weights, cfg)


@pytest.mark.parametrize("kernel_attention,prefill_chunk,prefill_rows", [
    (False, 256, None), (True, 256, None), (False, 128, None), (False, 256, 128)],
    ids=["gemv-wgmma", "gemv-wgmma-attention-sampling", "gemv-wgmma-split-gemm", "gemv-dequant"])
def test_kernel_backend_on_the_emulator_matches_the_reference(tiny_path, oracle, monkeypatch,
                                                             kernel_attention, prefill_chunk, prefill_rows):
    """Prefill chunk 256: the two prompts prefill in one 151-row step (the wgmma GEMM's prefill plan, two
    128-row M blocks), or with INT4_PREFILL_GEMM_MAX_ROWS lowered to 128 (`prefill_rows`), dequantise +
    matmul; 128: a 128-row step (one M block split along K) and a 23-row one (the mma.sync GEMM)."""
    from nanoqwen_kernels import attention as kattn
    from nanoqwen_kernels import sampling as ksamp
    from nanoqwen_kernels.testing import emu
    from nanoqwen_runtime.engine import ops_kernels

    try:
        emu.compiler()
    except emu.EmulatorError as e:
        pytest.skip(str(e))
    prompts, ref, bound = oracle
    if prefill_rows is not None:
        monkeypatch.setattr(ops_kernels, "INT4_PREFILL_GEMM_MAX_ROWS", prefill_rows)
    launched: list[str] = []
    with emu.emulated(sms=4, seed=5, timeout_s=60.0):
        def counted(family, kernel, *args, **kw):
            launched.append(kernel)
            emu.launch(family, kernel, *args, **kw)

        kattn.launch = ksamp.launch = counted  # emulated() puts the real launchers back on exit
        engine = _emu_engine(tiny_path, monkeypatch, kernel_attention, prefill_chunk)
        run = teacher_forced(engine, prompts, ref.tokens, batch=2)
    decided = 0
    for p in range(len(prompts)):
        diff = (run.logits[p] - ref.logits[p]).abs().amax(dim=-1)
        assert bool((diff <= bound[p]).all()), (p, diff.tolist(), bound[p].tolist())
        clear = ref.gap(p) >= 2 * bound[p]
        for j in range(STEPS):
            if clear[j]:
                assert run.chosen[p][j] == ref.tokens[p][j], f"prompt {p} position {j}"
                decided += 1
    assert decided >= STEPS // 2
    paths = engine.ops.paths
    layers = TINY.num_hidden_layers
    decode_steps = run.decode_steps
    assert paths["gemv_int4"] >= 4 * layers * decode_steps and paths["residual_epilogue"] > 0
    if prefill_rows is not None:  # the 151-row step dequantised
        assert paths["dequant_gemm"] == 4 * layers and not {"int4_gemm", "int4_gemm_wgmma128"} & set(paths)
    elif prefill_chunk == 256:  # the 151-row step on the wgmma prefill plan
        assert paths["int4_gemm_wgmma128"] == 4 * layers and not {"int4_gemm", "dequant_gemm"} & set(paths)
    else:  # the 128-row step on the wgmma prefill plan, the 23-row step on the mma.sync GEMM
        assert paths["int4_gemm_wgmma128"] == paths["int4_gemm"] == 4 * layers, paths
        assert "dequant_gemm" not in paths
    if kernel_attention:  # every layer's attention and every step's sampling ran on the emulator
        assert launched.count("paged_attention_decode_hd64") >= layers * decode_steps, launched
        assert "paged_attention_prefill_hd64" in launched and "sample_tokens_bf16" in launched, launched
        # the kernel backend's default merge: the o_proj GEMV merges every decode step's split rows
        assert paths.get("attention_merge_o_proj", 0) == layers * decode_steps, paths
    else:
        assert not launched
    assert engine.kv_blocks_used() == 0


def test_attention_merge_in_o_proj_gives_the_combine_kernels_bits(tiny_path, monkeypatch):
    """The o_proj GEMV's merge of the split attention rows against the combine kernel (the engine with
    `KernelOps.fuses_attention_merge` forced off), every launch on the emulator (attention and sampling
    too): prompts of 130 and 125 tokens (one prefill chunk of 255: no INT4 GEMM, which the
    emulator does not run), so that the decode steps' contexts split in the engine's decode plans (3
    tiles: the first prompt from its first step, the second from its fourth) and the combine kernel has
    rows to merge beside unsplit ones. The o_proj GEMV's merge
    prologue uses the combine kernel's arithmetic, so the logits of every teacher-forced position must
    be bitwise equal; each decode step's layers must have deferred the merge ("attention_merge_o_proj")
    and launched the `_merge_hd64_resid` GEMV instead of the combine kernel, one launch fewer per layer."""
    from nanoqwen_kernels import attention as kattn
    from nanoqwen_kernels import gemv as kgemv
    from nanoqwen_kernels import sampling as ksamp
    from nanoqwen_kernels.testing import emu
    from nanoqwen_runtime.engine import ops_kernels

    try:
        emu.compiler()
    except emu.EmulatorError as e:
        pytest.skip(str(e))
    rng = np.random.default_rng(11)
    prompts = [[int(x) for x in rng.integers(10, 500, n)] for n in (130, 125)]
    forced = reference_decode(ReferenceModel.from_file(tiny_path, dtype=torch.float32), prompts, STEPS).tokens
    runs, launches, engines = {}, {}, {}
    for merge in ("combine", "o_proj"):
        launched: list[str] = []
        with emu.emulated(sms=4, seed=9, timeout_s=60.0):
            def counted(family, kernel, *args, _launched=launched, **kw):
                _launched.append(kernel)
                emu.launch(family, kernel, *args, **kw)

            kattn.launch = ksamp.launch = kgemv.launch = counted  # put back by emulated() on exit
            with monkeypatch.context() as mp:
                if merge == "combine":
                    mp.setattr(ops_kernels.KernelOps, "fuses_attention_merge", lambda *a: False)
                engine = _emu_engine(tiny_path, monkeypatch, kernel_attention=True)
                runs[merge] = teacher_forced(engine, prompts, forced, batch=2)
        launches[merge], engines[merge] = launched, engine
    assert all(p.can_defer_merge for p in engines["o_proj"].ops.decode_plans.values())
    for p in range(len(prompts)):
        assert torch.equal(runs["o_proj"].logits[p], runs["combine"].logits[p]), f"prompt {p}: logits differ"
    layers, steps = TINY.num_hidden_layers, runs["o_proj"].decode_steps
    assert steps == runs["combine"].decode_steps and steps > 0
    paths = engines["o_proj"].ops.paths
    assert paths["attention_merge_o_proj"] == layers * steps, paths
    assert "attention_merge_o_proj" not in engines["combine"].ops.paths
    merged = [k for k in launches["o_proj"] if k.endswith("_merge_hd64_resid")]
    assert len(merged) == layers * steps, merged
    combine = "paged_attention_combine_hd64"
    assert launches["combine"].count(combine) - launches["o_proj"].count(combine) == layers * steps
    assert len(launches["combine"]) - len(launches["o_proj"]) == layers * steps
    # only a decode plan's merge is deferred: a prefill or verify chunk of <= 8 tokens on a plan that
    # splits launches the combine kernel (the merge prologue was tested on decode rows only)
    ops, o_proj = engines["o_proj"].ops, engines["o_proj"].weights.layers[0].o_proj
    plan = next(iter(ops.decode_plans.values()))
    assert ops.fuses_attention_merge(plan, o_proj, 2)
    stand_in = types.SimpleNamespace(mode="prefill", can_defer_merge=True)
    assert not ops.fuses_attention_merge(stand_in, o_proj, 2)
