"""Programmatic dependent launch A/B on the synthetic 7B geometry, one JSON line (GPU machine).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 bench/engine/pdl_ab.py [--rounds 3]

Two engines of the same config but `EngineConfig.pdl`, same weights, measured alternately (`rounds`
times, best of each): decode graph replay at batch 1 and 8, context 128. It was a section of
`nanoqwen-cli bench` until issue 11 (1.000x / 1.002x in session 2, NOTES.md); it lives here now.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from nanoqwen_model import QWEN25_CODER_7B, Qwen2Config
from nanoqwen_runtime.engine import Engine, EngineConfig
from nanoqwen_runtime.engine.bench import copy_bandwidth, decode_at_context
from nanoqwen_runtime.engine.synthetic import random_weights


def pdl_ab(geom: Qwen2Config, weights, batches=(1, 8), rounds: int = 3) -> dict:
    cfg = dict(kv_memory_bytes=4 << 30, max_model_len=4096, dense_weight_cache=False)
    engines = {pdl: Engine(geom, weights, EngineConfig(pdl=pdl, **cfg)) for pdl in (True, False)}
    rows = []
    for b in batches:
        best = {True: 0.0, False: 0.0}
        for r in range(rounds):
            for pdl, eng in engines.items():
                res = decode_at_context(eng, 128, 32, batch=b, seed=300 + 10 * r)
                best[pdl] = max(best[pdl], res["graph_tok_s"])
        rows.append({"batch": b, "context": 128, "graph_tok_s_pdl": best[True],
                     "graph_tok_s_plain": best[False], "speedup": best[True] / best[False]})
    return {"rows": rows, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    bw = copy_bandwidth(dev)
    weights = random_weights(QWEN25_CODER_7B, dev, seed=0)
    res = pdl_ab(QWEN25_CODER_7B, weights, rounds=a.rounds)
    wall = round(time.perf_counter() - t0, 1)
    print(json.dumps({"bench": "pdl_ab", "device": torch.cuda.get_device_name(dev),
                      "copy_bandwidth_GBps": round(bw / 1e9), **res, "wall_s": wall}))


if __name__ == "__main__":
    main()
