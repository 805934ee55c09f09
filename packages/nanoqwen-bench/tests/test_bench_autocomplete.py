"""The `autocomplete` workload (nanoqwen_bench.autocomplete, .engine.bench_autocomplete) on the CPU reference
engine with the real 0.5B, at small sizes: a cursor moving down a stdlib file, requests one after the other,
every odd one cancelled; the prefix cache serves exactly the full blocks two successive prompts share,
and no request keeps KV blocks."""

from __future__ import annotations

import json

import pytest
from nanoqwen_bench.autocomplete import autocomplete_requests
from nanoqwen_bench.engine.bench_autocomplete import percentile, run_autocomplete
from nanoqwen_runtime import Tokenizer
from nanoqwen_runtime.fim import fim_prompt
from nanoqwen_runtime.reference_engine import ReferenceEngine, ReferenceEngineConfig

pytestmark = pytest.mark.model
SIZES = {"prefix_min": 96, "prefix_max": 160, "suffix_tokens": 48, "extra_tokens": 48}


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 95) == pytest.approx(1.95)


def test_requests_move_down_one_file(qwen05b_packed):
    tok = Tokenizer.from_file(qwen05b_packed("rtn"))
    reqs = autocomplete_requests(tok, 4, **SIZES)
    assert len({r.path for r in reqs}) == 1 and reqs[0].extra.filename != reqs[0].path
    lines = [r.line for r in reqs]
    assert lines == sorted(lines) and len(set(lines)) == 4
    for a, b in zip(reqs, reqs[1:], strict=False):
        assert b.prefix.startswith(a.prefix[: a.prefix.rfind("\n") + 1])  # the code above stays


    def above(r):  # tokens of the whole lines above the cursor, counted line by line as the module does
        return sum(len(tok.encode_text(ln)) for ln in r.prefix.splitlines(keepends=True)[:r.line])

    assert above(reqs[0]) > 96 and above(reqs[-1]) <= 160


def test_autocomplete_on_the_reference_engine(qwen05b_packed, tmp_path):
    path = qwen05b_packed("rtn")
    tok = Tokenizer.from_file(path)
    engine = ReferenceEngine.from_file(path, ReferenceEngineConfig(kv_memory_bytes=64 << 20, max_batch=1))
    rep = run_autocomplete(engine, tok, tmp_path, n_requests=4, max_tokens=6, cancel_after=2,
                           log=lambda s: None,
                           **SIZES)
    rows = rep["requests"]
    assert [r["finish"] == "cancelled" for r in rows] == [False, True, False, True]
    assert all(r["generated_tokens"] == 2 for r in rows if r["finish"] == "cancelled")
    assert all(r["kv_blocks_used_after"] == 0 for r in rows)  # aborted requests free their blocks
    # the cache serves exactly the full blocks of the prompt the previous request shares with this one
    reqs = autocomplete_requests(tok, 4, **SIZES)
    ids = [fim_prompt(tok, r.prefix, r.suffix, [r.extra], path=r.path).ids for r in reqs]
    assert rows[0]["cached_tokens"] == 0
    for i in range(1, 4):
        common = next((k for k, (a, b) in enumerate(zip(ids[i - 1], ids[i], strict=False)) if a != b),
                      min(len(ids[i - 1]), len(ids[i])))
        assert rows[i]["prompt_tokens"] == len(ids[i])
        assert rows[i]["cached_tokens"] == common // 16 * 16, i
    assert rep["summary"]["cache_share_warm"] > 0
    saved = json.loads((tmp_path / "autocomplete.json").read_text())
    assert saved["summary"] == rep["summary"]
    assert "| completed |" in (tmp_path / "autocomplete.md").read_text()


def test_autocomplete_with_cache_reuse_on_the_reference_engine(qwen05b_packed, tmp_path):
    """With `cache_reuse` the exact prefix is served as before, and past it the suffix's blocks that the
    previous prompt computed are copied at their shifted positions (engine/blocks.py): the reuse path
    ran, and the report counts those tokens apart."""
    path = qwen05b_packed("rtn")
    tok = Tokenizer.from_file(path)
    engine = ReferenceEngine.from_file(path, ReferenceEngineConfig(kv_memory_bytes=64 << 20, max_batch=1,
                                                                   cache_reuse=16))
    rep = run_autocomplete(engine, tok, tmp_path, n_requests=4, max_tokens=6, cancel_after=2,
                           log=lambda s: None, **SIZES)
    rows = rep["requests"]
    reqs = autocomplete_requests(tok, 4, **SIZES)
    ids = [fim_prompt(tok, r.prefix, r.suffix, [r.extra], path=r.path).ids for r in reqs]
    assert rows[0]["cached_tokens"] == rows[0]["reused_tokens"] == 0
    for i in range(1, 4):
        common = next((k for k, (a, b) in enumerate(zip(ids[i - 1], ids[i], strict=False)) if a != b),
                      min(len(ids[i - 1]), len(ids[i])))
        assert rows[i]["cached_tokens"] - rows[i]["reused_tokens"] == common // 16 * 16, i
        assert rows[i]["reused_tokens"] % 16 == 0 and rows[i]["cached_tokens"] < rows[i]["prompt_tokens"]
    assert sum(r["reused_tokens"] for r in rows) > 0 and rep["summary"]["reused_share_warm"] > 0
    assert rep["settings"]["cache_reuse"] == 16
    assert all(r["kv_blocks_used_after"] == 0 for r in rows)
    engine.check_accounting()


@pytest.mark.gpu
def test_autocomplete_on_the_cuda_engine(qwen05b_packed, tmp_path):
    """The same workload on the CUDA engine (graphs, prefix caching on), at the issue's sizes: the cache
    serves the full blocks two successive prompts share, cancelled requests end after 5 tokens, no
    request keeps KV blocks, and the report has every latency figure."""
    from nanoqwen_runtime.engine import Engine, EngineConfig

    path = qwen05b_packed("rtn")
    tok = Tokenizer.from_file(path)
    engine = Engine.from_file(path, EngineConfig(kv_memory_bytes=2 << 30, prefix_caching=True))
    rep = run_autocomplete(engine, tok, tmp_path, n_requests=8, max_tokens=32, log=lambda s: None)
    rows = rep["requests"]
    reqs = autocomplete_requests(tok, 8)
    ids = [fim_prompt(tok, r.prefix, r.suffix, [r.extra], path=r.path).ids for r in reqs]
    for i in range(1, 8):
        common = next((k for k, (a, b) in enumerate(zip(ids[i - 1], ids[i], strict=False)) if a != b),
                      min(len(ids[i - 1]), len(ids[i])))
        assert rows[i]["cached_tokens"] == common // engine.config.block_size * engine.config.block_size, i
    # odd requests are cancelled at their 5th token (unless the model ended before it)
    assert all(r["finish"] != "cancelled" for r in rows[0::2])
    assert all(r["finish"] == "eos" and r["generated_tokens"] < 5 or r["finish"] == "cancelled"
               and r["generated_tokens"] == 5 for r in rows[1::2])
    assert all(r["kv_blocks_used_after"] == 0 for r in rows)
    s = rep["summary"]
    cancelled = sum(r["finish"] == "cancelled" for r in rows)
    assert s["ttlt_completed"]["p50_ms"] > 0 and s["ttft_cancelled"]["n"] == cancelled
