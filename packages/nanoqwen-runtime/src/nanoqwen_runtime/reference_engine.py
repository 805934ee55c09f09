"""The reference engine: continuous batching over the plain-torch `ReferenceModel`, with the CUDA
`Engine`'s request API, so that whatever drives an engine (the HTTP server, tests) runs on a CPU too.

    engine = ReferenceEngine.from_file("model.nanoqwen", ReferenceEngineConfig(kv_memory_bytes=256 << 20))
    engine.submit(Request(prompt_ids, SamplingParams(max_tokens=16)))   # any time, also between steps
    while engine.has_work:
        for ev in engine.step(): ...          # events.TokenEvent per token, then one FinishEvent

Same surface as `engine.Engine`, from the same base class (`engine_base.EngineBase`): `submit(Request)
-> FinishEvent | None` (a refusal), `step()`, `abort(request_id)`, `has_work`, `generate()`,
`kv_blocks_used()`, `check_accounting()`, `stats()`.
Same scheduling, because it is the same code: the engine's `Scheduler` (FIFO admission, prefill steps
alternating with decode steps, preemption of the youngest sequence when pages run out) and
`BlockManager` (exact page accounting) over a KV pool of `kv_memory_bytes` (so "KV blocks back to
zero" is observable). Same stop rules and text, also the same code: `request_stream.RequestStream`
(EOS ids, stop strings through `StopMatcher`, `max_tokens`, context limit, `StreamDecoder` text).

What differs from the CUDA engine: each step is one `ReferenceModel.forward` (fp32 matmuls and fp32 KV
pages by default: the exactness oracle), and each request samples with its own CPU `Sampler` seeded
from its seed (the scheduler draws one when the request gave None), so a seeded request repeats
exactly. A request whose logits hold NaN/Inf ends with `FinishEvent(reason=ERROR)` and no token.
Logprobs (logprobs.py) are the log-softmax of the same f32 logits the sampler reads; a prefill step in
which a sequence wants its prompt's logprobs computes the logits at every position.
A request with a grammar (`Request.grammar`) has its row's logits masked by its matcher's bitmask
(token_mask.py) before its sampler runs, as the CUDA engine does on the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from os import PathLike
from typing import TYPE_CHECKING

import torch

from .engine.blocks import cache_reuse_error
from .engine.metadata import plan_rows, sampled_rows
from .engine.scheduler import BlockManager, FinishReason, Scheduler, SeqStatus, StepPlan
from .engine_base import EngineBase
from .events import nonfinite_logits_message
from .kv_cache import KVCacheSpec, PagedKVCache, StepMetadata
from .logprobs import PromptLogprobs, row_logprobs, unpack
from .reference import ReferenceModel
from .request_stream import Event, FinishEvent, RequestStream
from .sampling import Sampler
from .speculative import SpeculationConfig
from .token_mask import apply_token_bitmask_, full_bitmask

if TYPE_CHECKING:
    from nanoqwen_format import NanoqwenFile

__all__ = ["ReferenceEngine", "ReferenceEngineConfig"]


@dataclass(frozen=True)
class ReferenceEngineConfig:
    """Knobs of the reference engine (the CLI maps `serve --device cpu` flags onto these).

    kv_memory_bytes: the page pool's size. 256 MiB holds ~10.9k tokens of the 0.5B in fp32 pages
      (24 layers x 2 x 2 KV heads x 64 x 4 B = 24 KiB a token), ample for tests on a CPU.
    kv_dtype: fp32 by default, as `ReferenceBackend` (exact match with HF in fp32).
    max_batch: running sequences at most (a CPU step costs about linearly in it).
    max_model_len: context limit per sequence; None = the model's max_position_embeddings.
    admit_watermark: fraction of the pool kept free when admitting while others run (as the engine).
    prefix_caching: keep full KV blocks after a request ends and start a new request after the
      longest cached prefix of its prompt (engine/blocks.py), as the CUDA engine.
    speculation: prompt-lookup speculation for greedy requests that leave `Request.speculation` None
      (speculation is off for temperature > 0); None = off unless a request asks.
    cache_reuse: shifted reuse of cached K/V for runs of at least this many tokens (0: off), as the
      CUDA engine's `EngineConfig.cache_reuse`.
    """

    kv_memory_bytes: int = 256 << 20
    block_size: int = 16
    max_batch: int = 32
    prefill_chunk: int = 512
    max_model_len: int | None = None
    kv_dtype: torch.dtype = torch.float32
    admit_watermark: float = 0.01
    prefix_caching: bool = True
    speculation: SpeculationConfig | None = None
    cache_reuse: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_memory_bytes", "block_size", "max_batch", "prefill_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ReferenceEngineConfig.{name} must be a positive int, got {v!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        why = cache_reuse_error(self.cache_reuse, self.prefix_caching)
        if why:
            raise ValueError(f"ReferenceEngineConfig.{why}")
        if self.speculation is not None and not isinstance(self.speculation, SpeculationConfig):
            raise ValueError(f"ReferenceEngineConfig.speculation must be a SpeculationConfig or None, "
                             f"got {self.speculation!r}")


class ReferenceEngine(EngineBase):
    """Continuous batching on `ReferenceModel` (see the module header); requests, stop rules and
    statistics: `EngineBase`. Not thread-safe: one owner."""

    def __init__(self, model: ReferenceModel, config: ReferenceEngineConfig | None = None, *, tokenizer=None):
        self.config = config = config or ReferenceEngineConfig()
        self.model = model
        self.geom = model.config
        self.tokenizer = tokenizer
        self.device = model.device
        limit = self.geom.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        spec = KVCacheSpec(self.geom.num_hidden_layers, self.geom.num_key_value_heads, self.geom.head_dim,
                           num_blocks=1, block_size=config.block_size, dtype=config.kv_dtype)
        n = config.kv_memory_bytes // spec.bytes_per_block
        if n < 2:
            raise ValueError(f"a KV budget of {config.kv_memory_bytes} bytes holds {n} blocks of "
                             f"{spec.bytes_per_block} bytes; need >= 2")
        self.num_blocks = int(n)
        self.cache = PagedKVCache(KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                              num_blocks=self.num_blocks, block_size=config.block_size,
                                              dtype=config.kv_dtype), device=self.device)
        self.blocks = BlockManager(self.cache.allocator, self.num_blocks, config.block_size,
                                   prefix_caching=config.prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_batch=config.max_batch, max_model_len=self.max_model_len,
                                   prefill_chunk=config.prefill_chunk, admit_watermark=config.admit_watermark,
                                   speculation=config.speculation, cache_reuse=config.cache_reuse)
        EngineBase.__init__(self)
        self._samplers: dict[int, Sampler] = {}  # seq_id -> its CPU sampler (made at its first token)
        self.num_steps = {"prefill": 0, "decode": 0}
        self.num_masked_rows = 0  # sampled rows a grammar's bitmask constrained
        dt = str(model.dtype).removeprefix("torch.")
        self.name = (f"reference engine (plain torch) on {self.device}, {dt} matmuls, "
                     f"{self.blocks.usable_blocks} KV blocks of {config.block_size} tokens")

    @classmethod
    def from_file(cls, path: str | PathLike | NanoqwenFile, config: ReferenceEngineConfig | None = None, *,
                  device: str = "cpu", dtype: torch.dtype = torch.float32, verify: bool = True
                  ) -> ReferenceEngine:
        """Load a container's weights (checked unless `verify=False`) and tokenizer, from one open
        (`path`: a path or an open `NanoqwenFile`, container.py)."""
        from .backend_types import resolve_device
        from .container import opened
        from .tokenizer import Tokenizer

        with opened(path) as f:
            model = ReferenceModel.from_file(f, device=resolve_device(device), dtype=dtype, verify=verify)
            tok_json = f.tokenizer_json
        return cls(model, config, tokenizer=Tokenizer.from_json(tok_json) if tok_json else None)

    # ---- stepping ---------------------------------------------------------------------------------
    def step(self, side_work: Callable[[], None] | None = None) -> list[Event]:
        """Run one step (prefill chunks, or a decode step: one token per decoding sequence, or for a
        sequence carrying drafts one greedy token after each of its verify rows); its events.
        `side_work()` runs before the forward pass (host-bound on the CPU; EngineBase.step)."""
        plan = self.scheduler.schedule()
        self._apply_kv_shifts(self.cache.pool)
        if plan is None:
            return []
        self.num_steps[plan.kind] += 1
        tokens, meta, rows = self._step_inputs(plan)
        if side_work is not None:
            side_work()
        prompt_lp = self._prompt_logprob_seqs(plan)
        if prompt_lp:  # every position's logits: some sequence wants its prompt's logprobs
            all_logits = self.model.forward(tokens, meta, self.cache, all_logits=True)  # f32 [T, vocab]
            starts = [0, *itertools.accumulate(meta.query_lens_host)]
            logits = all_logits[[e - 1 for e in starts[1:]]]
            for i in prompt_lp:
                self._collect_prompt_logprobs(plan, i, all_logits, starts[rows[i][0]])
        else:
            logits = self.model.forward(tokens, meta, self.cache)  # f32 [rows, vocab]
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        keep = sampled_rows(plan)  # each sequence's rows whose tokens count (a skipping chunk: its last)
        constrained = [(keep[i][-1], s) for i, (s, smp) in enumerate(zip(plan.seqs, plan.sample, strict=True))
                       if smp and s.matcher is not None and s.status is SeqStatus.RUNNING]
        if constrained:  # grammar rows: -inf where the bitmask forbids (other rows: all ones)
            masks = full_bitmask(logits.shape[0], logits.shape[1])
            self.num_masked_rows += self._fill_token_masks(constrained, masks)
            with torch.inference_mode():  # the forward's logits are inference tensors
                apply_token_bitmask_(logits, masks)
        sampled: dict[int, int | list[int]] = {}
        token_lp: dict[int, list] = {}
        events: list[Event] = []
        for i, (s, smp) in enumerate(zip(plan.seqs, plan.sample, strict=True)):
            if not smp or s.status is not SeqStatus.RUNNING:
                continue  # mid-prefill chunk: no token
            if all(finite[r] for r in keep[i]):
                # verify rows: the request is greedy (drafters exist only for temperature 0), so its
                # sampler is an argmax and draws nothing
                sampler = self._samplers.get(s.seq_id)
                if sampler is None:
                    sampler = self._samplers[s.seq_id] = Sampler(s.request.params.with_(seed=s.seed))
                toks = [sampler(logits[r]) for r in keep[i]]
                sampled[s.seq_id] = toks if plan.drafts and plan.drafts[i] else toks[0]
                k = s.request.logprobs
                if k is not None:  # verify rows: row j's logits chose token j of those committed
                    token_lp[s.seq_id] = unpack(row_logprobs(logits[keep[i]], torch.tensor(toks), k,
                                                             self.geom.vocab_size), k)
            else:  # finished before commit: the scheduler appends no token to it
                events.append(self._error(s, nonfinite_logits_message(s.num_generated)))
        for seq in self.scheduler.commit(plan, sampled):
            lps = token_lp.get(seq.seq_id)
            prompt = None
            if lps is not None and seq.request.prompt_logprobs and seq.num_generated == seq.num_new_tokens:
                prompt = self._prompt_lp.pop(seq.seq_id).result() if seq.num_prompt > 1 else (None,)
            events.extend(self._emit(seq, lps, prompt))
        return events

    def _prompt_logprob_seqs(self, plan: StepPlan) -> list[int]:
        """The plan indices of prefill chunks whose positions give prompt logprobs."""
        if plan.kind != "prefill":
            return []
        return [i for i, s in enumerate(plan.seqs)
                if s.request.prompt_logprobs and s.num_generated == 0 and s.num_prompt > 1
                and plan.start_pos[i] < s.num_prompt - 1]

    def _collect_prompt_logprobs(self, plan: StepPlan, i: int, all_logits: torch.Tensor, flat: int) -> None:
        """Prompt logprobs of sequence i's chunk, whose first token is row `flat` of `all_logits`."""
        s, start, q = plan.seqs[i], plan.start_pos[i], plan.query_lens[i]
        acc = self._prompt_lp.get(s.seq_id)
        if acc is None:
            acc = self._prompt_lp[s.seq_id] = PromptLogprobs(s.num_prompt, s.request.logprobs)
        m = acc.rows_in_chunk(start, q)
        targets = torch.tensor(s.tokens[start + 1:start + 1 + m])
        acc.add(start, row_logprobs(all_logits[flat:flat + m], targets, acc.k, self.geom.vocab_size))

    def _step_inputs(self, plan: StepPlan) -> tuple[torch.Tensor, StepMetadata, dict[int, list[int]]]:
        """Token ids int64 [T], the step metadata (kv_cache.py diagram) from the scheduler's pages, and
        each sequence's rows of the logits. A verify step (drafts) is one row per verified token, as
        in the CUDA engine (`engine.metadata.plan_rows`)."""
        bs = self.config.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        ctx: list[int] = []
        qlens: list[int] = []
        rows: dict[int, list[int]] = {}
        feeds = [plan.step_tokens(i) for i in range(len(plan.seqs))]
        for r, (i, start, q) in enumerate(plan_rows(plan)):
            s, first = plan.seqs[i], plan.start_pos[i]
            tokens.extend(feeds[i][start - first:start - first + q])
            positions.extend(range(start, start + q))
            slots.extend(s.blocks[p // bs] * bs + p % bs for p in range(start, start + q))
            ctx.append(start + q)
            qlens.append(q)
            rows.setdefault(i, []).append(r)
        max_pages = max(len(s.blocks) for s in plan.seqs)
        table = torch.zeros((len(qlens), max_pages), dtype=torch.int32)
        for i, rs in rows.items():
            for r in rs:
                table[r, : len(plan.seqs[i].blocks)] = torch.tensor(plan.seqs[i].blocks, dtype=torch.int32)
        dev = self.device
        meta = StepMetadata(page_table=table.to(dev),
                            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
                            query_lens=torch.tensor(qlens, dtype=torch.int32, device=dev),
                            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
                            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                            context_lens_host=ctx, query_lens_host=qlens)
        return torch.tensor(tokens, dtype=torch.int64), meta, rows

    def _finish(self, st: RequestStream, reason: FinishReason, detail: str = "") -> FinishEvent:
        self._samplers.pop(st.seq.seq_id, None)
        return super()._finish(st, reason, detail)
