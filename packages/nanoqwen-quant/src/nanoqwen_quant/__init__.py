"""Import Qwen2 checkpoints and quantize them to INT4 (RTN, GPTQ) into .nanoqwen files."""

__version__ = "0.1.0"
