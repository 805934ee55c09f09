"""`PackOptions`: what `nanoqwen-quant pack` is asked to do (the recipe, the device, the calibration
text, the checkpoint folder), and the progress callback every stage of a pack reports to.

Read by the GPTQ layer loop (`gptq_layers.py`), the container writer (`io.py`) and `pack.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .gptq import GPTQConfig
from .rtn import GROUP_SIZES

__all__ = ["LINEARS", "LM_HEAD_CHOICES", "METHODS", "PackOptions", "Progress", "no_progress"]

LINEARS = ("qkv", "o_proj", "gate_up", "down")  # the fused linears of a layer that get quantized
LM_HEAD_CHOICES = ("bf16", "int8", "int4")
METHODS = ("none", "rtn", "gptq")

Progress = Callable[[str, int, int], None]  # (stage description, done, total)


def no_progress(stage: str, done: int, total: int) -> None:
    """The default `Progress`: reports nowhere."""


@dataclass
class PackOptions:
    """The recipe. `calib_tokens` is rounded down to whole `calib_seq_len` windows."""

    method: str = "rtn"
    group_size: int = 128
    symmetric: bool = True
    lm_head: str = "bf16"
    device: str = "auto"  # "auto": CUDA when present, else CPU
    calib_paths: list[str] | None = None
    calib_tokens: int = 65536
    calib_seq_len: int = 2048
    calib_batch: int = 4  # sequences per forward chunk (bounds activation memory)
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    checkpoint_dir: str | None = None  # default: OUT + ".ckpt"
    resume: bool = False

    def validate(self) -> None:
        """Raise ValueError on an unknown choice; copies group size and symmetry into `gptq`."""
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.lm_head not in LM_HEAD_CHOICES:
            raise ValueError(f"lm_head must be one of {LM_HEAD_CHOICES}, got {self.lm_head!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.calib_batch < 1:
            raise ValueError(f"calib_batch must be >= 1, got {self.calib_batch}")
        self.gptq.group_size = self.group_size
        self.gptq.symmetric = self.symmetric

    def resolved_device(self) -> torch.device:
        """The device to quantize on: "auto" is CUDA when torch sees one, else the CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but torch sees no CUDA device")
        return dev
