"""Programmatic dependent launch A/B on the synthetic 7B geometry, one JSON line (GPU machine).

    PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src:packages/nanoqwen-runtime/src \
        python3 bench/engine/pdl_ab.py [--rounds 3]

The same measurement is a section of `nanoqwen-cli bench` (bench.md "Programmatic dependent launch
A/B"); this script runs only it, for a quick look.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from nanoqwen_runtime.engine.bench import copy_bandwidth, pdl_ab
from nanoqwen_runtime.engine.config import QWEN25_7B
from nanoqwen_runtime.engine.synthetic import random_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    bw = copy_bandwidth(dev)
    weights = random_weights(QWEN25_7B, dev, seed=0)
    res = pdl_ab(QWEN25_7B, weights, rounds=a.rounds)
    wall = round(time.perf_counter() - t0, 1)
    print(json.dumps({"bench": "pdl_ab", "device": torch.cuda.get_device_name(dev),
                      "copy_bandwidth_GBps": round(bw / 1e9), **res, "wall_s": wall}))


if __name__ == "__main__":
    main()
