"""Load a .nanoqwen container onto the device: one device buffer, filled through pinned memory.

The tensor bytes of a container sit in one region of the file (records are 256-byte aligned, in
file order). The loader allocates one device byte buffer for that region, streams the file into it
in large chunks (64 MiB) through two pinned staging buffers, so that reading chunk i+1 from the page
cache / disk overlaps the host-to-device copy of chunk i, and then makes typed views of each tensor
(`weights.Int4Linear` etc.) over the buffer: no second copy, no per-tensor allocation.

Checksums (xxh3-64 per tensor) are checked only when asked (`verify=True`, the CLI's `--verify`),
before any byte is uploaded. Progress is reported through a callback `progress(done_bytes, total)`.
On the CPU (the torch backend in tests) the same code path copies into a host buffer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
import torch
from nanoqwen_model import Qwen2Config

from .weights import DenseLinear, Int4Linear, Int8Linear, LayerWeights, Linear, ModelWeights

CHUNK_BYTES = 64 << 20


@dataclass
class LoadStats:
    path: str
    nbytes: int
    seconds: float          # upload (file -> device) only
    verify_seconds: float   # checksum pass (0 unless verify=True)
    total_seconds: float    # open + verify + upload + views

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


@dataclass
class LoadedModel:
    geometry: Qwen2Config
    weights: ModelWeights
    metadata: dict
    stats: LoadStats
    buffer: torch.Tensor  # uint8, owns every weight view


def _upload(mm_region: np.ndarray, device: torch.device,
            progress: Callable[[int, int], None] | None) -> torch.Tensor:
    """Copy a host uint8 array into a new device buffer in CHUNK_BYTES pieces (double-buffered)."""
    total = mm_region.nbytes
    dst = torch.empty(total, dtype=torch.uint8, device=device)
    if device.type != "cuda":
        for start in range(0, total, CHUNK_BYTES):
            end = min(total, start + CHUNK_BYTES)
            dst[start:end].copy_(torch.from_numpy(np.array(mm_region[start:end])))
            if progress:
                progress(end, total)
        return dst
    stream = torch.cuda.Stream(device)
    staging = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done = [None, None]
    with torch.cuda.stream(stream):
        for i, start in enumerate(range(0, total, CHUNK_BYTES)):
            end = min(total, start + CHUNK_BYTES)
            slot = i % 2
            if done[slot] is not None:
                done[slot].synchronize()  # the copy that last used this staging buffer is finished
            buf = staging[slot][: end - start]
            buf.numpy()[:] = mm_region[start:end]  # reads the file (page cache or disk)
            dst[start:end].copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            done[slot] = ev
            if progress:
                progress(end, total)
    stream.synchronize()
    return dst


def _view(buf: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    return buf[offset:offset + nbytes].view(dtype).view(*shape)


def _linear(f, name: str, buf: torch.Tensor, base: int) -> Linear:
    rec = f.records[name]
    off = rec.offset - base
    if rec.encoding == "bf16":
        return DenseLinear(_view(buf, off, rec.nbytes, torch.bfloat16, rec.shape))
    if rec.encoding not in ("int4", "int8"):
        raise nqf.FormatError(f"tensor {name!r}: encoding {rec.encoding!r} is not supported by the engine")
    lay = nqf.quantized.parse_layout(rec.encoding, rec.layout, rec.shape, rec.group_size, rec.symmetric)
    n, k, g = lay.n, lay.k, lay.group_size
    scales = _view(buf, off + lay.scales_offset, n * (k // g) * 2, torch.bfloat16, (n, k // g))
    if rec.encoding == "int8":
        return Int8Linear(_view(buf, off, n * k, torch.int8, (n, k)), scales, n, k, g)
    qweight = _view(buf, off, n * k // 2, torch.int32, (n // 8, k // 128, 32, 4))
    zeros = None
    if lay.zeros_offset is not None:
        zeros = _view(buf, off + lay.zeros_offset, n * (k // g), torch.uint8, (n, k // g))
    return Int4Linear(qweight, scales, zeros, n, k, g)


def _plain(f, name: str, buf: torch.Tensor, base: int) -> torch.Tensor:
    rec = f.records[name]
    if rec.encoding != "bf16":
        raise nqf.FormatError(f"tensor {name!r}: the engine needs bf16, the file has {rec.encoding!r}")
    return _view(buf, rec.offset - base, rec.nbytes, torch.bfloat16, rec.shape)


def check_shapes(geom: Qwen2Config, w: ModelWeights) -> None:
    """Raise ValueError naming the first tensor whose shape disagrees with the config."""
    got = {"embed_tokens": tuple(w.embed_tokens.shape), "final_norm": tuple(w.final_norm.shape),
           "lm_head": (w.lm_head.n, w.lm_head.k)}
    for i, lw in enumerate(w.layers):
        p = f"layers.{i}."
        for name in ("qkv", "o_proj", "gate_up", "down"):
            lin = getattr(lw, name)
            got[p + name] = (lin.n, lin.k)
        for name in ("qkv_bias", "input_norm", "post_attn_norm"):
            got[p + name] = tuple(getattr(lw, name).shape)
    for name, want in geom.tensor_shapes(with_lm_head=True).items():
        if got[name] != tuple(want):
            raise ValueError(f"tensor {name!r} has shape {list(got[name])}, the config implies {list(want)}")


def load(path: str | Path, device: str | torch.device = "cuda", *, verify: bool = False,
         progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """Read a container and put its weights on `device` (see the module header)."""
    device = torch.device(device)
    t0 = time.perf_counter()
    with nqf.open(path) as f:
        meta = f.metadata
        geom = Qwen2Config.from_metadata(f.config)
        verify_s = 0.0
        if verify:
            tv = time.perf_counter()
            f.verify()
            verify_s = time.perf_counter() - tv
        recs = list(f.records.values())
        if not recs:
            raise nqf.FormatError(f"{path}: no tensors")
        base = min(r.offset for r in recs)
        end = max(r.offset + r.nbytes for r in recs)
        # our own read-only map of the tensor region (the reader's accessors are per tensor)
        region = np.memmap(path, dtype=np.uint8, mode="r", offset=base, shape=(end - base,))
        tu = time.perf_counter()
        buf = _upload(region, device, progress)
        upload_s = time.perf_counter() - tu
        del region
        layers = []
        for i in range(geom.num_hidden_layers):
            p = f"layers.{i}."
            layers.append(LayerWeights(
                input_norm=_plain(f, p + "input_norm", buf, base),
                qkv=_linear(f, p + "qkv", buf, base),
                qkv_bias=_plain(f, p + "qkv_bias", buf, base),
                o_proj=_linear(f, p + "o_proj", buf, base),
                post_attn_norm=_plain(f, p + "post_attn_norm", buf, base),
                gate_up=_linear(f, p + "gate_up", buf, base),
                down=_linear(f, p + "down", buf, base),
            ))
        embed = _plain(f, "embed_tokens", buf, base)
        if "lm_head" in f.records:
            lm_head = _linear(f, "lm_head", buf, base)
        elif geom.tie_word_embeddings:
            lm_head = DenseLinear(embed)
        else:
            raise nqf.FormatError(f"{path}: no lm_head and the config does not tie embeddings")
        weights = ModelWeights(embed, layers, _plain(f, "final_norm", buf, base), lm_head)
    check_shapes(geom, weights)
    stats = LoadStats(str(path), int(buf.numel()), upload_s, verify_s, time.perf_counter() - t0)
    return LoadedModel(geom, weights, meta, stats, buf)
