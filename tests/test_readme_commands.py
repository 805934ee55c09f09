"""CPU: every `nanoqwen-cli` / `nanoqwen-quant` command of the root README, run as a user types it.

The commands are read from the README's ```bash blocks (so a command added there is run here) and run by
bash in a scratch folder, with the console scripts this environment installed:
- every `.nanoqwen` file a command reads is the real Qwen2.5-Coder-0.5B packed with RTN (a link to the
  cached pack), and the files the commands name (`module.py`, `before.py`, `after.py`) exist;
- the machine is offline, as CI is: the Hugging Face endpoint is a closed local port, so a command that
  names a hub model must end in the one-line offline error that names the offline routes;
- `--max-tokens 4` is appended to every generation (the README's commands write hundreds of tokens);
- `chat` reads `/exit` from stdin; a CPU `serve` is started on a free port, waited for until its
  ready line, and stopped with SIGTERM (exit 0); `--device cuda` on this GPU-less machine must be one
  line, exit 1, as must `bench`.

A command of a kind this file does not know fails the test: the README cannot grow a command that no
test runs.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
HUB_ID = re.compile(r"\b[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+\b")


def readme_commands() -> list[str]:
    """The README's nanoqwen command lines: bash blocks, continuations joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if re.search(r"(^|[|&] *|=\S+ )nanoqwen-(cli|quant) ", line):
                out.append(re.sub(r"\s+", " ", line))
    return out


COMMANDS = readme_commands()


def test_the_readme_has_the_commands_a_user_needs():
    kinds = {c.split("nanoqwen-")[1].split()[0] + " " + c.split("nanoqwen-")[1].split()[1] for c in COMMANDS}
    for needed in ("cli generate", "cli chat", "cli serve", "cli inspect", "cli list", "quant pack"):
        assert needed in kinds, f"the README shows no `nanoqwen-{needed}` command"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, qwen05b_packed) -> Path:
    folder = tmp_path_factory.mktemp("readme")
    pack = qwen05b_packed("rtn")
    for cmd in COMMANDS:
        for word in shlex.split(cmd):
            if word.endswith(".nanoqwen") and f"-o {word}" not in cmd:
                (folder / word).unlink(missing_ok=True)
                (folder / word).symlink_to(pack)
    (folder / "module.py").write_text("import math\n\n\ndef area(r):\n")
    (folder / "before.py").write_text("def add(a, b):\n    ")
    (folder / "after.py").write_text("\n\n\nprint(add(1, 2))\n")
    return folder


def _env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NANOQWEN_DEBUG", "HF_HUB_OFFLINE")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["NANOQWEN_CACHE"] = str(folder / "cache")
    env["HF_HOME"] = str(folder / "hf")
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # discard port: nothing listens, as offline
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(proc: subprocess.CompletedProcess, shown: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, shown
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command(command: str, scratch: Path):
    env = _env(scratch)
    argv = shlex.split(command.split("|")[-1] if command.startswith("echo") else command.split("|")[0])
    while "=" in argv[0]:  # VAR=value prefixes
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    tool, verb = argv[0], argv[1]
    if verb in ("generate", "infill"):
        command += " --max-tokens 4"
    hub = [w for w in argv[2:3] if HUB_ID.fullmatch(w) and not (scratch / w).exists()]
    is_cuda = "--device cuda" in command
    if verb == "serve" and not is_cuda:
        port = _free_port()
        command = re.sub(r"--port \d+", "", command) + f" --port {port}"
        proc = subprocess.Popen(f"exec {command}", shell=True, cwd=scratch, env=env, text=True,
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        try:
            for line in proc.stderr:  # the event: the server says it is ready (or it exits)
                if "ready on http://" in line:
                    break
            else:
                pytest.fail(f"{command}: exited {proc.wait()} before it was ready")
            proc.send_signal(signal.SIGTERM)  # the server itself (exec): it drains and exits 0
            assert proc.wait(timeout=TIMEOUT_S) == 0, command
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        return
    stdin = "/exit\n" if verb == "chat" else None
    proc = subprocess.run(command, shell=True, cwd=scratch, env=env, text=True, input=stdin,
                          capture_output=True, timeout=TIMEOUT_S)
    shown = f"{command}\nrc {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}\nstdout:\n{proc.stdout[-1000:]}"
    if hub:  # offline: one line, naming the routes that work without the network
        line = _one_line(proc, shown)
        assert "GGUF" in line and ".nanoqwen" in line, shown
    elif is_cuda or verb == "bench":  # no GPU here
        line = _one_line(proc, shown)
        assert "GPU" in line or "CUDA" in line or "cuda" in line, shown
    elif tool == "nanoqwen-quant" and verb == "pack":  # a local file the README names but this folder lacks
        line = _one_line(proc, shown)
        assert "no such file" in line, shown
    elif verb in ("generate", "chat", "infill", "inspect", "list", "verify"):
        assert proc.returncode == 0, shown
        if verb in ("generate", "infill", "inspect"):
            assert proc.stdout.strip(), shown
    else:
        pytest.fail(f"no expectation for the README command {command!r}: add one here")
