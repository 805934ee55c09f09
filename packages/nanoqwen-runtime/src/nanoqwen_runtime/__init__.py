"""nanoqwen runtime: tokenizer, chat template, reference and CUDA engines, paged KV cache, sampling.

    from nanoqwen_runtime import Tokenizer, ChatTemplate, Pipeline, SamplingParams
    pipe = Pipeline.load("model.nanoqwen", device="cpu")
    prompt = pipe.chat_prompt([{"role": "user", "content": "Write is_prime(n) in Python"}])
    for event in pipe.stream([prompt], pipe.sampling_params(temperature=0)): print(event.text, end="")

`Tokenizer` and `ChatTemplate` need no torch; the rest is imported on first use.
"""

from .chat import ChatTemplate, ChatTemplateError
from .tokenizer import StreamDecoder, Tokenizer, TokenizerError

__version__ = "0.1.0"

_LAZY = {
    "Pipeline": "generate", "GenerationResult": "generate", "TextEvent": "generate",
    "SamplingParams": "sampling", "SamplingError": "sampling", "Sampler": "sampling",
    "Backend": "backend", "ReferenceBackend": "backend", "BackendError": "backend",
    "ContextLengthError": "backend", "TokenRequest": "backend",
    "ReferenceModel": "reference", "TokenEvent": "events", "ErrorEvent": "events",
    "WeightError": "integrity", "NonFiniteWeightError": "integrity",
    "PagedKVCache": "kv_cache", "KVCacheSpec": "kv_cache", "BlockAllocator": "kv_cache",
}

__all__ = ["Tokenizer", "TokenizerError", "StreamDecoder", "ChatTemplate", "ChatTemplateError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'nanoqwen_runtime' has no attribute {name!r}")
