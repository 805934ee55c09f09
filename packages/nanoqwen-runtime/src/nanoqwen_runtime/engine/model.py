"""The engine's model step: one forward pass of the Qwen2 decoder over the paged KV pool, built from an
op backend (`ops_torch.TorchOps`, or `ops_kernels.KernelOps` over nanoqwen_kernels), on static
buffers, with CUDA-graph capture of decode steps per batch bucket.

Per layer, the step computes (the ops and what the kernel backend launches for them at decode, M <= 8
rows; ops_kernels.py says what runs above that):

    qkv_projection  RMSNorm(residual) (input norm) -> qkv GEMV (+ bias) -> RoPE + paged K/V write:
                    one GEMV with the norm as its prologue and RoPE / K/V as its epilogue (layer 0:
                    a plain RMSNorm of the embeddings first)
    attention       paged decode attention; where the plan splits the context, the o_proj GEMV merges
                    the split rows (else the combine kernel, a launch of its own)
    linear_residual o_proj GEMV, its output added into the residual by the GEMV's epilogue (and the
                    attention's split rows merged while it stages them)
    linear          RMSNorm(residual) (post-attention norm) -> gate_up GEMV: one GEMV, norm prologue
    mlp_down        SiLU * mul -> down GEMV -> added into the residual: one GEMV

plus, per step: embedding gather, final norm, row gather, lm_head GEMV, the logits' range per row,
sampling. The residual stream and the norms between the linears travel as `residual.ResidualUpdate`
and `residual.NormedInput` values, so a backend can fuse them or not (the torch backend launches
each op on its own). nanoqwen-bench's `bench_profile.profile_decode_ops` counts and times the launches
of a step.

The logits' range (`ops.logits_range`: one min/max reduction over the step's B x V bf16 logits, 0.3 MB
at batch 1 for V = 152064) is written to static buffers beside the sampled tokens; `run()` reads
tokens and ranges back in one copy, the synchronisation every step already has. A row whose minimum or
maximum is not finite (NaN propagates through min/max; +-Inf is an extreme) had non-finite logits: the
engine ends its request with an error instead of emitting its token (`StepOutput.finite`).

A step has two parts: the forward to the logits and their range (`_forward`), then the token mask and
sampling (`_sample`). A decode step is captured as two graphs (`StepGraph`: its body per bucket and
context class, its tail per bucket), queued by `queue_forward` and `queue_sample`; the engine queues
them back to back, or, for a step planned ahead with constrained rows, puts the host's mask work
between them (engine.py).

All activations live in workspace tensors sized for the largest step (`prefill_chunk` tokens or
`max_batch` rows), so a step allocates nothing and a captured graph always reads and writes the same
addresses. The workspace memory is counted before the KV pool is sized.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from nanoqwen_model import Qwen2Config

from ..logprobs import MAX_TOP_LOGPROBS, row_logprobs
from ..token_mask import apply_token_bitmask_, bit_values, full_bitmask
from .config import EngineConfig
from .logprob_step import StepLogprobs
from .metadata import DeviceStepBuffers, StepInputs
from .residual import NO_UPDATE, NormedInput
from .weights import ModelWeights

PROMPT_LOGPROB_ROWS = 64  # prompt positions per lm_head call for prompt logprobs (bf16 [64, V]: 19 MB)


@dataclass
class Workspace:
    resid: torch.Tensor   # bf16 [T, H] residual stream
    normed: torch.Tensor  # bf16 [T, H]
    qkv: torch.Tensor     # bf16 [T, qkv_dim]
    q: torch.Tensor       # bf16 [T, Hq, D]
    attn: torch.Tensor    # bf16 [T, Hq*D]
    proj: torch.Tensor    # bf16 [T, H] (o_proj / down outputs)
    gate_up: torch.Tensor  # bf16 [T, 2I]
    act: torch.Tensor     # bf16 [T, I]
    last: torch.Tensor    # bf16 [R, H] normed hidden state of the sampled rows
    # uint8 [8R]: what a step reads back, in one copy: the sampled tokens (int32 [R]), then each row's
    # smallest and largest logit (bf16 [R] each); the three fields below are views of it
    step_out: torch.Tensor
    tokens: torch.Tensor      # int32 [R]
    logit_min: torch.Tensor   # bf16 [R]
    logit_max: torch.Tensor   # bf16 [R]
    logits: torch.Tensor  # bf16 [R, Vp] (the GPU sampler reads bf16; the reference rounds to bf16 too);
    # Vp = V rounded up to 8 (the sampler reads 16-byte rows); columns V.. are -inf
    logits_unpadded: torch.Tensor | None  # bf16 [R, V] lm_head output when V % 8 != 0, else None

    @classmethod
    def allocate(cls, g: Qwen2Config, max_tokens: int, max_rows: int, device) -> Workspace:
        def e(*shape, dtype=torch.bfloat16):
            return torch.zeros(*shape, dtype=dtype, device=device)

        T, R = max_tokens, max_rows
        vp = -(-g.vocab_size // 8) * 8
        logits = e(R, vp)
        logits[:, g.vocab_size:] = float("-inf")
        out = e(8 * R, dtype=torch.uint8)
        return cls(e(T, g.hidden_size), e(T, g.hidden_size), e(T, g.qkv_dim),
                   e(T, g.num_attention_heads, g.head_dim), e(T, g.q_dim), e(T, g.hidden_size),
                   e(T, 2 * g.intermediate_size), e(T, g.intermediate_size), e(R, g.hidden_size),
                   out, out[:4 * R].view(torch.int32), out[4 * R:6 * R].view(torch.bfloat16),
                   out[6 * R:].view(torch.bfloat16), logits,
                   e(R, g.vocab_size) if vp != g.vocab_size else None)

    @staticmethod
    def nbytes(g: Qwen2Config, max_tokens: int, max_rows: int) -> int:
        per_tok = 2 * (3 * g.hidden_size + g.qkv_dim + 2 * g.q_dim + 3 * g.intermediate_size)
        return max_tokens * per_tok + max_rows * (2 * g.hidden_size + 2 * g.vocab_size + 8)


@dataclass
class StepOutput:
    """What one step gives back for its real rows: sampled tokens (int32 [n]) and whether each row's
    logits were all finite (bool [n]); a row that was not is not to be emitted. When the step computed
    logprobs (`logprobs.StepLogprobs`): `logprobs` f32 [len(rows), 1 + 2k] (`logprobs.row_logprobs`
    layout) of its `rows`, and `prompt_logprobs` [(plan index, first position, f32 [m, 1 + 2k])]."""

    tokens: np.ndarray
    finite: np.ndarray
    logprobs: np.ndarray | None = None
    prompt_logprobs: list | None = None


@dataclass
class LaunchedStep:
    """A step queued on the device (`ModelRunner.launch`), with the copy of its output (`Workspace.
    step_out`) into a host buffer queued behind it; `result()` waits for that copy alone."""

    num_real: int
    host_out: torch.Tensor  # uint8 [8R], pinned on CUDA: tokens int32 [R], then logit min / max bf16 [R]
    done: torch.cuda.Event | None  # recorded after the copy (None on the CPU: the copy has happened)
    host_logprobs: torch.Tensor | None = None  # f32 [n, 1 + 2k] view of a pinned buffer (copy queued)
    prompt_logprobs: list | None = None  # [(plan index, first position, f32 [m, 1 + 2k] on the host)]

    def result(self) -> StepOutput:
        """Sampled tokens and finite-logits flags of rows 0..num_real-1 (waits for the step)."""
        if self.done is not None:
            self.done.synchronize()
        n, R = self.num_real, self.host_out.shape[0] // 8
        ranges = self.host_out[4 * R:].view(torch.bfloat16).view(2, R)[:, :n]
        lp = self.host_logprobs.numpy().copy() if self.host_logprobs is not None else None
        return StepOutput(self.host_out[:4 * R].view(torch.int32)[:n].numpy().copy(),
                          torch.isfinite(ranges).all(0).numpy(), lp, self.prompt_logprobs)


class ModelRunner:
    """Runs steps: `run(inputs) -> StepOutput` (sampled tokens and finite-logits flags of the real rows)."""

    def __init__(self, geom: Qwen2Config, weights: ModelWeights, cfg: EngineConfig, ops,
                 num_blocks: int, max_pages: int):
        self.g, self.w, self.cfg, self.ops = geom, weights, cfg, ops
        self.device = torch.device(cfg.device)
        self.max_tokens = max(cfg.prefill_chunk, cfg.max_batch, max(cfg.graph_buckets))
        self.max_rows = max(cfg.max_batch, max(cfg.graph_buckets))
        self.max_pages = max_pages
        self.num_blocks = num_blocks
        # KV pool, DESIGN.md layout [L, 2, num_blocks, Hkv, block_size, D]; zeroed so that a padded
        # row reading the padding block never meets NaN bit patterns.
        self.kv = torch.zeros(geom.num_hidden_layers, 2, num_blocks, geom.num_key_value_heads,
                              cfg.block_size, geom.head_dim, dtype=torch.bfloat16, device=self.device)
        self.ws = Workspace.allocate(geom, self.max_tokens, self.max_rows, self.device)
        self.buffers = DeviceStepBuffers(max_tokens=self.max_tokens, max_rows=self.max_rows,
                                         max_pages=max_pages, device=self.device)
        # two host buffers for the steps' outputs, used in turn (one step may be in flight while the
        # one before it is read back), each with the event recorded after its copy
        cuda = self.device.type == "cuda"
        self._out_host = [torch.empty(self.ws.step_out.shape, dtype=torch.uint8, pin_memory=cuda)
                          for _ in range(2)]
        self._out_done = [torch.cuda.Event() if cuda else None for _ in range(2)]
        # and for the logprobs of the rows that asked (a step without any computes none)
        self._lp_host = [torch.empty(self.max_rows * (1 + 2 * MAX_TOP_LOGPROBS), dtype=torch.float32,
                                     pin_memory=cuda) for _ in range(2)]
        self._out_turn = 0
        # constrained decoding: the step's token bitmask (token_mask.py), all ones outside the rows
        # of a step that carries masks; one pinned host mirror (a step's masks are written after the
        # step before it is read back, and so its upload has completed)
        self.token_bitmask = full_bitmask(self.max_rows, geom.vocab_size, self.device)
        self._mask_host = full_bitmask(self.max_rows, geom.vocab_size, pin_memory=cuda)
        self._mask_bits = bit_values(self.device)
        self._mask_dirty = 0  # rows of `token_bitmask` the last masked step wrote (to reset to ones)
        self.context_classes = cfg.context_classes(max_pages * cfg.block_size)
        self.graphs: dict[tuple[int, int], StepGraph] = {}  # (bucket, context class)
        # which code paths each graph runs (the op backend's `paths` counted during its capture), and
        # how often each was replayed: tests assert the path that ran instead of assuming it
        self.graph_paths: dict[tuple[int, int], collections.Counter[str]] = {}
        self.replays: collections.Counter[tuple[int, int]] = collections.Counter()
        self._graph_pool = None
        if hasattr(ops, "check_weights"):
            ops.check_weights(weights)
        if hasattr(ops, "setup"):
            ops.setup(max_context_len=max_pages * cfg.block_size, max_rows=self.max_rows,
                      max_tokens=self.max_tokens, buckets=cfg.graph_buckets, step_buffers=self.buffers,
                      context_classes=self.context_classes)

    # ---- the forward pass ------------------------------------------------------------------------
    def _forward(self, v: dict[str, torch.Tensor], T: int, B: int, kind: str, max_ctx: int) -> None:
        """The step up to its logits (bf16 [B, Vp] in `Workspace.logits`) and their range per row."""
        g, w, ops, ws = self.g, self.w, self.ops, self.ws
        eps = g.rms_norm_eps
        resid, normed = ws.resid[:T], ws.normed[:T]
        qkv, q, attn, proj = ws.qkv[:T], ws.q[:T], ws.attn[:T], ws.proj[:T]
        gu, act = ws.gate_up[:T], ws.act[:T]
        ops.embed(v["input_ids"], w.embed_tokens, resid)
        attn_meta = None
        if hasattr(ops, "attention_plan"):
            attn_meta = ops.attention_plan(kind=kind, query_start=v["query_start"],
                                           context_lens=v["context_lens"], page_table=v["page_table"],
                                           num_rows=B, num_tokens=T, max_context_len=max_ctx)
        update = NO_UPDATE  # the residual stream holds the embeddings
        for i, lw in enumerate(w.layers):
            kc, vc = self.kv[i, 0], self.kv[i, 1]
            x = NormedInput(resid, update, lw.input_norm, eps, normed)
            ops.qkv_projection(x, lw.qkv, lw.qkv_bias, qkv, v["positions"], v["slot_mapping"], kc, vc, q,
                               g.num_attention_heads, g.num_key_value_heads)
            merge = None  # split rows left for the o projection to merge
            if attn_meta is not None:
                merge = ops.attention_run(attn_meta, q, kc, vc, attn, o_proj=lw.o_proj)
            else:
                ops.attention(q, kc, vc, v["query_start"], v["context_lens"], v["page_table"], attn, B)
            update = ops.linear_residual(attn, lw.o_proj, proj, resid, merge=merge)
            ops.linear(NormedInput(resid, update, lw.post_attn_norm, eps, normed), lw.gate_up, gu)
            update = ops.mlp_down(gu, act, lw.down, proj, resid)
        ops.norm(NormedInput(resid, update, w.final_norm, eps, normed))
        if kind == "decode":
            last = normed  # one token per row: every row is sampled
        else:
            last = ws.last[:B]
            torch.index_select(normed, 0, v["sample_rows"].long(), out=last)
        if ws.logits_unpadded is None:
            ops.linear(last, w.lm_head, ws.logits[:B])
        else:
            ops.linear(last, w.lm_head, ws.logits_unpadded[:B])
            ws.logits[:B, : g.vocab_size].copy_(ws.logits_unpadded[:B])
        ops.logits_range(ws.logits[:B, : g.vocab_size], ws.logit_min[:B], ws.logit_max[:B])

    def _sample(self, v: dict[str, torch.Tensor], B: int) -> None:
        """The step's tail: the token bitmask over the logits `_forward` left (after their range: a
        masked -inf is not a non-finite logit), then sampling into `Workspace.tokens`."""
        ws, V = self.ws, self.g.vocab_size
        if self.cfg.token_mask:
            apply_token_bitmask_(ws.logits[:B, :V], self.token_bitmask[:B], self._mask_bits)
        self.ops.sample(ws.logits[:B], v["temperature"], v["top_p"], v["top_k"], v["seed"], v["offset"],
                        ws.tokens[:B])

    # ---- steps -----------------------------------------------------------------------------------
    def run(self, inputs: StepInputs, side_work: Callable[[], None] | None = None,
            logprobs: StepLogprobs | None = None) -> StepOutput:
        """Run one step; returns the sampled tokens and finite-logits flags of the real rows (and the
        logprobs `logprobs` asks for: `queue_sample`)."""
        return self.launch(inputs, side_work, logprobs).result()

    def launch(self, inputs: StepInputs, side_work: Callable[[], None] | None = None,
               logprobs: StepLogprobs | None = None) -> LaunchedStep:
        """Queue one step whole, with the token bitmask its inputs carry; `LaunchedStep.result()` reads
        it back."""
        return self.queue_sample(self.queue_forward(inputs, side_work), inputs.token_bitmask, logprobs)

    @torch.inference_mode()
    def queue_forward(self, inputs: StepInputs, side_work: Callable[[], None] | None = None
                      ) -> QueuedForward:
        """Queue a step up to its logits (a captured decode graph's body, or the eager forward); the
        caller then queues its tail with `queue_sample`, before any other step. In between, the host
        may compute the step's token masks: the engine does so for a step planned ahead with
        constrained rows, whose masks depend on the token still being read back.
        A step planned ahead (`inputs.feed_rows`) first copies its rows' token ids from the sampled
        tokens the previous step left in `Workspace.tokens` (on the device, in stream order: that step
        has not finished when this one is queued).
        `side_work()`, when given, runs once: right after a captured graph is launched (the host then
        only waits for the device until the read-back), or before an eager forward (prefill chunks,
        uncaptured decode), whose launches are host-bound: a caller's work there would delay them
        all, and its output (the server's previous tokens) would wait for the whole forward."""
        views = self.buffers.load(inputs)
        if inputs.feed_rows is not None:
            n = len(inputs.feed_rows)
            torch.index_select(self.ws.tokens, 0, views["feed_rows"], out=views["input_ids"][:n])
        B, T = inputs.num_rows, inputs.num_tokens
        cls = self.context_class(inputs.max_context_len)
        graph = self.graphs.get((B, cls)) if inputs.kind == "decode" else None
        if graph is not None:
            graph.body.replay()
            self.replays[(B, cls)] += 1
            if side_work is not None:
                side_work()
        else:
            if side_work is not None:
                side_work()
            self._forward(views, T, B, inputs.kind, cls)
        return QueuedForward(inputs.num_real, B, views, graph)

    @torch.inference_mode()
    def queue_sample(self, step: QueuedForward, token_bitmask: np.ndarray | None = None,
                     logprobs: StepLogprobs | None = None) -> LaunchedStep:
        """Queue the tail of the step `queue_forward` queued last: upload its token bitmask rows
        (int32 [real rows, W] numpy, or None: all ones), sample, and copy the output to the host.
        `logprobs` (built only when a row asked): after sampling (outside the captured graphs, on the
        same stream), the log-softmax of the step's logits at the rows that asked and its top-k
        (`_logprobs`), copied to the host beside the tokens; a prefill chunk's prompt logprobs too."""
        self._load_token_bitmask(token_bitmask)
        if step.graph is not None:
            step.graph.tail.replay()
        else:
            self._sample(step.views, step.num_rows)
        # tokens and logit ranges in one device-to-host copy; this buffer's previous step (two
        # launches ago) has been read back, as the engine keeps at most one step in flight beyond it
        turn = self._out_turn
        self._out_turn ^= 1
        host_lp = prompt_lp = None
        if logprobs is not None:
            host_lp, prompt_lp = self._logprobs(logprobs, turn)
        host, done = self._out_host[turn], self._out_done[turn]
        host.copy_(self.ws.step_out, non_blocking=True)
        if done is not None:
            done.record()
        return LaunchedStep(step.num_real, host, done, host_lp, prompt_lp)

    def _logprobs(self, lp: StepLogprobs, turn: int) -> tuple[torch.Tensor | None, list]:
        """Queue the logprobs of the rows `lp.rows` of the step just queued (its logits and sampled
        tokens are in the workspace) and their copy into this turn's pinned buffer; compute a prefill
        chunk's prompt logprobs (lm_head over the final norm's output at each position, in slices of
        PROMPT_LOGPROB_ROWS rows; read back at once: prefill steps are synchronous)."""
        V, ws = self.g.vocab_size, self.ws
        host = None
        if lp.rows:
            n = len(lp.rows)
            if lp.rows == list(range(n)):
                logits, tokens = ws.logits[:n], ws.tokens[:n]
            else:
                idx = torch.tensor(lp.rows, dtype=torch.long).to(self.device, non_blocking=True)
                logits, tokens = ws.logits.index_select(0, idx), ws.tokens.index_select(0, idx)
            packed = row_logprobs(logits, tokens, lp.k, V)
            host = self._lp_host[turn][:packed.numel()].view(packed.shape)
            host.copy_(packed, non_blocking=True)
        prompt = []
        for i, flat, m, start, targets in lp.prompt:
            parts = []
            for a in range(0, m, PROMPT_LOGPROB_ROWS):
                b = min(m, a + PROMPT_LOGPROB_ROWS)
                out = torch.empty(b - a, V, dtype=torch.bfloat16, device=self.device)
                self.ops.linear(ws.normed[flat + a:flat + b], self.w.lm_head, out)
                parts.append(row_logprobs(out, torch.tensor(targets[a:b]), lp.k, V))
            prompt.append((i, start, torch.cat(parts).cpu()))
        return host, prompt

    def context_class(self, max_context_len: int) -> int:
        """The smallest context class holding `max_context_len` (the attention plan it runs with)."""
        for c in self.context_classes:
            if c >= max_context_len:
                return c
        raise ValueError(f"context {max_context_len} exceeds the engine's {self.context_classes[-1]}")

    def _load_token_bitmask(self, masks) -> None:
        """Upload a step's bitmask rows (int32 [n, W] numpy), or put the rows the last masked step
        wrote back to all ones (stream-ordered after that step); nothing when neither is needed."""
        if masks is not None:
            if not self.cfg.token_mask:
                raise AssertionError("a step carries token masks but the engine has token_mask=False")
            n = masks.shape[0]
            self._mask_host[:n].numpy()[:] = masks
            if self._mask_dirty > n:
                self.token_bitmask[n:self._mask_dirty].fill_(-1)
            self.token_bitmask[:n].copy_(self._mask_host[:n], non_blocking=True)
            self._mask_dirty = n
        elif self._mask_dirty:
            self.token_bitmask[:self._mask_dirty].fill_(-1)
            self._mask_dirty = 0

    def logits(self, num_rows: int) -> torch.Tensor:
        """bf16 [num_rows, V] logits of the last step (tests compare them with the reference)."""
        return self.ws.logits[:num_rows, : self.g.vocab_size]

    @torch.inference_mode()
    def capture_graphs(self, padding_block: int) -> None:
        """Capture the decode step per (bucket, context class) as a `StepGraph`: its body per class,
        its tail once per bucket (the kernels must be loaded: `ops.warm_up()`)."""
        if not getattr(self.ops, "graph_capturable", False):
            raise RuntimeError(f"op backend {self.ops.name!r} cannot be captured; use mode='eager'")
        for bucket in sorted(self.cfg.graph_buckets, reverse=True):
            tail = tail_paths = None
            for cls in self.context_classes:
                inputs = padding_inputs(bucket, self.max_pages, padding_block, self.cfg.block_size)
                views = self.buffers.load(inputs)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._forward(views, bucket, bucket, "decode", cls)
                        self._sample(views, bucket)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                body, body_paths = self._capture(functools.partial(self._forward, views, bucket, bucket,
                                                                   "decode", cls))
                if tail is None:
                    tail, tail_paths = self._capture(functools.partial(self._sample, views, bucket))
                self.graphs[(bucket, cls)] = StepGraph(body, tail)
                self.graph_paths[(bucket, cls)] = body_paths + tail_paths
        torch.cuda.synchronize(self.device)

    def _capture(self, fn: Callable[[], None]) -> tuple[torch.cuda.CUDAGraph, collections.Counter[str]]:
        """A CUDA graph of `fn` in the runner's graph memory pool, and the op paths its capture ran."""
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        before = collections.Counter(self.ops.paths)
        with torch.cuda.graph(graph, pool=self._graph_pool):
            fn()
        return graph, collections.Counter(self.ops.paths) - before


@dataclass
class StepGraph:
    """A captured decode step: `body`, the forward to the logits and their range; `tail`, the token
    mask and sampling (one per bucket, shared by its context classes). Split so that a step planned
    ahead can take its token masks after its forward is queued; `replay()` runs the whole step."""

    body: torch.cuda.CUDAGraph
    tail: torch.cuda.CUDAGraph

    def replay(self) -> None:
        self.body.replay()
        self.tail.replay()


@dataclass
class QueuedForward:
    """A step whose forward is queued and whose tail is not yet (`ModelRunner.queue_forward`)."""

    num_real: int
    num_rows: int
    views: dict[str, torch.Tensor]  # the step-input buffers its tail reads
    graph: StepGraph | None  # the captured step it replays, or None (eager)


def padding_inputs(rows: int, max_pages: int, padding_block: int, block_size: int) -> StepInputs:
    """A decode step of `rows` padding rows (graph capture and warm-up)."""
    z32 = np.zeros(rows, np.int32)
    return StepInputs(
        kind="decode", input_ids=z32.copy(), positions=z32.copy(),
        slot_mapping=np.full(rows, padding_block * block_size, np.int32),
        query_start=np.arange(rows + 1, dtype=np.int32), context_lens=np.ones(rows, np.int32),
        page_table=np.full((rows, max_pages), padding_block, np.int32),
        sample_rows=np.arange(rows, dtype=np.int32), temperature=np.zeros(rows, np.float32),
        top_p=np.ones(rows, np.float32), top_k=z32.copy(), seed=np.zeros(rows, np.int64),
        offset=np.zeros(rows, np.int64), num_real=0, max_query_len=1, max_context_len=1)
