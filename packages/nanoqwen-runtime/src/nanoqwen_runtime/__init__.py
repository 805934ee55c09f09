"""nanoqwen runtime: tokenizer, chat template, reference and CUDA engines, paged KV cache, sampling."""

__version__ = "0.1.0"
