"""Helpers shared by the engine tests (test_engine_cpu, test_prefix_cache, test_speculative_engine,
test_reference, test_reference_engine): the tiny synthetic geometry, the engine's bound against the
fp32 reference, a CPU engine config, and runners. conftest.py puts this folder on sys.path (pytest
imports test files with --import-mode=importlib, so they cannot import each other)."""

from __future__ import annotations

import torch
from nanoqwen_model import Qwen2Config
from nanoqwen_runtime.engine import EngineConfig, TokenEvent

# The tiny synthetic model and the engine's bound against the fp32 reference (derivation in
# test_engine_cpu.py: 24 bf16 roundings of ~2^-9 each over logits of std ~2 give ~0.04 at the largest
# of 512 logits plus half an ulp; 0.15 is ~3x that). Two paths each within LOGIT_ATOL of the truth can
# only pick different tokens where the top-2 gap is below NEAR_TIE.
TINY = Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, intermediate_size=384, vocab_size=512, rope_theta=1e6, rms_norm_eps=1e-6,
                   max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=(3,))
LOGIT_ATOL = 0.15
NEAR_TIE = 2 * LOGIT_ATOL


def cpu_config(**kw) -> EngineConfig:
    """The engine on the torch op backend, eager, a 64-block pool (keyword arguments override)."""
    base = dict(device="cpu", backend="torch", mode="eager", num_blocks=64, block_size=16,
                max_model_len=256, prefill_chunk=48, max_batch=8)
    base.update(kw)
    return EngineConfig(**base)


def run_engine(engine, requests, gaps=None):
    """Run to completion; ({request_id: tokens}, {request_id: FinishEvent}). `gaps` (a dict) receives
    each token's top-2 logit gap."""
    out, fins = {}, {}
    engine.record_logits = gaps is not None
    for ev in engine.generate(requests):
        if isinstance(ev, TokenEvent):
            out.setdefault(ev.request, []).append(ev.token_id)
            if gaps is not None:
                top2 = torch.topk(engine.last_logits[ev.request], 2).values
                gaps.setdefault(ev.request, []).append(float(top2[0] - top2[1]))
        else:
            fins[ev.request_id] = ev
    return out, fins


def assert_same_until_near_tie(got, want, want_gaps):
    """Per request: tokens equal up to the first token whose top-2 gap is < NEAR_TIE (from there on
    either choice is right, and the sequences may diverge)."""
    assert got.keys() == want.keys()
    for rid in want:
        assert len(got[rid]) == len(want[rid]), rid
        for i, (a, b) in enumerate(zip(got[rid], want[rid], strict=True)):
            if want_gaps[rid][i] < NEAR_TIE:
                break
            assert a == b, f"request {rid} token {i}: {a} != {b}"


def hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation by full (uncached) HF forwards: the plainest possible oracle."""
    ids = list(ids)
    out = []
    for _ in range(steps):
        with torch.no_grad():
            nxt = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


def kernel_engine_on_cpu(monkeypatch, model, cfg: EngineConfig, plan_factory=None):
    """The CUDA engine's kernel op backend run on the CPU with every launch recorded, not run: the
    device checks and `launch` of each launcher module are replaced, and the attention plans (which
    allocate CUDA work buffers) by `plan_factory(mode, geometry, launched, **plan_kwargs)` (default: a
    stand-in that records "paged_attention_{mode}"). `model` is a `loader.load` result; `cfg` is a
    validated CPU config whose backend is switched to "kernels". Returns (engine, launched): the list
    the kernel names go to. Checks the engine <-> nanoqwen_kernels contract, not the numbers."""
    import nanoqwen_kernels.attention as kattn
    import nanoqwen_kernels.gemm as kgemm
    import nanoqwen_kernels.gemv as kgemv
    import nanoqwen_kernels.layer_ops as kops
    import nanoqwen_kernels.sampling as ksamp
    from nanoqwen_runtime.engine import ops_kernels
    from nanoqwen_runtime.engine.engine import Engine

    launched: list[str] = []
    for mod in (kops, ksamp, kgemv, kgemm):
        monkeypatch.setattr(mod, "require_sm90", lambda device: 0)
        monkeypatch.setattr(mod, "launch", lambda fam, name, *a, **k: launched.append(name))
    monkeypatch.setattr(kgemv, "_sm_count", lambda index: 132)
    for encode in ("tensor_map_2d", "tensor_map_2d_bf16"):  # the wgmma GEMM's TMA descriptors (driver)
        monkeypatch.setattr(kgemm.cuda_driver, encode, lambda *a, **k: None)
    monkeypatch.setattr(ops_kernels.klaunch, "require_sm90", lambda device: 0)

    class RecordingPlan:
        def __init__(self, mode, geometry, launched, **kw):
            self.mode = mode
            self.can_defer_merge = False  # a plan of one launch: no split rows for o_proj to merge

        def run(self, *a, **kw):
            launched.append(f"paged_attention_{self.mode}")

    make_plan = plan_factory or RecordingPlan
    monkeypatch.setattr(kattn, "plan_decode", lambda g, **kw: make_plan("decode", g, launched, **kw))
    monkeypatch.setattr(kattn, "plan_prefill", lambda g, **kw: make_plan("prefill", g, launched, **kw))
    cfg.backend = "kernels"  # after validation: the launches are mocked, so CPU tensors are fine
    monkeypatch.setattr("nanoqwen_runtime.engine.engine.make_ops",
                        lambda config, geom: ops_kernels.KernelOps(geom, config, torch.device("cpu")))
    return Engine(model.geometry, model.weights, cfg), launched


def gpu_reference(container, prompts, steps: int):
    """The fp32 reference model's greedy decode of `prompts` on the GPU (`agreement.reference_decode`,
    the oracle of the real-model GPU tests); the model is freed before returning."""
    from nanoqwen_runtime.engine.agreement import reference_decode
    from nanoqwen_runtime.reference import ReferenceModel

    model = ReferenceModel.from_file(container, device="cuda", dtype=torch.float32)
    ref = reference_decode(model, prompts, steps)
    del model
    torch.cuda.empty_cache()
    return ref


def noise_bounds(container, twin_config: EngineConfig, prompts, reference, batch: int) -> list:
    """Per prompt, the bound at each position (`agreement.noise_bound`): the engine built with
    `twin_config` (its torch op backend) teacher-forced on the reference's tokens, `batch` at a time."""
    from nanoqwen_runtime.engine import Engine
    from nanoqwen_runtime.engine.agreement import noise_bound, teacher_forced

    engine = Engine.from_file(container, twin_config)
    twin = teacher_forced(engine, prompts, reference.tokens, batch=batch)
    del engine
    torch.cuda.empty_cache()
    return [noise_bound(reference.logits[p], twin.logits[p]) for p in range(len(prompts))]


def reference_engine(container, model, **cfg):
    """A `ReferenceEngine` of `container` (ReferenceEngineConfig(**cfg)) on the already loaded `model`:
    the same container's weights, one load per test module instead of one per engine."""
    from nanoqwen_runtime.reference_engine import ReferenceEngine, ReferenceEngineConfig

    eng = ReferenceEngine.from_file(container, ReferenceEngineConfig(**cfg))
    eng.model = model
    return eng
