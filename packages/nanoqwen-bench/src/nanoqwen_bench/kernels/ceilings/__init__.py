"""The decode-ceiling measurements of `decode_ceilings`: `ceilings_micro` (GPU microkernels of
ceilings.cu) and `ceilings_report` (pure-Python parsers and tables)."""
