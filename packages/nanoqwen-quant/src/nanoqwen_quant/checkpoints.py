"""Exact import of published 4-bit GPTQ and AWQ checkpoints (HF folders or hub ids), and of GGUF files
whose decoder linears are all Q4_0, into the `int4-g{G}-tile8x128-f16s-v1` container layout: the
formats and their conversion, in numpy (the Sources that read them are sources.QuantizedHFSource and
sources.GGUFSource; the pack path is pack_import.py). The
checkpoint's codes, fp16 scales and zero points are moved, never requantized, so every imported
weight dequantizes to the checkpoint's own weight bit for bit in fp32 (tests/test_checkpoints.py
checks it against a test-side writer of both formats).

Detection: `quantization_config` in config.json (or AutoGPTQ's older quantize_config.json), with
`quant_method` "gptq" or "awq". Anything else that declares a quantization is refused, as are 4-bit
layouts that are not these two (`QuantScheme.from_config` says why, one line).

Layouts read, per linear with in_features K, out_features N, group size G (both from their projects'
packers: AutoGPTQ/GPTQModel `QuantLinear.pack`, AutoAWQ `WQLinear_GEMM.from_linear`):

    GPTQ  qweight int32 [K/8, N]    row i, nibble b (bits 4b..4b+3) = q[8 i + b, n]
          qzeros  int32 [K/G, N/8]  column c, nibble b = z'[j, 8 c + b]; z = z' + 1 for
                                    checkpoint_format "gptq" (v1), z = z' for "gptq_v2"
          scales  fp16  [K/G, N];   g_idx int32 [K] (must be k // G: see below)
    AWQ   qweight int32 [K, N/8]    column c, nibble b = q[k, 8 c + AWQ_ORDER[b]]
          qzeros  int32 [K/G, N/8]  the same packing; scales fp16 [K/G, N]; version "gemm" only
    both  w[n, k] = (q[k, n] - z[k // G, n]) * scales[k // G, n]

Into the container: q, z and s are transposed to [N, K] / [N, K/G] and q/k/v (gate/up) concatenated
along N, which keeps every group (groups run along K). A fused tensor whose zero points are all 8 is
written symmetric (implicit 8), otherwise asymmetric with its zero points (0..16: v1 stores z - 1 in a
nibble, so z = 16 occurs). Embeddings, norms, biases and the lm_head are read as HFFolderSource reads
any checkpoint (rounded to bf16).

Refused, with the tensor named: act-order checkpoints whose g_idx is not k // G (desc_act without
static groups: an exact import would need K permuted in the weights and in the activations, as
Marlin does; nanoqwen's kernels have no such permutation), bits other than 4, group sizes other than
32/64/128, a quantized lm_head, tensors of the wrong dtype or shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np

__all__ = ["AWQ_ORDER", "FUSED", "IMPORT_METHODS", "CheckpointImportError", "QuantScheme", "read_scheme",
           "unpack_gptq_qweight", "unpack_columns", "import_layer", "layer_tensor_names", "gguf_q4_0_scheme",
           "unpack_q4_0"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble b of a word holds column 8c + AWQ_ORDER[b]
IMPORT_METHODS = ("gptq", "awq")
GROUP_SIZES = (32, 64, 128)
# container linear -> the HF projections fused into it, in row (N) order
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o_proj": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
         "down": ("mlp.down_proj",)}


class CheckpointImportError(ValueError):
    """A GPTQ/AWQ checkpoint (or a declared quantization) that cannot be imported exactly; the message
    names the file or tensor and the reason."""


@dataclass(frozen=True)
class QuantScheme:
    """The quantization a checkpoint declares. method "gptq" | "awq" | "gguf" (an all-Q4_0 GGUF,
    `gguf_q4_0_scheme`); fmt: GPTQ's checkpoint_format ("gptq" = v1, zero points stored minus one;
    "gptq_v2"), AWQ's version ("gemm") or the GGUF block type ("Q4_0"); sym: GPTQ's `sym` (AWQ: False,
    it always stores zero points; Q4_0: True); desc_act: GPTQ's act-order flag."""

    method: str
    group_size: int
    fmt: str
    sym: bool
    desc_act: bool

    @classmethod
    def from_config(cls, qc: dict, where: str) -> QuantScheme:
        """Parse a `quantization_config` map; CheckpointImportError with the reason for anything that
        cannot be imported."""
        method = qc.get("quant_method", "gptq" if "desc_act" in qc else None)
        if method not in IMPORT_METHODS:
            raise CheckpointImportError(
                f"{where}: quant_method {method!r} is not supported: nanoqwen imports 4-bit "
                              f"{' and '.join(IMPORT_METHODS)} checkpoints, or packs float ones")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise CheckpointImportError(
                f"{where}: {method} bits={bits!r}: only 4-bit checkpoints can be imported")
        g = qc.get("group_size", qc.get("q_group_size"))
        if g not in GROUP_SIZES:
            raise CheckpointImportError(
                f"{where}: {method} group_size={g!r}: only {GROUP_SIZES} can be imported "
                              "exactly (-1, one group per column, has no INT4 container layout)")
        if method == "gptq":
            fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
            if fmt not in ("gptq", "gptq_v2"):
                raise CheckpointImportError(
                    f"{where}: gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
            return cls("gptq", g, fmt, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointImportError(
                f"{where}: awq version {version!r} is not supported: only the GEMM layout "
                              "(version 'gemm') can be imported")
        if qc.get("zero_point", True) is not True:
            raise CheckpointImportError(
                f"{where}: awq zero_point={qc.get('zero_point')!r}: only zero_point=true "
                              "checkpoints (AutoAWQ's default) can be imported")
        return cls("awq", g, "gemm", False, False)

    def to_metadata(self) -> dict:
        return {"format": self.method, "checkpoint_format": self.fmt, "group_size": self.group_size,
                "sym": self.sym, "desc_act": self.desc_act, "scale_dtype": "f16",
                "layout": nqf.layout_tag("int4", self.group_size, "f16")}


def read_scheme(folder: Path) -> QuantScheme | None:
    """The scheme a local HF folder declares (config.json `quantization_config`, else AutoGPTQ's
    quantize_config.json), or None for a float checkpoint."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        return None  # HFFolderSource reports the missing config
    qc = json.loads(cfg_path.read_text()).get("quantization_config")
    where = str(cfg_path)
    if qc is None and (folder / "quantize_config.json").is_file():
        where = str(folder / "quantize_config.json")
        qc = json.loads((folder / "quantize_config.json").read_text())
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointImportError(f"{where}: quantization_config must be a map, got {type(qc).__name__}")
    return QuantScheme.from_config(qc, where)


# ------------------------------------------------------------------------------------- unpacking
def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [...] -> uint8 [..., 8], nibble b = bits 4b..4b+3 of the word."""
    w = words.view(np.uint32)[..., None]
    return ((w >> (4 * np.arange(8, dtype=np.uint32))) & 15).astype(np.uint8)


def unpack_gptq_qweight(qweight: np.ndarray) -> np.ndarray:
    """GPTQ int32 [K/8, N] -> q uint8 [K, N]."""
    k8, n = qweight.shape
    return _nibbles(qweight).transpose(0, 2, 1).reshape(k8 * 8, n)


def unpack_columns(packed: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """int32 [R, N/8] with nibble b of column c = v[:, 8c + order[b]] -> v uint8 [R, N]."""
    r, n8 = packed.shape
    nib = _nibbles(packed)  # [R, N/8, b]
    out = np.empty((r, n8, 8), np.uint8)
    out[:, :, list(order)] = nib
    return out.reshape(r, n8 * 8)


RawGetter = Callable[[str], np.ndarray]  # HF tensor name -> the tensor as stored (numpy)
HasTensor = Callable[[str], bool]


def _expect(spec: str, method: str, name: str, a: np.ndarray, dtype, shape) -> None:
    if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
        raise CheckpointImportError(f"{spec}: {method} tensor {name} is {a.dtype} {list(a.shape)}, "
                                    f"the format needs {np.dtype(dtype)} {list(shape)}")


def import_linear(raw: RawGetter, has: HasTensor, base: str, scheme: QuantScheme, spec: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One HF projection `base` (e.g. "model.layers.0.self_attn.q_proj") -> (q uint8 [N, K],
    s float16 [N, K/G], z uint8 [N, K/G], 0..16): the checkpoint's values, transposed, unchanged."""
    sc, g = scheme, scheme.group_size
    if has(base + ".weight") and not has(base + ".qweight"):
        raise CheckpointImportError(f"{spec}: {base} is not quantized ({base}.weight) in a {sc.method} "
                                    "checkpoint; mixed checkpoints are not supported")
    qweight = raw(base + ".qweight")
    if qweight.ndim != 2:
        raise CheckpointImportError(f"{spec}: {base}.qweight must be 2-D, got {list(qweight.shape)}")
    if sc.method == "gptq":
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        _expect(spec, sc.method, base + ".qweight", qweight, np.int32, (k // 8, n))
    else:
        k, n = qweight.shape[0], qweight.shape[1] * 8
        _expect(spec, sc.method, base + ".qweight", qweight, np.int32, (k, n // 8))
    if k % g:
        raise CheckpointImportError(f"{spec}: {base}: in_features {k} is not a multiple of group_size {g}")
    qzeros, scales = raw(base + ".qzeros"), raw(base + ".scales")
    _expect(spec, sc.method, base + ".qzeros", qzeros, np.int32, (k // g, n // 8))
    _expect(spec, sc.method, base + ".scales", scales, np.float16, (k // g, n))
    if not np.isfinite(scales).all():
        raise CheckpointImportError(f"{spec}: {base}.scales holds NaN or Inf")
    if sc.method == "gptq":
        if has(base + ".g_idx"):
            g_idx = raw(base + ".g_idx")
            _expect(spec, sc.method, base + ".g_idx", g_idx, np.int32, (k,))
            if not np.array_equal(g_idx, np.arange(k, dtype=np.int32) // g):
                monotone = not (np.diff(g_idx) < 0).any()
                kind = "non-standard" if monotone else "non-monotone (act-order, desc_act)"
                raise CheckpointImportError(
                    f"{spec}: {base}.g_idx is {kind}: input row k is not in group k // {g}. An exact "
                    "import would permute K in the weights and the activations (as Marlin does), which "
                    "nanoqwen's kernels do not; re-quantize with desc_act=false or static_groups=true, "
                    "or use a float checkpoint")
        q = unpack_gptq_qweight(qweight)
        z = unpack_columns(qzeros).astype(np.int16) + (1 if sc.fmt == "gptq" else 0)
    else:
        q = unpack_columns(qweight, AWQ_ORDER)
        z = unpack_columns(qzeros, AWQ_ORDER).astype(np.int16)
    return (np.ascontiguousarray(q.T), np.ascontiguousarray(scales.T),
            np.ascontiguousarray(z.T.astype(np.uint8)))


def import_layer(raw: RawGetter, has: HasTensor, i: int, shapes: dict, scheme: QuantScheme, spec: str
                 ) -> dict[str, nqf.QuantizedTensor]:
    """The four fused linears of decoder layer i in the f16-scale tile layout (exact, see the module
    header). shapes: the config's container shapes (`Qwen2Config.tensor_shapes()`)."""
    p = f"model.layers.{i}."
    out = {}
    for name, parts in FUSED.items():
        got = [import_linear(raw, has, p + b, scheme, spec) for b in parts]
        q = np.concatenate([x[0] for x in got], 0)
        s = np.concatenate([x[1] for x in got], 0)
        z = np.concatenate([x[2] for x in got], 0)
        want = shapes[f"layers.{i}.{name}"]
        if q.shape != tuple(want):
            raise CheckpointImportError(f"{spec}: layer {i} {name}: the {scheme.method} tensors give shape "
                                        f"{list(q.shape)}, the config implies {list(want)}")
        zeros = None if (z == 8).all() else z  # GPTQ sym: the container's implicit 8
        out[name] = nqf.int4.pack(q, s, zeros, scheme.group_size, scale_dtype="f16")
    return out


# ------------------------------------------------------------------------------------------- GGUF Q4_0
# llama.cpp's Q4_0 (ggml-common.h `block_q4_0`): blocks of 32 weights along a row, 18 bytes each: the
# fp16 scale d, then 16 bytes qs where weight j (0..15) is qs[j] & 0xF and weight 16 + j is qs[j] >> 4;
# w = (q - 8) * d. That is the container's symmetric g32 layout with fp16 scales (implicit zero point 8)
# exactly: the same codes, the same fp16 scale per group of 32 along K.
Q4_0_BLOCK = 32
Q4_0_BLOCK_BYTES = 18
GGUF_Q4_0_SCHEME_FMT = "Q4_0"


def gguf_q4_0_scheme() -> QuantScheme:
    """The scheme of a GGUF whose decoder linears are all Q4_0 (sources.QuantizedGGUFSource)."""
    return QuantScheme("gguf", Q4_0_BLOCK, GGUF_Q4_0_SCHEME_FMT, True, False)


def unpack_q4_0(blocks: np.ndarray, n: int, k: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0 tensor's raw bytes (uint8, n rows of k / 32 blocks, as gguf's reader gives them) -> (q
    uint8 [n, k] in 0..15, d float16 [n, k / 32]), unchanged."""
    if k % Q4_0_BLOCK:
        raise CheckpointImportError(f"{name}: Q4_0 row length {k} is not a multiple of {Q4_0_BLOCK}")
    raw = np.ascontiguousarray(blocks, dtype=np.uint8)
    if raw.size != n * (k // Q4_0_BLOCK) * Q4_0_BLOCK_BYTES:
        raise CheckpointImportError(f"{name}: {raw.size} bytes of Q4_0 data, a [{n}, {k}] tensor needs "
                                    f"{n * (k // Q4_0_BLOCK) * Q4_0_BLOCK_BYTES}")
    b = raw.reshape(n, k // Q4_0_BLOCK, Q4_0_BLOCK_BYTES)
    d = np.ascontiguousarray(b[:, :, :2]).view(np.float16).reshape(n, k // Q4_0_BLOCK)
    if not np.isfinite(d).all():
        raise CheckpointImportError(f"{name}: a Q4_0 scale is NaN or Inf")
    qs = b[:, :, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, k)  # weights 0..15, then 16..31
    return np.ascontiguousarray(q), np.ascontiguousarray(d)


def layer_tensor_names(i: int) -> list[str]:
    """HF names a GPTQ/AWQ checkpoint must hold for decoder layer i (g_idx is optional)."""
    p = f"model.layers.{i}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    parts = ("qweight", "qzeros", "scales")
    names += [f"{p}{b}.{part}" for bs in FUSED.values() for b in bs for part in parts]
    return names
