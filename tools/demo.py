"""The nanoqwen demo (`nox -s demo`): pack the real Qwen2.5-Coder-0.5B to INT4, then write code with it.

    python tools/demo.py GGUF_PATH [--out PATH] [--method rtn|gptq] [--prompt TEXT] [--max-tokens N]
                         [--dtype float32|bfloat16] [--threads N] [--compare-dtypes]

1. Packs GGUF_PATH with `nanoqwen-quant pack` into the model cache (`$NANOQWEN_CACHE/models`, default
   ~/.cache/nanoqwen/models; `nanoqwen-cli list` shows it), or to --out. An existing pack is used as
   it is (the packer writes atomically, so an existing file is complete). The default is RTN: GPTQ
   with a small calibration set is measured in packages/nanoqwen-runtime/README.md and takes longer
   than "a few minutes" on 2 CPU cores.
2. Runs `nanoqwen-cli generate CONTAINER --chat --prompt ... --temperature 0` on the CPU reference
   backend: the answer streams to the terminal, then the statistics line (prompt tokens, generated
   tokens, TTFT, decode tok/s).
3. Checks the answer's Python code block parses (`ast.parse`) and names the defined functions.
4. Ends with where the packed model is, the command that runs it again, and the speed it reached.
With --compare-dtypes it first times decoding with float32 and bfloat16 matmuls and reports both.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

DEFAULT_PROMPT = ("Write a Python function `is_prime(n: int) -> bool` that returns True when n is a prime "
                  "number. Include a docstring.")


def pack(gguf: Path, out: Path | None, method: str) -> Path:
    """The packed container: `out`, or the model cache's file for GGUF_PATH and `method` (the name
    `nanoqwen-cli generate GGUF_PATH` looks up), packing it first when it is not there."""
    from nanoqwen_quant.model_cache import parse_model
    from nanoqwen_quant.model_fetch import recipe_label
    from nanoqwen_quant.options import PackOptions

    # GPTQ with a small calibration set: 16 windows of 512 tokens
    calib = {"calib_tokens": 8192, "calib_seq_len": 512} if method == "gptq" else {}
    recipe = recipe_label(PackOptions(method=method, **calib))
    target = out if out is not None else parse_model(str(gguf)).cache_path(recipe)
    if target.exists():
        print(f"[demo] using the packed model {target} ({target.stat().st_size / 1e6:.0f} MB)", flush=True)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "nanoqwen_quant.cli", "pack", str(gguf), "-o", str(target), "--method",
           method, "--device", "cpu"]
    for key, value in calib.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    print(f"[demo] packing: nanoqwen-quant {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"[demo] packed in {time.perf_counter() - t0:.0f} s -> {target} "
          f"({target.stat().st_size / 1e6:.0f} MB)", flush=True)
    return target


STATS = re.compile(r"decode ([0-9.]+) tok/s")


def _threads_args(threads: int | None) -> list[str]:
    return [] if threads is None else ["--threads", str(threads)]


def generate(container: Path, prompt: str, max_tokens: int, dtype: str, threads: int | None
             ) -> tuple[str, str]:
    """Run `nanoqwen-cli generate` as a user would: its text streams through and its stderr (backend and
    statistics lines) is passed on as it comes. Returns the generated text and the statistics line."""
    cmd = [sys.executable, "-m", "nanoqwen_cli.main", "generate", str(container), "--chat",
           "--prompt", prompt, "--temperature", "0", "--max-tokens", str(max_tokens), "--device", "cpu",
           "--dtype", dtype, *_threads_args(threads)]
    print(f"[demo] nanoqwen-cli generate {container.name} --chat --prompt {prompt!r} --temperature 0 "
          f"--max-tokens {max_tokens} --device cpu --dtype {dtype} {' '.join(_threads_args(threads))}\n",
          flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err_lines: list[str] = []

    def pass_stderr() -> None:
        for raw in proc.stderr:
            line = raw.decode("utf-8", errors="replace")
            err_lines.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    relay = threading.Thread(target=pass_stderr, daemon=True)
    relay.start()
    chunks = []
    while data := os.read(proc.stdout.fileno(), 4096):
        chunks.append(data)
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    code = proc.wait()
    relay.join()
    if code != 0:
        raise SystemExit(f"[demo] nanoqwen-cli generate failed with exit code {code}")
    stats = [line.strip() for line in err_lines if STATS.search(line)]
    if not stats:
        raise SystemExit("[demo] nanoqwen-cli generate printed no statistics line (decode tok/s)")
    return b"".join(chunks).decode("utf-8", errors="replace"), stats[-1]


def check_code(text: str) -> list[str]:
    blocks = re.findall(r"```(?:python|py)?\n(.*?)```", text, flags=re.S)
    if not blocks:
        raise SystemExit("[demo] the answer has no fenced code block")
    tree = ast.parse(blocks[0])
    return [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def compare_dtypes(container: Path, threads: int | None) -> dict[str, float]:
    """Decode tok/s of a 64-token greedy run with float32 and with bfloat16 matmuls."""
    speeds = {}
    for dtype in ("float32", "bfloat16"):
        cmd = [sys.executable, "-m", "nanoqwen_cli.main", "generate", str(container), "--prompt",
               "def quicksort(a):", "--temperature", "0", "--max-tokens", "64", "--dtype", dtype,
               *_threads_args(threads), "--json"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        speeds[dtype] = json.loads(out.stdout)["decode_tok_s"]
        print(f"[demo] {dtype} matmuls: {speeds[dtype]:.2f} decode tok/s", flush=True)
    return speeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--out", type=Path, default=None,
                    help="where to write the packed model (default: the model cache, nanoqwen-cli list)")
    ap.add_argument("--method", choices=["rtn", "gptq"], default="rtn")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: nanoqwen's rule for a shared machine)")
    ap.add_argument("--compare-dtypes", action="store_true")
    args = ap.parse_args()
    if not args.gguf.exists():
        raise SystemExit(f"[demo] {args.gguf} does not exist (run `python tools/testmodel.py`)")
    container = pack(args.gguf, args.out, args.method)
    if args.compare_dtypes:
        compare_dtypes(container, args.threads)
    text, stats = generate(container, args.prompt, args.max_tokens, args.dtype, args.threads)
    names = check_code(text)
    print(f"[demo] the code block parses (ast.parse) and defines: {', '.join(names) or '(no function)'}")
    speed = float(STATS.search(stats).group(1))
    threads = " ".join(_threads_args(args.threads))
    again = f"nanoqwen-cli chat {container}" + (f" {threads}" if threads else "")
    print(f"\n[demo] the packed model: {container} ({container.stat().st_size / 1e6:.0f} MB)\n"
          f"[demo] run it again:     {again}\n"
          f"[demo] speed reached:    {speed:.2f} decode tok/s on the CPU "
          f"({threads or 'threads by the rule'}, {args.dtype} matmuls): {stats}", flush=True)


if __name__ == "__main__":
    main()
