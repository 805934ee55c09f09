"""Pack time of a recipe on the Qwen2.5-Coder-7B geometry (synthetic weights, real calibration tokens).

    python -m nanoqwen_bench.quality.pack_time_7b --recipe awq-clipact [--layers 4] [--device cuda]

Reuses nanoqwen_bench/quant/gptq_7b_h200.py's synthetic source (the 7B's shapes, random well-scaled bf16
weights generated on the GPU) and its committed calibration tokens (nanoqwen_bench/quant/prepared: 65,536
stdlib tokens in windows of 2,048), packs the first `--layers` decoder layers with the recipe of
run_quality.RECIPES, and prints one JSON line: the measured seconds and the 28-layer estimate
total x 28 / layers. The estimate is an upper bound: the fixed costs (embeddings, lm_head, the
calibration embedding) are scaled with the layers too. Quality needs real weights; this is speed only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

LAYERS_7B = 28


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calib-batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("/tmp/7b-recipe.nanoqwen"))
    a = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import hashlib

    import numpy as np
    from nanoqwen_quant.calib import CalibrationSet
    from nanoqwen_quant.options import PackOptions
    from nanoqwen_quant.pack import pack

    from ..quant import gptq_7b_h200 as g7
    from . import run_quality as rq

    kw = dict(rq.RECIPES[a.recipe])
    dev = torch.device(a.device)
    ids = np.load(g7.PREPARED / "calib_tokens.npy")
    meta = json.loads((g7.PREPARED / "calib.json").read_text())
    calib = CalibrationSet(torch.from_numpy(ids.astype(np.int64)), meta["source"] + " (pre-tokenized)",
                           meta["files"], hashlib.sha256(ids.astype(np.int32).tobytes()).hexdigest())
    if kw["method"] == "gptq" or kw.get("awq"):
        kw |= {"calib_tokens": calib.tokens, "calib_seq_len": int(ids.shape[1]), "calib_batch": a.calib_batch}
    src = g7.make_synthetic_source(dev, a.layers)
    opts = PackOptions(device=str(dev), **kw)
    t0 = time.perf_counter()
    try:
        s = pack(src, a.out, opts, log=lambda m: print(m, flush=True), calibration=calib)
        total = time.perf_counter() - t0
    finally:
        a.out.unlink(missing_ok=True)
        import shutil
        shutil.rmtree(Path(str(a.out) + ".ckpt"), ignore_errors=True)
    print(json.dumps({"bench": "pack_time_7b", "recipe": a.recipe, "options": kw, "layers": a.layers,
                      "device": str(dev), "seconds": round(total, 1), "bytes": s.nbytes,
                      "estimate_28_layers_s": round(total * LAYERS_7B / a.layers, 1), "goal_s": 900}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
