"""Reduced paged-attention workload for compute-sanitizer (racecheck, synccheck, memcheck).

    compute-sanitizer --tool racecheck python packages/nanoqwen-kernels/tests/sanitize_attention.py

Covers both kernels, both head dims, partial tail pages, split-KV by the actual context (merged by
the last split and by the combine kernel), on poisoned shuffled caches (see
reference_attention.make_paged_case), and checks each result against the fp32 reference, so a run
that the sanitizer passes also computed the right thing. Prints "sanitize_attention: OK" last. Small
on purpose: the sanitizer slows kernels down 10-100x.
"""

from __future__ import annotations

import torch
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.attention import AttentionGeometry, plan_decode, plan_prefill
from nanoqwen_kernels.reference_attention import make_paged_case


def _close(out, ref, what):
    """The tests' per-row check (R.ATTENTION_ROW); a failure ends the run without the OK line."""
    try:
        R.assert_rows_close(out, ref, R.ATTENTION_ROW, what)
    except AssertionError as e:
        raise SystemExit(f"sanitize_attention: wrong result: {e}") from None


def main() -> None:
    for nh, nkv, hd in ((28, 4, 128), (14, 2, 64)):
        lens = [1, 2, 15, 16, 17, 33, 200]
        case = make_paged_case(nh, nkv, hd, 16, lens, seed=1, max_pages=14)
        # fuse 1: the combine kernel merges; fuse 16: the last split does, inside the launch
        for splits, fuse in ((1, 1), (3, 1), (3, 16)):
            plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=len(lens), max_context_len=224,
                               num_splits=splits, fuse_max_splits=fuse)
            out = plan.run(case.q, case.k_cache, case.v_cache, case.page_table, case.context_lens)
            _close(out, case.reference(), f"decode hd{hd} splits {splits} fuse {fuse}")
    nh, nkv, hd = 28, 4, 128
    ctx, qlen = [16, 100, 70], [16, 37, 1]
    case = make_paged_case(nh, nkv, hd, 16, ctx, qlen, seed=2, max_pages=7)
    for splits, fuse in ((1, 1), (2, 1), (2, 16)):  # contexts of 2 tiles: split them anyway
        plan = plan_prefill(AttentionGeometry(nh, nkv, hd, 16), max_batch=3, max_query_len=37, max_total_q=54,
                            max_context_len=112, num_splits=splits, unsplit_max_tiles=0,
                            fuse_max_splits=fuse)
        out = plan.run(case.q, case.k_cache, case.v_cache, case.page_table, case.context_lens,
                       case.query_start_loc)
        _close(out, case.reference(), f"prefill splits {splits} fuse {fuse}")
    torch.cuda.synchronize()
    print("sanitize_attention: OK")


if __name__ == "__main__":
    main()
