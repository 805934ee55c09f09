"""The CUDA engine (nanoqwen-runtime 0.2): paged KV cache, continuous batching, CUDA-graph decode.

    from nanoqwen_runtime.engine import Engine, EngineConfig, Request
    engine = Engine.from_file(path, EngineConfig())
    for event in engine.generate([Request(prompt_ids, SamplingParams(max_tokens=64))]): ...

The model's shape is `nanoqwen_model.Qwen2Config` (read from the container); its synthetic stand-ins
are `nanoqwen_model.QWEN25_CODER_7B` / `QWEN25_CODER_05B`.

Modules: config (EngineConfig), sequence (Request, Sequence, FinishReason), scheduler (continuous
batching, preemption, verify steps), blocks (block accounting, prefix cache),
metadata (step inputs + static device buffers), loader (.nanoqwen -> device), weights (typed views),
model (the step, graph capture), ops_torch / ops_kernels (op backends), engine (the API),
synthetic (random weights with real geometry).
"""

from ..events import TokenEvent
from .config import GRAPH_BUCKETS, EngineConfig, parse_bytes
from .engine import Engine, Event, FinishEvent
from .scheduler import FinishReason, Request

__all__ = ["Engine", "EngineConfig", "Request", "Event", "TokenEvent", "FinishEvent", "FinishReason",
           "GRAPH_BUCKETS", "parse_bytes"]
