"""`nanoqwen-cli infill`: the middle on stdout (byte for byte), the way and the statistics on stderr; its
refusals. The real 0.5B-Instruct fills a function body through the chat way (the way its metadata
chooses) so that the file compiles; the tiny test container has no FIM tokens and is refused."""

from __future__ import annotations

import json

import pytest
from nanoqwen_cli.main import app
from nanoqwen_runtime.testing import write_tiny_container
from typer.testing import CliRunner

runner = CliRunner()
BEFORE = "def add(a, b):\n"
AFTER = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_container(tmp_path_factory.mktemp("infill") / "tiny.nanoqwen", method="rtn", seed=5)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "before.py").write_text(BEFORE)
    (tmp_path / "after.py").write_text(AFTER)
    return tmp_path / "before.py", tmp_path / "after.py"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_model_without_fim_tokens_is_refused(tiny, files):
    r = invoke("infill", tiny, "--prefix-file", files[0], "--suffix-file", files[1], "--threads", "1")
    assert r.exit_code == 1 and "no fill-in-the-middle tokens" in r.stderr, r.output


@pytest.mark.parametrize(("extra", "message"), [
    (["--way", "spell"], "--way must be one of fim, chat"),
    (["--max-lines", "0"], "--max-lines must be >= 1"),
    (["--time-budget-ms", "0"], "--time-budget-ms must be >= 1"),
])
def test_bad_options_exit_2(tiny, files, extra, message):
    r = invoke("infill", tiny, "--prefix-file", files[0], *extra)
    assert r.exit_code == 2 and message in r.stderr, r.output


def test_empty_prefix_and_suffix_exit_2(tiny, tmp_path):
    (tmp_path / "empty.py").write_text("")
    r = invoke("infill", tiny, "--prefix-file", tmp_path / "empty.py", "--suffix-file", tmp_path / "empty.py")
    assert r.exit_code == 2 and "nothing to fill in" in r.stderr, r.output


@pytest.mark.model
def test_real_model_fills_a_body_that_compiles(qwen05b_packed, files):
    model = qwen05b_packed("rtn")
    r = invoke("infill", model, "--prompt-file", files[0], "--suffix-file", files[1], "--max-tokens", "32",
               "--threads", "1")
    assert r.exit_code == 0, r.output
    middle = r.stdout
    assert middle.strip() and "print(add" not in middle
    compile(BEFORE + middle + AFTER, "infilled.py", "exec")
    assert "model: instruct" in r.stderr and "infill way: chat" in r.stderr
    assert "prompt tokens" in r.stderr and "finish:" in r.stderr
    j = invoke("infill", model, "--prefix-file", files[0], "--suffix-file", files[1], "--max-tokens", "32",
               "--threads", "1", "--json")
    assert j.exit_code == 0, j.output
    out = json.loads(j.stdout)
    assert out["middle"] == middle and out["way"] == "chat" and out["variant"] == "instruct"  # greedy
