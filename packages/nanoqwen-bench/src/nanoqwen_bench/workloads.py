"""Deterministic prompt sets for the workload benchmark (`nanoqwen-cli bench --workload ...`).

- `code-edit`: chat prompts asking the model to rewrite a given Python function: add type hints,
  rename a variable, add a docstring, convert a loop to a list comprehension. An edit mostly copies the
  function, which is what prompt-lookup speculation (speculative.py) exploits. The functions are drawn
  from the Python standard library of the running interpreter (`sysconfig.get_paths()["stdlib"]`):
  the sorted list of its .py files (test folders and site-packages left out) is shuffled with a seeded
  `random.Random`, files are parsed with `ast` in that order, and each contributes at most one
  top-level `def` of 8..40 lines, to the next prompt if it suits that prompt's edit task. So the same
  Python version (the same stdlib files) gives the same prompts; `prompt_set_sha256` fingerprints a
  set for the report.
- `free-form`: open-ended chat prompts ("explain ...", "write a story about ...") with little in the
  prompt to copy: the workload on which speculation must cost (almost) nothing.

A prompt is a `WorkloadPrompt`: chat messages (rendered by the container's chat template by the
caller) plus where it came from. Nothing here imports torch or reads a model.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WORKLOADS", "EDIT_TASKS", "WorkloadPrompt", "FunctionSource", "stdlib_dir", "stdlib_files",
           "extract_functions", "code_edit_prompts", "free_form_prompts", "workload_prompts",
           "prompt_set_sha256", "python_version"]

WORKLOADS = ("code-edit", "free-form")
EDIT_TASKS = ("type-hints", "rename", "docstring", "comprehension")
MIN_LINES, MAX_LINES = 8, 40

# Folders of the stdlib whose files are tests, test data (some not even Python 3), installed packages,
# or generated code: `encodings` holds ~120 codec modules with the same `getregentry` function.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                        "lib2to3", "ensurepip", "turtledemo", "encodings"})

CODE_EDIT_SYSTEM = ("You are a careful Python programmer. Reply with the complete rewritten function in one "
                    "```python code block and nothing else.")


@dataclass(frozen=True)
class WorkloadPrompt:
    """One benchmark prompt. messages: ((role, content), ...) for the chat template; task: the edit
    task (code-edit) or the prompt kind (free-form); source: "path/in/stdlib.py:function" or ""."""

    workload: str
    index: int
    task: str
    source: str
    messages: tuple[tuple[str, str], ...]

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: [{"role": ..., "content": ...}, ...]."""
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass(frozen=True)
class FunctionSource:
    """A top-level function of a stdlib file. path: relative to the stdlib folder, '/'-separated;
    text: its source lines (decorators included), `lines` of them."""

    path: str
    name: str
    text: str
    lines: int
    has_docstring: bool
    annotated: bool             # any parameter or return annotation
    rename_target: str | None   # a local name worth renaming (a parameter or an assigned name)
    appended_list: str | None   # the list a `for` loop builds with `.append(...)`, if any


def python_version() -> str:
    return platform.python_version()


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """The stdlib's .py files as sorted '/'-separated paths relative to `root` (tests, test data and
    installed packages left out)."""
    root = stdlib_dir() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library folder {root} does not exist")
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def _rename_target(fn: ast.FunctionDef) -> str | None:
    """The first parameter (not self/cls) of 3+ characters, else the first assigned local of 3+."""
    args = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    for name in args:
        if name not in ("self", "cls") and len(name) >= 3:
            return name
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and len(node.id) >= 3:
            return node.id
    return None


def _appended_list(fn: ast.FunctionDef) -> str | None:
    """`name` when the function has `for ...: name.append(...)` (the append alone in the loop body, or
    alone under one `if`): a loop a list comprehension can replace."""
    for node in ast.walk(fn):
        if not isinstance(node, ast.For) or node.orelse or len(node.body) != 1:
            continue
        stmt = node.body[0]
        if isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1:
            stmt = stmt.body[0]
        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "append"
                and isinstance(stmt.value.func.value, ast.Name) and len(stmt.value.args) == 1):
            return stmt.value.func.value.id
    return None


def extract_functions(source: str, path: str = "<string>") -> list[FunctionSource]:
    """Top-level `def`s of `source` of MIN_LINES..MAX_LINES lines (decorators included), in file order.
    A file that does not parse yields [] (the stdlib holds a few deliberately broken files)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        n = node.end_lineno - start + 1
        if not MIN_LINES <= n <= MAX_LINES:
            continue
        text = "\n".join(lines[start - 1:node.end_lineno])
        a = node.args
        annotated = node.returns is not None or any(
            x.annotation is not None for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
            if x is not None)
        out.append(FunctionSource(path, node.name, text, n, ast.get_docstring(node) is not None, annotated,
                                  _rename_target(node), _appended_list(node)))
    return out


def _suits(fn: FunctionSource, task: str) -> bool:
    if task == "type-hints":
        return not fn.annotated
    if task == "rename":
        return fn.rename_target is not None
    if task == "docstring":
        return not fn.has_docstring
    return fn.appended_list is not None


def _new_name(old: str, text: str) -> str:
    new = f"{old}_value"
    i = 2
    while new in text:
        new = f"{old}_value{i}"
        i += 1
    return new


def _instruction(fn: FunctionSource, task: str) -> str:
    if task == "type-hints":
        return ("Add type hints to every parameter and to the return value of this function. "
                "Change nothing else.")
    if task == "rename":
        return (f"Rename the variable `{fn.rename_target}` to `{_new_name(fn.rename_target, fn.text)}` "
                "everywhere in this function. Change nothing else.")
    if task == "docstring":
        return ("Add a docstring to this function that says what it does, what its parameters are and what "
                "it returns. Change nothing else.")
    return (f"Rewrite the first `for` loop that appends to `{fn.appended_list}` in this function as a list "
            "comprehension. Change nothing else.")


def code_edit_prompts(n: int = 16, seed: int = 0, root: Path | None = None) -> list[WorkloadPrompt]:
    """`n` code-edit prompts; prompt i asks for task EDIT_TASKS[i % 4]. Deterministic for a given
    stdlib (`root`, default: this interpreter's) and `seed`, and prefix-stable: the first m prompts of
    a set of n > m are the set of m.

    The draw: the sorted files shuffled by `random.Random(seed)`, visited in that order; each file's
    functions (8..40 lines, shuffled by the same generator) are offered to the next prompt's task and
    the first that suits it is taken, else the file is passed over (a file gives one prompt at most).
    """
    if n < 1:
        raise ValueError(f"need at least one prompt, got n={n}")
    root = stdlib_dir() if root is None else Path(root)
    files = stdlib_files(root)
    rng = random.Random(seed)
    rng.shuffle(files)
    out: list[WorkloadPrompt] = []
    for rel in files:
        if len(out) == n:
            break
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        fns = extract_functions(text, rel)
        rng.shuffle(fns)
        task = EDIT_TASKS[len(out) % len(EDIT_TASKS)]
        fn = next((f for f in fns if _suits(f, task)), None)
        if fn is None:
            continue
        user = f"{_instruction(fn, task)}\n\n```python\n{fn.text}\n```"
        out.append(WorkloadPrompt("code-edit", len(out), task, f"{fn.path}:{fn.name}",
                                  (("system", CODE_EDIT_SYSTEM), ("user", user))))
    if len(out) < n:
        raise ValueError(f"the standard library at {root} has suitable functions for only {len(out)} of "
                         f"{n} prompts")
    return out


_EXPLAIN = ["how a refrigerator keeps food cold", "why the sky is blue",
            "how vaccines train the immune system", "what causes the seasons on Earth",
            "how a bill becomes a law", "why bread rises",
            "how tides work", "what inflation is and why it happens", "how bees communicate",
            "why some metals rust and others do not", "how an airplane wing produces lift",
            "what a black hole is"]
_STORY = ["a lighthouse keeper who finds a message in a bottle", "a robot learning to paint",
          "two rival bakers in a small village", "a child who can talk to clouds",
          "a detective cat solving a missing-sock mystery", "the last tree on a distant planet",
          "a musician who loses her hearing", "a time traveller stuck in a Tuesday",
          "a fox and a crow who open a library", "an old map found inside a piano",
          "a city where it rains only at night", "a dragon who is afraid of heights"]


def free_form_prompts(n: int = 16, seed: int = 0) -> list[WorkloadPrompt]:
    """`n` open-ended chat prompts, alternating "explain" and "story" (topics drawn without repeats
    while they last, then cycling), deterministic for `seed`."""
    if n < 1:
        raise ValueError(f"need at least one prompt, got n={n}")
    rng = random.Random(seed)
    explain, story = list(_EXPLAIN), list(_STORY)
    rng.shuffle(explain)
    rng.shuffle(story)
    out = []
    for i in range(n):
        if i % 2 == 0:
            topic = explain[(i // 2) % len(explain)]
            task, user = "explain", f"Explain {topic}, in a few paragraphs of plain prose."
        else:
            topic = story[(i // 2) % len(story)]
            task, user = "story", f"Write a short story about {topic}."
        out.append(WorkloadPrompt("free-form", i, task, "", (("user", user),)))
    return out


def workload_prompts(name: str, n: int = 16, seed: int = 0) -> list[WorkloadPrompt]:
    """The prompts of workload `name` (one of WORKLOADS)."""
    if name == "code-edit":
        return code_edit_prompts(n, seed)
    if name == "free-form":
        return free_form_prompts(n, seed)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def prompt_set_sha256(prompts: list[WorkloadPrompt]) -> str:
    """A fingerprint of a prompt set (its messages, tasks and sources, in order)."""
    rows = [[p.workload, p.index, p.task, p.source, [list(m) for m in p.messages]] for p in prompts]
    blob = json.dumps(rows, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
