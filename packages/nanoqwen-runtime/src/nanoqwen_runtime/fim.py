"""Fill-in-the-middle (FIM): the code at a cursor, from the text before it, the text after it and
other files of the project.

Two ways of prompting, chosen per model (`choose_way`):

- **fim**: Qwen2.5-Coder's own FIM tokens, in its documented repo-level format (the Qwen2.5-Coder
  README, "repository level code completion"; llama-server's /infill builds the same):

      <|repo_name|>{repo}\\n
      <|file_sep|>{path 1}\\n{text 1}          one per extra file (a missing final newline is added)
      <|file_sep|>{path}\\n                     the current file
      <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

  Without extra files the prompt is the last line alone. The models were trained on it; what they
  generate up to an end token is the middle.
- **chat**: for the small Instruct models, which run past the middle with FIM tokens (the 0.5B; the
  1.5B-Instruct infills better with the FIM tokens: `choose_way`): the chat
  template with a user turn that shows the file with the cursor marked and asks for the code at it, and
  the assistant's answer started as a code block that already holds the prefix
  (```` ```{lang}\\n{prefix} ````). The model continues the file from the cursor; the middle is what it
  writes before it repeats the suffix (`trim_middle`) or closes the block (stop string ```` ``` ````).

The user's text (prefix, suffix, extra files, paths) is always encoded as plain text
(`Tokenizer.encode_text`): `<|fim_prefix|>` written in a file is eight characters, never a control
token. Special-token ids come from the container's tokenizer; a tokenizer without the FIM tokens is
refused (`FIMError`).

Fitting the context (`budget`, prompt tokens): extra files are dropped whole, the first given first
(llama.vim and llama.vscode send their most recent chunks last), until the prompt fits; the prefix and
the suffix are never cut. A prompt that does not fit without any extra file raises
`ContextOverflowError` with both lengths. (llama-server keeps the tail of the extra files' tokens,
cutting one mid-file, and cuts the prefix to 3/4 of a batch; whole files are easier to reason about, and
an editor that sends too much prefix gets a clear error instead of a silently shorter one.)

Generation stops on the end tokens the tokenizer has (`STOP_TOKENS`); the engine never shows special
tokens (it decodes with skip_special_tokens), and whitespace comes back byte for byte.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .tokenizer import Tokenizer

__all__ = ["ContextOverflowError", "ExtraFile", "FIMError", "FIMTokens", "InfillPrompt", "STOP_TOKENS",
           "WAYS",
           "MiddleTrimmer", "build_prompt", "chat_prompt", "choose_way", "fim_prompt", "model_variant",
           "trim_middle",
           "cut_at_suffix", "cut_lines"]

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
REPO_NAME, FILE_SEP, FIM_PAD = "<|repo_name|>", "<|file_sep|>", "<|fim_pad|>"
# Tokens that end a middle: the end of a document, a FIM pad, the next file, the end of a chat turn, or
# the model starting a new FIM prompt. Those the tokenizer has are used.
STOP_TOKENS = ("<|endoftext|>", FIM_PAD, FILE_SEP, "<|im_end|>", "<|im_start|>", REPO_NAME, FIM_PREFIX,
               FIM_SUFFIX, FIM_MIDDLE)
WAYS = ("fim", "chat")
Way = Literal["fim", "chat"]

# The chat way's user turn. CURSOR marks the gap in the file shown to the model.
CURSOR = "<CURSOR>"
CHAT_INSTRUCTION = ("Complete the code at the cursor, marked {cursor}, in the file {path} below. Reply with "
                    "the file in one ```{lang} code block, from its first line, with the cursor replaced by "
                    "the missing code.")
FENCE = "```"
_LANGS = {".py": "python", ".js": "javascript", ".ts": "typescript", ".go": "go", ".rs": "rust", ".c": "c",
          ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".java": "java", ".rb": "ruby",
          ".sh": "bash",
          ".lua": "lua", ".php": "php", ".cs": "csharp", ".kt": "kotlin", ".swift": "swift"}


class FIMError(ValueError):
    """The model or the request cannot do fill-in-the-middle (a missing token, no text at all)."""


class ContextOverflowError(FIMError):
    """The prompt does not fit even without extra files. `prompt_tokens` and `limit` say by how much."""

    def __init__(self, prompt_tokens: int, limit: int, n_prefix: int, n_suffix: int):
        self.prompt_tokens, self.limit = prompt_tokens, limit
        self.n_prefix, self.n_suffix = n_prefix, n_suffix
        super().__init__(f"the infill prompt has {prompt_tokens} tokens (prefix {n_prefix}, suffix "
                         f"{n_suffix}, with every extra file dropped) but at most {limit} fit; send less "
                         "prefix or suffix")


@dataclass(frozen=True)
class ExtraFile:
    """Another file of the project, shown to the model before the current one."""

    filename: str
    text: str


@dataclass(frozen=True)
class FIMTokens:
    """Ids of the FIM tokens in one tokenizer; `repo_name`/`file_sep` None where it has none."""

    prefix: int
    suffix: int
    middle: int
    repo_name: int | None
    file_sep: int | None
    stop_ids: frozenset[int]

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer) -> FIMTokens:
        ids = {t: tok.added_tokens.get(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, REPO_NAME, FILE_SEP)}
        missing = [t for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE) if ids[t] is None]
        if missing:
            raise FIMError(f"this model's tokenizer has no fill-in-the-middle tokens ({', '.join(missing)} "
                           "missing): it cannot infill; use a Qwen2.5-Coder model")
        stops = frozenset(tok.added_tokens[t] for t in STOP_TOKENS if t in tok.added_tokens)
        return cls(ids[FIM_PREFIX], ids[FIM_SUFFIX], ids[FIM_MIDDLE], ids[REPO_NAME], ids[FILE_SEP], stops)


@dataclass(frozen=True)
class InfillPrompt:
    """A built prompt. ids: token ids; way: "fim" or "chat"; stop_ids: token ids that end the middle
    (add the model's EOS ids); stop: stop strings (the chat way's closing fence); n_prefix / n_suffix /
    n_extra: tokens of each part in the prompt; extras_used / extras_dropped: extra files kept / dropped
    to fit the budget."""

    ids: list[int]
    way: Way
    stop_ids: frozenset[int]
    stop: tuple[str, ...]
    n_prefix: int
    n_suffix: int
    n_extra: int
    extras_used: int
    extras_dropped: int


def _extras(extra: Sequence[ExtraFile | Mapping[str, Any]]) -> list[ExtraFile]:
    out = []
    for i, e in enumerate(extra):
        if isinstance(e, ExtraFile):
            out.append(e)
        elif isinstance(e, Mapping) and isinstance(e.get("text", ""), str) \
                and isinstance(e.get("filename", "tmp"), str):
            out.append(ExtraFile(e.get("filename", "tmp"), e.get("text", "")))
        else:
            raise FIMError(f"extra file {i} must be {{'filename': str, 'text': str}}, got {e!r}")
    return out


def _fit(build, n_extras: int, budget: int | None):
    """`build(first_kept_extra)` -> (ids, n_prefix, n_suffix, n_extra); the first build that fits `budget`
    (dropping extra files from the front), else ContextOverflowError."""
    for first in range(n_extras + 1):
        ids, n_prefix, n_suffix, n_extra = build(first)
        if budget is None or len(ids) <= budget:
            return ids, n_prefix, n_suffix, n_extra, first
    raise ContextOverflowError(len(ids), budget, n_prefix, n_suffix)


def _check_text(prefix: str, suffix: str) -> None:
    if not isinstance(prefix, str) or not isinstance(suffix, str):
        raise FIMError("the prefix and the suffix must be strings")
    if not prefix and not suffix:
        raise FIMError("the prefix and the suffix are both empty: there is nothing to fill in")


def fim_prompt(tok: Tokenizer, prefix: str, suffix: str, extra: Sequence[ExtraFile | Mapping] = (), *,
               repo: str = "myproject", path: str = "filename", budget: int | None = None) -> InfillPrompt:
    """The FIM-token prompt (module header). With no extra file, the plain
    `<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>`; else the repo-level format (needs `<|repo_name|>` and
    `<|file_sep|>` in the tokenizer, else FIMError)."""
    _check_text(prefix, suffix)
    ft = FIMTokens.from_tokenizer(tok)
    files = _extras(extra)
    if files and (ft.repo_name is None or ft.file_sep is None):
        raise FIMError("this model's tokenizer has no <|repo_name|> / <|file_sep|> tokens: extra files "
                       "cannot be given")
    p_ids, s_ids = tok.encode_text(prefix), tok.encode_text(suffix)
    enc = tok.encode_text
    file_ids = [[ft.file_sep, *enc(f.filename + "\n"), *enc(f.text if f.text.endswith("\n") or not f.text
                                                            else f.text + "\n")] for f in files]

    def build(first: int):
        head: list[int] = []
        if first < len(files):
            head = [ft.repo_name, *enc(repo + "\n")]
            for f in file_ids[first:]:
                head += f
            head += [ft.file_sep, *enc(path + "\n")]
        ids = [*head, ft.prefix, *p_ids, ft.suffix, *s_ids, ft.middle]
        return ids, len(p_ids), len(s_ids), len(head)

    ids, n_p, n_s, n_e, first = _fit(build, len(files), budget)
    return InfillPrompt(ids, "fim", ft.stop_ids, (), n_p, n_s, n_e, len(files) - first, first)


def language_of(path: str) -> str:
    """The code-block language for a file name ('' when unknown)."""
    m = re.search(r"\.[A-Za-z0-9]+$", path or "")
    return _LANGS.get(m.group().lower(), "") if m else ""


def chat_prompt(tok: Tokenizer, template, prefix: str, suffix: str, extra: Sequence[ExtraFile | Mapping] = (),
                *, path: str = "filename", budget: int | None = None) -> InfillPrompt:
    """The chat-template infill prompt (module header). `template`: a `chat.ChatTemplate`. The user's text
    is placed through sentinels and encoded as plain text; the template's own text keeps its special
    tokens."""
    _check_text(prefix, suffix)
    if template is None:
        raise FIMError("this container has no chat template: the chat way of infilling needs one")
    stop_ids = FIMTokens.from_tokenizer(tok).stop_ids  # a model without FIM tokens is not a coder: refused
    files = _extras(extra)
    lang = language_of(path)
    # sentinels: private-use characters that no template and (almost) no file contains; a user text that
    # does contain one is refused rather than mis-split
    marks = [f"\ue000{i}\ue001" for i in range(2 * len(files) + 4)]
    for t in (prefix, suffix, path, *(f.filename for f in files), *(f.text for f in files)):
        if "\ue000" in t:
            raise FIMError("the text contains the private-use character U+E000, which the chat infill "
                           "prompt reserves")

    def build(first: int):
        kept = files[first:]
        texts: list[str] = []

        def put(text: str) -> str:
            texts.append(text)
            return marks[len(texts) - 1]

        other = "".join(f"File {put(f.filename)}:\n```{language_of(f.filename)}\n{put(f.text)}\n```\n\n"
                        for f in kept)
        user = (other + CHAT_INSTRUCTION.format(cursor=CURSOR, path=put(path), lang=lang) + "\n\n"
                f"```{lang}\n{put(prefix)}{CURSOR}{put(suffix)}\n```")
        rendered = template.render([{"role": "user", "content": user}], add_generation_prompt=True)
        rendered += f"```{lang}\n" + put(prefix)
        ids: list[int] = []
        n_prefix = n_suffix = 0
        pos = 0
        for m in re.finditer("\ue000(\\d+)\ue001", rendered):
            ids += tok.encode(rendered[pos:m.start()])
            i = int(m.group(1))
            piece = tok.encode_text(texts[i])
            if texts[i] is prefix:
                n_prefix += len(piece)
            elif texts[i] is suffix:
                n_suffix += len(piece)
            ids += piece
            pos = m.end()
        ids += tok.encode(rendered[pos:])
        return ids, n_prefix, n_suffix, len(ids) - n_prefix - n_suffix

    ids, n_p, n_s, n_e, first = _fit(build, len(files), budget)
    return InfillPrompt(ids, "chat", stop_ids, (FENCE,), n_p, n_s, n_e, len(files) - first, first)


def build_prompt(way: Way, tok: Tokenizer, template, prefix: str, suffix: str,
                 extra: Sequence[ExtraFile | Mapping] = (), *, path: str = "filename",
                 budget: int | None = None) -> InfillPrompt:
    """`fim_prompt` or `chat_prompt` by `way`."""
    if way == "fim":
        return fim_prompt(tok, prefix, suffix, extra, path=path, budget=budget)
    if way == "chat":
        return chat_prompt(tok, template, prefix, suffix, extra, path=path, budget=budget)
    raise FIMError(f"unknown infill way {way!r} (expected one of {WAYS})")


# ---- which way for which model ---------------------------------------------------------------------------
_INSTRUCT = re.compile(r"instruct|(^|[-_ ./])chat([-_ ./]|$)", re.I)


def model_variant(metadata: Mapping[str, Any]) -> tuple[str, str]:
    """("base" | "instruct", why) of a container, from its metadata: the `variant` key where the packer
    wrote one, else the name of the source it was packed from (`provenance.source`: a hub id like
    Qwen/Qwen2.5-Coder-1.5B-Instruct, or a file name): "Instruct" or "chat" in it means an Instruct model,
    anything else a base model. Qwen's base and Instruct models ship the same chat template, so the
    template cannot tell them apart."""
    v = metadata.get("variant")
    if v in ("base", "instruct"):
        return v, f"the container's metadata says variant={v!r}"
    source = str((metadata.get("provenance") or {}).get("source") or "")
    name = re.split(r"[\\/]", source.rstrip("/\\"))[-2:] if source else []
    label = "/".join(name)
    if not source:
        return "base", "no variant or source name in the metadata; taken as a base model"
    if _INSTRUCT.search(label):
        return "instruct", f"packed from {label!r}, an Instruct model"
    return "base", f"packed from {label!r}, no 'Instruct' in the name: a base model"


# Instruct models up to this hidden size infill the chat way; larger ones, and every base model, with
# the FIM tokens. By the pass rates in bench/RESULTS.md (HumanEval infilling, greedy, middle trimmed):
# the 0.5B-Instruct (hidden 896) passes 45.0 % the chat way against 26.8 % with the FIM tokens, on which
# it runs past the middle (291 tasks); the 1.5B-Instruct (hidden 1536) passes 72.9 % with the FIM
# tokens against 60.4 % the chat way (96 tasks). Instruct models above the 1.5B are not measured: they
# get the 1.5B's way.
CHAT_INFILL_MAX_HIDDEN = 896


def choose_way(variant: str, hidden_size: int) -> Way:
    """The prompting way the server and the CLI use for a model: its variant (`model_variant`) and its
    hidden size (config `hidden_size`), by the measured pass rates (CHAT_INFILL_MAX_HIDDEN)."""
    return "chat" if variant == "instruct" and hidden_size <= CHAT_INFILL_MAX_HIDDEN else "fim"


# ---- trimming the middle ---------------------------------------------------------------------------------
_MIN_HEAD = 8  # non-blank characters of the suffix that must repeat before the middle is cut there


def _suffix_head(suffix: str) -> str:
    """The start of the suffix that, found in the middle, means the middle repeats the suffix: its first
    lines up to and including the first one that brings at least _MIN_HEAD non-blank characters (the
    whole suffix when shorter), stripped of surrounding whitespace."""
    lines = suffix.splitlines(keepends=True)
    head, count = "", 0
    for line in lines:
        head += line
        count += len("".join(line.split()))
        if count >= _MIN_HEAD:
            break
    return head.strip()


def cut_at_suffix(middle: str, suffix: str) -> tuple[str, bool]:
    """(the middle cut where it starts repeating the suffix, whether it was cut).

    The suffix's head (`_suffix_head`) is looked for in the middle. Where the suffix starts with
    whitespace (`lead`), a match counts at the start of a line (after indentation): the middle is cut at
    that line's start, less the newlines `lead` itself brings; or right after the same whitespace within
    a line. Where the suffix starts with text (the cursor is inside a word or a line), a match counts
    anywhere and the middle is cut right there. An empty or all-blank suffix never cuts."""
    head = _suffix_head(suffix)
    if not head:
        return middle, False
    lead = suffix[: len(suffix) - len(suffix.lstrip())]
    start = 0
    while (i := middle.find(head, start)) >= 0:
        start = i + 1
        before = middle[:i]
        line_start = before.rfind("\n") + 1
        if not lead:
            return before, True
        if not before[line_start:].strip():
            kept = middle[:line_start]
            for _ in range(lead.count("\n")):
                if kept.endswith("\n"):
                    kept = kept[:-1]
            return kept, True
        if "\n" not in lead and before.endswith(lead):
            return before[: len(before) - len(lead)], True
    return middle, False


def cut_lines(middle: str, max_lines: int | None) -> tuple[str, bool]:
    """(the middle cut to at most `max_lines` lines, whether it was cut). A line is counted when it has
    text or ends with a newline; the newline ending the last kept line is dropped (editors insert the
    middle before the text after the cursor, which is on that line)."""
    if max_lines is None:
        return middle, False
    if max_lines < 1:
        raise FIMError(f"max_lines must be >= 1, got {max_lines}")
    lines = middle.split("\n")
    if len(lines) <= max_lines or (len(lines) == max_lines + 1 and lines[-1] == ""):
        return middle, False
    return "\n".join(lines[:max_lines]), True


def trim_middle(middle: str, suffix: str, *, max_lines: int | None = None, suffix_repeat: bool = True
                ) -> tuple[str, bool]:
    """`cut_at_suffix` (unless suffix_repeat is False), then `cut_lines`; (middle, whether cut)."""
    cut = False
    if suffix_repeat:
        middle, cut = cut_at_suffix(middle, suffix)
    middle, cut2 = cut_lines(middle, max_lines)
    return middle, cut or cut2


class MiddleTrimmer:
    """`trim_middle` on streamed text: `push(text) -> (text safe to show now, done)`, `flush()` -> the rest.

    The concatenation of everything returned equals `trim_middle` of the text pushed so far when `done`
    (the caller ends the request there), else of all the text at `flush()`. Text is shown only where no
    later cut can reach it: before the newlines that end the complete lines (a cut at a line start also
    drops up to as many newlines as the suffix starts with, and a line budget drops the newline that ends
    the last kept line), and more than the suffix head's length from the end (a suffix that starts
    inside a line is cut wherever its head begins)."""

    def __init__(self, suffix: str, *, max_lines: int | None = None, suffix_repeat: bool = True):
        if max_lines is not None and max_lines < 1:
            raise FIMError(f"max_lines must be >= 1, got {max_lines}")
        self.suffix, self.max_lines, self.suffix_repeat = suffix, max_lines, suffix_repeat
        self.text = ""
        self.sent = 0
        self.done = False
        self.trimmed = False
        self.cut_by: str | None = None  # "suffix" | "lines" once the middle was cut
        head = _suffix_head(suffix) if suffix_repeat else ""
        lead = suffix[: len(suffix) - len(suffix.lstrip())]
        self._hold_chars = len(head) + len(lead) if head else 0
        self._hold_newlines = lead.count("\n") + 1

    def push(self, text: str) -> tuple[str, bool]:
        if self.done:
            return "", True
        self.text += text
        cut, trimmed = self._trim()
        if trimmed:
            self.done = True
            out, self.sent = cut[self.sent:], len(cut)
            return out, True
        safe = self.text.rfind("\n") + 1 - self._hold_newlines
        safe = min(safe, len(self.text) - self._hold_chars) if self._hold_chars else safe
        if safe <= self.sent:
            return "", False
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> str:
        """What is left to show at the end of generation."""
        if self.done:
            return ""
        self.done = True
        cut, _ = self._trim()
        return cut[self.sent:]

    def _trim(self) -> tuple[str, bool]:
        """trim_middle of the text so far; sets `trimmed` and `cut_by` ("suffix" or "lines") on a cut."""
        text, by_suffix = cut_at_suffix(self.text, self.suffix) if self.suffix_repeat else (self.text, False)
        text, by_lines = cut_lines(text, self.max_lines)
        if by_suffix or by_lines:
            self.trimmed = True
            self.cut_by = "suffix" if by_suffix else "lines"
        return text, by_suffix or by_lines
