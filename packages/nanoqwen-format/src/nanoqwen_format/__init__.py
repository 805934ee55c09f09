"""The .nanoqwen container: byte-exact spec, zero-copy mmap reader, streaming writer."""

__version__ = "0.1.0"
