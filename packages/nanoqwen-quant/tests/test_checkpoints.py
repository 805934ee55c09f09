"""Exact import of GPTQ and AWQ checkpoints (nanoqwen_quant.checkpoints), against checkpoints written by
a test-side packer from the formats' published descriptions (checkpoint_writers.py), never by
nanoqwen's code:

- every imported linear, dequantized by nanoqwen's reference decoders (nanoqwen_format's numpy int4
  codec and nanoqwen_model.codec in torch), equals the checkpoint's own fp32 dequantization bit for
  bit, for GPTQ v1 and v2, sym and asym, AWQ, group sizes 32/64/128;
- the container runs through the reference runtime and gives the logits of the checkpoint's own
  dequantized model;
- what cannot be imported exactly, or is not asked for correctly, is refused with a clear message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
import pytest
import torch
from nanoqwen_model import Qwen2Config, codec
from nanoqwen_quant.checkpoints import CheckpointImportError
from nanoqwen_quant.cli import app
from nanoqwen_quant.options import PackOptions, UsageError
from nanoqwen_quant.pack import pack
from nanoqwen_quant.sources import QuantizedHFSource, SourceError, open_source
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import checkpoint_writers as cw  # noqa: E402

# (id, writer, keyword arguments): every format variant, every group size, both symmetries
CASES = [
    ("gptq_v1_sym_g128", cw.write_gptq, dict(group_size=128, sym=True, checkpoint_format="gptq")),
    ("gptq_v1_asym_g32", cw.write_gptq, dict(group_size=32, sym=False, checkpoint_format="gptq")),
    ("gptq_v1_asym_g64", cw.write_gptq, dict(group_size=64, sym=False, checkpoint_format="gptq")),
    ("gptq_v2_sym_g64", cw.write_gptq, dict(group_size=64, sym=True, checkpoint_format="gptq_v2")),
    ("gptq_v2_asym_g128", cw.write_gptq, dict(group_size=128, sym=False, checkpoint_format="gptq_v2")),
    ("gptq_v2_asym_g32_desc_act_trivial", cw.write_gptq,
     dict(group_size=32, sym=False, checkpoint_format="gptq_v2", desc_act=True)),
    ("awq_g32", cw.write_awq, dict(group_size=32)),
    ("awq_g64", cw.write_awq, dict(group_size=64)),
    ("awq_g128", cw.write_awq, dict(group_size=128)),
]
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def float_model(tiny_hf: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tiny float model's HF state dict and config.json map (from the shared fixture folder)."""
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(tiny_hf.glob("*.safetensors")):
        sd |= load_file(str(f))
    return sd, json.loads((tiny_hf / "config.json").read_text())


def write_case(case, tiny_hf: Path, folder: Path):
    _, writer, kw = case
    sd, config = float_model(tiny_hf)
    return writer(folder, sd, config, tiny_hf, seed=len(folder.name), **kw)


def import_case(case, tiny_hf, tmp_path):
    """Write the checkpoint, import it with `pack` (method import). Returns (container, its own deq)."""
    folder = tmp_path / case[0]
    deq = write_case(case, tiny_hf, folder)
    src = open_source(str(folder))
    assert isinstance(src, QuantizedHFSource)  # detected from quantization_config
    out = tmp_path / f"{case[0]}.nanoqwen"
    summary = pack(src, out, PackOptions(method="import", device="cpu"), log=lambda line: None)
    assert summary.notes and "exactly" in summary.notes[0]
    return out, deq


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_import_is_bit_exact(case, tiny_hf, tmp_path):
    out, deq = import_case(case, tiny_hf, tmp_path)
    _, _, kw = case
    g = kw["group_size"]
    sd, config = float_model(tiny_hf)
    zeros_seen = []
    with nqf.open(out) as f:
        assert f.metadata["quantization"]["method"] == "import"
        assert f.metadata["quantization"]["group_size"] == g
        assert f.metadata["quantization"]["source_format"]["format"] == case[0].split("_")[0]
        for i in range(config["num_hidden_layers"]):
            for name, parts in FUSED.items():
                rec = f.records[f"layers.{i}.{name}"]
                assert rec.layout == f"int4-g{g}-tile8x128-f16s-v1"
                want = np.concatenate([deq[f"model.layers.{i}.{p}.weight"] for p in parts], 0)
                # nanoqwen_format's numpy reference decoder: bit for bit
                got = f.dequantize(f"layers.{i}.{name}")
                assert got.dtype == np.float32 and np.array_equal(got, want), (i, name)
                # nanoqwen_model's torch codec on the same bytes: bit for bit
                qt = f.quantized(f"layers.{i}.{name}")
                zeros = None if qt.zeros is None else torch.from_numpy(qt.zeros.copy())
                w_t = codec.dequantize_int4(torch.from_numpy(qt.qweight.view(np.int32).copy()),
                                            torch.from_numpy(qt.scales.copy()), zeros, g)
                assert torch.equal(w_t, torch.from_numpy(want)), (i, name)
                # GPTQ sym stores z = 8 everywhere: the container's implicit 8, no zeros part
                assert qt.symmetric == bool(kw.get("sym", False))
                if qt.zeros is not None:
                    zeros_seen.append(qt.zeros)
            # the non-quantized tensors: the checkpoint's fp16 values rounded to bf16, as any HF folder
            bias = torch.cat([sd[f"model.layers.{i}.self_attn.{x}_proj.bias"] for x in "qkv"])
            bias16 = bias.float().to(torch.float16).to(torch.bfloat16)
            bias_bits = bias16.view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(f.array(f"layers.{i}.qkv_bias"), bias_bits)
    if zeros_seen:  # the writers force the ends of the zero-point range: v1 reaches 16, v2/AWQ 0 and 15
        z = np.concatenate([x.ravel() for x in zeros_seen])
        v1 = kw.get("checkpoint_format") == "gptq"
        assert (z.min(), z.max()) == ((1, 16) if v1 else (0, 15))


@pytest.mark.parametrize("case", [CASES[1], CASES[8]], ids=[CASES[1][0], CASES[8][0]])
def test_imported_container_runs_with_the_checkpoint_logits(case, tiny_hf, tmp_path):
    """The reference runtime on the container vs nanoqwen_model's forward on the checkpoint's own
    dequantized model (linears from the writer's fp32 dequantization; embeddings, norms, biases and
    lm_head as fp16 rounded to bf16, as the HF source reads them), both in fp32. The weights are equal
    bit for bit (test above), so the two differ only in the attention path (paged K/V in fp32 pages:
    exact copies; per-sequence batching): fp32 summation order, each of the ~16 reductions of length
    <= 256 off by <= 256 x 2^-24 = 1.5e-5 relative at worst, 2.5e-4 of the largest logit all added:
    the bound is 3e-4 x max |logit|."""
    from nanoqwen_model.forward import dense_attend, forward
    from nanoqwen_runtime.kv_cache import KVCacheSpec, PagedKVCache, build_step_metadata
    from nanoqwen_runtime.reference import ReferenceModel

    out, deq = import_case(case, tiny_hf, tmp_path)
    sd, config = float_model(tiny_hf)
    cfg = Qwen2Config.from_hf(config)

    def bf16_of_fp16(t):
        return t.float().to(torch.float16).to(torch.bfloat16).float()

    w = {"embed_tokens": bf16_of_fp16(sd["model.embed_tokens.weight"]),
         "final_norm": bf16_of_fp16(sd["model.norm.weight"]), "lm_head": bf16_of_fp16(sd["lm_head.weight"])}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[f"layers.{i}.input_norm"] = bf16_of_fp16(sd[p + "input_layernorm.weight"])
        w[f"layers.{i}.post_attn_norm"] = bf16_of_fp16(sd[p + "post_attention_layernorm.weight"])
        biases = [bf16_of_fp16(sd[p + f"self_attn.{x}_proj.bias"]) for x in "qkv"]
        w[f"layers.{i}.qkv_bias"] = torch.cat(biases)
        for name, parts in FUSED.items():
            fused = np.concatenate([deq[p + b + ".weight"] for b in parts])
            w[f"layers.{i}.{name}"] = torch.from_numpy(fused)
    ids = [int(x) for x in np.random.default_rng(0).integers(2, cfg.vocab_size, 24)]
    t = len(ids)
    want = forward(cfg, w, torch.tensor(ids), torch.arange(t), dense_attend(1, t))
    model = ReferenceModel.from_file(out, dtype=torch.float32)
    cache = PagedKVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                     num_blocks=8, block_size=8, dtype=torch.float32))
    got = model.forward(torch.tensor(ids), build_step_metadata([cache.new_sequence()], [t]), cache,
                        all_logits=True)
    assert float(want.abs().max()) > 0.1  # a model that computes something
    err = float((got - want).abs().max()) / float(want.abs().max())
    assert err <= 3e-4, err


def _edit_config(folder: Path, **qc_changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] |= qc_changes
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def gptq_folder(tiny_hf, tmp_path):
    folder = tmp_path / "gptq"
    write_case(CASES[1], tiny_hf, folder)
    return folder


@pytest.mark.parametrize("changes,match", [
    (dict(bits=8), "only 4-bit"),
    (dict(group_size=-1), "group_size=-1"),
    (dict(group_size=16), "group_size=16"),
    (dict(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
], ids=["bits8", "g-1", "g16", "marlin", "bnb"])
def test_unsupported_schemes_are_refused(gptq_folder, changes, match):
    _edit_config(gptq_folder, **changes)
    with pytest.raises(CheckpointImportError, match=match):
        open_source(str(gptq_folder))


def test_awq_gemv_version_is_refused(tiny_hf, tmp_path):
    folder = tmp_path / "awq"
    write_case(("awq", cw.write_awq, dict(group_size=128, version="gemv")), tiny_hf, folder)
    with pytest.raises(CheckpointImportError, match="awq version 'gemv' is not supported"):
        open_source(str(folder))


def test_act_order_g_idx_is_refused_naming_the_tensor(gptq_folder, tmp_path):
    """desc_act with a permuted g_idx: refused at import (the layer is read), naming the tensor."""
    from safetensors.numpy import load_file, save_file

    path = gptq_folder / "model.safetensors"
    t = load_file(str(path))
    name = "model.layers.1.mlp.down_proj.g_idx"
    t[name] = np.random.default_rng(0).permutation(t[name]).astype(np.int32)
    save_file(t, str(path))
    _edit_config(gptq_folder, desc_act=True)
    src = open_source(str(gptq_folder))
    match = r"model\.layers\.1\.mlp\.down_proj\.g_idx is non-monotone"
    with pytest.raises(CheckpointImportError, match=match):
        pack(src, tmp_path / "x.nanoqwen", PackOptions(method="import", device="cpu"), log=lambda line: None)
    assert not (tmp_path / "x.nanoqwen").exists()


def test_wrong_tensor_and_quantized_lm_head_are_refused(gptq_folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = gptq_folder / "model.safetensors"
    t = load_file(str(path))
    o_scales = "model.layers.0.self_attn.o_proj.scales"
    t[o_scales] = t[o_scales].astype(np.float32)
    save_file(t, str(path))
    src = open_source(str(gptq_folder))
    with pytest.raises(CheckpointImportError, match=r"o_proj\.scales is float32 .* needs float16"):
        pack(src, tmp_path / "x.nanoqwen", PackOptions(method="import", device="cpu"), log=lambda line: None)
    t["lm_head.qweight"] = np.zeros((16, 320), np.int32)
    save_file(t, str(path))
    with pytest.raises(SourceError, match="lm_head is quantized"):
        pack(open_source(str(gptq_folder)), tmp_path / "x.nanoqwen",
             PackOptions(method="import", device="cpu"), log=lambda line: None)


def test_method_must_fit_the_source(gptq_folder, tiny_hf, tmp_path):
    """A GPTQ/AWQ checkpoint is imported, never requantized; import needs such a checkpoint; options
    of a quantizer are refused with import."""
    out = tmp_path / "x.nanoqwen"
    for method in ("rtn", "gptq", "none"):
        with pytest.raises(UsageError, match="requantizing it with"):
            pack(open_source(str(gptq_folder)), out, PackOptions(method=method, device="cpu"))
    with pytest.raises(UsageError, match="needs a GPTQ or AWQ checkpoint"):
        pack(open_source(str(tiny_hf)), out, PackOptions(method="import", device="cpu"))
    with pytest.raises(UsageError, match="group_size"):
        pack(open_source(str(gptq_folder)), out, PackOptions(method="import", group_size=64, device="cpu"))
    assert not out.exists()


def test_cli_default_method_and_a_leftover_checkpoint_folder(gptq_folder, tiny_hf, tmp_path):
    """No --method and an OUT.ckpt folder left by an interrupted GPTQ pack: a GPTQ source is imported
    (import keeps no checkpoint; the folder is left as it was); a float source gets the default recipe,
    GPTQ, so it is refused until --resume is passed, with --method gptq or without --method alike; with
    --method rtn (no checkpoint) it packs and leaves the folder alone."""
    out = tmp_path / "m.nanoqwen"
    ckpt = tmp_path / "m.nanoqwen.ckpt"
    ckpt.mkdir()
    (ckpt / "keep").write_text("x")
    res = CliRunner().invoke(app, ["pack", str(gptq_folder), "-o", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    with nqf.open(out) as f:
        assert f.metadata["quantization"]["method"] == "import"
    assert (ckpt / "keep").read_text() == "x"
    out2 = tmp_path / "f.nanoqwen"
    (tmp_path / "f.nanoqwen.ckpt").mkdir()
    (tmp_path / "f.nanoqwen.ckpt" / "keep").write_text("y")
    for method in (["--method", "gptq"], []):
        res = CliRunner().invoke(app, ["pack", str(tiny_hf), "-o", str(out2), "--device", "cpu", *method])
        assert res.exit_code == 1 and "exists: pass --resume" in " ".join(res.output.split()), res.output
        assert not out2.exists()
    res = CliRunner().invoke(app, ["pack", str(tiny_hf), "-o", str(out2), "--device", "cpu",
                                   "--method", "rtn"])
    assert res.exit_code == 0, res.output
    with nqf.open(out2) as f:
        assert f.metadata["quantization"]["method"] == "rtn"
    assert (tmp_path / "f.nanoqwen.ckpt" / "keep").read_text() == "y"


def test_cli_imports_by_default(gptq_folder, tmp_path):
    """No --method: a GPTQ folder is imported (method import, fp16-scale layout); --method rtn refused."""
    out = tmp_path / "m.nanoqwen"
    res = CliRunner().invoke(app, ["pack", str(gptq_folder), "-o", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    with nqf.open(out) as f:
        assert f.metadata["quantization"]["method"] == "import"
        assert f.records["layers.0.qkv"].layout == "int4-g32-tile8x128-f16s-v1"
    res = CliRunner().invoke(app, ["pack", str(gptq_folder), "-o", str(tmp_path / "r.nanoqwen"),
                                   "--method", "rtn", "--device", "cpu"])
    assert res.exit_code == 2 and "requantizing it with rtn is refused" in " ".join(res.output.split())
