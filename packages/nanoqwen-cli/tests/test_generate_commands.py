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
    (["--kv-memory", "8GiB"], "--kv-memory, --eager and --no-overlap are engine options"),
    (["--eager"], "--kv-memory, --eager and --no-overlap are engine options"),
    (["--no-overlap"], "--kv-memory, --eager and --no-overlap are engine options"),
    (["--speculate", "ngram:0"], "--speculate: speculation 'ngram:0': K must be in 1..7"),
    (["--speculate", "ngram:"], "--speculate: unknown speculation 'ngram:'"),
])
def test_bad_options_exit_2_with_a_message(model, args, message):
    r = invoke("generate", model, "-p", "x", *args)
    assert r.exit_code == 2 and message in r.stderr, r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu_is_an_error(model):
    r = invoke("generate", model, "-p", "x", "--device", "cuda")
    assert r.exit_code == 1  # the machine, not the command line
    assert "no CUDA GPU is available" in r.stderr
    assert "backend:" not in r.stderr  # nothing ran on the CPU instead


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_engine_options_without_gpu_are_an_error(model):
    # --device cuda picks the engine; its options are accepted, and the missing GPU is still the error
    r = invoke("generate", model, "-p", "x", "--device", "cuda", "--kv-memory", "1GiB", "--eager")
    assert r.exit_code == 1 and "no CUDA GPU is available" in r.stderr
    assert "backend:" not in r.stderr


def test_prompt_longer_than_context_refused(model):
    r = invoke("generate", model, "-p", "word " * 400)
    assert r.exit_code == 2 and "context window is 256 tokens" in r.stderr


def weights_read(monkeypatch) -> list:
    """Record every call of the reference backend's weight loader (what reads the tensors)."""
    import nanoqwen_runtime.reference as reference

    calls, real = [], reference.load_weights

    def load_weights(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "load_weights", load_weights)
    return calls


@pytest.mark.parametrize("args,message", [
    (["--temperature", "nan"], "temperature must be a finite number >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--speculate", "ngram:9"], "K must be in 1..7"),
    (["--max-model-len", "100000"], "--max-model-len must be <= 256"),
    (["-p", "word " * 400], "context window is 256 tokens"),
    (["--chat", "-p", "word " * 400], "context window is 256 tokens"),
    (["--max-model-len", "64", "-p", "word " * 70], "context window is 64 tokens"),
])
def test_refusals_come_before_the_weights_are_read(model, monkeypatch, args, message):
    calls = weights_read(monkeypatch)
    r = invoke("generate", model, *([] if "-p" in args else ["-p", "x"]), *args)
    assert r.exit_code == 2 and message in r.stderr, r.output
    assert calls == []
    ok = invoke("generate", model, "-p", "x", "--max-tokens", "1")
    assert ok.exit_code == 0 and len(calls) == 1  # the spy sees a real load


def test_generate_opens_the_container_once_and_builds_one_tokenizer(model, monkeypatch):
    """generate parses and checks the container's header, index and metadata once, builds the
    tokenizer once, and reads the weights from that same open file."""
    import nanoqwen_format as nqf
    from nanoqwen_runtime.tokenizer import Tokenizer

    opens, tokenizers = [], []
    real_open, real_tok = nqf.NanoqwenFile.__init__, Tokenizer.__init__

    def counted_open(self, path):
        opens.append(path)
        real_open(self, path)

    def counted_tok(self, tokenizer_json):
        tokenizers.append(1)
        real_tok(self, tokenizer_json)

    monkeypatch.setattr(nqf.NanoqwenFile, "__init__", counted_open)
    monkeypatch.setattr(Tokenizer, "__init__", counted_tok)
    calls = weights_read(monkeypatch)
    r = invoke("generate", model, "-p", "def f():", "--chat", "--max-tokens", "3", "--max-model-len", "128")
    assert r.exit_code == 0, r.output
    assert len(opens) == 1 and len(tokenizers) == 1 and len(calls) == 1
    assert isinstance(calls[0][0], nqf.NanoqwenFile)  # the weights came from the open file
    r = invoke("chat", model, "--max-tokens", "2", input="hi\n")
    assert r.exit_code == 0, r.output
    assert len(opens) == 2 and len(tokenizers) == 2 and len(calls) == 2


@pytest.mark.model
def test_the_46k_token_prompt_is_refused_without_reading_the_weights(qwen05b_packed, monkeypatch):
    """The real 0.5B (32K context): a 46K-token prompt is refused from the container's tokenizer
    alone: the weights are never read, and the refusal takes far less than loading them (~6 s on 2
    cores; 5 s is the generous bound)."""
    import time

    path = qwen05b_packed("rtn")
    calls = weights_read(monkeypatch)
    prompt = "x = 1\n" * 15600  # 4 tokens a line
    t0 = time.perf_counter()
    r = invoke("generate", path, "-p", prompt)
    took = time.perf_counter() - t0
    assert r.exit_code == 2 and "tokens but the context window is 32768 tokens" in r.stderr, r.output
    assert calls == [] and took < 5.0, took


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
    the tokens, reports them, and a greedy run is reproducible; --eager, --no-overlap and --kv-memory are
    honoured."""
    path = write_tiny_container(tmp_path / "gpu.nanoqwen", method="rtn", seed=1, config_overrides=GPU_TINY)
    args = ["generate", path, "-p", "def fib(n):", "--max-tokens", "12", "--temperature", "0",
            "--device", "cuda", "--kv-memory", "1GiB", "--json"]
    runs = [invoke(*args), invoke(*args), invoke(*args, "--eager"), invoke(*args, "--no-overlap")]
    for r in runs:
        assert r.exit_code == 0, r.output
    outs = [json.loads(r.stdout) for r in runs]
    for o in outs:
        assert "engine" in o["backend"], o["backend"]
        assert 1 <= o["generated_tokens"] <= 12
        assert o["finish_reason"] in ("length", "eos") and o["ttft_s"] > 0
        assert o["finish_reason"] == "eos" or o["generated_tokens"] == 12
    assert outs[0]["text"] == outs[1]["text"]  # greedy is deterministic
    # graph and eager launch the same kernels on the same data; overlap runs the same steps
    assert outs[0]["text"] == outs[2]["text"] == outs[3]["text"]


# ---------------------------------------------------------------------------------------------------
# prompts from a file or stdin; Ctrl-C in generate and chat
# ---------------------------------------------------------------------------------------------------


def test_prompt_from_file_and_stdin_match_the_argument(model, tmp_path):
    args = ("--json", "--max-tokens", "6", "--temperature", "0")
    want = json.loads(invoke("generate", model, "-p", "def add(a, b):\n", *args).stdout)
    prompt = tmp_path / "prompt.py"
    prompt.write_bytes(b"def add(a, b):\n")  # byte for byte: the trailing newline is part of the prompt
    from_file = json.loads(invoke("generate", model, "--prompt-file", prompt, *args).stdout)
    from_stdin = json.loads(invoke("generate", model, "-p", "-", *args, input=b"def add(a, b):\n").stdout)
    for got in (from_file, from_stdin):
        assert (got["text"], got["prompt_tokens"]) == (want["text"], want["prompt_tokens"])


def interrupt_stream(monkeypatch, after_text: int = 1, calls: tuple[int, ...] = (0,)):
    """Make Pipeline.stream raise KeyboardInterrupt (as Ctrl-C would) once `after_text` events with
    text have been yielded, on the calls numbered in `calls`. Returns the texts shown before it."""
    from nanoqwen_runtime.generate import Pipeline as P

    real = P.stream
    shown: list[str] = []
    count = [0]

    def stream(self, prompts, params):
        n = count[0]
        count[0] += 1
        seen = 0
        if n in calls and after_text == 0:
            raise KeyboardInterrupt
        for ev in real(self, prompts, params):
            yield ev
            if n in calls and ev.text:
                shown.append(ev.text)
                seen += 1
                if seen >= after_text:
                    raise KeyboardInterrupt

    monkeypatch.setattr(P, "stream", stream)
    return shown


def test_generate_ctrl_c_ends_the_line_and_exits_130(model, monkeypatch):
    shown = interrupt_stream(monkeypatch, after_text=3)
    r = invoke("generate", model, "-p", "x", "--max-tokens", "40", "--temperature", "0")
    assert r.exit_code == 130, r.output
    assert r.stdout == "".join(shown) + ("" if shown[-1].endswith("\n") else "\n")
    assert r.stderr.splitlines()[-1] == "interrupted (Ctrl-C)"
    assert "prompt tokens" not in r.stderr  # no statistics of a cut-short run


def chat_prompt_tokens(model, messages) -> int:
    pipe = Pipeline.load(model, dtype=torch.float32)
    return len(pipe.tokenizer.encode(pipe.chat_prompt(messages)))


def test_chat_ctrl_c_stops_the_reply_and_keeps_it(model, monkeypatch):
    shown = interrupt_stream(monkeypatch, after_text=2)
    r = invoke("chat", model, "--max-tokens", "30", "--temperature", "0", input="first\nsecond\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.count("assistant> ") == 2
    assert "(stopped; the partial reply is kept in the history)" in r.stderr
    partial = "".join(shown)
    n = chat_prompt_tokens(model, [{"role": "user", "content": "first"},
                                   {"role": "assistant", "content": partial},
                                   {"role": "user", "content": "second"}])
    assert f"[{n} prompt tokens" in r.stderr  # the second turn carries the partial reply


def test_chat_ctrl_c_before_any_text_drops_the_question(model, monkeypatch):
    interrupt_stream(monkeypatch, after_text=0)
    r = invoke("chat", model, "--max-tokens", "3", input="first\nsecond\n")
    assert r.exit_code == 0, r.output
    assert "(stopped before any text; the question is dropped from the history)" in r.stderr
    n = chat_prompt_tokens(model, [{"role": "user", "content": "second"}])
    assert f"[{n} prompt tokens" in r.stderr


def test_chat_ctrl_c_or_ctrl_d_at_the_prompt_exits_0(model, monkeypatch):
    import nanoqwen_cli.generate_commands as gc

    for signal in (KeyboardInterrupt, EOFError):
        def press(prompt, signal=signal):
            raise signal

        monkeypatch.setattr(gc, "input", press, raising=False)
        r = invoke("chat", model)
        assert r.exit_code == 0, r.output
        assert "error" not in r.stderr and "interrupted" not in r.stderr


def test_chat_refused_line_keeps_the_history(model):
    r = invoke("chat", model, "--max-tokens", "3", input=b"one\n\xc3(\ntwo\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.count("assistant> ") == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "byte offset 0 (0xc3" in errors[0]
    sizes = [int(line.split()[0].strip("[")) for line in r.stderr.splitlines() if "prompt tokens" in line]
    assert sizes[1] > sizes[0] + 3  # turn "two" carries turn "one" and its answer


def test_engine_is_ready_after_an_interrupted_reply(model, monkeypatch):
    """After Ctrl-C the interrupted request is ended in the engine (Pipeline.stream finishes what is
    still running when the CLI closes it), so the next turn can start (the engine refuses a start()
    while it has work). On the CPU torch backend."""
    from nanoqwen_cli.generate_commands import Stopped, _reply
    from nanoqwen_runtime.engine import Engine, EngineConfig
    from nanoqwen_runtime.engine.backend import EngineBackend

    cfg = EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=64, block_size=16,
                       max_model_len=256, prefill_chunk=48, max_batch=8)
    engine = Engine.from_file(model, cfg)
    pipe = Pipeline.from_container(model, EngineBackend(engine))
    params = pipe.sampling_params(max_tokens=20, temperature=0.0)
    ids = pipe.tokenizer.encode("def f():")
    real_step, steps = engine.step, [0]

    def step():
        steps[0] += 1
        if steps[0] == 4:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(Stopped):
        _reply(pipe, ids, params, stream=False)
    assert not engine.has_work and engine.kv_blocks_used() == 0
    result = _reply(pipe, ids, params, stream=False)
    assert result.generated_tokens >= 1 and result.error is None


# ---------------------------------------------------------------------------------------------------
# --speculate
# ---------------------------------------------------------------------------------------------------


def test_speculation_default_is_per_backend(model, monkeypatch):
    """Left out, --speculate takes the backend's measured default (loading.DEFAULT_SPECULATION: ngram:4
    on the CUDA engine, off on the CPU reference); `--speculate off` is off; a sampled request is never
    speculated."""
    import nanoqwen_cli.loading as loading

    assert loading.DEFAULT_SPECULATION == {"reference": None, "engine": "ngram:4"}
    assert loading.LoadOptions(device="cpu").speculation() is None
    monkeypatch.setitem(loading.DEFAULT_SPECULATION, "reference", "ngram:2")
    assert loading.LoadOptions(device="cpu").speculation().spec() == "ngram:2"
    assert loading.LoadOptions(device="cpu", speculate="off").speculation() is None
    assert loading.LoadOptions(device="cuda").speculation().spec() == "ngram:4"
    assert loading.LoadOptions(device="cuda", speculate="off").speculation() is None
    args = ("-p", "def add(a, b):", "--json", "--max-tokens", "6", "--temperature", "0")
    default = json.loads(invoke("generate", model, *args).stdout)
    off = json.loads(invoke("generate", model, *args, "--speculate", "off").stdout)
    assert default["speculation"] == "ngram:2" and off["speculation"] is None
    assert off["drafted_tokens"] is off["accepted_tokens"] is off["acceptance_rate"] is None
    assert default["text"] == off["text"]  # exact on the reference backend
    sampled = json.loads(invoke("generate", model, "-p", "x", "--json", "--max-tokens", "3",
                                "--temperature", "0.8", "--seed", "1").stdout)
    assert sampled["speculation"] is None and sampled["drafted_tokens"] is None


def test_speculation_counts_in_the_stats_line_and_json(model):
    """generate reports the drafted and accepted tokens and the acceptance rate: the counts the
    engine kept for this one request (a ReferenceBackend run the same way gives the same counts)."""
    from nanoqwen_runtime.backend import ReferenceBackend
    from nanoqwen_runtime.speculative import SpeculationConfig

    prompt = "def f():"  # on this random model: drafts, some accepted and some not
    args = ("-p", prompt, "--max-tokens", "16", "--temperature", "0", "--speculate", "ngram:3")
    out = json.loads(invoke("generate", model, *args, "--json").stdout)
    backend = ReferenceBackend.from_file(model, speculation=SpeculationConfig(k=3))
    pipe = Pipeline.from_container(model, backend)
    want = pipe.generate([prompt], SamplingParams(max_tokens=16))[0]
    stats = backend.stats()
    assert out["text"] == want.text
    assert (out["drafted_tokens"], out["accepted_tokens"]) == (stats.spec_drafted_tokens,
                                                               stats.spec_accepted_tokens)
    assert out["drafted_tokens"] > 0, out  # the repeated prompt gives drafts
    assert out["acceptance_rate"] == round(out["accepted_tokens"] / out["drafted_tokens"], 4)
    r = invoke("generate", model, *args)
    line = r.stderr.splitlines()[-1]
    rate = f"{100 * stats.spec_accepted_tokens / stats.spec_drafted_tokens:.0f}%"
    assert (f"speculation ngram:3: {stats.spec_drafted_tokens} drafted, {stats.spec_accepted_tokens} "
            f"accepted ({rate})") in line, line


def test_describe_params_says_whether_speculation_runs():
    from nanoqwen_cli.generate_commands import _describe_params
    from nanoqwen_runtime.speculative import SpeculationConfig

    spec = SpeculationConfig(k=6)
    assert _describe_params(SamplingParams(max_tokens=5), spec) == \
        "sampling: greedy (temperature 0), max_tokens 5, speculation ngram:6"
    sampled = _describe_params(SamplingParams(temperature=0.7, seed=1), spec)
    assert sampled.endswith("speculation off (temperature > 0: sampled requests are not speculated)")
    assert "speculation" not in _describe_params(SamplingParams(), None)


def test_speculate_reference_backend_same_greedy_text(model):
    """--speculate on the reference backend: the greedy answer is the one without it (exact), and the
    stderr sampling line names the speculation."""
    args = ("-p", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "--max-tokens", "12",
            "--temperature", "0")
    plain = invoke("generate", model, *args)
    spec = invoke("generate", model, *args, "--speculate", "ngram:3")
    assert spec.exit_code == 0, spec.output
    assert "speculation ngram:3" in spec.stderr
    assert spec.stdout == plain.stdout


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_threads_option_in_help(command):
    r = invoke(command, "--help")
    assert r.exit_code == 0 and "--threads" in r.stdout and "physical cores" in r.stdout, r.stdout
