"""Test-side writers of tiny GPTQ and AWQ checkpoints as HF folders, from the formats' published
descriptions (never from nanoqwen's code), each with its own fp32 dequantization; and `write_gguf`, a
float HF folder as a qwen2 GGUF file (through the gguf package, llama.cpp's own writer).

GPTQ (AutoGPTQ / GPTQModel `QuantLinear`, as loaded by transformers' `GPTQConfig`), per linear with
in_features K and out_features N, group size G, intweight q[k, n] in 0..15, zero points z[j, n]:

    qweight  int32 [K/8, N]    row i, bits 4b..4b+3 = q[8 i + b, n]            (b = 0..7)
    qzeros   int32 [K/G, N/8]  column c, bits 4b..4b+3 = z'[j, 8 c + b]        z' = z - 1 for
                               checkpoint_format "gptq" (v1), z' = z for "gptq_v2"
    scales   fp16  [K/G, N]
    g_idx    int32 [K]         group of input row k: k // G without act-order
    bias     fp16  [N]         (Qwen2's q/k/v projections)
    w[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]

sym=True uses z = 2^(bits-1) = 8 (stored 7 in v1). v1 can store z = 1..16 only (z' is a nibble).

AWQ (AutoAWQ `WQLinear_GEMM`, version "gemm"):

    qweight  int32 [K, N/8]    column c, bits 4b..4b+3 = q[k, 8 c + ORDER[b]]
                               ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros   int32 [K/G, N/8]  the same packing of z[j, n]
    scales   fp16  [K/G, N]
    w[n, k] = (q[k, n] - z[k // G, n]) * scales[k // G, n]

The fp32 dequantization of each writer is the formula above in float64 rounded to float32 (exact:
the product of a 5-bit integer and an 11-bit fp16 significand). Quantization itself is plain
round-to-nearest from the tiny float model; a few zero points are forced to the ends of their range
(v1: 1 and 16; v2/AWQ: 0 and 15) so that the importer sees every value.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _rtn(w: np.ndarray, group_size: int, sym: bool, zmin: int, zmax: int, rng):
    """w float64 [N, K] -> q uint8 [K, N], z int64 [K/G, N], s float16 [K/G, N] (the checkpoint's
    [in, out] orientation)."""
    n, k = w.shape
    wg = w.reshape(n, k // group_size, group_size)
    if sym:
        s = np.abs(wg).max(axis=2) / 7.5
        z = np.full(s.shape, 8, np.int64)
    else:
        lo, hi = np.minimum(wg.min(axis=2), 0), np.maximum(wg.max(axis=2), 0)
        s = (hi - lo) / 15
    s16 = np.where(s > 0, s, 1.0).astype(np.float16)
    s16 = np.where(s16 > 0, s16, np.float16(1.0))
    if not sym:
        z = np.clip(np.rint(-lo / s16.astype(np.float64)), zmin, zmax).astype(np.int64)
        flat = z.reshape(-1)
        flat[rng.choice(flat.size, max(1, flat.size // 16), replace=False)] = zmax  # range ends
        flat[rng.choice(flat.size, max(1, flat.size // 16), replace=False)] = zmin
    q = np.clip(np.rint(wg / s16.astype(np.float64)[:, :, None]) + z[:, :, None], 0, 15).astype(np.uint8)
    return q.reshape(n, k).T.copy(), z.T.copy(), s16.T.copy()


def _dequant(q_kn: np.ndarray, z_gn: np.ndarray, s_gn: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """The checkpoint's own dequantization: f32 [N, K] (out, in), w = (q - z[g_idx]) * s[g_idx]."""
    w = (q_kn.astype(np.float64) - z_gn[g_idx].astype(np.float64)) * s_gn[g_idx].astype(np.float64)
    return w.astype(np.float32).T.copy()


def _pack_rows(q_kn: np.ndarray) -> np.ndarray:
    """GPTQ qweight: [K, N] nibbles -> int32 [K/8, N], row i bits 4b.. = q[8i + b]."""
    k, n = q_kn.shape
    x = q_kn.astype(np.uint32).reshape(k // 8, 8, n)
    out = np.zeros((k // 8, n), np.uint32)
    for b in range(8):
        out |= x[:, b, :] << np.uint32(4 * b)
    return out.view(np.int32)


def _pack_cols(v: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """[R, N] nibbles -> int32 [R, N/8], column c bits 4b.. = v[:, 8c + order[b]]."""
    r, n = v.shape
    assert v.min() >= 0 and v.max() <= 15, "a nibble holds 0..15"
    x = v.astype(np.uint32).reshape(r, n // 8, 8)
    out = np.zeros((r, n // 8), np.uint32)
    for b in range(8):
        out |= x[:, :, order[b]] << np.uint32(4 * b)
    return out.view(np.int32)


def _save(folder: Path, tensors: dict[str, np.ndarray], config: dict, tokenizer_from: Path) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    for name in COPIED:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)


def _float_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Every tensor of the float model that is not a quantized linear's weight, as fp16 (as published
    GPTQ/AWQ checkpoints store them)."""
    out = {}
    for name, t in state_dict.items():
        if any(name.endswith(f"{lin}.weight") for lin in LINEAR_NAMES):
            continue
        out[name] = t.float().numpy().astype(np.float16)
    return out


def _linear_weights(state_dict: dict[str, torch.Tensor]):
    """(HF weight name, its module name, the weight as f64 [N, K]) of every linear the formats quantize."""
    for name, t in state_dict.items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and any(base.endswith(lin) for lin in LINEAR_NAMES):
            yield name, base, t.double().numpy()


def write_gptq(folder: Path, state_dict: dict[str, torch.Tensor], config: dict, tokenizer_from: Path, *,
               group_size: int, sym: bool, checkpoint_format: str = "gptq", desc_act: bool = False,
               seed: int = 0) -> dict[str, np.ndarray]:
    """An HF folder of a GPTQ 4-bit checkpoint of `state_dict` (HF names, float). Returns the checkpoint's
    own fp32 dequantization of every quantized linear: HF weight name -> f32 [N, K]."""
    assert checkpoint_format in ("gptq", "gptq_v2")
    rng = np.random.default_rng(seed)
    v1 = checkpoint_format == "gptq"
    tensors, deq = _float_tensors(state_dict), {}
    for name, base, w in _linear_weights(state_dict):
        k = w.shape[1]
        q, z, s = _rtn(w, group_size, sym, 1 if v1 else 0, 16 if v1 else 15, rng)
        g_idx = np.arange(k, dtype=np.int32) // group_size
        deq[name] = _dequant(q, z, s, g_idx)
        tensors[base + ".qweight"] = _pack_rows(q)
        tensors[base + ".qzeros"] = _pack_cols(z - 1 if v1 else z)
        tensors[base + ".scales"] = s
        tensors[base + ".g_idx"] = g_idx
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
          "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
          "checkpoint_format": checkpoint_format}
    _save(folder, tensors, {**config, "torch_dtype": "float16", "quantization_config": qc}, tokenizer_from)
    return deq


def write_awq(folder: Path, state_dict: dict[str, torch.Tensor], config: dict, tokenizer_from: Path, *,
              group_size: int, version: str = "gemm", seed: int = 0) -> dict[str, np.ndarray]:
    """An HF folder of an AutoAWQ 4-bit GEMM checkpoint of `state_dict`. Returns its own fp32
    dequantization of every quantized linear: HF weight name -> f32 [N, K]."""
    rng = np.random.default_rng(seed)
    tensors, deq = _float_tensors(state_dict), {}
    for name, base, w in _linear_weights(state_dict):
        k = w.shape[1]
        q, z, s = _rtn(w, group_size, False, 0, 15, rng)
        deq[name] = _dequant(q, z, s, np.arange(k) // group_size)
        tensors[base + ".qweight"] = _pack_cols(q, AWQ_ORDER)
        tensors[base + ".qzeros"] = _pack_cols(z, AWQ_ORDER)
        tensors[base + ".scales"] = s
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": version}
    _save(folder, tensors, {**config, "torch_dtype": "float16", "quantization_config": qc}, tokenizer_from)
    return deq


def write_gguf(path: Path, folder: Path, dtype=np.float32) -> Path:
    """A float HF folder (the tiny model) as a qwen2 GGUF, the way llama.cpp's converter lays one out:
    the config as `qwen2.*` fields, the byte-level BPE tokenizer as `tokenizer.ggml.*` (vocab padded to
    the embedding's rows with unused tokens), HF tensor names mapped to GGUF's, stored as `dtype`
    (float32 or float16)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd |= load_file(str(f))
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    n = cfg["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for t, i in vocab.items():
        tokens[i], types[i] = t, gguf.TokenType.NORMAL
    for t, i in added.items():
        tokens[i], types[i] = t, gguf.TokenType.CONTROL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_token_merges(merges)
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for k, t in sd.items():
        if k in names:
            g = names[k]
        else:
            _, _, i, rest = k.split(".", 3)
            g = f"blk.{i}.{layer[rest]}"
        w.add_tensor(g, t.float().numpy().astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
