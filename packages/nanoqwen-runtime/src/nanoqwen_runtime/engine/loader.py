"""Load a .nanoqwen container onto the device: one device buffer, filled through pinned memory.

The tensor bytes of a container sit in one region of the file (records are 256-byte aligned, in
file order). The loader allocates one device byte buffer for that region, streams the file into it
in large chunks (64 MiB) through two pinned staging buffers, so that reading chunk i+1 from the page
cache / disk overlaps the host-to-device copy of chunk i, and then makes typed views of each tensor
(`weights.Int4Linear` etc.) over the buffer: no second copy, no per-tensor allocation.

Integrity (integrity.py), on by default (`verify=True`; the CLI's `--no-verify` turns it off):

- checksums: while a chunk's host-to-device copy runs, one worker thread hashes the chunk's bytes from
  the pinned buffer (xxhash's streaming xxh3-64, fed each tensor's slices of each chunk: the padding
  between tensors is skipped; `NanoqwenFile.stream_verifier`). xxhash releases the GIL, so hashing
  chunk i overlaps the copy of chunk i+1 from the file and the DMA of both; a staging buffer is
  refilled only once its copy and its hashing are done. A mismatch raises `ChecksumError` naming the
  tensor before any engine exists. (Header, trailer, index and metadata: checked at open, always.)
- finite weights: after the upload, one `aminmax` per bf16 tensor and per INT4/INT8 scales tensor on
  the device; the extremes come back in one copy (`NonFiniteWeightError`, integrity.check_finite).

Progress is reported through a callback `progress(done_bytes, total)`. On the CPU (the torch backend
in tests) the same code path copies into a host buffer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
import torch
from nanoqwen_model import Qwen2Config

from ..container import opened
from ..integrity import check_finite
from .weights import DenseLinear, Int4Linear, Int8Linear, LayerWeights, Linear, ModelWeights

CHUNK_BYTES = 64 << 20


@dataclass
class LoadStats:
    path: str
    nbytes: int
    seconds: float               # upload (file -> device), the hashing that overlaps it included
    verify_seconds: float        # time spent hashing, on the worker thread (0 without verify)
    verify_wait_seconds: float   # time the upload waited for the hashing: the part of it not overlapped
    finite_seconds: float        # the NaN/Inf check on the device, one read-back included (0 without verify)
    total_seconds: float         # open + upload + views + checks
    verified: bool = False

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


class _Hasher:
    """Feeds a `StreamVerifier` from one worker thread, in submission order (None: no verification)."""

    def __init__(self, verifier):
        self.verifier = verifier
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nanoqwen-verify") if verifier else None
        self.wait_seconds = 0.0

    def submit(self, offset: int, chunk: np.ndarray) -> Future | None:
        return None if self._pool is None else self._pool.submit(self.verifier.feed, offset, chunk)

    def wait(self, fut: Future | None) -> None:
        """Wait for one chunk's hashing; raises its ChecksumError."""
        if fut is not None:
            t0 = time.perf_counter()
            try:
                fut.result()
            finally:
                self.wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _upload(mm_region: np.ndarray, base: int, device: torch.device, hasher: _Hasher,
            progress: Callable[[int, int], None] | None) -> torch.Tensor:
    """Copy a host uint8 array (the file's bytes from offset `base`) into a new device buffer in
    CHUNK_BYTES pieces (double-buffered), hashing each piece on `hasher` as it passes."""
    total = mm_region.nbytes
    dst = torch.empty(total, dtype=torch.uint8, device=device)
    try:
        if device.type != "cuda":
            host = dst.numpy()
            pending = []
            for start in range(0, total, CHUNK_BYTES):
                end = min(total, start + CHUNK_BYTES)
                host[start:end] = mm_region[start:end]
                pending.append(hasher.submit(base + start, host[start:end]))
                if progress:
                    progress(end, total)
            for fut in pending:
                hasher.wait(fut)
            return dst
        stream = torch.cuda.Stream(device)
        staging = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        copied: list[torch.cuda.Event | None] = [None, None]
        hashed: list[Future | None] = [None, None]
        try:
            with torch.cuda.stream(stream):
                for i, start in enumerate(range(0, total, CHUNK_BYTES)):
                    end = min(total, start + CHUNK_BYTES)
                    slot = i % 2
                    if copied[slot] is not None:
                        copied[slot].synchronize()  # the copy that last used this staging buffer is done
                    hasher.wait(hashed[slot])       # and so is its hashing
                    buf = staging[slot][: end - start]
                    host = buf.numpy()
                    host[:] = mm_region[start:end]  # reads the file (page cache or disk)
                    dst[start:end].copy_(buf, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    copied[slot] = ev
                    hashed[slot] = hasher.submit(base + start, host)  # overlaps this copy and the next read
                    if progress:
                        progress(end, total)
                for fut in hashed:
                    hasher.wait(fut)
        finally:
            stream.synchronize()
        return dst
    finally:
        hasher.close()


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
    sdt = torch.float16 if lay.scale_dtype == "f16" else torch.bfloat16  # the -f16s int4 layout: fp16
    scales = _view(buf, off + lay.scales_offset, n * (k // g) * 2, sdt, (n, k // g))
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


def finite_check_targets(w: ModelWeights) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(name, part, tensor) of every floating tensor the model computes with as stored: bf16 norms,
    biases, embeddings and dense linears, and the scales of INT4/INT8 linears (bf16, or fp16 for the
    -f16s INT4 layout) (integrity.py)."""
    def linear(name: str, lin: Linear):
        if isinstance(lin, DenseLinear):
            yield name, "", lin.weight
        else:
            yield name, "scales", lin.scales

    yield "embed_tokens", "", w.embed_tokens
    for i, lw in enumerate(w.layers):
        p = f"layers.{i}."
        yield p + "input_norm", "", lw.input_norm
        yield from linear(p + "qkv", lw.qkv)
        yield p + "qkv_bias", "", lw.qkv_bias
        yield from linear(p + "o_proj", lw.o_proj)
        yield p + "post_attn_norm", "", lw.post_attn_norm
        yield from linear(p + "gate_up", lw.gate_up)
        yield from linear(p + "down", lw.down)
    yield "final_norm", "", w.final_norm
    if not (isinstance(w.lm_head, DenseLinear) and w.lm_head.weight is w.embed_tokens):  # tied: checked
        yield from linear("lm_head", w.lm_head)


def load(path: str | Path | nqf.NanoqwenFile, device: str | torch.device = "cuda", *, verify: bool = True,
         progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """Read a container and put its weights on `device` (see the module header). `path`: a path, or
    an open `NanoqwenFile` (container.py: not opened again). verify (default): checksums streamed with
    the upload and NaN/Inf refused (ChecksumError / NonFiniteWeightError, naming the tensor);
    verify=False skips both."""
    device = torch.device(device)
    t0 = time.perf_counter()
    with opened(path) as f:
        path = f.path
        meta = f.metadata
        geom = Qwen2Config.from_metadata(f.config)
        recs = list(f.records.values())
        if not recs:
            raise nqf.FormatError(f"{path}: no tensors")
        base = min(r.offset for r in recs)
        end = max(r.offset + r.nbytes for r in recs)
        # our own read-only map of the tensor region (the reader's accessors are per tensor)
        region = np.memmap(path, dtype=np.uint8, mode="r", offset=base, shape=(end - base,))
        hasher = _Hasher(f.stream_verifier() if verify else None)
        tu = time.perf_counter()
        buf = _upload(region, base, device, hasher, progress)
        upload_s = time.perf_counter() - tu
        if verify:
            hasher.verifier.finish()
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
    finite_s = 0.0
    if verify:
        tf = time.perf_counter()
        check_finite(finite_check_targets(weights), str(path))
        finite_s = time.perf_counter() - tf
    stats = LoadStats(str(path), int(buf.numel()), upload_s,
                      hasher.verifier.seconds if verify else 0.0, hasher.wait_seconds, finite_s,
                      time.perf_counter() - t0, verified=verify)
    return LoadedModel(geom, weights, meta, stats, buf)
