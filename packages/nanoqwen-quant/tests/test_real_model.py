"""The real Qwen2.5-Coder-0.5B-Instruct GGUF (model-marked; skipped when it is not fetched).

- The GGUF source reads q/k in HF order (no llama.cpp un-permute for qwen2): our forward on the
  packed bf16 container matches transformers' own GGUF loading, the oracle.
- Quality with a reduced calibration set to keep CI short (GPTQ on 4 x 512 tokens of the stdlib
  "calib" split; the README table uses the full recipe): on held-out stdlib code (the "heldout" split,
  disjoint files) GPTQ-g128 beats RTN-g128, and GPTQ stays within GPTQ_PPL_BOUND of bf16.
  Cost: the fixture packs three containers (GPTQ ~10 s/layer on an idle 2-core machine) and the
  quality test runs three 1,024-token evaluations.
"""

from __future__ import annotations

import json

import nanoqwen_format as nqf
import pytest
import torch
from nanoqwen_quant import qwen2
from nanoqwen_quant.calib import heldout_text
from nanoqwen_quant.evaluate import config_from_container, load_f32, perplexity
from nanoqwen_quant.pack import PackOptions, pack
from nanoqwen_quant.sources import GGUFSource

pytestmark = [pytest.mark.model, pytest.mark.slow]

# Bounds (one table). Measured with this reduced recipe on 1,024 held-out tokens: bf16 5.1485,
# RTN-g128 5.6923 (+10.6%), GPTQ-g128 5.6146 (+9.05%). The full recipe (README) gives GPTQ +6.0%.
GPTQ_PPL_BOUND = 1.10  # ppl(GPTQ-g128) <= 1.10 * ppl(bf16) on the held-out text
RTN_PPL_BOUND = 1.20  # ppl(RTN-g128) <= 1.20 * ppl(bf16): RTN is worse, but not broken
ORACLE_LOGITS_ATOL = 2e-3  # fp32 forward, same bf16 weights, vs transformers (fp32 sums differ)
EVAL_TOKENS = 1024


@pytest.fixture(scope="module")
def packed(qwen05b_gguf, qwen05b_packed, tmp_path_factory):
    # bf16 and RTN come from the session cache of `nanoqwen-quant pack` (root conftest), shared with the
    # runtime and end-to-end tests; GPTQ with the reduced CI calibration is packed here.
    out = {"bf16": qwen05b_packed("none"), "rtn": qwen05b_packed("rtn")}
    out["gptq"] = tmp_path_factory.mktemp("q05b") / "gptq.nanoqwen"
    opts = PackOptions(method="gptq", calib_tokens=2048, calib_seq_len=512, device="cpu")
    pack(GGUFSource(qwen05b_gguf), out["gptq"], opts, log=lambda m: None)
    return out


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
            assert any(t["content"] == "<|im_end|>" and t["id"] == 151645 for t in tok["added_tokens"])
            assert f.metadata["generation"]["eos_token_ids"] == [151645, 151643]


def test_bf16_forward_matches_transformers_gguf_loader(packed, qwen05b_gguf):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(qwen05b_gguf.parent), gguf_file=qwen05b_gguf.name,
                                             dtype=torch.float32)
    sd = m.state_dict()
    with nqf.open(packed["bf16"]) as f:
        cfg = config_from_container(f.metadata)
        qkv = load_f32(f, "layers.0.qkv", "cpu")
        # q/k rows in HF order: equal to the oracle's weights rounded to bf16
        q_ref = sd["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16).float()
        k_ref = sd["model.layers.0.self_attn.k_proj.weight"].to(torch.bfloat16).float()
        assert torch.equal(qkv[: cfg.q_size], q_ref)
        assert torch.equal(qkv[cfg.q_size: cfg.q_size + cfg.kv_size], k_ref)
        # logits of the bf16 container vs transformers running the same bf16-rounded weights in fp32
        with torch.no_grad():
            for v in sd.values():
                v.copy_(v.to(torch.bfloat16).float())
        ids = torch.tensor([[750, 75698, 1445, 982, 262, 421, 308, 366, 220, 17, 510, 286, 470, 308, 198]])
        with torch.no_grad():
            ref = m(ids).logits
        x = load_f32(f, "embed_tokens", "cpu")[ids]
        rope = qwen2.rope_cos_sin(ids.shape[1], cfg.head_dim, cfg.rope_theta, "cpu")
        for i in range(cfg.num_hidden_layers):
            w = {k: load_f32(f, f"layers.{i}.{k}", "cpu") for k in
                 ("input_norm", "qkv", "qkv_bias", "o_proj", "post_attn_norm", "gate_up", "down")}
            x = qwen2.decoder_layer(cfg, x, w, rope)
        logits = qwen2.rms_norm(x, load_f32(f, "final_norm", "cpu"), cfg.rms_norm_eps) @ load_f32(
            f, "lm_head", "cpu").t()
    # transformers reads rms_norm_eps as the f32 value 9.99999997e-07; we store 1e-06 (the HF config value)
    torch.testing.assert_close(logits, ref, atol=ORACLE_LOGITS_ATOL * float(ref.abs().max()), rtol=0)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_quality_gptq_beats_rtn_within_bound_of_bf16(packed):
    text = heldout_text(20_000)
    ppl = {name: perplexity(path, text, seq_len=512, max_tokens=EVAL_TOKENS, device="cpu").perplexity
           for name, path in packed.items()}
    print("perplexity on held-out stdlib code:", ppl)
    assert ppl["gptq"] < ppl["rtn"], ppl
    assert ppl["gptq"] <= GPTQ_PPL_BOUND * ppl["bf16"], ppl
    assert ppl["bf16"] < ppl["rtn"] <= RTN_PPL_BOUND * ppl["bf16"], ppl
    with nqf.open(packed["gptq"]) as f:
        errs = f.metadata["quantization"]["layer_errors"]
    # per projection, GPTQ's output error on the calibration inputs is below RTN's in every layer
    assert all(e[n]["out_rel"] < e[n]["rtn_out_rel"] for e in errs for n in e)
