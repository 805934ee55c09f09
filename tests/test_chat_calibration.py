"""CPU: bench/quality/chat_calib.py, the chat-formatted GPTQ calibration set of issue 16's next test
(why GPTQ loses pass rate). Function extraction on hand-written sources (documented functions kept,
undocumented, decorated, too short and docstring-only ones left out, methods dedented), the rendered
conversation with the tiny container's Qwen template, the split it reads (calibration only, never the
held-out files), and that `build_calibration` reads the written folder with the template's special
tokens as single ids. Here, not under one package's tests: the script uses nanoqwen-quant's calibration
split and nanoqwen-runtime's chat template."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


CC = _load("chat_calib", ROOT / "bench" / "quality" / "chat_calib.py")

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
    found = list(CC.documented_functions(SOURCE))
    names = [head.split("(")[0] for head, _ in found]
    assert names == ["def top", "def area"]
    head, whole = found[1]
    assert head == ('def area(self, w, h):\n    """Area of a w x h box.\n\n    Both sides must be positive.\n'
                    '    """')
    assert whole.startswith(head) and whole.endswith("return w * h")
    assert all(not line.startswith(" " * 8 + "def") for line in whole.splitlines())  # dedented
    compile(whole, "<area>", "exec")  # the answer is valid Python on its own
    assert list(CC.documented_functions("def broken(:\n")) == []


def test_conversation_asks_with_one_of_the_instructions_and_answers_with_the_function():
    head, whole = next(CC.documented_functions(SOURCE))
    user, assistant = CC.conversation(head, whole)
    assert user["role"] == "user" and assistant["role"] == "assistant"
    instruction, _, rest = user["content"].partition("\n\n")
    assert instruction in CC.INSTRUCTIONS
    assert "Complete the following Python function" not in user["content"]  # not the harness's wording
    assert rest == f"```python\n{head}\n```"
    assert assistant["content"] == f"```python\n{whole}\n```"
    assert CC.conversation(head, whole) == [user, assistant]  # the same function, the same instruction


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
    got = list(CC.conversations(calib_files, 20))
    assert len(got) == 20
    assert read and not heldout & set(read)
    assert read == calib_files[:len(read)]  # in the split's hash order


def test_run_quality_chat_recipe_builds_its_calibration_from_the_none_pack(tmp_path, monkeypatch):
    """run_quality.py's gptq-asym-chat recipe: GPTQ asym with calib_paths = the folder chat_calib
    writes from the model's `none` pack (its template), written once and reused."""
    from nanoqwen_quant.options import PackOptions
    from nanoqwen_runtime.testing import write_tiny_container

    rq = _load("run_quality", ROOT / "bench" / "quality" / "run_quality.py")
    kw = dict(rq.RECIPES["gptq-asym-chat"])
    assert kw.pop("calib") == "chat"
    opts = PackOptions(**kw)
    assert (opts.method, opts.symmetric, opts.group_size, opts.calibrated) == ("gptq", False, 128, True)
    write_tiny_container(tmp_path / "tiny-none.nanoqwen")
    monkeypatch.setattr(rq, "CHAT_CONVERSATIONS", 5)
    folder = rq.chat_calibration(tmp_path, "tiny")
    assert folder == tmp_path / "tiny-chat-calib"
    files = sorted(folder.iterdir())
    assert len(files) == 5 and all("<|im_start|>assistant\n```python\n" in f.read_text() for f in files)
    (tmp_path / "tiny-none.nanoqwen").unlink()  # a second call reuses the folder, needs no container
    assert rq.chat_calibration(tmp_path, "tiny") == folder and sorted(folder.iterdir()) == files
