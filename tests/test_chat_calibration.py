"""CPU: the chat calibration text, `nanoqwen-quant pack`'s default
(nanoqwen_quant/calib_chat.py), and nanoqwen_bench.quality.chat_calib, which writes the same conversations to
files (the set the measurement that chose the default was calibrated on). Function extraction on
hand-written sources (documented functions kept, undocumented, decorated, too short and docstring-only
ones left out, methods dedented), the rendered conversation with the tiny container's Qwen template, the
split it reads (calibration only, never the held-out files), that `build_calibration` keeps the
template's special tokens as single ids, and that the package's text (rendered by transformers from the
source) tokenizes to the same ids as the script's files (rendered by the runtime's `ChatTemplate`): on
the tiny container, and on the real 0.5B. Here, not under one package's tests: the script uses
nanoqwen-runtime's chat template."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CC = importlib.import_module("nanoqwen_bench.quality.chat_calib")
CHAT = importlib.import_module("nanoqwen_quant.calib_chat")

SOURCE = '''
import functools


def top(values):
    """Sum of the squares of `values`.

    Empty input gives 0.
    """
    total = 0
    for v in values:
        total += v * v
    return total


def undocumented(x):
    y = x + 1
    y = y * 2
    y = y - 3
    y = y // 4
    return y


@functools.cache
def decorated(x):
    """Cached."""
    a = x
    b = a + 1
    c = b + 1
    return c


def short(x):
    """Too short."""
    return x


def only_doc():
    """Nothing but a docstring, however long it is.

    line
    line
    line
    """


class Box:
    def area(self, w, h):
        """Area of a w x h box.

        Both sides must be positive.
        """
        if w <= 0 or h <= 0:
            raise ValueError("sides must be positive")
        return w * h
'''


def test_documented_functions_keeps_documented_bodies_and_dedents_methods():
    found = list(CHAT.documented_functions(SOURCE))
    names = [head.split("(")[0] for head, _ in found]
    assert names == ["def top", "def area"]
    head, whole = found[1]
    assert head == ('def area(self, w, h):\n    """Area of a w x h box.\n\n    Both sides must be positive.\n'
                    '    """')
    assert whole.startswith(head) and whole.endswith("return w * h")
    assert all(not line.startswith(" " * 8 + "def") for line in whole.splitlines())  # dedented
    compile(whole, "<area>", "exec")  # the answer is valid Python on its own
    assert list(CHAT.documented_functions("def broken(:\n")) == []


def test_conversation_asks_with_one_of_the_instructions_and_answers_with_the_function():
    head, whole = next(CHAT.documented_functions(SOURCE))
    user, assistant = CHAT.conversation(head, whole)
    assert user["role"] == "user" and assistant["role"] == "assistant"
    instruction, _, rest = user["content"].partition("\n\n")
    assert instruction in CHAT.INSTRUCTIONS
    assert "Complete the following Python function" not in user["content"]  # not the harness's wording
    assert rest == f"```python\n{head}\n```"
    assert assistant["content"] == f"```python\n{whole}\n```"
    assert CHAT.conversation(head, whole) == [user, assistant]  # the same function, the same instruction


def test_written_set_renders_the_template_and_tokenizes_special_tokens(tmp_path):
    from nanoqwen_quant.calib import build_calibration
    from nanoqwen_runtime.generate import Pipeline
    from nanoqwen_runtime.testing import tiny_tokenizer_json, write_tiny_container

    model = write_tiny_container(tmp_path / "tiny.nanoqwen")
    pipe = Pipeline.from_container(model, backend=None)
    files = []
    for i in range(3):  # the same function in three files: written once
        f = tmp_path / "src" / f"m{i}.py"
        f.parent.mkdir(exist_ok=True)
        f.write_text(SOURCE)
        files.append(f)
    out = tmp_path / "calib"
    assert CC.write_calibration(pipe.template, files, out, limit=10) == 2
    texts = [p.read_text() for p in sorted(out.iterdir())]
    assert [p.name for p in sorted(out.iterdir())] == ["chat-00001.txt", "chat-00002.txt"]
    for text in texts:
        assert text.count("<|im_start|>user\n") == 1 and text.count("<|im_start|>assistant\n") == 1
        assert text.rstrip().endswith("```<|im_end|>")
    assert CC.write_calibration(pipe.template, files, tmp_path / "one", limit=1) == 1

    tokenizer_json = tiny_tokenizer_json()  # the tiny container's tokenizer
    cs = build_calibration(tokenizer_json, 32, 16, [out])
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    start = tok.token_to_id("<|im_start|>")
    assert start is not None and start in cs.ids.flatten().tolist()


def test_reads_the_calibration_split_only(monkeypatch, tmp_path):
    from nanoqwen_quant import calib

    calib_files = calib.stdlib_files("calib")
    heldout = set(calib.stdlib_files("heldout"))
    read: list[Path] = []
    real = Path.read_text

    def spy(self, *a, **k):
        read.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", spy)
    got = list(CHAT.conversations(calib_files, 20))
    assert len(got) == 20
    assert read and not heldout & set(read)
    assert read == calib_files[:len(read)]  # in the split's hash order


def _same_ids_through_files_and_in_memory(container: Path, tmp_path: Path, n_tokens: int, seq_len: int):
    """The calibration ids of the chat text two ways: nanoqwen_bench.quality.chat_calib's files (the runtime's
    ChatTemplate of `container`) read as --calib, and `pack`'s default (transformers' rendering)."""
    import nanoqwen_format as nqf
    from nanoqwen_quant.calib import build_calibration, stdlib_files
    from nanoqwen_runtime.generate import Pipeline

    pipe = Pipeline.from_container(container, backend=None)
    files = tmp_path / "chat-files"
    CC.write_calibration(pipe.template, stdlib_files("calib"), files, limit=400)
    with nqf.open(container) as f:
        template, tokenizer_json, config = f.chat_template, f.tokenizer_json, f.config
    eos = config.get("eos_token_id")
    renderer = CHAT.ChatRenderer(template, tokenizer_json, config.get("bos_token_id"),
                                 eos[0] if isinstance(eos, list) else eos)
    through_files = build_calibration(tokenizer_json, n_tokens, seq_len, [files])
    in_memory = build_calibration(tokenizer_json, n_tokens, seq_len, None, renderer)
    assert in_memory.source.startswith("chat:python-stdlib ")
    assert in_memory.files == through_files.files > 1  # the same conversations, in the same order
    assert in_memory.sha256 == through_files.sha256
    assert (in_memory.ids == through_files.ids).all()


def test_pack_default_text_equals_the_written_files_tiny(tmp_path):
    from nanoqwen_runtime.testing import write_tiny_container

    model = write_tiny_container(tmp_path / "tiny.nanoqwen")
    _same_ids_through_files_and_in_memory(model, tmp_path, 8192, 512)


@pytest.mark.model
def test_pack_default_text_equals_the_written_files_real_05b(qwen05b_packed, tmp_path):
    """The real Qwen template and tokenizer: the default's 65,536 tokens (~240 conversations)."""
    _same_ids_through_files_and_in_memory(qwen05b_packed("none"), tmp_path, 65536, 2048)


def test_run_quality_recipes_name_their_calibration_text():
    """run_quality.py's gptq-asym-chat recipe is the default (`PackOptions()` with asym explicit); every
    other calibrated recipe keeps the text it was measured on, the stdlib code."""
    from nanoqwen_quant.options import PackOptions

    rq = importlib.import_module("nanoqwen_bench.quality.run_quality")
    chat = PackOptions(**rq.RECIPES["gptq-asym-chat"])
    assert chat.chat_calibration and chat.method == PackOptions().method
    assert (chat.method, chat.symmetric, chat.group_size) == ("gptq", False, 128)
    for name in ("gptq", "gptq-asym", "awq-clipact-asym", "gptq-awq-clip"):
        opts = PackOptions(**rq.RECIPES[name])
        assert opts.calibrated and opts.calib_text == "code" and not opts.chat_calibration, name
    assert "calib_text" not in rq.RECIPES["rtn-asym"]
