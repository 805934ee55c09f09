"""Builders shared by the nanoqwen-format tests (and the CLI tests): a small, fully featured container.

Imported as a plain module: conftest.py puts this folder on sys.path (pytest runs with
--import-mode=importlib, which does not).
"""

from __future__ import annotations

import nanoqwen_format as nqf
import numpy as np

META = {
    "config": {"architecture": "qwen2", "hidden_size": 256, "num_hidden_layers": 1, "eos_token_id": [2, 3]},
    "tokenizer": '{"model": {"type": "BPE"}}',
    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "generation": {"eos_token_ids": [2, 3], "temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "quantization": {"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False, "lm_head": "int8"},
    "provenance": {"source": "unit-test", "source_sha256": "00" * 32, "tools": {"nanoqwen-format": "0.1.0"}},
    "blob": b"\x00\x01binary",
}


def build_tensors(seed: int = 0) -> dict:
    """Fresh random tensors of every encoding, odd sizes: name -> (kind, payload, encoding)."""
    rng = np.random.default_rng(seed)
    return {
        "embed_tokens": ("array", rng.standard_normal((37, 256)).astype(np.float32), "bf16"),
        "final_norm": ("array", nqf.bf16.from_f32(rng.standard_normal(256)), "bf16"),
        "f16_vec": ("array", rng.standard_normal((3, 5, 7)).astype(np.float16), "f16"),
        "f32_mat": ("array", rng.standard_normal((11, 13)).astype(np.float32), "f32"),
        "layers.0.qkv": ("quant", nqf.int4.quantize_rtn(rng.standard_normal((40, 256)), 64, False), None),
        "layers.0.down": ("quant", nqf.int4.quantize_rtn(rng.standard_normal((24, 384)), 128, True), None),
        "layers.0.gate_up": ("quant", nqf.int4.quantize_rtn(rng.standard_normal((16, 128)), 32, True), None),
        "lm_head": ("quant", nqf.int8.quantize_rtn(rng.standard_normal((37, 256)), 128), None),
        "layers.0.o_proj": ("quant", f16s_tensor(rng, 16, 256, 64), None),
    }


def f16s_tensor(rng, n: int, k: int, g: int):
    """A random asymmetric `int4-g{G}-tile8x128-f16s-v1` tensor: fp16 scales that are not bf16 values
    (10 mantissa bits), zero points over the whole 0..16 range (16 included)."""
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, (n, k // g)) * 1e-2).astype(np.float16)
    zeros = rng.integers(0, 17, (n, k // g), dtype=np.uint8)
    zeros.flat[0] = 16
    return nqf.int4.pack(q, scales, zeros, g, scale_dtype="f16")


def write_container(path, tensors=None, meta=None) -> dict:
    tensors = build_tensors() if tensors is None else tensors
    with nqf.Writer(path) as w:
        for name, (kind, payload, enc) in tensors.items():
            if kind == "array":
                w.add_array(name, payload, encoding=enc)
            else:
                w.add_quantized(name, payload)
        w.set_metadata(META if meta is None else meta)
    return tensors
