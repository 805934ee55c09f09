"""RTN pack of the Qwen2.5-Coder-7B geometry on CPU: wall time and peak host RSS (goal < 8 GB).

Builds a synthetic HF checkpoint folder with the exact 7B shapes (nanoqwen_model's QWEN25_CODER_7B:
hidden 3584, 28 layers, 28/4 heads of 128, intermediate 18944, vocab 152064, untied lm_head, q/k/v
bias) and random well-scaled bf16 weights (never zeros) on local disk, in 4-layer safetensors shards
with an index, then runs `nanoqwen-quant pack DIR -o OUT --method rtn` as a child process and reports
its wall time and peak RSS (getrusage of the child: ru_maxrss). The folder and output are deleted afterwards.

    python -m nanoqwen_bench.quant.rtn_7b_cpu [--workdir /tmp] [--keep] [--extra-args "..."]

The tokenizer is the real Qwen2 one when the 0.5B GGUF is cached (converted by transformers), else a
small trained byte-level BPE: the tokenizer does not affect RTN.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from nanoqwen_model.config import QWEN25_CODER_7B
from nanoqwen_quant.synthetic import random_layer

# the HF config.json of the synthetic checkpoint: nanoqwen_model's 7B geometry under config.json keys
CONFIG_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "torch_dtype": "bfloat16", "use_sliding_window": False,
    **{k: v for k, v in QWEN25_CODER_7B.to_metadata().items() if k != "architecture"},
}
LAYERS_PER_SHARD = 4


def _tokenizer_json() -> str:
    gguf = Path.home() / ".cache" / "nanoqwen" / "qwen2.5-coder-0.5b-instruct.gguf"
    if gguf.is_file():
        from nanoqwen_quant.sources import gguf_tokenizer_json

        return gguf_tokenizer_json(gguf)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x\n"] * 8, trainers.BpeTrainer(vocab_size=300))
    return tok.to_str()


def make_folder(folder: Path) -> None:
    """Write the synthetic checkpoint shard by shard (a few GB of RAM at most)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(7)
    c = CONFIG_7B
    weight_map = {}
    n = c["num_hidden_layers"]
    shards = [list(range(s, min(s + LAYERS_PER_SHARD, n))) for s in range(0, n, LAYERS_PER_SHARD)]
    total = len(shards) + 1
    for k, layers in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{total:05d}.safetensors"
        sd = {}
        for i in layers:
            sd |= random_layer(c, i, g)
        save_file(sd, str(folder / name))
        weight_map |= {t: name for t in sd}
        del sd
    name = f"model-{total:05d}-of-{total:05d}.safetensors"
    h, v = c["hidden_size"], c["vocab_size"]
    sd = {"model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16),
          "lm_head.weight": (torch.randn(v, h, generator=g) * h ** -0.5).to(torch.bfloat16),
          "model.norm.weight": (1 + torch.randn(h, generator=g) * 0.1).to(torch.bfloat16)}
    save_file(sd, str(folder / name))
    weight_map |= {t: name for t in sd}
    del sd
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(c))
    (folder / "tokenizer.json").write_text(_tokenizer_json())
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic folder and the output")
    ap.add_argument("--extra-args", default="", help="extra arguments for `nanoqwen-quant pack`")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nanoqwen-7b-rtn-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        make_folder(work / "hf")
        size = sum(f.stat().st_size for f in (work / "hf").iterdir())
        print(f"synthetic 7B folder: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
        out = work / "7b-rtn.nanoqwen"
        cmd = [sys.executable, "-m", "nanoqwen_quant.cli", "pack", str(work / "hf"), "-o", str(out),
               "--method", "rtn", *args.extra_args.split()]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=dict(os.environ, COLUMNS="120"))
        wall = time.perf_counter() - t0
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        result = {"bench": "rtn_7b_cpu", "wall_s": round(wall, 1),
                  "peak_rss_gb": round(peak_kib * 1024 / 1e9, 2),
                  "out_gb": round(out.stat().st_size / 1e9, 3), "source_gb": round(size / 1e9, 2),
                  "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
        print(json.dumps(result))
        return 0 if result["peak_rss_gb"] < 8 else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
