"""Checkpoint sources: a GGUF file, a local HF folder of (sharded) safetensors, or an HF hub repo id.

Every source exposes the same small interface (`Source`): the model's `nanoqwen_model.Qwen2Config`,
the tokenizer as an HF `tokenizer.json` string, the chat template, generation defaults, and weights
one decoder layer at a time, already renamed and fused to the container names of DESIGN.md:

    layer(i) -> {"input_norm": [h], "qkv": [(nq+2nkv)*d, h], "qkv_bias": [(nq+2nkv)*d],
                 "o_proj": [h, nq*d], "post_attn_norm": [h], "gate_up": [2*I, h], "down": [h, I]}

All tensors are torch.bfloat16 on the CPU: "the bf16 model" is the checkpoint rounded to bf16
(a GGUF is dequantized with `gguf.quants.dequantize` to f32, then rounded to nearest even), and
every quantizer starts from exactly those values. Only the tensors of one layer are materialized at
a time (GGUF and safetensors are both memory-mapped), which keeps packing a 7B under 8 GB of RAM.

Refusal comes first: the config is parsed (strictly, by nanoqwen_model) and checked against the INT4
tile layout (`packable`) when a source is opened, so a model that is not the dense Qwen2 decoder, or
a geometry the packer cannot hold, is refused before any weight is read or downloaded.

GGUF Q/K weights: llama.cpp's converter permutes the rows of q/k only for the `llama` family
(`LlamaModel.permute`); `qwen2` is written in HF order, which tests/test_real_model.py checks against
transformers' own GGUF loader (the oracle) on the real 0.5B model.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
import torch
from nanoqwen_model.config import GGUF_ARCHITECTURES, Qwen2Config, UnsupportedModelError
from nanoqwen_model.forward import LAYER_TENSORS

from .checkpoints import (
    FUSED,
    CheckpointImportError,
    QuantScheme,
    gguf_q4_0_scheme,
    import_layer,
    layer_tensor_names,
    read_scheme,
    unpack_q4_0,
)


class SourceError(ValueError):
    """The checkpoint source is missing, incomplete or malformed."""


class Source(ABC):
    """A Qwen2 checkpoint, read one layer at a time. Subclasses set the attributes in __init__."""

    spec: str  # the source as the user gave it (hub id or path), recorded in provenance
    config: Qwen2Config
    tokenizer_json: str
    chat_template: str
    generation: dict

    @abstractmethod
    def _get(self, hf_name: str) -> torch.Tensor:
        """One tensor by its HF name, as bf16 [out, in] (torch convention)."""

    @abstractmethod
    def _has(self, hf_name: str) -> bool:
        """Whether the checkpoint holds the tensor."""

    @abstractmethod
    def source_sha256(self) -> str:
        """sha256 of the GGUF file, or of the sorted safetensors files concatenated."""

    def embed_tokens(self) -> torch.Tensor:
        """bf16 [vocab, hidden]."""
        return self._get("model.embed_tokens.weight")

    def final_norm(self) -> torch.Tensor:
        """bf16 [hidden]."""
        return self._get("model.norm.weight")

    def lm_head(self) -> torch.Tensor:
        """bf16 [vocab, hidden]; the embedding when the model ties them."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens()
        return self._get("lm_head.weight")

    def plain_layer(self, i: int) -> dict[str, torch.Tensor]:
        """The non-linear tensors of decoder layer `i` (bf16): the two norms and the fused q/k/v bias
        (what a source whose linears are imported exactly adds beside them)."""
        if not 0 <= i < self.config.num_hidden_layers:
            raise IndexError(f"layer {i} out of range 0..{self.config.num_hidden_layers - 1}")
        p = f"model.layers.{i}."
        return {"input_norm": self._get(p + "input_layernorm.weight"),
                "qkv_bias": torch.cat([self._get(p + f"self_attn.{x}_proj.bias") for x in "qkv"], 0),
                "post_attn_norm": self._get(p + "post_attention_layernorm.weight")}

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """The seven bf16 tensors of decoder layer `i`, fused and named as in DESIGN.md."""
        out = self.plain_layer(i)
        p = f"model.layers.{i}."
        g = self._get
        out.update({
            "qkv": torch.cat([g(p + f"self_attn.{x}_proj.weight") for x in "qkv"], 0),
            "o_proj": g(p + "self_attn.o_proj.weight"),
            "gate_up": torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")], 0),
            "down": g(p + "mlp.down_proj.weight"),
        })
        shapes = self.config.tensor_shapes()
        for name in LAYER_TENSORS:
            shape = shapes[f"layers.{i}.{name}"]
            if tuple(out[name].shape) != shape:
                raise SourceError(f"layer {i} {name}: shape {tuple(out[name].shape)}, expected {shape}")
        return out

    def check_complete(self) -> None:
        """Raise SourceError naming the first missing tensor (cheap: no tensor data is read)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight",
                      p + "self_attn.o_proj.weight"]
            names += [p + f"self_attn.{x}_proj.{k}" for x in "qkv" for k in ("weight", "bias")]
        for n in names:
            if not self._has(n):
                raise SourceError(f"{self.spec}: missing tensor {n}")


def packable(config: Qwen2Config) -> Qwen2Config:
    """`config`, or UnsupportedModelError when a projection does not fit the INT4 tile layout."""
    config.check_int4_layout()
    return config


def _to_bf16(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    t = torch.from_numpy(np.array(a, copy=True)) if isinstance(a, np.ndarray) else a
    return t.to(torch.bfloat16).contiguous()


def _sha256_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ GGUF
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _GGUF_LAYER:
        return f"blk.{parts[2]}.{_GGUF_LAYER[parts[3]]}"
    raise KeyError(hf_name)


class GGUFSource(Source):
    """A llama.cpp GGUF file of a qwen2 model; quantized blocks are dequantized per tensor (`layer`).

    When every decoder linear (q, k, v, o, gate, up, down of every layer) is Q4_0, `scheme` says so and
    the linears can be imported exactly instead (`quantized_layer`: symmetric g32 with fp16 scales,
    checkpoints.unpack_q4_0), with `plain_layer` holding the rest of a layer (norms, the q/k/v bias).
    `layer` still dequantizes everything, for `--method none` of the same file (the reference that
    `nanoqwen-quant eval` compares against). Embeddings and the lm_head are read as always (to bf16)."""

    def __init__(self, path: str | Path):
        import gguf

        self.spec = str(path)
        self.path = Path(path)
        if not self.path.is_file():
            raise SourceError(f"GGUF file not found: {path}")
        try:
            self._reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the gguf package raises ValueError / struct errors on bad files
            raise SourceError(f"{path}: not a readable GGUF file ({e})") from e
        fields = {}
        for k, f in self._reader.fields.items():
            if k.startswith("tokenizer.ggml.") and k.rsplit(".", 1)[-1] in ("tokens", "merges", "token_type",
                                                                         "scores"):
                continue
            try:
                fields[k] = f.contents()
            except Exception:  # a field type this gguf version cannot decode; we never need it
                continue
        self.fields = fields
        arch = fields.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:  # refuse before reading the tokenizer or any tensor
            raise UnsupportedModelError(f"GGUF general.architecture {arch!r} is not supported: "
                                        f"nanoqwen-quant packs only {GGUF_ARCHITECTURES}")
        self._tensors = {t.name: t for t in self._reader.tensors}
        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise SourceError(f"{path}: no token_embd.weight tensor")
        vocab = int(emb.shape[1])  # GGUF shapes are ggml order: [ne0=hidden, ne1=vocab]
        eos = int(fields["tokenizer.ggml.eos_token_id"]) if "tokenizer.ggml.eos_token_id" in fields else None
        bos = fields.get("tokenizer.ggml.bos_token_id")
        pad = fields.get("tokenizer.ggml.padding_token_id")
        eos_ids = self._eos_ids(eos)
        self.config = packable(Qwen2Config.from_gguf(
            fields, vocab_size=vocab, tied="output.weight" not in self._tensors, eos=eos_ids,
            bos=None if bos is None else int(bos), pad=None if pad is None else int(pad)))
        self.chat_template = str(fields.get("tokenizer.chat_template", ""))
        if not self.chat_template:
            raise SourceError(f"{path}: GGUF has no tokenizer.chat_template")
        self.tokenizer_json = with_gguf_added_tokens(gguf_tokenizer_json(self.path), *self._token_kinds())
        self.generation = qwen_generation_defaults(eos_ids)
        # every decoder linear Q4_0: they can be imported exactly (quantized_layer); no --method imports
        self.scheme: QuantScheme | None = gguf_q4_0_scheme() if self._all_linears_q4_0() else None

    def _token_kinds(self) -> tuple[list[str], list[int]]:
        """The GGUF vocabulary's tokens and their `tokenizer.ggml.token_type` (1 normal, 3 control, 4
        user-defined, 5 unused, ...)."""
        toks = self._reader.fields["tokenizer.ggml.tokens"]
        kinds = self._reader.fields["tokenizer.ggml.token_type"]
        return ([bytes(toks.parts[i]).decode("utf-8") for i in toks.data],
                [int(kinds.parts[i][0]) for i in kinds.data])

    def _eos_ids(self, eos: int | None) -> list[int]:
        """The GGUF eos plus `<|endoftext|>`: Qwen's generation_config.json stops on both."""
        ids = [] if eos is None else [eos]
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            for idx in tokens.data[-512:]:  # special tokens sit at the end of the Qwen vocabulary
                if bytes(tokens.parts[idx]) == b"<|endoftext|>":
                    tid = tokens.data.index(idx)
                    if tid not in ids:
                        ids.append(tid)
        return ids

    def _has(self, hf_name: str) -> bool:
        try:
            return gguf_name(hf_name) in self._tensors
        except KeyError:
            return False

    def _get(self, hf_name: str) -> torch.Tensor:
        import gguf

        name = gguf_name(hf_name)
        t = self._tensors.get(name)
        if t is None:
            raise SourceError(f"{self.spec}: missing tensor {name} ({hf_name})")
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # ggml [ne0, ne1] -> torch [ne1, ne0]
        return _to_bf16(np.asarray(a, dtype=np.float32).reshape(shape))

    def _all_linears_q4_0(self) -> bool:
        """Whether every decoder linear is stored as Q4_0 (no tensor data read)."""
        for i in range(self.config.num_hidden_layers):
            for parts in FUSED.values():
                for b in parts:
                    t = self._tensors.get(gguf_name(f"model.layers.{i}.{b}.weight"))
                    if t is None or t.tensor_type.name != "Q4_0":
                        return False
        return True

    def _linear_q4_0(self, hf_name: str) -> tuple[np.ndarray, np.ndarray]:
        name = gguf_name(hf_name)
        t = self._tensors.get(name)
        if t is None:
            raise SourceError(f"{self.spec}: missing tensor {name} ({hf_name})")
        if t.tensor_type.name != "Q4_0":
            raise CheckpointImportError(f"{self.spec}: {name} is {t.tensor_type.name}, not Q4_0: only a "
                                        "GGUF whose decoder linears are all Q4_0 is imported exactly")
        k, n = (int(x) for x in t.shape.tolist())  # ggml order: [ne0 = in_features, ne1 = out_features]
        return unpack_q4_0(t.data, n, k, f"{self.spec}: {name}")

    def quantized_layer(self, i: int) -> dict:
        """{container linear name: nanoqwen_format.QuantizedTensor} of decoder layer i, exact."""
        if not 0 <= i < self.config.num_hidden_layers:
            raise IndexError(f"layer {i} out of range 0..{self.config.num_hidden_layers - 1}")
        shapes = self.config.tensor_shapes()
        out = {}
        for name, parts in FUSED.items():
            got = [self._linear_q4_0(f"model.layers.{i}.{b}.weight") for b in parts]
            q = np.concatenate([x[0] for x in got], 0)
            d = np.concatenate([x[1] for x in got], 0)
            if q.shape != tuple(shapes[f"layers.{i}.{name}"]):
                raise SourceError(f"{self.spec}: layer {i} {name}: the Q4_0 tensors give shape "
                                  f"{list(q.shape)}, the config implies {list(shapes[f'layers.{i}.{name}'])}")
            out[name] = nqf.int4.pack(q, d, None, self.scheme.group_size, scale_dtype="f16")
        return out

    def source_sha256(self) -> str:
        return _sha256_files([self.path])


def is_quantized_source(source: Source) -> bool:
    """A source whose linears are imported exactly (`--method import`): a GPTQ/AWQ checkpoint or a GGUF
    whose decoder linears are all Q4_0. Both have `scheme`, `quantized_layer(i)` and `plain_layer(i)`."""
    return isinstance(source, QuantizedHFSource) or getattr(source, "scheme", None) is not None


def gguf_tokenizer_json(path: Path) -> str:
    """HF tokenizer.json of a GGUF's embedded tokenizer, via transformers' GGUF converter.

    transformers is a well-kept implementation of this conversion (byte-level BPE, pre-tokenizer,
    added/special tokens); it is imported only here, at pack time.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise SourceError("converting a GGUF tokenizer needs transformers: pip install transformers") from e
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return tok.backend_tokenizer.to_str()


GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # llama.cpp's token types


def with_gguf_added_tokens(tokenizer_json: str, tokens: list[str], kinds: list[int]) -> str:
    """`tokenizer_json` with every control and user-defined token of the GGUF vocabulary among its added
    tokens, at its GGUF id (control: special, as Qwen's own tokenizer.json marks them; user-defined, like
    `<tool_call>`: not special). transformers' GGUF conversion leaves some of them out in some versions
    (the FIM tokens, seen on one machine), and a container without them cannot infill. An added token at
    another id than the GGUF's is a SourceError."""
    data = json.loads(tokenizer_json)
    added = data.setdefault("added_tokens", [])
    have = {t["content"]: t["id"] for t in added}
    missing = 0
    for i, (tok, kind) in enumerate(zip(tokens, kinds, strict=True)):
        if kind not in (GGUF_CONTROL, GGUF_USER_DEFINED):
            continue
        if tok in have:
            if have[tok] != i:
                raise SourceError(f"the converted tokenizer has {tok!r} at id {have[tok]}, the GGUF at {i}")
            continue
        added.append({"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": kind == GGUF_CONTROL})
        missing += 1
    if not missing:
        return tokenizer_json  # byte for byte what the conversion gave
    added.sort(key=lambda t: t["id"])
    return json.dumps(data, ensure_ascii=False)


def qwen_generation_defaults(eos_ids: list[int], gen: dict | None = None) -> dict:
    """Generation defaults; values from Qwen2.5-Coder-Instruct's generation_config.json when absent."""
    gen = gen or {}
    eos = gen.get("eos_token_id", eos_ids)
    eos = [eos] if isinstance(eos, int) else list(eos)
    return {
        "eos_token_ids": [int(e) for e in eos],
        "temperature": float(gen.get("temperature", 0.7)),
        "top_p": float(gen.get("top_p", 0.8)),
        "top_k": int(gen.get("top_k", 20)),
        "max_new_tokens": int(gen.get("max_new_tokens", 2048)),
    }


# ------------------------------------------------------------------------------ HF safetensors
class HFFolderSource(Source):
    """A local HF checkpoint folder: config.json, tokenizer.json, and (sharded) safetensors."""

    def __init__(self, folder: str | Path, spec: str | None = None):
        self.path = Path(folder)
        self.spec = spec or str(folder)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise SourceError(f"{folder}: no config.json")
        self.config = packable(Qwen2Config.from_hf(json.loads(cfg_path.read_text())))  # refuse first
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {k: self.path / v for k, v in weight_map.items()}
            self._files = sorted({self.path / v for v in weight_map.values()})
        else:
            self._files = sorted(self.path.glob("*.safetensors"))
            self._where = {}
            from safetensors import safe_open

            for f in self._files:
                with safe_open(f, framework="pt") as sf:
                    self._where.update({k: f for k in sf.keys()})
        if not self._files:
            raise SourceError(f"{folder}: no *.safetensors files")
        for f in self._files:
            if not f.is_file():
                raise SourceError(f"{folder}: shard {f.name} listed in the index is missing")
        tok = self.path / "tokenizer.json"
        if not tok.is_file():
            raise SourceError(f"{folder}: no tokenizer.json")
        self.tokenizer_json = tok.read_text()
        self.chat_template = self._chat_template()
        gen_path = self.path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        self.generation = qwen_generation_defaults(self.config.eos_token_id, gen)

    def _chat_template(self) -> str:
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        tc = self.path / "tokenizer_config.json"
        if tc.is_file():
            t = json.loads(tc.read_text()).get("chat_template")
            if isinstance(t, str) and t:
                return t
        raise SourceError(f"{self.path}: no chat template (chat_template.jinja or tokenizer_config.json)")

    def _has(self, hf_name: str) -> bool:
        return hf_name in self._where

    def _get(self, hf_name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self._where.get(hf_name)
        if f is None:
            raise SourceError(f"{self.spec}: missing tensor {hf_name}")
        # open per tensor: a handle kept open keeps every page it touched mapped, which would count
        # the whole checkpoint into the resident set by the end of a 7B pack
        with safe_open(f, framework="pt") as h:
            return _to_bf16(h.get_tensor(hf_name))

    def source_sha256(self) -> str:
        return _sha256_files(self._files)


# ------------------------------------------------------------------------------------- hub id
HUB_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "model.safetensors.index.json", "*.safetensors",
                "quantize_config.json"]  # AutoGPTQ's older checkpoints keep their scheme there


class QuantizedHFSource(HFFolderSource):
    """A GPTQ or AWQ checkpoint folder (nanoqwen_quant.checkpoints reads its formats). `layer(i)` holds
    only the non-quantized tensors (norms, the fused q/k/v bias, bf16); `quantized_layer(i)` the four
    fused linears as exact `int4-g{G}-tile8x128-f16s-v1` QuantizedTensors."""

    def __init__(self, folder: str | Path, scheme: QuantScheme, spec: str | None = None):
        super().__init__(folder, spec)
        self.scheme = scheme

    def _raw(self, hf_name: str) -> np.ndarray:
        """One tensor as stored (no dtype conversion), numpy."""
        from safetensors import safe_open

        f = self._where.get(hf_name)
        if f is None:
            raise SourceError(f"{self.spec}: missing tensor {hf_name}")
        with safe_open(f, framework="pt") as h:
            return h.get_tensor(hf_name).numpy()

    def quantized_layer(self, i: int):
        """{container linear name: nanoqwen_format.QuantizedTensor} of decoder layer i."""
        if not 0 <= i < self.config.num_hidden_layers:
            raise IndexError(f"layer {i} out of range 0..{self.config.num_hidden_layers - 1}")
        return import_layer(self._raw, self._has, i, self.config.tensor_shapes(), self.scheme, self.spec)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """The non-quantized tensors of layer i (bf16): norms and the fused q/k/v bias."""
        return self.plain_layer(i)

    def check_complete(self) -> None:
        """SourceError naming the first missing tensor, or a quantized lm_head (no tensor data read)."""
        if self._has("lm_head.qweight"):
            raise SourceError(f"{self.spec}: the lm_head is quantized (lm_head.qweight): not supported; "
                              "nanoqwen imports checkpoints with a float lm_head")
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(self.config.num_hidden_layers):
            names += layer_tensor_names(i)
        for n in names:
            if not self._has(n):
                raise SourceError(f"{self.spec}: missing tensor {n} (a {self.scheme.method} checkpoint)")


def hf_folder_source(folder: str | Path, spec: str | None = None) -> HFFolderSource:
    """HFFolderSource, or QuantizedHFSource when the folder declares a GPTQ/AWQ quantization (any other
    declared quantization is refused: its `.weight` tensors are not float weights)."""
    scheme = read_scheme(Path(folder))
    return HFFolderSource(folder, spec) if scheme is None else QuantizedHFSource(folder, scheme, spec)


def hub_folder(repo_id: str, revision: str | None = None, cache_dir: str | None = None,
               local_files_only: bool = False) -> Path:
    """Download only the files a pack needs into huggingface_hub's cache and return the snapshot folder
    (config first, so a non-Qwen2 repo or an unsupported quantization is refused before the weights).
    `local_files_only`: take them from that cache, never the network."""
    from huggingface_hub import hf_hub_download, snapshot_download

    cfg = hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache_dir,
                          local_files_only=local_files_only)
    cfg_map = json.loads(Path(cfg).read_text())
    packable(Qwen2Config.from_hf(cfg_map))
    if cfg_map.get("quantization_config") is not None:  # refuse an unsupported scheme before the download
        QuantScheme.from_config(cfg_map["quantization_config"], f"{repo_id}: config.json")
    return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                  allow_patterns=HUB_PATTERNS, local_files_only=local_files_only))


def hub_source(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> HFFolderSource:
    """The source of an HF hub repo (`hub_folder`, then `hf_folder_source`)."""
    folder = hub_folder(repo_id, revision, cache_dir)
    return hf_folder_source(folder, spec=repo_id if revision is None else f"{repo_id}@{revision}")


def open_source(spec: str) -> Source:
    """A path to a .gguf file, a local folder, or `owner/name[@revision]` on the HF hub."""
    p = Path(os.path.expanduser(spec))
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise SourceError(f"{spec}: a file source must be a GGUF (magic {magic!r})")
        return GGUFSource(p)
    if p.is_dir():
        return hf_folder_source(p)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        repo, _, rev = spec.partition("@")
        return hub_source(repo, rev or None)
    raise SourceError(f"{spec}: no such file or folder, and not an HF hub id (owner/name)")


__all__ = ["Source", "GGUFSource", "HFFolderSource", "SourceError", "UnsupportedModelError", "open_source",
           "hub_source", "hub_folder", "hf_folder_source", "QuantizedHFSource", "is_quantized_source",
           "packable"]
