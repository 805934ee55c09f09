"""End-to-end on a tiny random Qwen2 HF folder: sources, the forward against transformers (the oracle),
pack none / rtn / gptq, checkpoint + resume byte identity, eval and the CLI."""

from __future__ import annotations

import json
import math

import nanoqwen_format as nqf
import numpy as np
import pytest
import torch
from nanoqwen_quant import qwen2
from nanoqwen_quant.cli import app
from nanoqwen_quant.config import UnsupportedModelError
from nanoqwen_quant.evaluate import perplexity
from nanoqwen_quant.gptq_run import CheckpointError
from nanoqwen_quant.pack import PackOptions, pack
from nanoqwen_quant.sources import HFFolderSource, SourceError, open_source
from typer.testing import CliRunner

# Tolerances: fp32 forward vs transformers' fp32 forward on identical (bf16-valued) weights.
LOGITS_ATOL = 2e-4
PPL_RTOL = 1e-4


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
    return m


def _our_logits(src, ids: torch.Tensor) -> torch.Tensor:
    c = src.config
    x = src.embed_tokens()[ids].float()
    rope = qwen2.rope_cos_sin(ids.shape[1], c.head_dim, c.rope_theta, "cpu")
    for i in range(c.num_hidden_layers):
        x = qwen2.decoder_layer(c, x, src.layer(i), rope)
    return qwen2.rms_norm(x, src.final_norm().float(), c.rms_norm_eps) @ src.lm_head().float().t()


def test_forward_matches_transformers(tiny_hf, tiny_config):
    src = open_source(str(tiny_hf))
    ids = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _hf_model(tiny_hf, tiny_config)(ids).logits
    torch.testing.assert_close(_our_logits(src, ids), ref, atol=LOGITS_ATOL, rtol=0)


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
    assert src.config.eos_token_id == [1]
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
            ref = nqf.int4.quantize_rtn(src.layer(0)[name].float().numpy(), group_size, sym)
            got = f.quantized(f"layers.0.{name}")
            np.testing.assert_array_equal(got.qweight, ref.qweight)
            np.testing.assert_array_equal(got.scales, ref.scales)
            assert 0 < q["layer_errors"][0][name]["w_rel"] < 0.2
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
    m = _hf_model(tiny_hf, tiny_config)
    total = 0.0
    with torch.no_grad():
        for w in windows:
            t = torch.tensor([w])
            total += float(m(t, labels=t).loss) * (len(w) - 1)
    n = sum(len(w) - 1 for w in windows)
    assert r.tokens == n
    assert r.perplexity == pytest.approx(math.exp(total / n), rel=PPL_RTOL)


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
    assert d["tokens"] > 0 and d["perplexity"] > 1
    bad = make_tiny_folder(tmp_path / "llama", dict(tiny_config, model_type="llama"))
    res = runner.invoke(app, ["pack", str(bad), "-o", str(tmp_path / "x.nanoqwen")])
    assert res.exit_code == 2 and "not supported" in res.output and not (tmp_path / "x.nanoqwen").exists()
