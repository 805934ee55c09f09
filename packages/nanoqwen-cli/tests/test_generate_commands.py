"""`nanoqwen-cli generate` and `chat` on a tiny random container (nanoqwen_runtime.testing)."""

from __future__ import annotations

import json

import pytest
import torch
from nanoqwen_cli.main import app
from nanoqwen_runtime import Pipeline, SamplingParams
from nanoqwen_runtime.testing import write_tiny_container
from typer.testing import CliRunner

runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_container(tmp_path_factory.mktemp("cli") / "tiny.nanoqwen", method="rtn", seed=5)


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def test_generate_streams_text_and_prints_backend_and_stats(model):
    r = invoke("generate", model, "--prompt", "def add(a, b):", "--max-tokens", "8", "--temperature", "0",
               "--threads", "1")
    assert r.exit_code == 0, r.output
    assert "backend: reference (plain torch) on cpu" in r.stderr
    assert "sampling: greedy (temperature 0), max_tokens 8" in r.stderr
    assert "TTFT" in r.stderr and "tok/s" in r.stderr and "prompt tokens" in r.stderr
    pipe = Pipeline.load(model, dtype=torch.float32)
    want = pipe.generate(["def add(a, b):"], SamplingParams(max_tokens=8))[0]
    assert r.stdout == want.text + "\n"
    assert f"[{want.prompt_tokens} prompt tokens, {want.generated_tokens} generated" in r.stderr


def test_generate_json_chat_seeded(model):
    args = ["generate", model, "-p", "hello", "--chat", "--system", "Be brief.", "--json",
            "--temperature", "0.9", "--top-p", "0.9", "--top-k", "40", "--seed", "7", "--max-tokens", "6"]
    a = json.loads(invoke(*args).stdout)
    b = json.loads(invoke(*args).stdout)
    assert a["text"] == b["text"]  # seeded
    assert set(a) >= {"text", "prompt_tokens", "generated_tokens", "ttft_s", "decode_tok_s", "finish_reason",
                      "backend", "sampling"}
    assert a["sampling"] == {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 7, "max_tokens": 6,
                             "stop": []}
    pipe = Pipeline.load(model, dtype=torch.float32)
    chat_prompt = pipe.chat_prompt([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hello"}])
    assert a["prompt_tokens"] == len(pipe.tokenizer.encode(chat_prompt))


def test_stop_string(model):
    full = json.loads(invoke("generate", model, "-p", "x", "--json", "--max-tokens", "20").stdout)["text"]
    assert len(full) > 4
    stop = full[2:4]
    r = json.loads(invoke("generate", model, "-p", "x", "--json", "--max-tokens", "20",
                          "--stop", stop).stdout)
    assert r["text"] == full[: full.find(stop)] and r["finish_reason"] == "stop"


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-2"], "top_k must be an integer >= 0"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["--system", "s"], "--system needs --chat"),
    (["--backend", "magic"], "--backend must be one of"),
    (["--backend", "engine"], "--backend engine runs on a CUDA GPU only"),
    (["--dtype", "int3"], "--dtype must be one of"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--kv-memory", "8GiB"], "--kv-memory and --eager are engine options"),
    (["--eager"], "--kv-memory and --eager are engine options"),
])
def test_bad_options_exit_2_with_a_message(model, args, message):
    r = invoke("generate", model, "-p", "x", *args)
    assert r.exit_code == 2 and message in r.stderr, r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu_is_an_error(model):
    r = invoke("generate", model, "-p", "x", "--device", "cuda")
    assert r.exit_code == 2
    assert "no CUDA GPU is available" in r.stderr
    assert "backend:" not in r.stderr  # nothing ran on the CPU instead


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_engine_options_without_gpu_are_an_error(model):
    # --device cuda picks the engine; its options are accepted, and the missing GPU is still the error
    r = invoke("generate", model, "-p", "x", "--device", "cuda", "--kv-memory", "1GiB", "--eager")
    assert r.exit_code == 2 and "no CUDA GPU is available" in r.stderr
    assert "backend:" not in r.stderr


def test_prompt_longer_than_context_refused(model):
    r = invoke("generate", model, "-p", "word " * 400)
    assert r.exit_code == 2 and "context window is 256 tokens" in r.stderr


def test_chat_repl_multi_turn(model):
    r = invoke("chat", model, "--max-tokens", "4", "--system", "S",
               input="first question\n/reset\nsecond\n/exit\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.count("assistant> ") == 2
    assert "(history cleared)" in r.stderr
    assert r.stderr.count("prompt tokens") == 2
    # the second turn after /reset is a fresh conversation: same prompt size as asking it first
    pipe = Pipeline.load(model, dtype=torch.float32)
    n = len(pipe.tokenizer.encode(pipe.chat_prompt([{"role": "system", "content": "S"},
                                                     {"role": "user", "content": "second"}])))
    assert f"[{n} prompt tokens" in r.stderr


def test_chat_keeps_history(model):
    r = invoke("chat", model, "--max-tokens", "3", input="one\ntwo\n")
    sizes = [int(line.split()[0].strip("[")) for line in r.stderr.splitlines() if "prompt tokens" in line]
    assert len(sizes) == 2 and sizes[1] > sizes[0] + 3  # turn 2 carries turn 1 and its answer


GPU_TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                intermediate_size=512)


@pytest.mark.gpu
def test_generate_on_cuda_runs_the_engine(tmp_path):
    """`--device cuda` picks the CUDA engine (kernel widths: head_dim 64, K a multiple of 128), streams
    the tokens, reports them, and a greedy run is reproducible; --eager and --kv-memory are honoured."""
    path = write_tiny_container(tmp_path / "gpu.nanoqwen", method="rtn", seed=1, config_overrides=GPU_TINY)
    args = ["generate", path, "-p", "def fib(n):", "--max-tokens", "12", "--temperature", "0",
            "--device", "cuda", "--kv-memory", "1GiB", "--json"]
    runs = [invoke(*args), invoke(*args), invoke(*args, "--eager")]
    for r in runs:
        assert r.exit_code == 0, r.output
    outs = [json.loads(r.stdout) for r in runs]
    for o in outs:
        assert "engine" in o["backend"], o["backend"]
        assert 1 <= o["generated_tokens"] <= 12
        assert o["finish_reason"] in ("length", "eos") and o["ttft_s"] > 0
        assert o["finish_reason"] == "eos" or o["generated_tokens"] == 12
    assert outs[0]["text"] == outs[1]["text"]  # greedy is deterministic
    # graph and eager launch the same kernels on the same data
    assert outs[0]["text"] == outs[2]["text"]
