"""The real Qwen2.5-Coder-0.5B-Instruct GGUF (model-marked; skipped when it is not fetched).

- The GGUF source reads q/k in HF order (no llama.cpp un-permute for qwen2): nanoqwen_model's
  forward on the packed bf16 container matches transformers' own GGUF loading, the oracle.
- GPTQ, asserted against what GPTQ claims, with no bound fitted to a measurement: per projection of
  every layer its output error on its calibration inputs (`out_rel`, the quantity it minimises) is
  below RTN's on the same inputs; static groups keep RTN's scales; on held-out stdlib code (the
  "heldout" split, disjoint files) both quantized containers cost perplexity against bf16.
  Not asserted: GPTQ below RTN on the held-out text. With this CI calibration (8,192 tokens) that
  order is a draw decided by fp32 summation order: the CPU pack put GPTQ sym below RTN sym, the same
  recipe packed on a GPU put it above (7.232 against 7.187, bf16 6.665; measured at 5f1fd37). The
  default recipe's held-out quality (65,536 calibration tokens) is asserted against its goal in
  test_quality_default.py.
- Cost: the CPU tests pack RTN (symmetric g128; bf16 comes from the session cache) in seconds. GPTQ
  packs on the GPU (`gpu` tests, `nox -s gpu_tests`), as test_quality_default.py does: on the 2-core
  CI machine its 24 layers took ~6 of CI's 20 minutes. The CPU suite keeps GPTQ's code paths on tiny
  models (test_gptq.py, test_pack_tiny.py, test_recipes.py).
"""

from __future__ import annotations

import json

import nanoqwen_format as nqf
import numpy as np
import pytest
import torch
from nanoqwen_model import forward as fwd
from nanoqwen_model.config import Qwen2Config
from nanoqwen_quant.calib import heldout_text
from nanoqwen_quant.evaluate import load_f32, perplexity
from nanoqwen_quant.options import LINEARS, PackOptions
from nanoqwen_quant.pack import pack
from nanoqwen_quant.sources import GGUFSource

pytestmark = [pytest.mark.model, pytest.mark.slow]

# Oracle tolerance (derived before measuring, as in tests/test_pack_tiny.py): both sides compute in
# fp32 with the same formulas; a dot product of length K <= 4864 (down) in another order moves by about
# sqrt(K) * 2^-24 ~ 4.2e-6 of the sum of |terms|; a logit passes 24 layers x (4 linears + attention)
# + the head = 121 such stages, RMSNorm re-scaling by O(1); x2 for the two sides' independent
# roundings. Bound: ORACLE_REL x max |logit| (1.0e-3).
FP32_U = 2**-24
ORACLE_REL = 2 * (24 * 5 + 1) * 4864**0.5 * FP32_U
# Calibration size. GPTQ lowers the output error on the inputs its Hessian H = 2/n sum x x^T was built
# from. With n tokens H has rank <= n, and down's H is [4864, 4864]: below n = 4864 GPTQ moves weights
# along directions no calibration token constrains (only the 1% damping does). So n >= intermediate_size,
# in the recipe's windows of 2,048 tokens: ceil(4864 / 2048) = 3 windows reach it; a 4th gives n / K =
# 1.7. That carries GPTQ's gain to held-out text only where H stands for the held-out inputs, which this
# n does not ensure: observed a draw with 2,048 tokens (GPTQ 5.61 vs RTN 5.69, then 5.91 after an
# fp32-rounding-level change of the forward) and with these 8,192 (module docstring).
INTERMEDIATE_05B = 4864
CALIB_SEQ_LEN = 2048
CALIB_TOKENS = (-(-INTERMEDIATE_05B // CALIB_SEQ_LEN) + 1) * CALIB_SEQ_LEN
# held-out tokens scored per model: the perplexities are compared on the same tokens
EVAL_TOKENS = 4096


@pytest.fixture(scope="module")
def packed(qwen05b_gguf, qwen05b_packed, tmp_path_factory):
    # bf16 comes from the session cache of `nanoqwen-quant pack` (root conftest), shared with the runtime
    # and end-to-end tests; RTN is packed here on the symmetric grid, GPTQ's grid in `gptq_packed`.
    d = tmp_path_factory.mktemp("q05b")
    out = {"bf16": qwen05b_packed("none"), "rtn": d / "rtn.nanoqwen"}
    pack(GGUFSource(qwen05b_gguf), out["rtn"], PackOptions(method="rtn", symmetric=True, device="cpu"),
         log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def gptq_packed(packed, qwen05b_gguf, tmp_path_factory):
    """`packed` plus "gptq": GPTQ symmetric g128 (reduced CI calibration), packed on the GPU."""
    path = tmp_path_factory.mktemp("q05b-gptq") / "gptq.nanoqwen"
    opts = PackOptions(method="gptq", symmetric=True, calib_tokens=CALIB_TOKENS, calib_seq_len=CALIB_SEQ_LEN,
                       device="cuda")
    pack(GGUFSource(qwen05b_gguf), path, opts, log=lambda m: None)
    return packed | {"gptq": path}


def test_containers_are_valid(packed, qwen05b_gguf):
    for name, path in packed.items():
        with nqf.open(path) as f:
            f.verify()
            assert f.config["num_hidden_layers"] == 24 and f.config["tie_word_embeddings"] is False
            assert f.records["lm_head"].encoding == "bf16"
            enc = f.records["layers.23.down"].encoding
            assert enc == ("bf16" if name == "bf16" else "int4")
            prov = f.metadata["provenance"]
            assert prov["source_sha256"] == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
            assert "<|im_start|>" in f.chat_template
            tok = json.loads(f.tokenizer_json)
            added = {t["content"]: (t["id"], t["special"]) for t in tok["added_tokens"]}
            # every control and user-defined token of the GGUF, at its id (the FIM tokens among them)
            assert added["<|im_end|>"] == (151645, True) and added["<|fim_prefix|>"] == (151659, True)
            assert added["<|file_sep|>"] == (151664, True) and added["<tool_call>"] == (151657, False)
            assert len(added) == 22
            assert f.metadata["generation"]["eos_token_ids"] == [151645, 151643]
            assert f.config["intermediate_size"] == INTERMEDIATE_05B


@pytest.mark.gpu
def test_gptq_container_is_valid(gptq_packed):
    with nqf.open(gptq_packed["gptq"]) as f:
        f.verify()
        assert f.records["layers.23.down"].encoding == "int4"
        q = f.metadata["quantization"]
        assert (q["method"], q["symmetric"], q["group_size"]) == ("gptq", True, 128)
        assert q["calibration"]["tokens"] == CALIB_TOKENS == 8192


def test_bf16_forward_matches_transformers_gguf_loader(packed, qwen05b_gguf):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(qwen05b_gguf.parent), gguf_file=qwen05b_gguf.name,
                                             dtype=torch.float32)
    sd = m.state_dict()
    with nqf.open(packed["bf16"]) as f:
        cfg = Qwen2Config.from_metadata(f.config)
        qkv = load_f32(f, "layers.0.qkv", "cpu")
        # q/k rows in HF order: equal to the oracle's weights rounded to bf16
        q_ref = sd["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16).float()
        k_ref = sd["model.layers.0.self_attn.k_proj.weight"].to(torch.bfloat16).float()
        assert torch.equal(qkv[: cfg.q_dim], q_ref)
        assert torch.equal(qkv[cfg.q_dim: cfg.q_dim + cfg.kv_dim], k_ref)
        # logits of the bf16 container vs transformers running the same bf16-rounded weights in fp32
        with torch.no_grad():
            for v in sd.values():
                v.copy_(v.to(torch.bfloat16).float())
        ids = torch.tensor([750, 75698, 1445, 982, 262, 421, 308, 366, 220, 17, 510, 286, 470, 308, 198])
        with torch.no_grad():
            m(ids[None, :2])  # warm-up, discarded: see _hf_model in tests/test_pack_tiny.py
            ref = m(ids[None]).logits[0]
        # one layer's weights at a time through nanoqwen_model's forward (f32 weights: fp32 math)
        t = ids.shape[0]
        positions, attend = torch.arange(t), fwd.dense_attend(1, t)
        inv_freq = fwd.rope_inv_freq(cfg.head_dim, cfg.rope_theta)
        h = load_f32(f, "embed_tokens", "cpu")[ids]
        for i in range(cfg.num_hidden_layers):
            w = {k: load_f32(f, f"layers.{i}.{k}", "cpu") for k in fwd.LAYER_TENSORS}
            h = fwd.decoder_layer(cfg, h, w, positions, inv_freq, attend, i)
        logits = fwd.logits(cfg, {"final_norm": load_f32(f, "final_norm", "cpu"),
                                  "lm_head": load_f32(f, "lm_head", "cpu")}, h)
    # transformers reads rms_norm_eps as the f32 value 9.99999997e-07, we use 1e-06 (the HF config
    # value): 3e-15 on eps next to mean squares of O(1) moves nothing at fp32 precision
    atol = ORACLE_REL * float(ref.abs().max())
    torch.testing.assert_close(logits, ref, atol=atol, rtol=0)
    # the greedy token agrees wherever the oracle's top two logits are further apart than the two
    # sides can disagree (2 atol); where they are closer, either token is within tolerance
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * atol
    assert bool(decided.any())
    assert torch.equal(logits.argmax(-1)[decided], ref.argmax(-1)[decided])


@pytest.mark.gpu
def test_gptq_output_error_below_rtn_in_every_projection(gptq_packed):
    # the metadata's per-projection errors on the calibration inputs (src/nanoqwen_quant/metrics.py):
    # out_rel = tr(E H E^T) / tr(W H W^T) is what GPTQ minimises, rtn_out_rel the same for RTN's Q
    with nqf.open(gptq_packed["gptq"]) as f:
        errs = f.metadata["quantization"]["layer_errors"]
    assert len(errs) == 24 and all(set(e) == set(LINEARS) for e in errs)
    worse = [(i, n, e[n]["out_rel"], e[n]["rtn_out_rel"]) for i, e in enumerate(errs) for n in LINEARS
             if not 0 <= e[n]["out_rel"] < e[n]["rtn_out_rel"]]
    assert not worse, worse


@pytest.mark.gpu
def test_gptq_keeps_rtn_scales(gptq_packed):
    # static groups: GPTQ's group scales are computed from the original weights, before any update,
    # exactly as RTN computes them; only columns with no calibration signal (dead, zeroed) differ
    with nqf.open(gptq_packed["gptq"]) as g, nqf.open(gptq_packed["rtn"]) as r:
        errs = g.metadata["quantization"]["layer_errors"]
        for i in range(24):
            for n in LINEARS:
                if errs[i][n]["dead_columns"] == 0:
                    name = f"layers.{i}.{n}"
                    np.testing.assert_array_equal(g.quantized(name).scales, r.quantized(name).scales)


@pytest.mark.gpu
def test_quantized_perplexity_above_bf16_on_heldout_text(gptq_packed):
    # on the same held-out tokens quantizing costs perplexity: the bf16 weights sit at a minimum of the
    # training loss, so a perturbation raises it (measured 6.665 -> 7.187 RTN, 7.232 GPTQ on a GPU;
    # both margins ~8%, far beyond fp32 summation order). GPTQ against RTN here: a draw (module docstring).
    text = heldout_text(20_000)
    ppl = {name: perplexity(path, text, seq_len=512, max_tokens=EVAL_TOKENS, device="cuda").perplexity
           for name, path in gptq_packed.items()}
    print("perplexity on held-out stdlib code:", ppl)
    assert ppl["bf16"] < min(ppl["gptq"], ppl["rtn"]), ppl
