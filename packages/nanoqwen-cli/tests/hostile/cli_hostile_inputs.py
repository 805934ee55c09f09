"""Builders of the hostile inputs the CLI must refuse (test_hostile_inputs.py runs the table).

Each builder writes one input into a folder and returns its path. The containers start from the tiny
random model of nanoqwen_runtime.testing; the damaged ones are made the way the issue found them:
an empty file, a file cut in half, wrong magic, a flipped byte inside a tensor (its stored checksum no
longer matches), and `final_norm` overwritten with NaN in an otherwise sound file (checksums rewritten,
so only a look at the values can refuse it); and one the load cannot refuse: `final_norm` at 3e38,
finite, whose logits overflow at run time. A GGUF is recognised by its magic alone, an HF folder by
config.json and a safetensors file, so those two are minimal stand-ins, not loadable checkpoints.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
from nanoqwen_runtime.testing import write_tiny_container

FLIPPED_TENSOR = "layers.1.gate_up"


def tiny(folder: Path) -> Path:
    return write_tiny_container(folder / "tiny.nanoqwen", method="rtn", seed=5)


def empty(folder: Path) -> Path:
    path = folder / "empty.nanoqwen"
    path.write_bytes(b"")
    return path


def truncated(folder: Path, sound: Path) -> Path:
    data = sound.read_bytes()
    path = folder / "truncated.nanoqwen"
    path.write_bytes(data[: len(data) // 2])
    return path


def wrong_magic(folder: Path, sound: Path) -> Path:
    path = folder / "magic.nanoqwen"
    path.write_bytes(b"NOTQWEN!" + sound.read_bytes()[8:])
    return path


def flipped_byte(folder: Path, sound: Path, tensor: str = FLIPPED_TENSOR) -> Path:
    """4 bytes flipped in the middle of `tensor` (as in the issue: inside layers.N.gate_up)."""
    with nqf.open(sound) as f:
        rec = f.records[tensor]
    data = bytearray(sound.read_bytes())
    at = rec.offset + rec.nbytes // 2
    for i in range(4):
        data[at + i] ^= 0xFF
    path = folder / "flipped.nanoqwen"
    path.write_bytes(bytes(data))
    return path


def planted_final_norm(folder: Path, sound: Path, value: float, name: str) -> Path:
    """A copy of `sound` with every final_norm weight set to `value` (bf16), written by the format's
    writer, so its checksums are valid: only a look at the values can refuse it."""
    path = folder / name
    with nqf.open(sound) as f, nqf.Writer(path) as w:
        for tensor, rec in f.records.items():
            if rec.is_quantized:
                w.add_quantized(tensor, f.quantized(tensor))
            elif tensor == "final_norm":
                w.add_array(tensor, np.full(rec.shape, value, dtype=np.float32), encoding="bf16")
            else:
                w.add_array(tensor, np.array(f.array(tensor)), encoding=rec.encoding)
        w.set_metadata(f.metadata)
    return path


def nan_final_norm(folder: Path, sound: Path) -> Path:
    """final_norm all NaN: refused at load, naming the tensor."""
    return planted_final_norm(folder, sound, float("nan"), "nan_norm.nanoqwen")


def overflowing_final_norm(folder: Path, sound: Path) -> Path:
    """final_norm at 3e38 (finite, near bf16's largest): loads, and every logit overflows to Inf/NaN at
    run time, which must end the request with an error instead of printing what was sampled from it."""
    return planted_final_norm(folder, sound, 3e38, "overflow_norm.nanoqwen")


def gguf(folder: Path) -> Path:
    """A file that starts like a GGUF v3 (magic, version, tensor and metadata counts)."""
    path = folder / "model.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))
    return path


def hf_folder(folder: Path) -> Path:
    path = folder / "Qwen2.5-Coder-0.5B"
    path.mkdir()
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    return path


def text_file(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


def long_code(nbytes: int, seed: int = 0) -> bytes:
    """About `nbytes` of code-like text: over the 128 KiB an argument may hold, far over the tiny
    model's 256-token context."""
    words = ["def", "return", "x", "foo", "bar", "(", ")", ":", "    ", "\n", "import", "os"]
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < nbytes:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out).encode()
