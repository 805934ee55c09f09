"""`nanoqwen-quant` as a user runs it (subprocess, CPU): every refusal of `pack` comes before the source
is read, as one stderr line `error: ...` with exit code 2 (bad command line) or 1 (files, source,
device), and leaves no file behind; the files a pack writes (mode 0666 & ~umask, a temp file the
output's glob finds, a SIGKILLed pack's temp file removed and reported by the next one, a running
pack to the same path refused); `--debug`; `eval` and `heldout` errors; the README names every option.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import nanoqwen_format as nqf
import pytest
import torch
import typer
from nanoqwen_quant import cli
from nanoqwen_quant.cli import app
from nanoqwen_quant.options import DeviceError, PackOptions, UsageError
from nanoqwen_quant.pack import pack
from nanoqwen_quant.sources import open_source
from typer.testing import CliRunner

README = Path(__file__).parents[1] / "README.md"


def run_cli(*args, umask: int | None = None) -> subprocess.CompletedProcess:
    preexec = (lambda: os.umask(umask)) if umask is not None else None
    return subprocess.run([sys.executable, "-m", "nanoqwen_quant.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=600, preexec_fn=preexec)


def assert_refused(res: subprocess.CompletedProcess, code: int, match: str) -> None:
    lines = res.stderr.splitlines()
    assert res.returncode == code, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert match in lines[0], lines[0]
    assert res.stdout == ""


def tree(root: Path) -> dict[str, int]:
    """Every path under root (files, folders, FIFOs), with its size: what 'no file left behind' compares."""
    return {str(p.relative_to(root)): p.lstat().st_size for p in root.rglob("*")}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---------------------------------------------------------------------------------------- refusals
# (id, extra arguments, setup(tmp_path) or None, exit code, text of the one stderr line). Arguments
# name "{out}" (tmp/out/m.nanoqwen), "{dir}" (tmp/out) and "{tmp}"; SRC is the tiny HF folder.
REFUSALS = [
    ("out-is-dir", ["-o", "{dir}", "--method", "rtn"], None, 2, "is a directory; give a file path"),
    ("out-is-dir-gptq", ["-o", "{dir}", "--method", "gptq"], None, 2, "is a directory"),
    ("out-is-fifo", ["-o", "{dir}/pipe"], lambda t: os.mkfifo(t / "out" / "pipe"), 2, "not a regular file"),
    ("out-folder-missing", ["-o", "{dir}/no/m.nanoqwen"], None, 1, "output folder does not exist"),
    ("out-folder-is-file", ["-o", "{dir}/f/m.nanoqwen"], lambda t: (t / "out" / "f").write_text("x"), 1,
     "output folder is not a folder"),
    ("method", ["--method", "awq"], None, 2,
     "method (--method) must be one of none, rtn, gptq, import, got 'awq'"),
    ("group-size", ["--group-size", "48"], None, 2, "group_size (--group-size) must be one of 32, 64, 128"),
    ("group-size-not-int", ["--group-size", "abc"], None, 2, "Invalid value for '--group-size'"),
    ("lm-head", ["--lm-head", "int2"], None, 2, "lm_head (--lm-head) must be one of bf16, int8, int4"),
    ("device-name", ["--device", "gpu"], None, 2, "must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("device-mps", ["--device", "mps"], None, 2, "must be auto, cpu, cuda or cuda:N"),
    ("none-group-size", ["--method", "none", "--group-size", "64"], None, 2, "applies to int4/int8 weights"),
    ("none-sym", ["--method", "none", "--sym"], None, 2, "symmetric=True (--sym) applies to int4"),
    ("none-sym-int8-head", ["--method", "none", "--sym", "--lm-head", "int8"], None, 2,
     "the int8 lm_head is symmetric only"),
    ("rtn-damp", ["--method", "rtn", "--damp", "0.1"], None, 2,
     "gptq.damp_percent (--damp) applies to method gptq only, not rtn"),
    ("rtn-act-order", ["--method", "rtn", "--no-act-order"], None, 2,
     "(--act-order/--no-act-order) applies to method gptq only"),
    ("rtn-calib", ["--method", "rtn", "--calib", "{tmp}"], None, 2,
     "calib_paths (--calib) applies to method gptq or --awq"),
    ("rtn-calib-tokens", ["--method", "rtn", "--calib-tokens", "4096"], None, 2,
     "calib_tokens (--calib-tokens) applies"),
    ("none-calib-batch", ["--method", "none", "--calib-batch", "2"], None, 2, "(--calib-batch) applies to"),
    ("rtn-resume", ["--method", "rtn", "--resume"], None, 2,
     "resume (--resume) applies to method gptq or --awq only"),
    ("rtn-checkpoint-dir", ["--method", "rtn", "--checkpoint-dir", "{tmp}/ck"], None, 2,
     "(--checkpoint-dir) applies"),
    ("gptq-seq-len", ["--method", "gptq", "--calib-seq-len", "8"], None, 2, "must be >= 16, got 8"),
    ("gptq-tokens", ["--method", "gptq", "--calib-tokens", "100", "--calib-seq-len", "512"], None, 2,
     "calib_tokens (--calib-tokens) must be at least one window"),
    ("gptq-batch", ["--method", "gptq", "--calib-batch", "0"], None, 2, "must be >= 1, got 0"),
    ("gptq-damp", ["--method", "gptq", "--damp", "0"], None, 2, "(--damp) must be a number > 0"),
    ("gptq-damp-nan", ["--method", "gptq", "--damp", "nan"], None, 2, "(--damp) must be a number > 0"),
    ("gptq-calib-missing", ["--method", "gptq", "--calib", "{tmp}/nope"], None, 1,
     "calibration path not found"),
    ("gptq-calib-empty", ["--method", "gptq", "--calib", "{tmp}/empty"], lambda t: (t / "empty").mkdir(), 1,
     "no files under"),
    ("gptq-resume-nothing", ["--method", "gptq", "--resume"], None, 1, "--resume: no checkpoint folder"),
    ("gptq-checkpoint-there", ["--method", "gptq"], lambda t: (t / "out" / "m.nanoqwen.ckpt").mkdir(), 1,
     "exists: pass --resume"),
]


@pytest.mark.parametrize(("args", "setup", "code", "match"), [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_pack_refuses_in_one_line_and_leaves_nothing(tiny_hf, tmp_path, args, setup, code, match):
    (tmp_path / "out").mkdir()
    if setup:
        setup(tmp_path)
    before, src_before = tree(tmp_path), tree(tiny_hf)
    fill = {"{out}": str(tmp_path / "out" / "m.nanoqwen"), "{dir}": str(tmp_path / "out"),
            "{tmp}": str(tmp_path)}
    args = [re.sub(r"\{\w+\}", lambda m: fill[m.group(0)], a) for a in args]
    if "-o" not in args and match != "Missing option '-o'":
        args += ["-o", fill["{out}"]]
    assert_refused(run_cli("pack", tiny_hf, *args), code, match)
    assert tree(tmp_path) == before and tree(tiny_hf) == src_before


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pack_refuses_cuda_without_a_gpu(tiny_hf, tmp_path):
    res = run_cli("pack", tiny_hf, "-o", tmp_path / "m.nanoqwen", "--device", "cuda")
    assert_refused(res, 1, "device 'cuda' (--device) asked for, but torch")
    res = run_cli("pack", tiny_hf, "-o", tmp_path / "m.nanoqwen", "--device", "cuda:1")
    assert_refused(res, 1, "sees no CUDA")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_pack_refuses_a_read_only_output_folder(tiny_hf, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert_refused(run_cli("pack", tiny_hf, "-o", ro / "m.nanoqwen"), 1, "output folder is not writable")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_pack_refuses_bad_sources_in_one_line(tiny_hf, tmp_path, tiny_config, make_tiny_folder):
    out = tmp_path / "m.nanoqwen"
    assert_refused(run_cli("pack", tmp_path / "missing", "-o", out), 1, "no such file or folder")
    llama = make_tiny_folder(tmp_path / "llama", dict(tiny_config, model_type="llama"))
    assert_refused(run_cli("pack", llama, "-o", out), 1, "'llama' is not supported")
    # read from the config alone, before any weight: the int4 lm_head needs vocab_size % 8 == 0
    odd = make_tiny_folder(tmp_path / "odd", dict(tiny_config, vocab_size=324))
    assert_refused(run_cli("pack", odd, "-o", out, "--lm-head", "int4"), 2, "vocab_size is 324")
    assert not out.exists() and not list(tmp_path.glob("m.nanoqwen*"))


def test_debug_adds_the_traceback(tiny_hf, tmp_path):
    res = run_cli("pack", tiny_hf, "-o", tmp_path, "--debug")
    assert res.returncode == 2 and res.stderr.startswith("Traceback (most recent call last):")
    assert res.stderr.splitlines()[-1].startswith("error: output (-o/--out)")
    assert "UsageError" in res.stderr


# ------------------------------------------------------------------------------------------- files
_KILLED_PACK = """
    import sys, time
    from nanoqwen_quant.options import PackOptions
    from nanoqwen_quant.pack import pack
    from nanoqwen_quant.sources import open_source

    def progress(stage, done, total):
        if stage == "layer 1":  # embed_tokens and layer 0 are in the temp file
            print("writing", flush=True)
            time.sleep(600)

    pack(open_source(sys.argv[1]), sys.argv[2], PackOptions(method="rtn", device="cpu"), progress=progress,
         log=print)
"""


def test_sigkilled_pack_is_cleaned_up_by_the_next_one(tiny_hf, tmp_path):
    out = tmp_path / "m.nanoqwen"
    out.write_bytes(b"an older model")  # replaced atomically by a pack that succeeds, never before
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED_PACK), str(tiny_hf), str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        files = sorted(p.name for p in tmp_path.glob("m.nanoqwen*"))  # the temp file shows in the glob
        assert len(files) == 2 and re.fullmatch(rf"m\.nanoqwen\.partial-{writer.pid}-[0-9a-f]{{8}}", files[1])
        before = tree(tmp_path)
        # a second pack to the same path while the first writes: refused before the source is opened
        assert_refused(run_cli("pack", tiny_hf, "-o", out, "--method", "rtn"), 1,
                       f"another write to this file is running (process {writer.pid}, temp file {files[1]}")
        assert tree(tmp_path) == before
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
    assert tree(tmp_path) == before and out.read_bytes() == b"an older model"
    res = run_cli("pack", tiny_hf, "-o", out, "--method", "rtn", umask=0o027)
    assert res.returncode == 0, res.stderr
    reports = [line for line in res.stderr.splitlines() if "temp file" in line]
    assert len(reports) == 1 and reports[0].startswith(f"{out}: removed the stale temp file {files[1]} (")
    assert reports[0].endswith(f"MB) of an interrupted write: process {writer.pid} is gone")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.nanoqwen"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o640  # 0666 & ~umask
    with nqf.open(out) as f:
        f.verify()


def test_stale_temp_file_of_a_dead_pid_is_removed_and_reported(tiny_hf, tmp_path):
    out = tmp_path / "m.nanoqwen"
    stale = tmp_path / f"m.nanoqwen.partial-{_dead_pid()}-x"
    stale.write_bytes(bytes(300_000))
    res = run_cli("pack", tiny_hf, "-o", out, "--method", "none", umask=0o022)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stderr.splitlines() if stale.name in line]
    assert len(lines) == 1 and "removed the stale temp file" in lines[0] and "(0.3 MB)" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.nanoqwen"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


# ------------------------------------------------------------------------------- the library checks too
def test_library_pack_validates_before_reading_the_source(tiny_hf, tmp_path, monkeypatch):
    src = open_source(str(tiny_hf))

    def never(*a, **k):
        raise AssertionError("the source was read")

    monkeypatch.setattr(src, "source_sha256", never)
    monkeypatch.setattr(src, "check_complete", never)
    monkeypatch.setattr(src, "layer", never)
    with pytest.raises(UsageError, match="is a directory"):
        pack(src, tmp_path, PackOptions())
    with pytest.raises(UsageError, match="device"):
        pack(src, tmp_path / "m.nanoqwen", PackOptions(device="tpu"))
    with pytest.raises(UsageError, match="applies to method gptq or --awq only"):
        pack(src, tmp_path / "m.nanoqwen", PackOptions(method="rtn", calib_paths=[str(tmp_path)]))
    with pytest.raises(FileNotFoundError, match="output folder does not exist"):
        pack(src, tmp_path / "x" / "m.nanoqwen", PackOptions())
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="sees no CUDA device"):
            pack(src, tmp_path / "m.nanoqwen", PackOptions(device="cuda"))
    with monkeypatch.context() as m:  # a folder this user may not write to (the test may run as root)
        m.setattr(os, "access", lambda path, mode, **kw: False)
        with pytest.raises(PermissionError, match="output folder is not writable"):
            pack(src, tmp_path / "m.nanoqwen", PackOptions())
    live = nqf.Writer(tmp_path / "m.nanoqwen")  # a write to the path, running
    live.open()
    try:
        with pytest.raises(nqf.ConcurrentWriteError):
            pack(src, tmp_path / "m.nanoqwen", PackOptions())
    finally:
        live.abort()
    assert list(tmp_path.iterdir()) == []


def test_library_pack_reports_stale_temp_files_to_log(tiny_hf, tmp_path):
    out = tmp_path / "m.nanoqwen"
    stale = tmp_path / f"m.nanoqwen.partial-{_dead_pid()}-0"
    stale.write_bytes(b"x")
    logs = []
    pack(open_source(str(tiny_hf)), out, PackOptions(method="none"), log=logs.append)
    assert [m for m in logs if "stale temp file" in m] == [f"{out}: removed the stale temp file {stale.name} "
                                                          f"(1 byte) of an interrupted write: process "
                                                          f"{stale.name.split('-')[1]} is gone"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.nanoqwen"]


def test_cuda_out_of_memory_is_one_line_with_advice(tiny_hf, tmp_path, monkeypatch):
    # no GPU needed: the error torch raises, raised where the pack would run out of memory
    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.8 GiB of "
            "which 1.1 GiB is free.\nIncluding non-PyTorch memory, this process has 138 GiB in use.")

    monkeypatch.setattr(cli, "do_pack", oom)
    res = CliRunner().invoke(app, ["pack", str(tiny_hf), "-o", str(tmp_path / "m.nanoqwen")])
    assert res.exit_code == 1
    assert res.stderr.splitlines()[-1] == (
        "error: CUDA out of memory (Tried to allocate 2.00 GiB); try fewer --calib-tokens, a smaller "
        "--calib-batch, another GPU (--device cuda:N) or --device cpu")
    assert "Traceback" not in res.stderr and list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------- eval, heldout
def test_eval_and_heldout_errors_are_one_line(tmp_path):
    text = tmp_path / "t.py"
    text.write_text("x = 1\n" * 10)
    bad = tmp_path / "bad.nanoqwen"
    bad.write_bytes(b"not a container at all, but long enough to have a header and a trailer" * 4)
    assert_refused(run_cli("eval", bad, "--text", text), 1, f"{bad}: header")
    assert_refused(run_cli("eval", tmp_path / "none.nanoqwen", "--text", text), 1, "No such file")
    assert_refused(run_cli("eval", bad, "--text", tmp_path / "none.txt"), 1, "none.txt: No such file")
    assert_refused(run_cli("eval", bad, "--text", text, "--device", "gpu"), 2, "--device")
    res = run_cli("eval", bad, "--text", text, "--seq-len", "1")
    assert_refused(res, 2, "seq_len (--seq-len) must be >= 2")
    assert_refused(run_cli("heldout", "-o", tmp_path), 2, "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.nanoqwen", "t.py"]


# ------------------------------------------------------------------------------------------ docs
def test_readme_documents_every_option():
    readme = README.read_text()
    command = typer.main.get_command(app)
    for name, cmd in command.commands.items():
        for param in cmd.params:
            for opt in [*param.opts, *getattr(param, "secondary_opts", [])]:
                if opt.startswith("--") and opt != "--help":
                    found = re.search(rf"`[^`]*{re.escape(opt)}\b", readme)
                    assert found, f"{name} {opt} missing from README"


# --------------------------------------------------------------------------------- the default recipe
def test_pack_without_method_is_gptq_asym_g128_on_chat_text(tiny_hf, tmp_path):
    """No --method on a float source: PackOptions' defaults, GPTQ asym g128 calibrated on the chat text
    (the stdlib's functions as conversations in the source's own template); on the CPU with the notice.
    The calibrated path ran: GPTQ metadata, a chat calibration of the asked size."""
    out = tmp_path / "d.nanoqwen"
    small = ["--calib-tokens", "1024", "--calib-seq-len", "256"]  # tiny model: a cheap calibration
    res = CliRunner().invoke(app, ["pack", str(tiny_hf), "-o", str(out), "--device", "cpu", *small])
    assert res.exit_code == 0, res.output
    assert "note: GPTQ calibrates on the CPU" in res.stderr
    with nqf.open(out) as f:
        q = f.metadata["quantization"]
        assert (q["method"], q["symmetric"], q["group_size"]) == ("gptq", False, 128)
        assert "gptq" in q and q["calibration"]["tokens"] == 1024
        assert q["calibration"]["source"].startswith("chat:python-stdlib ")
        assert f.records["layers.0.qkv"].layout == "int4-g128-tile8x128-v1"


@pytest.mark.parametrize("text, prefix", [("chat", "chat:python-stdlib "), ("code", "python-stdlib ")])
def test_calib_text_picks_the_built_in_text(tiny_hf, tmp_path, text, prefix):
    """--calib-text chat | code: the text the calibration came from, recorded in the metadata."""
    out = tmp_path / "m.nanoqwen"
    res = CliRunner().invoke(app, ["pack", str(tiny_hf), "-o", str(out), "--device", "cpu", "--method",
                                   "gptq", "--calib-text", text, "--calib-tokens", "512", "--calib-seq-len",
                                   "128"])
    assert res.exit_code == 0, res.output
    with nqf.open(out) as f:
        assert f.metadata["quantization"]["calibration"]["source"].startswith(prefix)


@pytest.mark.parametrize("args, match", [
    (["--calib-text", "prose"], "calib_text (--calib-text) must be one of chat, code, got 'prose'"),
    (["--calib-text", "code", "--calib", "CALIB"], "calib_paths (--calib) replaces it: give one of them"),
    (["--method", "rtn", "--calib-text", "code"],
     "calib_text (--calib-text) applies to method gptq or --awq"),
])
def test_calib_text_refused(tiny_hf, calib_dir, tmp_path, args, match):
    args = [str(calib_dir) if a == "CALIB" else a for a in args]
    res = CliRunner().invoke(app, ["pack", str(tiny_hf), "-o", str(tmp_path / "m.nanoqwen"), *args])
    assert res.exit_code == 2 and match in " ".join(res.output.split()), res.output
    assert not (tmp_path / "m.nanoqwen").exists()


def test_pack_gptq_warns_once_on_cpu(tiny_hf, calib_dir, tmp_path):
    """--method gptq (asym g128 by default) on the CPU: one notice, printed before the calibrated loop
    starts, names its cost and --method rtn; the pack still runs GPTQ as asked (no fallback). --method
    rtn prints no such notice."""
    out = tmp_path / "m.nanoqwen"
    small = ["--calib", str(calib_dir), "--calib-tokens", "512", "--calib-seq-len", "64"]  # tiny model: cheap
    res = CliRunner().invoke(app, ["pack", str(tiny_hf), "-o", str(out), "--device", "cpu", "--method",
                                   "gptq", *small])
    assert res.exit_code == 0, res.output
    lines = res.stderr.splitlines()
    notices = [i for i, line in enumerate(lines) if line.startswith("note: GPTQ calibrates on the CPU")]
    assert len(notices) == 1, res.stderr
    notice = lines[notices[0]]
    assert "about 2 minutes per layer of the 0.5B" in notice and "this model has 2 layers" in notice
    assert "--method rtn is the calibration-free recipe" in notice
    calib_line = next(i for i, line in enumerate(lines) if line.startswith("calibration: "))
    assert notices[0] < calib_line  # before the calibrated loop (pack() logs the calibration first)
    with nqf.open(out) as f:
        q = f.metadata["quantization"]
        assert (q["method"], q["symmetric"], q["group_size"]) == ("gptq", False, 128)
        assert "gptq" in q and q["calibration"]["tokens"] == 512  # the calibrated path ran
        assert f.records["layers.0.qkv"].layout == "int4-g128-tile8x128-v1"
    res = CliRunner().invoke(app, ["pack", str(tiny_hf), "-o", str(tmp_path / "r.nanoqwen"),
                                   "--device", "cpu", "--method", "rtn"])
    assert res.exit_code == 0, res.output
    assert "note:" not in res.stderr and "calibrat" not in res.stderr


# ------------------------------------------------------------------------------ output and the cache
def test_pack_prints_one_summary_line_and_the_table_with_verbose(tiny_hf, tmp_path):
    """By default the pack ends with one line (file, size, time, device, worst layer error) and no
    per-layer table; --verbose adds the table (a column per linear and error kind, a row per layer)."""
    out = tmp_path / "m.nanoqwen"
    args = ["pack", str(tiny_hf), "-o", str(out), "--device", "cpu", "--method", "rtn"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"packed {out}: ") and " on cpu, worst layer weight error " in last, res.stderr
    assert "w_rel" not in res.stderr
    res = CliRunner().invoke(app, [*args, "--verbose"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "qkv w_rel" in res.stderr and "down w_rel" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"packed {out}: ")


def test_pack_without_out_fills_the_model_cache_once(tiny_hf, tmp_path):
    """No -o: the container goes into $NANOQWEN_CACHE/models under the source's name and recipe; a second
    pack of the same source and recipe finds it there and packs nothing."""
    env = {"NANOQWEN_CACHE": str(tmp_path / "cache")}
    args = ["pack", str(tiny_hf), "--device", "cpu", "--method", "rtn"]
    res = CliRunner().invoke(app, args, env=env)
    assert res.exit_code == 0, res.output
    (packed,) = (tmp_path / "cache" / "models").glob("*.nanoqwen")
    assert packed.name.startswith("local--hf--") and packed.name.endswith("--rtn.nanoqwen")
    assert f"packed {packed}: " in res.stderr
    with nqf.open(packed) as f:
        assert f.metadata["quantization"]["method"] == "rtn"
    res = CliRunner().invoke(app, args, env=env)
    assert res.exit_code == 0, res.output
    assert res.stderr.strip() == f"{packed}: already in the model cache (nanoqwen-cli rm removes it)"


def test_pack_refuses_a_container_and_a_recipe_clash(tiny_hf, tmp_path):
    out = tmp_path / "m.nanoqwen"
    assert CliRunner().invoke(app, ["pack", str(tiny_hf), "-o", str(out), "--method", "none"]).exit_code == 0
    assert_refused(run_cli("pack", out), 2, "is already a .nanoqwen container: there is nothing to pack")
    assert_refused(run_cli("pack", "owner/name:rtn", "--method", "gptq"), 2,
                   "owner/name:rtn names the recipe rtn, and --method is gptq: give one")
