"""CPU tests of the INT4 fp16-scale layout (`int4-g{G}-tile8x128-f16s-v1`, imported GPTQ/AWQ
checkpoints) through the runtime: loader views, the reference runtime's weights, the torch backend
against the reference, and the kernel backend's dispatch to the `_f16s` kernels (launches mocked).

The container is the synthetic tiny model of test_engine_cpu.py rewritten with fp16 scales that bf16
cannot hold (the bf16 scale times 1 + u, u in [2^-9, 2^-8): 10-bit significands) and asymmetric zero
points 7..9 with some 0 and 16 (the whole range GPTQ v1 produces). The weights stay well scaled, so
the logit bound of test_engine_cpu.py holds unchanged: LOGIT_ATOL = 0.15, NEAR_TIE = 2 x it (its
derivation counts the bf16 roundings of activations, which do not depend on the scale dtype).
"""

from __future__ import annotations

import nanoqwen_format as nqf
import numpy as np
import pytest
import torch
from engine_testkit import kernel_engine_on_cpu
from nanoqwen_model import Qwen2Config
from nanoqwen_runtime.engine import Engine, EngineConfig
from nanoqwen_runtime.engine.agreement import reference_decode, teacher_forced
from nanoqwen_runtime.engine.loader import load
from nanoqwen_runtime.engine.synthetic import write_container
from nanoqwen_runtime.engine.weights import Int4Linear
from nanoqwen_runtime.reference import ReferenceModel, load_weights

TINY = Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, intermediate_size=384, vocab_size=512, rope_theta=1e6, rms_norm_eps=1e-6,
                   max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=(3,))
LOGIT_ATOL = 0.15
NEAR_TIE = 2 * LOGIT_ATOL


def to_f16_scales(qt: nqf.QuantizedTensor, rng: np.random.Generator) -> nqf.QuantizedTensor:
    """The same words with fp16 scales off the bf16 grid and asymmetric zero points 0..16."""
    s = nqf.bf16.to_f32(qt.scales) * (1 + rng.uniform(2**-9, 2**-8, qt.scales.shape)).astype(np.float32)
    s16 = s.astype(np.float16)
    zeros = rng.integers(7, 10, qt.scales.shape, dtype=np.uint8)
    zeros.flat[:: 97] = 16
    zeros.flat[1 :: 101] = 0
    return nqf.int4.pack(nqf.int4.unpack(qt), s16, zeros, qt.group_size, scale_dtype="f16")


def convert_to_f16_scales(src, out, rng: np.random.Generator):
    """Copy container `src` to `out` with every INT4 tensor converted by `to_f16_scales`; returns out."""
    with nqf.open(src) as f, nqf.Writer(out) as w:
        for name, rec in f.records.items():
            if rec.encoding == "int4":
                w.add_quantized(name, to_f16_scales(f.quantized(name), rng))
            else:
                w.add_array(name, np.array(f.array(name)), rec.encoding)
        w.set_metadata(f.metadata)
    return out


@pytest.fixture(scope="module")
def f16s_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("f16s")
    src = write_container(d / "bf16s.nanoqwen", TINY, seed=1, lm_head="int4")
    out = d / "f16s.nanoqwen"
    return convert_to_f16_scales(src, out, np.random.default_rng(0))


def test_loader_views_fp16_scales(f16s_path):
    m = load(f16s_path, "cpu")
    lins = [lin for lw in m.weights.layers for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
    lins.append(m.weights.lm_head)
    assert all(isinstance(lin, Int4Linear) and lin.scales.dtype == torch.float16 for lin in lins)
    with nqf.open(f16s_path) as f:
        qt = f.quantized("layers.1.down")
        lin = m.weights.layers[1].down
        assert np.array_equal(lin.scales.numpy(), qt.scales) and np.array_equal(lin.zeros.numpy(), qt.zeros)
        assert int(lin.zeros.max()) == 16
        # the torch codec on the loaded views is the numpy reference, bit for bit, before the bf16 cast
        from nanoqwen_model import codec

        w32 = codec.dequantize_int4(lin.qweight, lin.scales, lin.zeros, lin.group_size)
        assert np.array_equal(w32.numpy(), f.dequantize("layers.1.down"))
        # and the reference runtime holds exactly that (fp32 weights: no rounding after the decoder)
        _, weights = load_weights(f16s_path, dtype=torch.float32)
        assert torch.equal(weights["layers.1.down"], w32)


def test_engine_matches_reference_with_fp16_scales(f16s_path):
    """Teacher-forced decode (as in test_engine_cpu.py): torch backend logits within LOGIT_ATOL of the
    fp32 reference runtime, greedy choices equal wherever the reference's top-2 gap is >= NEAR_TIE."""
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(10, 500, n)] for n in (40, 7)]
    ref = reference_decode(ReferenceModel.from_file(f16s_path, dtype=torch.float32), prompts, 8)
    assert all(float(lg.std()) > 1.0 for lg in ref.logits)  # still well-scaled weights
    cfg = EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=32, block_size=16,
                       max_model_len=128, prefill_chunk=32, max_batch=4)
    engine = Engine.from_file(f16s_path, cfg)
    run = teacher_forced(engine, prompts, ref.tokens, batch=2)
    decided = 0
    for p in range(len(prompts)):
        err = (run.logits[p] - ref.logits[p]).abs().amax(dim=-1)
        assert float(err.max()) <= LOGIT_ATOL, (p, err)
        clear = ref.gap(p) >= NEAR_TIE
        assert [c for c, k in zip(run.chosen[p], clear, strict=True) if k] == \
            [t for t, k in zip(ref.tokens[p], clear, strict=True) if k]
        decided += int(clear.sum())
    assert decided >= 5, decided  # ~60% of 16 positions clear 0.3 (test_engine_cpu.py); a third must


def test_kernel_backend_launches_f16s_kernels(f16s_path, monkeypatch):
    """The kernel backend hands fp16 scales to nanoqwen_kernels, whose launcher picks the `_f16s`
    entry points for every INT4 linear (GEMV, fused SiLU GEMV, GEMM / dequantize above 8 rows);
    launches are recorded, not run (no GPU), as in test_engine_cpu.py's plumbing test."""
    cfg = EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=64, block_size=16,
                       max_model_len=128, prefill_chunk=64, max_batch=16)
    engine, launched = kernel_engine_on_cpu(monkeypatch, load(f16s_path, "cpu"), cfg)
    from nanoqwen_runtime.engine import Request
    from nanoqwen_runtime.sampling import SamplingParams

    for i, n in enumerate((20, 3, 5, 9, 2, 4, 6, 7, 8, 3)):  # a 47-row prefill, then a 10-row decode batch
        engine.submit(Request([7] * n, SamplingParams(max_tokens=3), str(i), ignore_eos=True))
    while engine.has_work:
        engine.step()
    int4 = [k for k in launched if k.startswith(("gemv_int4", "gemm_int4", "dequant_int4"))]
    assert int4 and all("_f16s" in k for k in int4), sorted(set(int4))
    assert any(k.startswith("gemv_int4") and k.endswith("_f16s_silu_resid") for k in int4)  # fused down proj
    assert any(k.startswith("gemv_int4") and k.endswith("_f16s_norm") for k in int4)  # fused gate_up norm
    assert any(not k.startswith("gemv_int4") for k in int4)  # and the M > 8 path (GEMM or dequantize)


@pytest.mark.gpu
def test_gpu_engine_with_fp16_scales_matches_reference(tmp_path):
    """GPU: a 7B-width, 2-layer container with fp16 scales (converted as above) on the CUDA engine,
    teacher-forced at batch 1 (the `_f16s` GEMV, graph mode) and batch 16 (the INT4 GEMM), prefill in
    chunks of 200 rows: every position within `agreement.noise_bound` (2 x the torch backend's distance
    from the fp32 reference, plus one bf16 ulp: the bound of test_engine_gpu.py, which does not depend
    on the scale dtype: scales widen to f32 exactly), greedy equal wherever the reference's gap is at
    least twice the bound; the graph's path counters show which INT4 kernel ran."""
    from nanoqwen_model import QWEN25_CODER_7B
    from nanoqwen_runtime.engine.agreement import noise_bound

    geom = QWEN25_CODER_7B.with_(num_hidden_layers=2)
    src = write_container(tmp_path / "bf16s.nanoqwen", geom, seed=6, device="cuda")
    path = tmp_path / "f16s.nanoqwen"
    convert_to_f16_scales(src, path, np.random.default_rng(1))
    g = torch.Generator().manual_seed(2)
    lengths = [1 + 37 * i % 300 for i in range(16)]
    prompts = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in lengths]
    model = ReferenceModel.from_file(path, device="cuda", dtype=torch.float32)
    ref = reference_decode(model, prompts, 4)
    del model
    base = dict(kv_memory_bytes=2 << 30, max_model_len=4096, prefill_chunk=200)
    twin_engine = Engine.from_file(path, EngineConfig(backend="torch", mode="eager", **base))
    twin = teacher_forced(twin_engine, prompts, ref.tokens, batch=len(prompts))
    del twin_engine
    bound = [noise_bound(ref.logits[p], twin.logits[p]) for p in range(len(prompts))]
    torch.cuda.empty_cache()
    engine = Engine.from_file(path, EngineConfig(**base))
    assert engine.ops.name == "kernels"
    for batch, path_name in ((1, "gemv_int4"), (16, "int4_gemm")):
        run = teacher_forced(engine, prompts, ref.tokens, batch=batch)
        decided = 0
        for p in range(len(prompts)):
            diff = (run.logits[p] - ref.logits[p]).abs().amax(dim=-1)
            assert bool((diff <= bound[p]).all()), (batch, p, diff.tolist(), bound[p].tolist())
            clear = (ref.gap(p) >= 2 * bound[p]).cpu()
            for j in range(len(clear)):
                if clear[j]:
                    assert run.chosen[p][j] == ref.tokens[p][j], (batch, p, j)
                    decided += 1
        assert decided >= len(prompts) * 4 // 4  # a quarter of the positions at the least (test_engine_gpu)
        graph = engine.runner.graph_paths[(batch, engine.runner.context_classes[0])]
        assert graph.get(path_name) == 4 * geom.num_hidden_layers, graph
    assert engine.kv_blocks_used() == 0
