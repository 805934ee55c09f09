"""The benchmark prompt sets (nanoqwen_bench.workloads): function extraction with `ast`, the
deterministic draw from the standard library, prompt shape. No model, no torch."""

from __future__ import annotations

import ast
import textwrap

import pytest
from nanoqwen_bench import workloads as W

SAMPLE = textwrap.dedent('''\
    import os

    def short(a):
        return a

    def collect(items, flag):
        out = []
        for item in items:
            if flag:
                out.append(item * 2)
        total = len(out)
        print(total)
        print(flag)
        return out

    @staticmethod
    def decorated(path: str) -> str:
        """Has a docstring and annotations."""
        x = path
        x = x + "a"
        x = x + "b"
        x = x + "c"
        x = x + "d"
        return x

    class C:
        def method(self, value):
            a = 1
            a = 2
            a = 3
            a = 4
            a = 5
            a = 6
            a = 7
            return value
    ''')


def test_extract_functions_picks_top_level_defs_of_8_to_40_lines():
    fns = W.extract_functions(SAMPLE, "sample.py")
    assert [f.name for f in fns] == ["collect", "decorated"]  # short: 2 lines; method: not top level
    collect, decorated = fns
    assert collect.lines == 9 and collect.text.startswith("def collect(items, flag):")
    assert collect.text.endswith("return out")
    assert not collect.has_docstring and not collect.annotated
    assert collect.rename_target == "items" and collect.appended_list == "out"
    # decorators are part of the function's text and its line count
    assert decorated.text.startswith("@staticmethod\ndef decorated") and decorated.lines == 9
    assert decorated.has_docstring and decorated.annotated
    assert decorated.rename_target == "path" and decorated.appended_list is None
    ast.parse(collect.text)
    ast.parse(decorated.text)


def test_extract_functions_line_bounds_and_broken_files():
    body = "\n".join(f"    x{i} = {i}" for i in range(W.MAX_LINES))  # def line + 40 = 41 lines
    assert W.extract_functions(f"def big():\n{body}\n") == []
    body = "\n".join(f"    x{i} = {i}" for i in range(W.MAX_LINES - 1))  # exactly 40
    assert [f.lines for f in W.extract_functions(f"def edge():\n{body}\n")] == [W.MAX_LINES]
    assert W.extract_functions("def broken(:\n    pass\n") == []
    assert W.extract_functions("print 'python 2'\n") == []


def test_stdlib_files_sorted_without_tests(tmp_path):
    for rel in ("b.py", "a.py", "pkg/c.py", "test/test_x.py", "pkg/tests/t.py", "pkg/test_y.py", "d.txt",
                "site-packages/z.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert W.stdlib_files(tmp_path) == ["a.py", "b.py", "pkg/c.py"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        W.stdlib_files(tmp_path / "missing")


def test_code_edit_prompts_from_a_small_tree_deterministic_and_one_per_file(tmp_path):
    for i in range(8):
        (tmp_path / f"m{i}.py").write_text(SAMPLE.replace("collect", f"collect{i}").replace(
            "decorated", f"decorated{i}"))
    a = W.code_edit_prompts(8, seed=3, root=tmp_path)
    b = W.code_edit_prompts(8, seed=3, root=tmp_path)
    assert a == b and W.prompt_set_sha256(a) == W.prompt_set_sha256(b)
    assert [p.task for p in a] == list(W.EDIT_TASKS) * 2
    files = [p.source.split(":")[0] for p in a]
    assert len(set(files)) == len(files)  # at most one function per file
    # the type-hints and docstring tasks never get `decorated*` (annotated, with a docstring)
    assert all("collect" in p.source for p in a if p.task in ("type-hints", "docstring"))
    assert W.code_edit_prompts(8, seed=4, root=tmp_path) != a
    assert W.code_edit_prompts(5, seed=3, root=tmp_path) == a[:5]  # prefix-stable
    with pytest.raises(ValueError, match="only 8 of 9 prompts"):
        W.code_edit_prompts(9, seed=3, root=tmp_path)  # 8 files, one function each
    with pytest.raises(ValueError, match="at least one prompt"):
        W.code_edit_prompts(0, root=tmp_path)


def test_code_edit_prompts_from_this_pythons_stdlib():
    ps = W.code_edit_prompts(16)
    assert ps == W.code_edit_prompts(16)  # same interpreter, same prompts
    assert W.code_edit_prompts(3) == ps[:3]
    assert len(ps) == 16 and [p.index for p in ps] == list(range(16))
    assert len({p.source for p in ps}) == 16
    for p in ps:
        assert p.workload == "code-edit" and p.task == W.EDIT_TASKS[p.index % 4]
        (role_s, system), (role_u, user) = p.messages
        assert role_s == "system" and role_u == "user" and "code block" in system
        instruction, code = user.split("\n\n```python\n", 1)
        assert code.endswith("\n```")
        code = code[:-4]
        ast.parse(code)  # the function is valid Python on its own
        assert W.MIN_LINES <= len(code.splitlines()) <= W.MAX_LINES
        path, name = p.source.split(":")
        assert f"def {name}" in code and (W.stdlib_dir() / path).is_file()
        if p.task == "rename":
            old, new = instruction.split("`")[1], instruction.split("`")[3]
            assert old in code and new not in code
        if p.task == "comprehension":
            assert f"{instruction.split('`')[3]}.append(" in code
    assert p.chat_messages()[1] == {"role": "user", "content": ps[-1].messages[1][1]}


def test_free_form_prompts():
    ps = W.free_form_prompts(16, seed=0)
    assert ps == W.free_form_prompts(16, seed=0) != W.free_form_prompts(16, seed=1)
    assert [p.task for p in ps] == ["explain", "story"] * 8
    assert len({p.messages for p in ps}) == 16  # 12 topics of each kind: no repeats within 16
    assert all(len(p.messages) == 1 and p.messages[0][0] == "user" and p.source == "" for p in ps)
    assert len(W.free_form_prompts(30)) == 30  # more than the topics: they cycle


def test_workload_prompts_dispatch_and_errors():
    assert W.workload_prompts("free-form", 2) == W.free_form_prompts(2)
    assert W.workload_prompts("code-edit", 4)[0].workload == "code-edit"
    with pytest.raises(ValueError, match="unknown workload 'edits'"):
        W.workload_prompts("edits")
    assert W.python_version().count(".") == 2
