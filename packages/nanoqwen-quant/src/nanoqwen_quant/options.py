"""`PackOptions`: what `nanoqwen-quant pack` is asked to do (the recipe, the device, the calibration
text, the checkpoint folder), and the progress callback every stage of a pack reports to.

Read by the GPTQ layer loop (`gptq_layers.py`), the container writer (`io.py`) and `pack.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from nanoqwen_model.config import Qwen2Config

from .calib import user_files
from .gptq import GPTQConfig
from .rtn import GROUP_SIZES

__all__ = ["CALIB_TEXTS", "LINEARS", "LM_HEAD_CHOICES", "METHODS", "DeviceError", "PackOptions", "Progress",
           "UsageError", "no_progress", "resolve_device"]

LINEARS = ("qkv", "o_proj", "gate_up", "down")  # the fused linears of a layer that get quantized
LM_HEAD_CHOICES = ("bf16", "int8", "int4")
METHODS = ("none", "rtn", "gptq", "import")  # import: a GPTQ/AWQ checkpoint as it is (checkpoints.py)
CALIB_TEXTS = ("chat", "code")  # the built-in calibration texts (calib.py)

Progress = Callable[[str, int, int], None]  # (stage description, done, total)


class UsageError(ValueError):
    """An option value or a combination of options that cannot work: the command line is wrong (exit 2).
    Messages name the field and its `nanoqwen-quant pack` option."""


class DeviceError(RuntimeError):
    """The device asked for is not there: CUDA without a CUDA device, or `cuda:N` past the last one."""


def no_progress(stage: str, done: int, total: int) -> None:
    """The default `Progress`: reports nowhere."""


def resolve_device(spec: str) -> torch.device:
    """"auto" (CUDA when torch sees one, else the CPU), "cpu", "cuda" or "cuda:N" -> torch.device.

    UsageError for any other string; DeviceError when CUDA is asked for and torch sees none, or N is
    not one of its devices. Called before any source is read."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise UsageError(f"device (--device) must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r} (--device) asked for, but torch {torch.__version__} sees no "
                              "CUDA device; use --device cpu (or auto)")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise DeviceError(f"device {spec!r} (--device) asked for, but torch sees {n} CUDA device(s): "
                              f"cuda:0..cuda:{n - 1}")
    return dev


# Options that only a calibrated pack (GPTQ, or AWQ scaling) reads: field -> its `nanoqwen-quant pack`
# option. Set to anything but the default without calibration, they would be ignored silently: refused.
_CALIBRATED_ONLY = {"calib_paths": "--calib", "calib_text": "--calib-text", "calib_tokens": "--calib-tokens",
                    "calib_seq_len": "--calib-seq-len", "calib_batch": "--calib-batch",
                    "checkpoint_dir": "--checkpoint-dir", "resume": "--resume"}
_GPTQ_CONFIG = {"damp_percent": "--damp", "act_order": "--act-order/--no-act-order", "block_size": "",
                "static_groups": "--static-groups/--dynamic-groups"}


@dataclass
class PackOptions:
    """The recipe. `calib_tokens` is rounded down to whole `calib_seq_len` windows.

    clip: each INT4 group's scale (and zero) chosen by the clip search (clip.py) instead of the full
    range; with clip_act its error is weighted by the calibration activations' E[x^2] (needs
    calibration: method gptq or awq). awq: activation-aware input scaling (awq.py) before quantizing,
    folded into the norms / up rows; needs calibration, so it runs the calibrated layer loop
    (gptq_layers.py) for rtn too."""

    # GPTQ asym g128 calibrated on chat conversations, by the pass rate (the measure the quality goal is
    # stated in; HumanEval on the real 1.5B, 164 problems x 20 samples at temperature 0.2,
    # bench/RESULTS.md): +1.7 points against none (95% CI -1.1..+4.6), where RTN asym g128
    # loses 1.5 (CI -4.8..+1.6) and GPTQ asym calibrated on raw stdlib code loses 4.5 (CI -8.6..-0.4;
    # the chat text gains 6.3 points over it, p = 0.002). It also meets both perplexity proxies
    # (+2.93% on the 1.5B, +2.86% on the 0.5B; RTN asym +4.22% / +4.59%). Cost: the calibrated layer
    # loop, ~1 minute for the 0.5B and ~6 for the 7B on a Hopper GPU, ~2 minutes per 0.5B layer on a
    # 2-core CPU (`pack` prints a notice there); `method="rtn"` is the calibration-free recipe.
    method: str = "gptq"
    group_size: int = 128
    # asymmetric (a zero point per group) by the same table: RTN g128 asym +4.59% on the 0.5B vs sym
    # +9.24% (1.5B: +4.22% vs +6.57%), for 4.19 vs 4.13 bits/weight; GPTQ shares the grid
    symmetric: bool = False
    clip: bool = False
    clip_act: bool = False
    awq: bool = False
    lm_head: str = "bf16"
    device: str = "auto"  # "auto": CUDA when present, else CPU
    calib_paths: list[str] | None = None
    # the built-in calibration text (calib.py): "chat" (None means it: the stdlib's documented functions
    # as conversations in the source's chat template, calib_chat.py) or "code" (the stdlib files as they
    # are, the text before 2026-12-04); `calib_paths` replaces it, so the two are exclusive
    calib_text: str | None = None
    calib_tokens: int = 65536
    calib_seq_len: int = 2048
    calib_batch: int = 4  # sequences per forward chunk (bounds activation memory)
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    checkpoint_dir: str | None = None  # default: OUT + ".ckpt"
    resume: bool = False

    def validate(self) -> None:
        """Check every option and their combinations before any source is read; copy group size and
        symmetry into `gptq`.

        UsageError: an unknown choice, a value out of range, an option the method does not use (GPTQ
        options with rtn/none, a group size or --asym with nothing to quantize). DeviceError: CUDA asked
        for and absent. CalibrationError (a ValueError): a --calib path that does not exist or holds no
        file. Only the checkpoint folder and the output path are left to `pack.check_output_path`."""
        if self.method not in METHODS:
            raise UsageError(f"method (--method) must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.lm_head not in LM_HEAD_CHOICES:
            raise UsageError(f"lm_head (--lm-head) must be one of {', '.join(LM_HEAD_CHOICES)}, "
                             f"got {self.lm_head!r}")
        if self.group_size not in GROUP_SIZES:
            raise UsageError(f"group_size (--group-size) must be one of {', '.join(map(str, GROUP_SIZES))}, "
                             f"got {self.group_size}")
        quantized = self.method != "none" or self.lm_head != "bf16"
        if not quantized and self.group_size != PackOptions.group_size:
            raise UsageError("group_size (--group-size) applies to int4/int8 weights, and method none with "
                             "lm_head bf16 writes none")
        if self.symmetric != PackOptions.symmetric and self.method == "none" and self.lm_head != "int4":
            flag = "True (--sym)" if self.symmetric else "False (--asym)"
            raise UsageError(f"symmetric={flag} applies to int4 weights, and method none with "
                             f"lm_head {self.lm_head} writes none (the int8 lm_head is symmetric only)")
        resolve_device(self.device)
        self._validate_recipe()
        if self.calibrated:
            self._validate_calibration()
        else:
            defaults = PackOptions()
            for f in fields(self):
                if f.name in _CALIBRATED_ONLY and getattr(self, f.name) != getattr(defaults, f.name):
                    raise UsageError(f"{f.name} ({_CALIBRATED_ONLY[f.name]}) applies to method gptq or "
                                     f"--awq only, not {self.method} without --awq")
        if self.method != "gptq":
            gdefaults = GPTQConfig()
            for name, opt in _GPTQ_CONFIG.items():
                if getattr(self.gptq, name) != getattr(gdefaults, name):
                    raise UsageError(f"gptq.{name}{f' ({opt})' if opt else ''} applies to method gptq only, "
                                     f"not {self.method}")
        self.gptq.group_size = self.group_size
        self.gptq.symmetric = self.symmetric
        self.gptq.clip = self.clip
        self.gptq.clip_act = self.clip_act

    @property
    def calibrated(self) -> bool:
        """Whether the pack runs the calibrated layer loop (GPTQ, or AWQ scaling with either method)."""
        return self.method == "gptq" or self.awq

    def recipe_metadata(self) -> dict:
        """The recipe fields beyond method / group size / symmetry, for the container's metadata."""
        return {"clip": self.clip, "clip_act": self.clip_act, "awq": self.awq}

    def _validate_recipe(self) -> None:
        if self.method == "none" and (self.clip or self.awq):
            raise UsageError("clip (--clip) and awq (--awq) apply to int4 linears, and method none writes "
                             "bf16 linears")
        if self.clip_act and not self.clip:
            raise UsageError("clip_act (--clip-act) weights the clip search: it needs clip (--clip)")
        if self.clip_act and not self.calibrated:
            raise UsageError("clip_act (--clip-act) needs calibration activations: method gptq or --awq")

    def _validate_calibration(self) -> None:
        if self.calib_seq_len < 16:
            raise UsageError(f"calib_seq_len (--calib-seq-len) must be >= 16, got {self.calib_seq_len}")
        if self.calib_tokens < self.calib_seq_len:
            raise UsageError(f"calib_tokens (--calib-tokens) must be at least one window of calib_seq_len "
                             f"(--calib-seq-len) = {self.calib_seq_len} tokens, got {self.calib_tokens}")
        if self.calib_batch < 1:
            raise UsageError(f"calib_batch (--calib-batch) must be >= 1, got {self.calib_batch}")
        g = self.gptq
        if not (math.isfinite(g.damp_percent) and g.damp_percent > 0):
            raise UsageError(f"gptq.damp_percent (--damp) must be a number > 0, got {g.damp_percent}")
        if g.block_size < 1:
            raise UsageError(f"gptq.block_size must be >= 1, got {g.block_size}")
        if not g.static_groups and g.act_order:
            raise UsageError("gptq.static_groups=False (--dynamic-groups) needs --no-act-order (with "
                             "act-order, dynamic groups need a g_idx, which the runtime has not)")
        if self.calib_text is not None and self.calib_text not in CALIB_TEXTS:
            raise UsageError(f"calib_text (--calib-text) must be one of {', '.join(CALIB_TEXTS)}, "
                             f"got {self.calib_text!r}")
        if self.calib_paths is not None:
            if not self.calib_paths:
                raise UsageError("calib_paths (--calib) is an empty list; leave it out for the default")
            if self.calib_text is not None:
                raise UsageError("calib_text (--calib-text) picks the built-in calibration text, and "
                                 "calib_paths (--calib) replaces it: give one of them")
            user_files(self.calib_paths)  # CalibrationError when a path is missing or holds no file

    @property
    def chat_calibration(self) -> bool:
        """Whether the calibration text is the chat conversations (the default) rather than files."""
        return self.calib_paths is None and (self.calib_text or "chat") == "chat"

    def check_model(self, config: Qwen2Config) -> None:
        """UsageError when the recipe cannot be applied to this model (read from its config only, before
        any weight): an int4 lm_head needs vocab_size % 8 == 0 (the INT4 tile layout's rows)."""
        if self.lm_head == "int4" and config.vocab_size % 8:
            raise UsageError(f"lm_head int4 (--lm-head) needs vocab_size % 8 == 0, and this model's "
                             f"vocab_size is {config.vocab_size}: use --lm-head int8 or bf16")

    def resolved_device(self) -> torch.device:
        """The device to quantize on (`resolve_device(self.device)`)."""
        return resolve_device(self.device)
