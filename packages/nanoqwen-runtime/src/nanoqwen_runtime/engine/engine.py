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
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from nanoqwen_model import Qwen2Config

from ..events import TokenEvent, nonfinite_logits_message
from ..kv_cache import BlockAllocator
from ..sampling import StopMatcher
from .config import EngineConfig
from .loader import LoadStats, load
from .metadata import build_step_inputs
from .model import ModelRunner, Workspace
from .scheduler import BlockManager, FinishReason, Request, Scheduler, SeqStatus, Sequence, StepPlan
from .weights import ModelWeights

GRAPH_RESERVE_BYTES = 1 << 30  # graph memory pool + CUDA context growth headroom


@dataclass
class FinishEvent:
    request_id: str
    reason: FinishReason
    detail: str = ""                 # refusal or error reason (one line)
    text: str = ""                   # held-back text flushed at the end
    num_prompt_tokens: int = 0
    num_generated: int = 0
    num_preemptions: int = 0
    ttft_s: float = 0.0              # submit -> first token
    decode_tok_s: float = 0.0        # generated tokens after the first / time after the first
    tokens: list[int] = field(default_factory=list)


Event = TokenEvent | FinishEvent


@dataclass
class _Stream:
    seq: Sequence
    decoder: object | None
    stop: StopMatcher
    t_submit: float
    t_first: float = 0.0


class Engine:
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
        self.blocks = BlockManager(BlockAllocator(self.num_blocks), self.num_blocks, bs)
        self.scheduler = Scheduler(self.blocks, max_batch=config.max_batch, max_model_len=self.max_model_len,
                                   prefill_chunk=config.prefill_chunk, admit_watermark=config.admit_watermark)
        self.runner = ModelRunner(geom, weights, config, self.ops, self.num_blocks, self.max_pages)
        self._streams: dict[int, _Stream] = {}
        self._ids = 0
        self.num_steps = {"prefill": 0, "decode": 0}
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
    def from_file(cls, path: str | Path, config: EngineConfig | None = None, *,
                  progress: Callable[[int, int], None] | None = None) -> Engine:
        config = config or EngineConfig()
        loaded = load(path, config.device, verify=config.verify, progress=progress)
        tokenizer = None
        tok_json = loaded.metadata.get("tokenizer")
        if tok_json:
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

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, request: Request) -> FinishEvent | None:
        """Queue a request; returns a refusal event (and queues nothing) if it can never run."""
        if request.request_id is None:
            request.request_id = f"req-{self._ids}"
        self._ids += 1
        why = self.scheduler.refusal_reason(request)
        if why is None and not all(0 <= t < self.geom.vocab_size for t in request.prompt_tokens):
            why = f"prompt has token ids outside 0..{self.geom.vocab_size - 1}"
        if why is None and request.params.stop and self.tokenizer is None:
            why = "stop strings need a tokenizer; this model has none"
        if why is not None:
            return FinishEvent(request.request_id, FinishReason.REFUSED, detail=why,
                               num_prompt_tokens=len(request.prompt_tokens))
        seq = self.scheduler.add(request)
        dec = None
        if request.detokenize and self.tokenizer is not None:
            dec = self.tokenizer.stream_decoder(skip_special_tokens=True)
        self._streams[seq.seq_id] = _Stream(seq, dec, StopMatcher(request.params.stop), time.perf_counter())
        return None

    def abort(self, request_id: str) -> FinishEvent | None:
        for st in list(self._streams.values()):
            if st.seq.request.request_id == request_id:
                return self._finish(st, FinishReason.ABORTED)
        return None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Run one engine step (a prefill chunk or one decode token for the batch); its events."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        out = self._run(plan)
        if self.record_logits:
            lg = self.runner.logits(len(plan.seqs))
            for row, (s, smp) in enumerate(zip(plan.seqs, plan.sample, strict=True)):
                if smp:
                    self.last_logits[s.request.request_id] = lg[row].clone()
        sampled: dict[int, int] = {}
        events: list[Event] = []
        for s, t, ok, smp in zip(plan.seqs, out.tokens, out.finite, plan.sample, strict=True):
            if not smp:
                continue  # mid-prefill chunk: no token, and its logits are not looked at
            if ok:
                sampled[s.seq_id] = int(t)
            else:  # finished before commit: the scheduler appends no token to it
                events.append(self._finish(self._streams[s.seq_id], FinishReason.ERROR,
                                           nonfinite_logits_message(s.num_generated)))
        for seq in self.scheduler.commit(plan, sampled):
            events.extend(self._on_token(self._streams[seq.seq_id]))
        return events

    def _run(self, plan: StepPlan):
        pad_to = None
        if plan.kind == "decode" and self.config.mode == "graph":
            pad_to = self.config.bucket_for(len(plan.seqs))
        inputs = build_step_inputs(plan, block_size=self.config.block_size, max_pages=self.max_pages,
                                   padding_block=self.blocks.padding_block, pad_to=pad_to)
        self.num_steps[plan.kind] += 1
        return self.runner.run(inputs)

    def _on_token(self, st: _Stream) -> list[Event]:
        seq = st.seq
        tok = seq.tokens[-1]
        idx = seq.num_generated - 1
        if idx == 0:
            st.t_first = time.perf_counter()
        rid = seq.request.request_id
        eos = seq.request.eos_ids if seq.request.eos_ids is not None else self.geom.eos_token_id
        if tok in eos and not seq.request.ignore_eos:
            return [TokenEvent(rid, tok, idx, "", FinishReason.EOS.value), self._finish(st, FinishReason.EOS)]
        text = st.decoder.push(tok) if st.decoder is not None else ""
        shown, stopped = st.stop.push(text)
        reason = None
        if stopped:
            reason = FinishReason.STOP
        elif seq.num_generated >= seq.request.params.max_tokens:
            reason = FinishReason.LENGTH
        elif len(seq.tokens) >= self.max_model_len:
            reason = FinishReason.CONTEXT
        if reason is None:
            return [TokenEvent(rid, tok, idx, shown)]
        return [TokenEvent(rid, tok, idx, shown, reason.value), self._finish(st, reason)]

    def _finish(self, st: _Stream, reason: FinishReason, detail: str = "") -> FinishEvent:
        seq = st.seq
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(seq, reason)
        del self._streams[seq.seq_id]
        tail = ""
        if reason is not FinishReason.STOP:
            if st.decoder is not None:
                tail, _ = st.stop.push(st.decoder.flush())
            tail += st.stop.flush()
        now = time.perf_counter()
        n = seq.num_generated
        dec = (n - 1) / (now - st.t_first) if n > 1 and now > st.t_first else 0.0
        return FinishEvent(seq.request.request_id, reason, detail, text=tail,
                           num_prompt_tokens=seq.num_prompt,
                           num_generated=n, num_preemptions=seq.num_preemptions,
                           ttft_s=(st.t_first - st.t_submit) if st.t_first else 0.0, decode_tok_s=dec,
                           tokens=seq.tokens[seq.num_prompt:])

    def generate(self, requests: Iterable[Request]) -> Iterator[Event]:
        """Submit `requests` and run until every request (also ones submitted meanwhile) is done."""
        for r in requests:
            ev = self.submit(r)
            if ev is not None:
                yield ev
        while self.scheduler.has_work:
            yield from self.step()

    # ---- introspection ---------------------------------------------------------------------------
    def kv_blocks_used(self) -> int:
        return self.blocks.num_used

    def check_accounting(self) -> None:
        self.blocks.check(self.scheduler.live())

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
            workspace_bytes=_storage_bytes(ws) + self.runner.buffers.nbytes,
            graph_pool_bytes=self._graph_memory[0], graph_device_bytes=self._graph_memory[1],
            allocated_bytes=torch.cuda.memory_allocated(self.device) if cuda else 0,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else 0,
            reserved_bytes=torch.cuda.memory_reserved(self.device) if cuda else 0)


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
    kv_pool_bytes: the paged KV pool. workspace_bytes: the step's activation buffers and the static
      step-input buffers (not the op backend's own plans and split-K scratch).
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
    would count against the capture (seen on the H200: -1.66 GB after earlier engines in one process)."""
    if device.type != "cuda":
        return 0, 0
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device), torch.cuda.mem_get_info(device)[0]
