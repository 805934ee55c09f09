"""Shared fixtures of the nanoqwen-quant tests: a tiny random Qwen2 checkpoint as an HF folder.

The tiny model has the real structure (GQA, q/k/v bias, untied lm_head, two safetensors shards with
an index, a byte-level BPE tokenizer trained on a few lines of code, a chat template) and sizes that
fit the INT4 tile layout: hidden 128, 2 query heads and 1 KV head of 64, intermediate 256, 2 layers.
Its weights are fresh random values (never zeros), rounded to bf16 so the source is exactly "bf16".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from nanoqwen_quant.synthetic import random_layer

TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256,
    "vocab_size": 320, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "use_sliding_window": False,
}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}")
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
] * 4


def tiny_tokenizer_json(vocab_size: int = 300) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def tiny_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named bf16 weights of the tiny model."""
    g = torch.Generator().manual_seed(seed)
    c = TINY_CONFIG
    h, v = c["hidden_size"], c["vocab_size"]

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": rnd(v, h, scale=0.5), "model.norm.weight": 1 + rnd(h, scale=0.1),
          "lm_head.weight": rnd(v, h, scale=h ** -0.5)}
    for i in range(c["num_hidden_layers"]):
        sd |= random_layer(c, i, g)
    return sd


def write_tiny_folder(folder: Path, config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = tiny_state_dict()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k].contiguous() for k in keys}, str(folder / fname))
        weight_map |= {k: fname for k in keys}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config or TINY_CONFIG))
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0], "temperature": 0.5}))
    return folder


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    return write_tiny_folder(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="session")
def calib_dir(tmp_path_factory) -> Path:
    """A folder of calibration text for the tiny model (its own corpus, repeated)."""
    d = tmp_path_factory.mktemp("calib")
    (d / "a.py").write_text("\n".join(CORPUS) * 8)
    (d / "b.py").write_text("\n".join(reversed(CORPUS)) * 8)
    return d


@pytest.fixture(scope="session")
def tiny_config() -> dict:
    """The tiny model's config.json dict (a copy)."""
    return dict(TINY_CONFIG)


@pytest.fixture(scope="session")
def make_tiny_folder():
    """write_tiny_folder(folder, config=None) -> folder."""
    return write_tiny_folder
