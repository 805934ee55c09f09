"""The engine: `Engine.from_file(path, config)` and `engine.generate(requests)` (streaming events).

    engine = Engine.from_file("model.nanoqwen", EngineConfig(kv_memory_bytes=parse_bytes("24GiB")))
    for ev in engine.generate([Request(tok.encode("def fib"), SamplingParams(max_tokens=64))]):
        if isinstance(ev, TokenEvent): print(ev.text, end="")
        elif isinstance(ev, FinishEvent): print(ev.reason, ev.num_generated, ev.decode_tok_s)

Every generated token is one `events.TokenEvent` (EOS tokens too, with no text), the last one with its
finish reason; then a `FinishEvent` carries the request's statistics. Text is decoded here only for
requests with `detokenize=True` (the default); the `Backend` adapter asks for none, because the
`Pipeline` above it decodes.

Continuous batching: `submit()` may be called at any time, also while iterating `generate()` (a new
request joins at the next step); `step()` runs one engine step and returns its events. Each request
ends on its own terms: EOS (unless `ignore_eos`), a stop string (text from the stop string on is not
emitted), its `max_tokens`, or the context limit. A request that can never run is refused at once
with a `FinishEvent(reason="refused", detail=...)`; the engine never crashes on it. A request whose
logits hold NaN/Inf at a step (corrupt or overflowing weights) ends with
`FinishEvent(reason="error", detail=...)`, and the token sampled from those logits is not emitted.

Sizing: the KV pool gets `kv_memory_bytes`, or `kv_memory_fraction` of the device memory that is free
after weights, workspace and the graph memory pool's reserve (`GRAPH_RESERVE_BYTES`).

Overlapped decode (`EngineConfig.overlap`). A synchronous step queues its work on the device, waits
for its sampled tokens, commits them and emits their events, and only then plans the next step: the
device idles while the host does everything but the waiting. With overlap on, in a run of plain
decode steps the engine plans step n+1 (`Scheduler.plan_ahead`) and queues it BEFORE it reads step n
back; step n+1's rows take their token ids from step n's sampled tokens on the device. So `step()`
queues step n+1 and returns step n's events, and the host's work between steps runs while the
device computes. The tokens are those of the synchronous engine (the same steps with the same
inputs) as long as no sequence ends with a step in flight and no speculating sequence's drafter
finds a match; a step that cannot be planned ahead (prefill, admission, preemption, eviction, drafts
expected) is run synchronously. A drafter with no match in its context as last committed is expected
to have none after the token in flight either: the step goes ahead without drafts, and a match that
token does give is drafted one step later (greedy verification emits the same tokens; the verify steps
fall elsewhere than the synchronous engine's). A sequence that step n's token
ends (EOS, stop string), or that is aborted, computes one row more in step n+1, which is dropped; that
step then has a row more than the synchronous engine's, which can move the other rows' logits in their
last bits (a different graph bucket or kernel path): their tokens are the same up to a near-tie. At
most one step is in flight between `step()` calls; `has_work` stays True until it is read back, unless
all of its sequences have ended (the next `step()` reads it back first).

Constrained decoding (`Request.grammar`, grammar.py). Every step applies a token bitmask to its logits
before sampling (`EngineConfig.token_mask`): `ModelRunner.token_bitmask`, an int32 [rows, ceil(V/32)]
device buffer that the captured decode graphs read, all ones in rows without a grammar, so constrained
and unconstrained rows share a batch and a graph. A step with constrained rows uploads their masks,
computed on the host from each request's matcher as last committed. The mask of step n+1 depends on
token n, so a step planned ahead with constrained rows is queued in two parts (`ModelRunner.
queue_forward` / `queue_sample`, a captured step being two graphs): its forward before step n is read
back, its masks and sampling after step n is committed (`num_steps_ahead_masked` counts such steps).
The device computes step n+1's forward while the host reads step n back and runs the matchers, so a
constrained row costs its neighbours the mask's work, not the overlap. A constrained request is never
speculated (the scheduler gives it no drafter).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from nanoqwen_model import Qwen2Config

from ..engine_base import EngineBase
from ..events import TokenEvent, nonfinite_logits_message
from ..kv_cache import BlockAllocator
from ..logprobs import PromptLogprobs, unpack
from ..request_stream import Event, FinishEvent
from ..token_mask import full_bitmask
from .config import EngineConfig
from .loader import LoadStats, load
from .logprob_step import step_logprobs
from .metadata import build_step_inputs, plan_rows, sampled_rows
from .model import LaunchedStep, ModelRunner, Workspace
from .scheduler import VERIFY_MAX_ROWS, BlockManager, Scheduler, StepPlan
from .sequence import SeqStatus
from .weights import ModelWeights

__all__ = ["Engine", "Event", "FinishEvent", "TokenEvent", "MemoryReport", "GRAPH_RESERVE_BYTES", "make_ops"]

GRAPH_RESERVE_BYTES = 1 << 30  # graph memory pool + CUDA context growth headroom


class Engine(EngineBase):
    """The CUDA engine (module header); requests, stop rules and statistics: `EngineBase`."""

    def __init__(self, geom: Qwen2Config, weights: ModelWeights, config: EngineConfig, *,
                 tokenizer=None, load_stats: LoadStats | None = None, keepalive=None):
        self.geom, self.weights, self.config = geom, weights, config
        self.tokenizer = tokenizer
        self.load_stats = load_stats
        self._keepalive = keepalive  # the device buffer that owns the weight views
        self.device = torch.device(config.device)
        self.ops = make_ops(config, geom)
        self.max_model_len = min(config.max_model_len or geom.max_position_embeddings,
                                 geom.max_position_embeddings)
        bs = config.block_size
        self.max_pages = -(-self.max_model_len // bs)
        self.num_blocks = self._size_pool()
        self.blocks = BlockManager(BlockAllocator(self.num_blocks), self.num_blocks, bs,
                                   prefix_caching=config.prefix_caching)
        # a verify step's rows are a decode batch: in graph mode they must fit a captured bucket
        verify_rows = VERIFY_MAX_ROWS
        if config.mode == "graph":
            verify_rows = min(VERIFY_MAX_ROWS, max(config.graph_buckets))
        self.scheduler = Scheduler(self.blocks, max_batch=config.max_batch, max_model_len=self.max_model_len,
                                   prefill_chunk=config.prefill_chunk, admit_watermark=config.admit_watermark,
                                   speculation=config.speculation, verify_max_rows=verify_rows,
                                   cache_reuse=config.cache_reuse)
        self.runner = ModelRunner(geom, weights, config, self.ops, self.num_blocks, self.max_pages)
        EngineBase.__init__(self)
        self.num_steps = {"prefill": 0, "decode": 0}
        self.num_steps_ahead = 0  # decode steps planned ahead and queued before their predecessor's read-back
        self.num_rows_dropped = 0  # rows of sequences that ended after their step was queued ahead
        self.num_steps_ahead_masked = 0  # steps planned ahead whose masks were taken after their forward
        self.num_masked_rows = 0  # sampled rows a grammar's bitmask constrained
        self.supports_grammar = config.token_mask
        self._in_flight: _InFlight | None = None  # the step queued ahead, not yet read back
        self.last_step_kind: str | None = None  # kind of the step whose events step() last returned
        # Tests and debugging: when True, step() keeps each sampled row's f32 logits (a device copy)
        # in `last_logits[request_id]`. Off by default: it costs a copy per token.
        self.record_logits = False
        self.last_logits: dict[str, torch.Tensor] = {}
        self._graph_memory = (0, 0)  # (torch reserved, device free) bytes graph capture took
        if config.mode == "graph":
            self.ops.warm_up()
            before = _cuda_memory(self.device)
            self.runner.capture_graphs(self.blocks.padding_block)
            after = _cuda_memory(self.device)
            self._graph_memory = (after[0] - before[0], before[1] - after[1])

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path, config: EngineConfig | None = None, *,
                  progress: Callable[[int, int], None] | None = None, tokenizer=None) -> Engine:
        """Load a container (`path`: a path or an open `NanoqwenFile`, container.py). `tokenizer`: the
        container's, when the caller has built it already (else it is built from the metadata)."""
        config = config or EngineConfig()
        loaded = load(path, config.device, verify=config.verify, progress=progress)
        tok_json = loaded.metadata.get("tokenizer")
        if tokenizer is None and tok_json:
            from ..tokenizer import Tokenizer

            tokenizer = Tokenizer.from_json(tok_json)
        return cls(loaded.geometry, loaded.weights, config, tokenizer=tokenizer, load_stats=loaded.stats,
                   keepalive=loaded.buffer)

    def _size_pool(self) -> int:
        cfg, g = self.config, self.geom
        per_block = g.kv_bytes_per_token() * cfg.block_size
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_memory_bytes is not None:
            budget = cfg.kv_memory_bytes
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            ws = Workspace.nbytes(g, max(cfg.prefill_chunk, cfg.max_batch), cfg.max_batch)
            if hasattr(self.ops, "dense_cache_bytes") and cfg.dense_weight_cache:
                ws += self.ops.dense_cache_bytes(self.weights)
            budget = int((free - ws - GRAPH_RESERVE_BYTES) * cfg.kv_memory_fraction)
        else:
            raise ValueError("on the CPU give the KV pool size: EngineConfig.kv_memory_bytes or num_blocks")
        n = budget // per_block
        if n < 2:
            raise ValueError(f"KV budget of {budget} bytes holds {n} blocks of {per_block} bytes; need >= 2")
        # never more than max_batch full-length sequences can use (+ the padding block)
        return int(min(n, cfg.max_batch * self.max_pages + 1))

    # ---- stepping --------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Requests to run, or a step in flight that still has a running sequence. A step left in flight
        with only ended sequences (their rows are dropped) does not count: the next step() reads it
        back first."""
        if self.scheduler.has_work:
            return True
        f = self._in_flight
        return f is not None and any(s.status is SeqStatus.RUNNING for s in f.plan.seqs)

    def step(self, side_work: Callable[[], None] | None = None) -> list[Event]:
        """Run one engine step (a prefill chunk, or a decode step: one token per sequence, or for a
        sequence carrying drafts its verify rows); its events. With overlap (module header) the step
        whose events are returned may have been queued by the previous call, and this call may queue
        the next one before it reads that step back.

        `side_work`, when given, is called once during a step that runs (not at all when there is
        nothing to run), where the caller's own host work costs the step least (ModelRunner.queue_forward):
        right after a captured decode graph is launched, while the host would only wait for the device;
        or before an eager forward, whose host work is the step's pace anyway (the server's engine
        process sends the previous step's tokens there)."""
        cur, self._in_flight = self._in_flight, None
        if cur is None:
            plan = self.scheduler.schedule()
            self._apply_kv_shifts(self.runner.kv)  # before any forward that could write their sources
            if plan is None:
                return []
            ahead = self._plan_ahead(plan)
            if ahead is None:  # synchronous
                return self._complete(plan, self._run(plan, side_work))
            cur = self._launch(plan)
        else:
            ahead = self._plan_ahead(cur.plan)
            if ahead is None and side_work is not None:
                side_work()  # the host would only wait for `cur` now
        queued = None
        if ahead is not None:
            self.num_steps_ahead += 1
            if self._has_constrained_rows(ahead):  # its masks need `cur`'s tokens committed
                queued = self.runner.queue_forward(self._step_inputs(ahead), side_work)
                self.num_steps_ahead_masked += 1
            else:
                self._in_flight = self._launch(ahead, side_work)
        events = self._complete(cur.plan, cur.launched.result())
        if queued is not None:
            masks, lp = self._token_bitmask(ahead), self._step_logprobs(ahead)
            self._in_flight = _InFlight(ahead, self.runner.queue_sample(queued, masks, lp))
        return events

    def _plan_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The next decode step, planned before `plan` is read back (overlap on), or None. Not while
        `record_logits` keeps each step's logits: the next step would overwrite them first."""
        if not self.config.overlap or self.record_logits:
            return None
        return self.scheduler.plan_ahead(plan)

    @staticmethod
    def _has_constrained_rows(plan: StepPlan) -> bool:
        return any(s.matcher is not None for s, smp in zip(plan.seqs, plan.sample, strict=True) if smp)

    def _complete(self, plan: StepPlan, out) -> list[Event]:
        """Commit a step that has been read back (`out`: model.StepOutput) and emit its events."""
        self.last_step_kind = plan.kind
        rows = sampled_rows(plan)  # plan index -> its rows of the step output whose tokens count
        lg = self.runner.logits(len(out.tokens)) if self.record_logits else None
        sampled: dict[int, int | list[int]] = {}
        events: list[Event] = []
        lp_rows = self._collect_logprobs(plan, out)
        for i, (s, smp) in enumerate(zip(plan.seqs, plan.sample, strict=True)):
            if not smp:  # mid-prefill chunk: no token, and its logits are not looked at
                continue
            if s.status is not SeqStatus.RUNNING:
                # a sequence that ended after this step was queued ahead (its token, or an abort)
                self.num_rows_dropped += 1
                continue
            rs = rows[i]
            if all(out.finite[r] for r in rs):
                toks = [int(out.tokens[r]) for r in rs]
                sampled[s.seq_id] = toks if plan.drafts and plan.drafts[i] else toks[0]
            else:  # finished before commit: the scheduler appends no token to it
                events.append(self._error(s, nonfinite_logits_message(s.num_generated)))
        for seq in self.scheduler.commit(plan, sampled):
            if lg is not None:  # the row whose logits chose the last token appended
                i = plan.seqs.index(seq)
                self.last_logits[seq.request.request_id] = lg[rows[i][seq.num_new_tokens - 1]].clone()
            k = seq.request.logprobs
            if k is None:
                events.extend(self._emit(seq))
                continue
            # verify rows: row j's logits chose token j of those committed
            lps = unpack(out.logprobs[[lp_rows[r] for r in rows[plan.seqs.index(seq)]]], k)
            prompt = None
            if seq.request.prompt_logprobs and seq.num_generated == seq.num_new_tokens:
                prompt = self._prompt_lp.pop(seq.seq_id).result() if seq.num_prompt > 1 else (None,)
            events.extend(self._emit(seq, lps, prompt))
        return events

    def _collect_logprobs(self, plan: StepPlan, out) -> dict[int, int]:
        """Take a step's prompt logprobs into their sequences' collectors; the row of `out.logprobs`
        of each step row that computed one (logprobs.py)."""
        for i, start, packed in out.prompt_logprobs or ():
            s = plan.seqs[i]
            acc = self._prompt_lp.get(s.seq_id)
            if acc is None:
                acc = self._prompt_lp[s.seq_id] = PromptLogprobs(s.num_prompt, s.request.logprobs)
            acc.add(start, packed)
        lp = step_logprobs(plan) if out.logprobs is not None else None
        return {r: j for j, r in enumerate(lp.rows)} if lp is not None else {}

    def _run(self, plan: StepPlan, side_work: Callable[[], None] | None = None):
        """Run `plan` now and read it back (model.StepOutput); nothing may be in flight."""
        if self._in_flight is not None:
            raise AssertionError("a step is in flight: read it back (step()) before running another")
        inputs, lp = self._step_inputs(plan), self._step_logprobs(plan)
        if lp is None:  # the plain step, exactly as without logprobs
            return self.runner.run(inputs, side_work)
        return self.runner.run(inputs, side_work, lp)

    def _launch(self, plan: StepPlan, side_work: Callable[[], None] | None = None) -> _InFlight:
        """Queue `plan` (and the copy of its output to the host); read it back with `.launched.result()`."""
        inputs = self._step_inputs(plan)
        return _InFlight(plan, self.runner.launch(inputs, side_work, self._step_logprobs(plan)))

    def _step_logprobs(self, plan: StepPlan):
        """The logprob work of `plan` (logprob_step.py); None at no cost while no live request asked."""
        return step_logprobs(plan) if self.num_logprob_requests else None

    def _step_inputs(self, plan: StepPlan):
        """The step's inputs, with its token masks unless it was planned ahead (`step()` computes
        those after the step before it is committed)."""
        pad_to = None
        if plan.kind == "decode" and self.config.mode == "graph":
            pad_to = self.config.bucket_for(plan.num_tokens)
        self.num_steps[plan.kind] += 1
        inputs = build_step_inputs(plan, block_size=self.config.block_size, max_pages=self.max_pages,
                                   padding_block=self.blocks.padding_block, pad_to=pad_to)
        if not plan.ahead:
            inputs.token_bitmask = self._token_bitmask(plan)
        return inputs

    def _token_bitmask(self, plan: StepPlan):
        """int32 [real rows, W] bitmask of a step with constrained rows (all ones elsewhere), or None.
        A constrained sequence is never speculated, so it has one row; its mask comes from the matcher
        as last committed, which must have taken the row's input token: a step planned ahead is masked
        only after the step before it is committed (`step()`). A sequence that ended meanwhile keeps
        all ones (its row is dropped)."""
        spec = plan_rows(plan)
        rows = {i: rs[-1] for i, rs in sampled_rows(plan).items()}  # plan index -> its (last) row
        constrained = [(i, s) for i, (s, smp) in enumerate(zip(plan.seqs, plan.sample, strict=True))
                       if smp and s.matcher is not None and s.status is SeqStatus.RUNNING]
        if not constrained:
            return None
        for i, s in constrained:
            if plan.end_pos(i) != len(s.tokens):
                raise AssertionError(f"the mask of sequence {s.seq_id} was asked before its input token "
                                     f"was committed ({len(s.tokens)} tokens, row at {plan.start_pos[i]})")
        masks = full_bitmask(len(spec), self.geom.vocab_size)
        self.num_masked_rows += self._fill_token_masks([(rows[i], s) for i, s in constrained], masks)
        return masks.numpy()

    # ---- introspection ---------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Where this engine's device memory goes (`MemoryReport`); the torch counters are read now."""
        w = self.weights
        tensors = [w.embed_tokens, w.final_norm]
        for lin in [w.lm_head] + [x for lw in w.layers for x in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]:
            tensors += [t for t in (getattr(lin, f.name) for f in fields(lin)) if isinstance(t, torch.Tensor)]
        for lw in w.layers:
            tensors += [t for t in (lw.input_norm, lw.post_attn_norm, lw.qkv_bias) if t is not None]
        dense = 0
        if self.config.dense_weight_cache and hasattr(self.ops, "dense_cache_bytes"):
            dense = self.ops.dense_cache_bytes(w)
        ws = [t for t in (getattr(self.runner.ws, f.name) for f in fields(self.runner.ws))
              if isinstance(t, torch.Tensor)]
        cuda = self.device.type == "cuda"
        return MemoryReport(
            container_bytes=_tensor_bytes(tensors), weight_buffer_bytes=_storage_bytes(tensors),
            dense_cache_bytes=dense, kv_pool_bytes=self.runner.kv.numel() * self.runner.kv.element_size(),
            workspace_bytes=(_storage_bytes(ws) + self.runner.buffers.nbytes
                             + getattr(self.ops, "scratch_bytes", 0)),
            graph_pool_bytes=self._graph_memory[0], graph_device_bytes=self._graph_memory[1],
            allocated_bytes=torch.cuda.memory_allocated(self.device) if cuda else 0,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else 0,
            reserved_bytes=torch.cuda.memory_reserved(self.device) if cuda else 0)


@dataclass
class _InFlight:
    """A queued step: its plan and the runner's handle on its output."""

    plan: StepPlan
    launched: LaunchedStep


def make_ops(config: EngineConfig, geom: Qwen2Config):
    """The op backend named by `config.backend` (explicit: no fallback from one to the other)."""
    device = torch.device(config.device)
    if config.backend == "torch":
        if config.mode == "graph":
            raise ValueError("backend='torch' runs eagerly only; use mode='eager'")
        from .ops_torch import TorchOps

        return TorchOps(geom, device=device)
    from .ops_kernels import KernelOps

    return KernelOps(geom, config, device)


@dataclass(frozen=True)
class MemoryReport:
    """Device memory of one engine, in bytes (`Engine.memory_report()`).

    container_bytes: the model's tensors as a container holds them (tied embeddings counted once).
    weight_buffer_bytes: the device memory those tensors occupy (the loader's one buffer, alignment
      padding included; or the separate tensors of weights built in memory).
    dense_cache_bytes: the bf16 copy of every quantized linear (`EngineConfig.dense_weight_cache`).
    kv_pool_bytes: the paged KV pool. workspace_bytes: the step's activation buffers, the static
      step-input buffers and the dequantize scratch of the prefill path (ops_kernels; not the op
      backend's plans and split-K scratch).
    graph_pool_bytes / graph_device_bytes: growth of torch's reserved memory / drop of the device's
      free memory across graph capture (the second adds what the driver keeps for the graphs).
    allocated / peak_allocated / reserved: torch's counters for the device when the report was made
      (process-wide: they include whatever else the process holds).
    """

    container_bytes: int
    weight_buffer_bytes: int
    dense_cache_bytes: int
    kv_pool_bytes: int
    workspace_bytes: int
    graph_pool_bytes: int
    graph_device_bytes: int
    allocated_bytes: int
    peak_allocated_bytes: int
    reserved_bytes: int

    @property
    def weights_gpu_bytes(self) -> int:
        """Device memory holding weights: the weight buffer plus the bf16 dense cache."""
        return self.weight_buffer_bytes + self.dense_cache_bytes


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct tensors (same address and size counted once: a tied lm_head)."""
    seen = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
    return sum(n for _, n in seen)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under the tensors (views of one buffer count it once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _cuda_memory(device: torch.device) -> tuple[int, int]:
    """(torch reserved bytes, device free bytes) of a CUDA device; (0, 0) else. Cached blocks nobody
    holds are released first, as `torch.cuda.graph` does when capture starts: otherwise that release
    would count against the capture (measured: -1.66 GB after earlier engines in one process)."""
    if device.type != "cuda":
        return 0, 0
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device), torch.cuda.mem_get_info(device)[0]
