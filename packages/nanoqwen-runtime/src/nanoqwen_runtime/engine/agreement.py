"""Engine-versus-reference agreement: teacher-forced decoding and the bound the engine is held to.

The GPU tests (and anyone checking a build) compare the CUDA engine with the plain-torch reference
runtime, the fp32 oracle. Three pieces:

- `reference_decode(model, prompts, steps)`: the reference, all prompts as one batch, prefill then
  `steps` greedy decode steps of one token each; its tokens and fp32 logits at every position.
- `teacher_forced(engine, prompts, forced, batch)`: the engine run on the same prompts, `batch`
  requests at a time, each decode step one token per request, with the token fed to the next step
  *forced* to the reference's (the engine's own choice is kept beside it). Every position of the
  engine is then compared with the reference at the same context, and greedy agreement up to the
  first near-tie is read off the engine's own choices: while they equal the forced tokens, the forced
  run is the free-running run.
- `noise_bound(...)`: the logit bound, derived rather than fitted. The engine rounds activations to
  bf16 at fixed points (each op's output, the residual stream, the K/V pages, the logits). Its torch
  backend (`ops_torch.TorchOps`) rounds at exactly the same points with plain torch math, so its
  distance from the fp32 reference, measured at the same position, is the rounding noise of that
  design. The kernels differ from it only in fp32 summation order inside each op, which changes which
  bf16 roundings fall on which side: another sample of the same noise. Two samples of one noise
  distribution: the kernels' distance from the reference is within twice the torch backend's
  (the maximum over 150K logits concentrates, so one sample is not far from the other), plus one bf16
  ulp at the logit's magnitude (the logits themselves are bf16). A near-tie is a reference top-2 gap
  below twice that bound: only there can two implementations within the bound pick different tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..events import TokenEvent
from ..kv_cache import KVCacheSpec, PagedKVCache, build_step_metadata
from ..reference import ReferenceModel
from ..sampling import SamplingParams
from .engine import Engine
from .scheduler import FinishReason, Request

__all__ = ["ReferenceDecode", "ForcedRun", "reference_decode", "teacher_forced", "bf16_ulp",
           "noise_bound", "greedy_agreement"]


@dataclass
class ReferenceDecode:
    tokens: list[list[int]]            # per prompt: the greedy tokens, `steps` of them
    logits: list[torch.Tensor]         # per prompt: f32 [steps, V], logits that chose each token

    def gap(self, p: int) -> torch.Tensor:
        """f32 [steps]: top-1 minus top-2 logit at each position of prompt p."""
        top2 = torch.topk(self.logits[p], 2, dim=-1).values
        return top2[:, 0] - top2[:, 1]


@torch.inference_mode()
def reference_decode(model: ReferenceModel, prompts: Sequence[Sequence[int]], steps: int,
                     block_size: int = 16) -> ReferenceDecode:
    """Greedy-decode `steps` tokens for every prompt, all prompts in one batch (fp32 K/V pages)."""
    c = model.config
    longest = max(len(p) for p in prompts) + steps
    blocks = len(prompts) * -(-longest // block_size)
    spec = KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_blocks=blocks,
                       block_size=block_size, dtype=torch.float32)
    cache = PagedKVCache(spec, model.device)
    seqs = [cache.new_sequence() for _ in prompts]
    feed = [list(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for _ in range(steps):
        meta = build_step_metadata(seqs, [len(f) for f in feed], model.device)
        lg = model.forward(torch.tensor([t for f in feed for t in f]), meta, cache)
        for i in range(len(prompts)):
            tokens[i].append(int(torch.argmax(lg[i])))
            logits[i].append(lg[i].float())
        feed = [[t[-1]] for t in tokens]
    return ReferenceDecode(tokens, [torch.stack(x) for x in logits])


@dataclass
class ForcedRun:
    chosen: list[list[int]] = field(default_factory=list)          # the engine's own greedy choices
    logits: list[torch.Tensor] = field(default_factory=list)       # f32 [steps, V] per prompt
    decode_steps: int = 0                                          # engine steps of kind "decode"


def teacher_forced(engine: Engine, prompts: Sequence[Sequence[int]], forced: Sequence[Sequence[int]],
                   batch: int) -> ForcedRun:
    """Run every prompt through the engine, `batch` at a time, feeding `forced[p]` as its generated
    tokens (greedy, EOS ignored, len(forced[p]) tokens each). See the module header."""
    steps = len(forced[0])
    chosen: dict[str, list[int]] = {}
    rows: dict[str, list[torch.Tensor]] = {}
    run_step = engine._run
    decode_before = engine.num_steps["decode"]

    def forced_step(plan, side_work=None):
        step = run_step(plan, side_work)
        tokens = np.array(step.tokens, copy=True)
        for row, (seq, samples) in enumerate(zip(plan.seqs, plan.sample, strict=True)):
            if samples:
                rid = seq.request.request_id
                chosen[rid].append(int(step.tokens[row]))
                tokens[row] = forced[int(rid)][seq.num_generated]
        return replace(step, tokens=tokens)

    engine._run = forced_step
    engine.record_logits = True
    try:
        for start in range(0, len(prompts), batch):
            group = range(start, min(len(prompts), start + batch))
            # speculation=False, whatever the engine's default: forced_step reads one row per request
            # (`step.tokens[row]` with row = plan index) and forces one token per step; a verify step
            # has 1 + len(draft) rows per request, and accepting drafts would skip forced positions
            reqs = [Request(list(prompts[p]), SamplingParams(max_tokens=steps), str(p), ignore_eos=True,
                            speculation=False)
                    for p in group]
            for p in group:
                chosen[str(p)], rows[str(p)] = [], []
            for ev in engine.generate(reqs):
                if isinstance(ev, TokenEvent):
                    rows[ev.request].append(engine.last_logits[ev.request].float())
                elif ev.reason is not FinishReason.LENGTH:
                    raise RuntimeError(f"request {ev.request_id} ended with {ev.reason}: {ev.detail}")
    finally:
        del engine._run
        engine.record_logits = False
    return ForcedRun([chosen[str(p)] for p in range(len(prompts))],
                     [torch.stack(rows[str(p)]) for p in range(len(prompts))],
                     engine.num_steps["decode"] - decode_before)


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 numbers at magnitude |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2**-126))) - 7)


def noise_bound(reference: torch.Tensor, twin: torch.Tensor) -> torch.Tensor:
    """f32 [steps]: per position, 2 x max|twin - reference| + one bf16 ulp at the largest |logit|.

    reference, twin: f32 [steps, V] (twin: the engine's torch backend, same rounding points)."""
    floor = torch.tensor([bf16_ulp(float(r.abs().max())) for r in reference], device=reference.device)
    return 2 * (twin - reference).abs().amax(dim=-1) + floor


def tie_free_prefix(ref: ReferenceDecode, p: int, near_tie: torch.Tensor, n: int) -> int:
    """How many of prompt p's first `n` reference tokens come before the first position j whose
    reference top-2 gap is below `near_tie[j]`: the tokens that any engine within the bound must choose
    exactly, knowable before the engine runs."""
    gaps = ref.gap(p).cpu()
    limit = near_tie.cpu()
    return next((j for j in range(n) if gaps[j] < limit[j]), n)


def greedy_agreement(chosen: Sequence[int], ref: ReferenceDecode, p: int,
                     near_tie: torch.Tensor) -> tuple[int, int]:
    """(tokens compared, tokens expected): the engine's choices must equal the reference's tokens at
    every position before the first one whose reference top-2 gap is below `near_tie[j]`; expected is
    that position (or all of them: `tie_free_prefix`). Returns at the first disagreement, so compared <
    expected then."""
    expected = tie_free_prefix(ref, p, near_tie, len(chosen))
    for j in range(expected):
        if chosen[j] != ref.tokens[p][j]:
            return j, expected
    return expected, expected
