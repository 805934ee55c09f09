"""Models by name: `generate`, `nanoqwen-quant pack`, `list` and `rm` with a Hugging Face id,
against a local Hub mirror (packages/nanoqwen-quant/tests/hub_mirror.py: a folder served on 127.0.0.1
the way huggingface_hub reads the Hub), never the network.

Every command runs as a user runs it, in a subprocess on the CPU, with HF_ENDPOINT at the mirror and
HF_HOME and NANOQWEN_CACHE in the test's own folder (no real cache is read or written). The mirror
serves the tiny random Qwen2 of the quant tests (an HF folder), a GPTQ checkpoint of it, and a GGUF
repo of it (two files).

- the first `generate tiny/coder` fetches, packs (RTN on the CPU) and runs; the second finds the cached
  container and sends the mirror no request at all;
- the GPTQ checkpoint is imported, byte for byte the tensors of a local `pack --method import`;
- `owner/name:F16` fetches that one GGUF file of the repo, packs and runs it; the repo without a tag
  is refused, listing its files;
- an unreachable Hub (one that drops every connection, or HF_HUB_OFFLINE=1) gives one line that names
  the offline routes, after one attempt (the dropping server counts connections: no retry loop);
- a repo the Hub does not have is one line;
- `list` shows the cached models within 80 columns in a pipe; `rm` removes one, and says so in one line
  when the name is not cached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
import pytest
from nanoqwen_cli.main import app
from typer.testing import CliRunner

QUANT_TESTS = Path(__file__).parents[2] / "nanoqwen-quant" / "tests"
sys.path.insert(0, str(QUANT_TESTS))

import checkpoint_writers as cw  # noqa: E402
from hub_mirror import DroppingServer, HubMirror  # noqa: E402

_spec = importlib.util.spec_from_file_location("nanoqwen_quant_tests_conftest", QUANT_TESTS / "conftest.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

TIMEOUT_S = 300
ROUTES = "offline, give a local GGUF file or Hugging Face folder, or a .nanoqwen file"


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory) -> Path:
    """tiny/coder (the tiny float model), tiny/coder-gptq (a GPTQ v1 sym g128 checkpoint of it) and
    tiny/coder-GGUF (two GGUF files of it, f32 and f16, as GGUF repos publish one file per quant type)."""
    root = tmp_path_factory.mktemp("hub")
    coder = tiny.write_tiny_folder(root / "tiny" / "coder")
    cw.write_gptq(root / "tiny" / "coder-gptq", tiny.tiny_state_dict(), dict(tiny.TINY_CONFIG), coder,
                  group_size=128, sym=True, checkpoint_format="gptq")
    (root / "tiny" / "coder-GGUF").mkdir()
    for kind, dtype in (("f32", np.float32), ("f16", np.float16)):
        cw.write_gguf(root / "tiny" / "coder-GGUF" / f"tiny-coder-{kind}.gguf", coder, dtype)
    (root / "tiny" / "coder-GGUF" / "README.md").write_text("two GGUF files\n")
    return root


@pytest.fixture
def mirror(hub_root):
    m = HubMirror(hub_root)
    yield m
    m.stop()


def env_for(tmp_path: Path, endpoint: str, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "NANOQWEN_"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), NANOQWEN_CACHE=str(tmp_path / "nanoqwen"),
               CUDA_VISIBLE_DEVICES="", HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def run(module: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S)


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return run("nanoqwen_cli.main", args, env)


def quant(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return run("nanoqwen_quant.cli", args, env)


GENERATE = ["generate", "tiny/coder", "-p", "def", "--max-tokens", "2", "--temperature", "0"]


def test_fetch_and_pack_then_the_cache_without_the_network(mirror, tmp_path):
    env = env_for(tmp_path, mirror.url)
    first = cli(GENERATE, env)
    assert first.returncode == 0, first.stderr
    cached = tmp_path / "nanoqwen" / "models" / "tiny--coder--rtn.nanoqwen"
    assert cached.is_file()
    assert ("GET", "/api/models/tiny/coder") in mirror.requests
    assert any(p.endswith("/model-00001-of-00002.safetensors") for m, p in mirror.requests if m == "GET")
    assert "fetching tiny/coder (safetensors) from the Hugging Face Hub" in first.stderr
    assert "recipe: rtn (no CUDA GPU here" in first.stderr
    assert "ask for it with tiny/coder:gptq)" in first.stderr
    assert f"packed {cached}: " in first.stderr
    assert "[1 prompt tokens, 2 generated" in first.stderr  # then it ran
    with nqf.open(cached) as f:
        assert f.metadata["provenance"]["source"] == "tiny/coder"
        assert f.metadata["quantization"]["method"] == "rtn"

    served = mirror.count()
    second = cli(GENERATE, env)
    assert second.returncode == 0, second.stderr
    assert mirror.count() == served  # the cache answered: not one request reached the mirror
    assert second.stderr.splitlines()[0] == f"model: {cached} (cached)"
    assert second.stdout == first.stdout  # greedy, the same container


def test_a_gptq_checkpoint_is_imported_exactly(mirror, hub_root, tmp_path):
    env = env_for(tmp_path, mirror.url)
    res = quant(["pack", "tiny/coder-gptq"], env)  # no --method, no -o: import into the cache
    assert res.returncode == 0, res.stderr
    cached = tmp_path / "nanoqwen" / "models" / "tiny--coder-gptq--import.nanoqwen"
    assert "importing gptq (gptq) g128 sym exactly" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"packed {cached}: ")
    local = tmp_path / "local.nanoqwen"
    res = quant(["pack", str(hub_root / "tiny" / "coder-gptq"), "-o", str(local), "--method", "import"], env)
    assert res.returncode == 0, res.stderr
    with nqf.open(cached) as a, nqf.open(local) as b:
        assert a.metadata["quantization"]["method"] == "import"
        assert {n: (r.layout, r.checksum) for n, r in a.records.items()} == \
               {n: (r.layout, r.checksum) for n, r in b.records.items()}


def test_one_gguf_file_of_a_repo_by_its_quant_tag(mirror, tmp_path):
    """`owner/name:F16` fetches that GGUF file only (as llama.cpp's `-hf user/repo:Q4_K_M`), packs and
    runs it; the repo without a tag is refused, listing its GGUF files."""
    env = env_for(tmp_path, mirror.url)
    res = cli(["generate", "tiny/coder-GGUF:F16", *GENERATE[2:]], env)
    assert res.returncode == 0, res.stderr
    assert "fetching tiny/coder-GGUF:F16 (tiny-coder-f16.gguf) from the Hugging Face Hub" in res.stderr
    fetched = {p.rsplit("/", 1)[-1] for m, p in mirror.requests if m == "GET" and "/resolve/" in p}
    assert fetched == {"tiny-coder-f16.gguf"}, fetched
    cached = tmp_path / "nanoqwen" / "models" / "tiny--coder-GGUF--F16--rtn.nanoqwen"
    assert f"packed {cached}: " in res.stderr and "[1 prompt tokens, 2 generated" in res.stderr
    res = quant(["pack", "tiny/coder-GGUF"], env)
    assert res.returncode == 1 and res.stderr.splitlines() == [
        "error: tiny/coder-GGUF holds 2 GGUF files: pick one with tiny/coder-GGUF:QUANT (such as Q4_K_M) "
        "or tiny/coder-GGUF:FILE.gguf (tiny-coder-f16.gguf, tiny-coder-f32.gguf)"], res.stderr


def test_an_unreachable_hub_is_one_line_after_one_attempt(tmp_path):
    hub = DroppingServer()
    try:
        res = cli(GENERATE, env_for(tmp_path, hub.url))
    finally:
        hub.stop()
    lines = res.stderr.splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: cannot reach the Hugging Face Hub ({hub.url}: ")
    assert "to fetch tiny/coder, and it is not in the cache" in lines[0] and ROUTES in lines[0]
    # huggingface_hub's own first request (its agent check) and ours; a retry loop would make 6 or more
    assert hub.connections <= 2, hub.connections


def test_offline_mode_is_one_line(tmp_path):
    res = quant(["pack", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "--method", "rtn"],
                env_for(tmp_path, "http://127.0.0.1:9", HF_HUB_OFFLINE="1"))
    lines = res.stderr.splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert "cannot reach the Hugging Face Hub" in lines[0] and "HF_HUB_OFFLINE is set" in lines[0]
    assert ROUTES in lines[0]


def test_a_repo_the_hub_does_not_have_is_one_line(mirror, tmp_path):
    res = quant(["pack", "nobody/nothing"], env_for(tmp_path, mirror.url))
    assert res.returncode == 1 and res.stderr.splitlines() == [
        "error: nobody/nothing: no such model on the Hugging Face Hub (or it is private: log in with "
        "hf auth login)"], res.stderr


def test_list_and_rm(hub_root, tmp_path, monkeypatch):
    """The cache as `list` and `rm` show it (in-process: neither command imports torch)."""
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "nanoqwen"))
    runner = CliRunner()
    res = runner.invoke(app, ["list"])
    assert res.exit_code == 0 and res.output.startswith("no models in the cache "), res.output
    from nanoqwen_quant.cli import app as quant_app

    folder = hub_root / "tiny" / "coder"
    for method in ("rtn", "none"):
        assert runner.invoke(quant_app, ["pack", str(folder), "--method", method]).exit_code == 0
    res = runner.invoke(app, ["list"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(map(len, lines)) <= 80, res.output
    rows = [line.split() for line in lines if line.startswith("local:")]
    assert [(r[0].startswith("local:coder--"), r[1]) for r in rows] == [(True, "none"), (True, "rtn")], rows
    assert all(r[-1].startswith("local--coder--") for r in rows)  # the file column fits here
    listed = json.loads(runner.invoke(app, ["list", "--json"]).output)
    assert [m["recipe"] for m in listed] == ["none", "rtn"] and all(Path(m["path"]).is_file() for m in listed)

    long = Path(listed[0]["path"]).with_name("Qwen--Qwen2.5-Coder-32B-Instruct-GGUF--qwen2.5-coder-32b-"
                                             "instruct-q4_k_m--rtn.nanoqwen")
    long.write_bytes(Path(listed[0]["path"]).read_bytes())
    res = runner.invoke(app, ["list"])  # a long name: the file column gives way, and it says so
    assert res.exit_code == 0 and max(map(len, res.output.splitlines())) <= 80, res.output
    assert "Qwen/Qwen2.5-Coder-32B-Instruct-GGUF:qwen2.5-coder-32b-instruct" in res.output  # folded, not cut
    assert "(file names left out at 80 columns: list --json or a wider terminal shows them)" in res.output
    long.unlink()

    res = runner.invoke(app, ["rm", listed[1]["name"]])  # two recipes of it: which one?
    assert res.exit_code == 1 and "2 cached recipes; give one of" in res.output
    res = runner.invoke(app, ["rm", listed[1]["full_name"]])
    assert res.exit_code == 0 and res.output.startswith(f"removed {listed[1]['full_name']} ("), res.output
    assert not Path(listed[1]["path"]).exists() and Path(listed[0]["path"]).exists()
    res = runner.invoke(app, ["rm", listed[1]["full_name"]])
    assert res.exit_code == 1 and len(res.output.splitlines()) == 1, res.output
    assert f"error: {listed[1]['full_name']}: not in the model cache" in res.output
