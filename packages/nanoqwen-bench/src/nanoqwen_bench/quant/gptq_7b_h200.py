"""GPTQ of the Qwen2.5-Coder-7B geometry on one H200: synthetic weights made on the GPU, real
calibration text (Python stdlib code tokenized with the real Qwen2 tokenizer). Goal: < 15 minutes.

Two steps, because the GPU machine has no registry, no model file and no network:

 1. here (CPU machine, with the 0.5B GGUF cached):
        python -m nanoqwen_bench.quant.gptq_7b_h200 prepare [--tokens 65536 --seq-len 2048]
    tokenizes the default calibration set (the stdlib "calib" split, see nanoqwen_quant.calib) and
    writes nanoqwen_bench/quant/prepared/calib_tokens.npy + calib.json (256 KB; committed, so this step is
    only needed to change the token count).
 2. on the GPU machine:
        PYTHONPATH=$(ls -d packages/*/src | paste -sd:) \
            python -m nanoqwen_bench.quant.gptq_7b_h200 run --out /tmp/7b-gptq.nanoqwen
    builds a `SyntheticSource` (the shapes of nanoqwen_model's QWEN25_CODER_7B, random well-scaled
    bf16 weights generated on the GPU from
    a per-tensor seed, so a layer is regenerated identically when the container is assembled),
    runs the real `nanoqwen_quant.pack.pack(..., method="gptq")` on CUDA, and prints one JSON line
    with the GPTQ-loop time, the total time (including assembling and writing the container), the
    peak GPU memory and the file size; the output and the checkpoint folder are deleted unless --keep.
    Smoke test on CPU (what was run before handing it over):
        python -m nanoqwen_bench.quant.gptq_7b_h200 run --device cpu --layers 1 --max-seqs 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
PREPARED = HERE / "prepared"


def prepare(tokens: int, seq_len: int) -> None:
    from nanoqwen_quant.calib import build_calibration
    from nanoqwen_quant.sources import gguf_tokenizer_json

    gguf = Path.home() / ".cache" / "nanoqwen" / "qwen2.5-coder-0.5b-instruct.gguf"
    tok = gguf_tokenizer_json(gguf)
    calib = build_calibration(tok, tokens, seq_len)
    PREPARED.mkdir(exist_ok=True)
    np.save(PREPARED / "calib_tokens.npy", calib.ids.numpy().astype(np.int32))
    (PREPARED / "calib.json").write_text(json.dumps(calib.to_metadata()))
    print(f"wrote {calib.tokens} tokens ({calib.ids.shape[0]} x {seq_len}) to {PREPARED}")


def make_synthetic_source(dev: torch.device, layers: int | None = None):
    from nanoqwen_model.config import QWEN25_CODER_7B
    from nanoqwen_quant.sources import Source, packable, qwen_generation_defaults

    class SyntheticSource(Source):
        """Random 7B-geometry weights, generated on `dev` from a seed derived from the tensor name."""

        def __init__(self):
            self.spec = "synthetic-qwen2.5-coder-7b-geometry"
            self.config = packable(QWEN25_CODER_7B.with_(
                num_hidden_layers=layers or QWEN25_CODER_7B.num_hidden_layers))
            self.tokenizer_json = "{}"  # not needed to pack pre-tokenized calibration
            self.chat_template = ""
            self.generation = qwen_generation_defaults([151645, 151643])
            c = self.config
            self._shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                            "lm_head.weight": (c.vocab_size, c.hidden_size),
                            "model.norm.weight": (c.hidden_size,)}
            h, inter, kv = c.hidden_size, c.intermediate_size, c.kv_dim
            for i in range(c.num_hidden_layers):
                p = f"model.layers.{i}."
                self._shapes |= {
                    p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                    p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                    p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (inter, h),
                    p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter)}

        def _has(self, name):
            return name in self._shapes

        def _get(self, name):
            shape = self._shapes[name]
            seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "little")
            g = torch.Generator(device=dev).manual_seed(seed)
            x = torch.randn(shape, generator=g, device=dev)
            if name.endswith("norm.weight"):
                x = 1 + 0.1 * x
            elif name.endswith(".bias"):
                x = 0.1 * x
            elif name == "model.embed_tokens.weight":
                x = 0.02 * x
            else:
                x = x * shape[1] ** -0.5
            return x.to(torch.bfloat16)

        def source_sha256(self):
            meta = json.dumps(QWEN25_CODER_7B.to_metadata(), sort_keys=True)
            return hashlib.sha256(meta.encode()).hexdigest()

    return SyntheticSource()


def run(out: Path, keep: bool, calib_batch: int, device: str, layers: int | None,
        max_seqs: int | None) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from nanoqwen_quant.calib import CalibrationSet
    from nanoqwen_quant.options import PackOptions
    from nanoqwen_quant.pack import pack

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this is for the H200 machine (--device cpu to smoke-test)")
    ids = np.load(PREPARED / "calib_tokens.npy")[:max_seqs]
    meta = json.loads((PREPARED / "calib.json").read_text())
    calib = CalibrationSet(torch.from_numpy(ids.astype(np.int64)), meta["source"] + " (pre-tokenized)",
                           meta["files"], hashlib.sha256(ids.astype(np.int32).tobytes()).hexdigest())
    src = make_synthetic_source(dev, layers)
    opts = PackOptions(method="gptq", device=str(dev), calib_tokens=calib.tokens,
                       calib_seq_len=int(ids.shape[1]), calib_batch=calib_batch)
    marks = {}

    def progress(stage, done, total):
        if stage == "gptq done":
            marks["gptq_done"] = time.perf_counter()

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        s = pack(src, out, opts, progress=progress, log=lambda m: print(m, flush=True), calibration=calib)
        total = time.perf_counter() - t0
        cuda = dev.type == "cuda"
        print(json.dumps({"bench": "gptq_7b_h200", "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                          "layers": src.config.num_hidden_layers,
                          "calib_tokens": calib.tokens, "seq_len": int(ids.shape[1]),
                          "gptq_loop_s": round(marks.get("gptq_done", t0) - t0, 1),
                          "total_s": round(total, 1), "out_gb": round(s.nbytes / 1e9, 3),
                          "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None,
                          "goal_s": 900, "notes": s.notes}))
    finally:
        if not keep:
            out.unlink(missing_ok=True)
            shutil.rmtree(Path(str(out) + ".ckpt"), ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--seq-len", type=int, default=2048)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, default=Path("/tmp/7b-gptq.nanoqwen"))
    r.add_argument("--keep", action="store_true")
    r.add_argument("--calib-batch", type=int, default=8)
    r.add_argument("--device", default="cuda")
    r.add_argument("--layers", type=int, default=None, help="quantize only the first N layers (smoke test)")
    r.add_argument("--max-seqs", type=int, default=None, help="use only the first N calibration windows")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.tokens, a.seq_len)
    else:
        run(a.out, a.keep, a.calib_batch, a.device, a.layers, a.max_seqs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
