"""CPU smoke test of the workload benchmark (nanoqwen_bench.engine.bench_workload): the runner drives the
engine (torch op backend, tiny random container with the byte-level test tokenizer and the Qwen chat
template) through both workloads, speculation off and on, and writes reports with the right keys and
self-consistent values. Its figures mean nothing on random weights; the real ones come from the H200
(`nanoqwen-cli bench --model ... --workload code-edit --workload free-form`)."""

from __future__ import annotations

import json

import pytest
import torch
from nanoqwen_bench.engine.bench_workload import GOALS, first_divergence, run_workloads
from nanoqwen_bench.workloads import code_edit_prompts, free_form_prompts, prompt_set_sha256
from nanoqwen_runtime.engine import Engine, EngineConfig
from nanoqwen_runtime.speculative import SpeculationConfig
from nanoqwen_runtime.testing import write_tiny_container

K = 4
MAX_TOKENS = 12


def _engine(path, max_model_len=4096):
    return Engine.from_file(path, EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=600,
                                               block_size=16, max_model_len=max_model_len, prefill_chunk=512,
                                               max_batch=8))


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    # byte-level tokens: a code-edit prompt of ~1,000 characters is ~1,000 tokens, so 4K positions
    return write_tiny_container(tmp_path_factory.mktemp("workload") / "tiny.nanoqwen", method="rtn", seed=3,
                                config_overrides={"max_position_embeddings": 4096})


@pytest.fixture(scope="module")
def reports(tiny_long, tmp_path_factory):
    out = tmp_path_factory.mktemp("workload-out")
    engine = _engine(tiny_long)
    reps = run_workloads(engine, tiny_long, ["code-edit", "free-form"], out, n_prompts=2,
                         max_tokens=MAX_TOKENS, speculation=SpeculationConfig(k=K), log=lambda s: None)
    assert engine.kv_blocks_used() == 0 and not engine.has_work
    return out, reps


def test_writes_json_and_markdown_per_workload(reports):
    out, reps = reports
    for name in ("code-edit", "free-form"):
        on_disk = json.loads((out / f"workload-{name}.json").read_text())
        assert on_disk == json.loads(json.dumps(reps[name]))
        md = (out / f"workload-{name}.md").read_text()
        assert md.startswith(f"# Workload `{name}`: speculation off vs on")
        assert "acceptance rate" in md and "mean accepted length" in md and "identical outputs" in md
        assert md.count("\n| 0 |") == 1 and md.count("\n| 1 |") == 1  # one table row per prompt


def test_report_keys_and_consistent_values(reports):
    _, reps = reports
    for name, rep in reps.items():
        assert set(rep) >= {"workload", "n_prompts", "max_tokens", "speculation", "off", "on", "speedup",
                            "goal", "goal_met", "off_drafted_tokens", "agreement", "prompts", "meta"}
        assert rep["workload"] == name and rep["n_prompts"] == 2 and rep["goal"] == GOALS[name]
        assert rep["speculation"]["k"] == K and rep["meta"]["speculation_spec"] == f"ngram:{K}"
        prompts = code_edit_prompts(2) if name == "code-edit" else free_form_prompts(2)
        assert rep["meta"]["prompt_set_sha256"] == prompt_set_sha256(prompts)
        assert rep["meta"]["python"].count(".") == 2
        off, on = rep["off"], rep["on"]
        # the non-speculative runs drafted nothing (speculation=False per request really is off) ...
        assert rep["off_drafted_tokens"] == 0 and all(p["off"]["spec_steps"] == 0 for p in rep["prompts"])
        # ... and the speculative ones did: every byte token of a ~150..1,300-token prompt over a
        # ~300-token vocabulary recurs, so the 1-gram lookup always finds a draft before any backoff
        # (a backoff needs window=8 verify steps; 12 tokens leave room for at most 11)
        assert on["spec_drafted_tokens"] > 0 and on["spec_steps"] > 0
        assert 0 <= on["spec_accepted_tokens"] <= on["spec_drafted_tokens"] <= K * on["spec_steps"]
        assert on["acceptance_rate"] == pytest.approx(on["spec_accepted_tokens"] / on["spec_drafted_tokens"])
        assert on["mean_accepted"] == pytest.approx(on["spec_accepted_tokens"] / on["spec_steps"])
        assert rep["speedup"] == pytest.approx(on["decode_tok_s"] / off["decode_tok_s"])
        assert rep["goal_met"] == (rep["speedup"] >= rep["goal"])
        for mode in (off, on):
            assert mode["decode_tok_s"] > 0 and mode["end_to_end_tok_s"] > 0 and mode["mean_ttft_s"] > 0
            assert mode["generated_tokens"] == sum(p["off" if mode is off else "on"]["generated_tokens"]
                                                   for p in rep["prompts"])
        for p in rep["prompts"]:
            for m in ("off", "on"):
                assert 1 <= p[m]["generated_tokens"] == len(p[m]["tokens"]) <= MAX_TOKENS
                assert p[m]["finish_reason"] in ("length", "eos")
            assert p["first_divergence"] == first_divergence(p["off"]["tokens"], p["on"]["tokens"])
            assert p["identical"] == (p["off"]["tokens"] == p["on"]["tokens"])
        ag = rep["agreement"]
        assert ag["total"] == 2 and ag["identical"] == sum(p["identical"] for p in rep["prompts"])
        assert len(ag["first_divergence"]) == 2 - ag["identical"]


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None


def test_refuses_prompts_longer_than_the_context(tiny_long, tmp_path):
    engine = _engine(tiny_long, max_model_len=256)  # code-edit prompts are ~1,000 byte tokens
    quiet = {"n_prompts": 1, "max_tokens": 4, "log": lambda s: None}
    with pytest.raises(ValueError, match=r"longer than the engine's context \(256\)"):
        run_workloads(engine, tiny_long, ["code-edit"], tmp_path, **quiet)
    with pytest.raises(ValueError, match="unknown workload"):
        run_workloads(engine, tiny_long, ["chat"], tmp_path, **quiet)


@pytest.mark.gpu
@pytest.mark.model
def test_workload_runner_on_the_real_model_gpu(qwen05b_packed, tmp_path):
    """The runner on the H200 path (kernel backend, CUDA graphs) with the real 0.5B: two code-edit
    prompts, 48 tokens each. A rewrite of a given function repeats its body, so the model's greedy
    answer copies prompt spans and prompt lookup must get drafts accepted (accepted > 0); the
    non-speculative runs draft nothing. The speed figures are left to the bench (two short prompts
    are no measurement); identical outputs are reported, not asserted (a near-tie may flip on the GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = qwen05b_packed("rtn")
    engine = Engine.from_file(path, EngineConfig(kv_memory_bytes=2 << 30, max_model_len=4096))
    reps = run_workloads(engine, path, ["code-edit"], tmp_path, n_prompts=2, max_tokens=48,
                         speculation=SpeculationConfig(), log=print)
    rep = reps["code-edit"]
    assert rep["off_drafted_tokens"] == 0
    assert rep["on"]["spec_accepted_tokens"] > 0 and rep["on"]["spec_steps"] > 0
    assert rep["meta"]["device"] == torch.cuda.get_device_name(0)
    print(json.dumps({k: rep[k] for k in ("speedup", "agreement")} | {"on": rep["on"]}, indent=1))
