"""The nanoqwen-cli command: generate, chat, bench, inspect, verify."""

__version__ = "0.1.0"
