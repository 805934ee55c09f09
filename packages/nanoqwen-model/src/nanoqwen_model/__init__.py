"""nanoqwen-model: the one Qwen2 description (`Qwen2Config`) and plain-torch forward of nanoqwen, the
INT4/INT8 codec in torch and the sampling reference. Depends on torch only."""

from .config import (
    QWEN25_CODER_05B,
    QWEN25_CODER_7B,
    QWEN25_CODER_15B,
    QWEN25_CODER_GEOMETRIES,
    ConfigError,
    Qwen2Config,
    UnsupportedModelError,
)

__all__ = ["Qwen2Config", "ConfigError", "UnsupportedModelError", "QWEN25_CODER_7B", "QWEN25_CODER_15B",
           "QWEN25_CODER_05B", "QWEN25_CODER_GEOMETRIES"]
__version__ = "0.1.0"
