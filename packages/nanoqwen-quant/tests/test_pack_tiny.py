"""End-to-end on a tiny random Qwen2 HF folder: sources, the forward against transformers (the oracle),
pack none / rtn / gptq, checkpoint + resume byte identity, eval and the CLI."""

from __future__ import annotations

import json
import math

import nanoqwen_format as nqf
import numpy as np
import pytest
import torch
from nanoqwen_model import forward as fwd
from nanoqwen_model.config import UnsupportedModelError
from nanoqwen_quant.cli import app
from nanoqwen_quant.evaluate import perplexity
from nanoqwen_quant.io import CheckpointError
from nanoqwen_quant.options import PackOptions
from nanoqwen_quant.pack import pack
from nanoqwen_quant.sources import HFFolderSource, SourceError, open_source
from typer.testing import CliRunner

# Tolerances (derived before measuring; nanoqwen-model's tests/test_forward.py makes the same argument
# for a model of the same sizes).
# FP32_REL: our fp32 forward vs transformers' fp32 forward on identical (bf16-valued) weights: the same
# formulas, only summation order and fused kernels differ. A dot product of length K <= 256 in another
# order moves by about sqrt(K) * 2^-24 ~ 1e-6 of the sum of |terms|; a logit passes ~10 such stages
# (2 layers x 4 linears + attention, then the head) with RMSNorm re-scaling by O(1): ~1e-5 of the
# logit scale, x2 for the two sides' independent roundings. Bound: FP32_REL x max |logit| (1.9e-5).
FP32_U = 2**-24
FP32_REL = 2 * 10 * 256**0.5 * FP32_U


def _bits_to_f32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a)).view(torch.bfloat16).float()


def _hf_model(folder, tiny_config):
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{k: v for k, v in tiny_config.items() if k not in ("architectures", "torch_dtype")})
    cfg._attn_implementation = "eager"
    m = Qwen2ForCausalLM(cfg).float().eval()
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd |= {k: v.float() for k, v in load_file(str(f)).items()}
    m.load_state_dict(sd, strict=True)
    # Warm-up call, result discarded. Observed here (torch 2.13 CPU, transformers 5): when torch's CPU
    # thread count was changed earlier in the process (GPTQ runs its column loop on one thread), the
    # first forward of a transformers model sometimes gives layer-0 attention probabilities ~7e-5 off
    # every later call, while every later call equals nanoqwen_model's forward bit for bit.
    with torch.no_grad():
        m(torch.zeros(1, 2, dtype=torch.long))
    return m


def _our_logits(src, ids: torch.Tensor) -> torch.Tensor:
    """nanoqwen_model's forward on the source's fused tensors, widened to f32. ids [B, T] -> [B, T, V]."""
    c = src.config
    weights = {"embed_tokens": src.embed_tokens().float(), "final_norm": src.final_norm().float(),
               "lm_head": src.lm_head().float()}
    for i in range(c.num_hidden_layers):
        weights |= {f"layers.{i}.{k}": v.float() for k, v in src.layer(i).items()}
    b, t = ids.shape
    logits = fwd.forward(c, weights, ids.reshape(-1), torch.arange(t).repeat(b), fwd.dense_attend(b, t))
    return logits.view(b, t, -1)


def test_source_forward_matches_transformers(tiny_hf, tiny_config):
    # the fused, renamed tensors of the source (q|k|v and gate|up order, biases) compute what the HF
    # checkpoint computes in transformers
    src = open_source(str(tiny_hf))
    ids = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _hf_model(tiny_hf, tiny_config)(ids).logits
    atol = FP32_REL * float(ref.abs().max())
    torch.testing.assert_close(_our_logits(src, ids), ref, atol=atol, rtol=0)


def test_hf_source_fuses_and_names(tiny_hf):
    src = HFFolderSource(tiny_hf)
    from safetensors import safe_open

    lw = src.layer(1)
    files = sorted(tiny_hf.glob("*.safetensors"))

    def get(name):
        for f in files:
            with safe_open(f, "pt") as s:
                if name in s.keys():
                    return s.get_tensor(name)
        raise KeyError(name)

    p = "model.layers.1."
    assert torch.equal(lw["qkv"], torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]))
    gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
    assert torch.equal(lw["gate_up"], gate_up)
    assert src.config.eos_token_id == (1,)
    assert src.generation["eos_token_ids"] == [1, 0] and src.generation["temperature"] == 0.5
    assert "im_start" in src.chat_template


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", "qwen3", "mistral"])
def test_refuses_other_architectures(tmp_path, model_type, tiny_config):
    cfg = dict(tiny_config, model_type=model_type)
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights at all: refused before reading
    with pytest.raises(UnsupportedModelError, match=model_type):
        open_source(str(tmp_path))


def test_refuses_bad_geometry_and_bad_paths(tmp_path, tiny_config):
    (tmp_path / "config.json").write_text(json.dumps(dict(tiny_config, hidden_size=100)))
    with pytest.raises(UnsupportedModelError, match="tile layout"):
        open_source(str(tmp_path))
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(SourceError, match="GGUF"):
        open_source(str(bogus))
    with pytest.raises(SourceError, match="no such file"):
        open_source(str(tmp_path / "missing" / "dir"))


def test_refuses_non_qwen2_gguf(tmp_path):
    import gguf

    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((8, 128), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="llama"):
        open_source(str(path))


def test_pack_none_keeps_bf16(tiny_hf, tmp_path):
    out = tmp_path / "bf16.nanoqwen"
    pack(open_source(str(tiny_hf)), out, PackOptions(method="none"), log=lambda m: None)
    src = HFFolderSource(tiny_hf)
    with nqf.open(out) as f:
        f.verify()
        assert f.metadata["quantization"]["method"] == "none"
        assert f.config["num_key_value_heads"] == 1 and f.config["tie_word_embeddings"] is False
        for i in range(2):
            for name, t in src.layer(i).items():
                rec = f.records[f"layers.{i}.{name}"]
                assert rec.encoding == "bf16" and rec.shape == tuple(t.shape)
                assert torch.equal(_bits_to_f32(f.array(f"layers.{i}.{name}")), t.float())
        assert torch.equal(_bits_to_f32(f.array("lm_head")), src.lm_head().float())
        prov = f.metadata["provenance"]
        assert prov["source"] == str(tiny_hf) and len(prov["source_sha256"]) == 64
        assert "torch" in prov["tools"]
        assert f.tokenizer_json == (tiny_hf / "tokenizer.json").read_text()


@pytest.mark.parametrize(("sym", "group_size", "lm_head"), [(True, 128, "int8"), (False, 32, "int4")])
def test_pack_rtn_matches_reference(tiny_hf, tmp_path, sym, group_size, lm_head):
    out = tmp_path / "rtn.nanoqwen"
    s = pack(open_source(str(tiny_hf)), out,
             PackOptions(method="rtn", group_size=group_size, symmetric=sym, lm_head=lm_head),
             log=lambda m: None)
    assert s.nbytes == out.stat().st_size and len(s.layer_errors) == 2
    src = HFFolderSource(tiny_hf)
    with nqf.open(out) as f:
        f.verify()
        q = f.metadata["quantization"]
        recipe = (q["method"], q["group_size"], q["symmetric"], q["lm_head"])
        assert recipe == ("rtn", group_size, sym, lm_head)
        for name in ("qkv", "o_proj", "gate_up", "down"):
            w = src.layer(0)[name].float()
            ref = nqf.int4.quantize_rtn(w.numpy(), group_size, sym)
            got = f.quantized(f"layers.0.{name}")
            np.testing.assert_array_equal(got.qweight, ref.qweight)
            np.testing.assert_array_equal(got.scales, ref.scales)
            # the recorded w_rel is ||W - Q|| / ||W|| of what the file holds: recomputed here in fp64
            # from the same fp32 values, the recorded fp32 one differs only by its sums of N*K squares
            # (relative error <= N*K * 2^-24, any order; the square root halves it)
            dq = torch.from_numpy(f.dequantize(f"layers.0.{name}")).double()
            w_rel = float(torch.linalg.vector_norm(w.double() - dq) / torch.linalg.vector_norm(w.double()))
            assert q["layer_errors"][0][name]["w_rel"] == pytest.approx(w_rel, rel=w.numel() * FP32_U, abs=0)
            assert w_rel > 0
        assert f.records["lm_head"].encoding == lm_head
        assert f.records["layers.0.qkv_bias"].encoding == "bf16"


def _gptq_opts(calib_dir, **kw):
    return PackOptions(method="gptq", calib_paths=[str(calib_dir)], calib_tokens=512, calib_seq_len=64,
                       calib_batch=3, device="cpu", **kw)


def test_gptq_resume_is_byte_identical(tiny_hf, calib_dir, tmp_path):
    full = tmp_path / "full.nanoqwen"
    pack(open_source(str(tiny_hf)), full, _gptq_opts(calib_dir), log=lambda m: None)
    assert not (tmp_path / "full.nanoqwen.ckpt").exists()

    part = tmp_path / "part.nanoqwen"

    def crash(stage, done, total):
        if stage.startswith("layer 1 gptq gate_up"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack(open_source(str(tiny_hf)), part, _gptq_opts(calib_dir), progress=crash, log=lambda m: None)
    assert not part.exists() and (tmp_path / "part.nanoqwen.ckpt" / "layer_000.pt").is_file()
    with pytest.raises(CheckpointError, match="--resume"):
        pack(open_source(str(tiny_hf)), part, _gptq_opts(calib_dir), log=lambda m: None)
    with pytest.raises(CheckpointError, match="cannot be resumed"):
        pack(open_source(str(tiny_hf)), part, _gptq_opts(calib_dir, group_size=64, resume=True),
             log=lambda m: None)
    logs = []
    pack(open_source(str(tiny_hf)), part, _gptq_opts(calib_dir, resume=True), log=logs.append)
    assert any("resuming" in m and "layer 1" in m for m in logs)
    assert part.read_bytes() == full.read_bytes()
    with nqf.open(full) as f:
        f.verify()
        q = f.metadata["quantization"]
        assert q["method"] == "gptq" and q["gptq"]["act_order"] and q["gptq"]["static_groups"]
        assert q["calibration"]["tokens"] == 512 and len(q["calibration"]["tokens_sha256"]) == 64
        for e in q["layer_errors"]:
            assert set(e) == {"qkv", "o_proj", "gate_up", "down"}
            for v in e.values():
                assert 0 <= v["out_rel"] < v["rtn_out_rel"]


def test_eval_matches_transformers_loss(tiny_hf, tmp_path, tiny_config):
    out = tmp_path / "bf16.nanoqwen"
    pack(open_source(str(tiny_hf)), out, PackOptions(method="none"), log=lambda m: None)
    text = (tiny_hf / "config.json").read_text() * 3
    r = perplexity(out, text, seq_len=50, device="cpu")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_hf / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    windows = [ids[s:s + 50] for s in range(0, len(ids), 50)]
    windows = [w for w in windows if len(w) >= 2]
    assert len({len(w) for w in windows}) == 2  # full windows batched together, and a short tail
    m = _hf_model(tiny_hf, tiny_config)
    total, max_logit = 0.0, 0.0
    with torch.no_grad():
        for w in windows:
            t = torch.tensor([w])
            o = m(t, labels=t)
            total += float(o.loss) * (len(w) - 1)
            max_logit = max(max_logit, float(o.logits.abs().max()))
    n = sum(len(w) - 1 for w in windows)
    assert r.tokens == n
    # a token's NLL is logsumexp(logits) - logit[target], which moves by at most 2 max|d logit|, so
    # log(ppl) = mean NLL moves by at most 2 FP32_REL max|logit| (the logits' bound above); that is
    # ppl's relative tolerance to first order
    assert r.perplexity == pytest.approx(math.exp(total / n), rel=2 * FP32_REL * max_logit)


def test_cli_pack_and_eval_json(tiny_hf, tmp_path, tiny_config, make_tiny_folder):
    runner = CliRunner()
    out = tmp_path / "cli.nanoqwen"
    res = runner.invoke(app, ["pack", str(tiny_hf), "-o", str(out), "--method", "rtn", "--asym",
                              "--group-size", "64"])
    assert res.exit_code == 0, res.output
    text = tmp_path / "t.py"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    res = runner.invoke(app, ["eval", str(out), "--text", str(text), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert d["tokens"] > 0 and d["perplexity"] > 1  # exp(mean NLL) > 1 unless every token had p = 1
    bad = make_tiny_folder(tmp_path / "llama", dict(tiny_config, model_type="llama"))
    res = runner.invoke(app, ["pack", str(bad), "-o", str(tmp_path / "x.nanoqwen")])
    assert res.exit_code == 1 and "not supported" in res.output and not (tmp_path / "x.nanoqwen").exists()
