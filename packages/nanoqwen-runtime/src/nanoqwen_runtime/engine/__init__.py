"""The CUDA engine (nanoqwen-runtime 0.2): paged KV cache, continuous batching, CUDA-graph decode.

    from nanoqwen_runtime.engine import Engine, EngineConfig, Request
    engine = Engine.from_file(path, EngineConfig())
    for event in engine.generate([Request(prompt_ids, SamplingParams(max_tokens=64))]): ...

Modules: config (dataclasses), scheduler (continuous batching, block accounting, preemption),
metadata (step inputs + static device buffers), loader (.nanoqwen -> device), weights (typed views),
model (the step, graph capture), ops_torch / ops_kernels (op backends), engine (the API),
synthetic (random weights with real geometry).
"""

from .config import GRAPH_BUCKETS, QWEN25_05B, QWEN25_7B, EngineConfig, ModelGeometry, parse_bytes
from .engine import Engine, Event, FinishEvent, TokenEvent
from .scheduler import FinishReason, Request

__all__ = ["Engine", "EngineConfig", "ModelGeometry", "Request", "Event", "TokenEvent", "FinishEvent",
           "FinishReason", "GRAPH_BUCKETS", "QWEN25_7B", "QWEN25_05B", "parse_bytes"]
