"""Child process of test_stand_ins_match_vllm.py: each stand-in in _stand_ins.py
against vLLM's own helper, run by Triton's CPU interpreter.

Triton's interpreter needs ``TRITON_INTERPRET=1`` before vLLM defines its kernels,
and vLLM only treats Triton as present without a GPU driver when
``CUDA_VISIBLE_DEVICES`` is empty (its "distributed environment" rule in
vllm/triton_utils/importing.py), so this runs in a process of its own. Prints one
line per helper; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _stand_ins as S  # noqa: E402


_T0 = time.time()


def check(name, got, want):
    assert len(got) == len(want), name
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            bad = (a != b).nonzero()[:5].tolist()
            raise SystemExit(f"{name}: output {i} differs from vLLM's at {bad}")
    print(f"{name}: matches vLLM ({time.time() - _T0:.1f} s)")


def batch(g):
    """A mixed batch: 3 decodes (one a padding token), 3 prefills (an empty request, a
    fresh prompt, a long context), 3 graph-padding tokens."""
    q = [1, 1, 1, 0, 17, 5]
    prefix = [40, 300, 7, 20, 0, 2000]
    qsl = torch.tensor([0] + torch.tensor(q).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor([p + n for p, n in zip(prefix, q)], dtype=torch.int32)
    T = int(qsl[-1])
    slot_mapping = torch.randint(0, 10**6, (T + 3,), generator=g)
    slot_mapping[2] = -1  # padding decode token
    slot_mapping[T:] = -1  # graph padding
    return qsl, seq, slot_mapping, len(q), T


def main():
    from vllm.triton_utils import HAS_TRITON

    assert HAS_TRITON, "vLLM does not see Triton"
    g = torch.Generator().manual_seed(7)
    qsl, seq, slot_mapping, R, T = batch(g)
    Tp = T + 3

    from vllm.v1.attention.ops.metadata import compute_token_to_req_indices

    outs = [torch.full((Tp + 5,), 99, dtype=torch.int32) for _ in range(2)]
    check("compute_token_to_req_indices",
          [S.token_to_req_indices(qsl, outs[0], T, Tp), outs[0]],
          [compute_token_to_req_indices(qsl, outs[1], T, Tp), outs[1]])
    t2r = outs[1][:Tp].clone()

    import vllm.v1.attention.backends.mla.sparse_swa as sw

    W, bs = 128, 64
    bt = torch.randint(1, 500, (R, 40), dtype=torch.int32, generator=g)
    is_valid = slot_mapping >= 0
    replay = torch.tensor([0, 290, 0, 0, 0, 1990] + [0] * 10, dtype=torch.int32)
    for off, n in ((0, 3), (3, T - 3)):
        res = []
        for fn in (S.swa_indices_and_lens, sw._COMPUTE_SWA_INDICES_AND_LENS_KERNEL):
            idx = torch.full((Tp, 1, W), 77, dtype=torch.int32)
            lens = torch.full((Tp,), 77, dtype=torch.int32)
            fn(idx, lens, W, W, lens, lens, qsl, seq, t2r, is_valid, bt, bs, replay,
               num_tokens=n, token_offset=off)
            res.append([idx, lens])
        check(f"_COMPUTE_SWA_INDICES_AND_LENS_KERNEL (tokens {off}..{off + n})", *res)

    res = []
    for fn in (S.prefill_gather_lens, sw._COMPUTE_PREFILL_METADATA_KERNEL):
        out = torch.full((8,), 77, dtype=torch.int32)
        fn(out, seq, qsl, replay, R - 3, 3, W)
        res.append([out])
    check("_COMPUTE_PREFILL_METADATA_KERNEL", *res)

    import vllm.v1.attention.backends.mla.compressor_utils as cu

    for ratio, states in ((4, 64), (128, 2), (2, 32)):
        res = []
        for fn in (S.compressed_slot_mapping, cu._COMPRESSED_SLOT_MAPPING_KERNEL):
            out = torch.full((Tp,), 77, dtype=torch.int64)
            fn(out, slot_mapping, qsl, seq, bt, states, ratio, 1, 1)
            res.append([out[:T]])
        check(f"_COMPRESSED_SLOT_MAPPING_KERNEL (ratio {ratio})", *res)

    import vllm.models.deepseek_v4.sparse_mla as mla

    positions = torch.cat([torch.arange(int(seq[r]) - (int(qsl[r + 1]) - int(qsl[r])), int(seq[r]))
                           for r in range(R)])
    res = []
    for fn in (S.c128a_topk_metadata, mla._BUILD_C128A_TOPK_METADATA_KERNEL):
        bufs = [torch.full((Tp, 256), 77, dtype=torch.int32), torch.full((Tp,), 77, dtype=torch.int32),
                torch.full((Tp, 256), 77, dtype=torch.int32)]
        fn(*bufs, positions, 128, 128, 3, t2r, bt[:3], 2, slot_mapping)
        res.append([bufs[0][:3], bufs[1][:3], bufs[2][: T - 3]])
    check("_BUILD_C128A_TOPK_METADATA_KERNEL", *res)

    import vllm.models.deepseek_v4.common.ops as v4ops
    import vllm.models.deepseek_v41.common.ops as v41ops

    topk = torch.full((T, 512), -1, dtype=torch.int32)
    for t in range(T):
        n = int(torch.randint(0, 512, (1,), generator=g))
        topk[t, :n] = torch.randperm(2000, generator=g)[:n].to(torch.int32)
    for name, ops in (("V4", v4ops), ("V4.1", v41ops)):
        check(f"{name} compute_global_topk_indices_and_lens",
              S.global_topk_indices_and_lens(topk, t2r, bt, 64, is_valid[:T]),
              ops.compute_global_topk_indices_and_lens(topk, t2r, bt, 64, is_valid[:T]))

    from dsv4 import formats

    # The gather's CuTe DSL variant (taken when cutlass's DSL is installed) runs on
    # CUDA only; its Triton kernel is the one the interpreter can run.
    import vllm.models.deepseek_v4.common.ops.cache_utils as v4_cache_utils
    import vllm.models.deepseek_v41.common.ops.cache_utils as v41_cache_utils

    v4_cache_utils.has_cutedsl = v41_cache_utils.has_cutedsl = lambda: False
    nb, gbs = 12, 16  # 16-token blocks: the gathers cross block boundaries
    cache = formats.new_fp8_ds_mla_cache(nb, gbs, fill="random", generator=g)
    formats.write_fp8_ds_mla(cache, torch.arange(nb * gbs),
                             torch.randn(nb * gbs, 512, generator=g).to(torch.bfloat16))
    gbt = torch.randint(1, nb, (2, 4), dtype=torch.int32, generator=g)
    # (seq_lens, gather_lens): a window gather, and an all-entries one with a request
    # that has no entry yet
    for gseq, glen in (([45, 3], [21, 3]), ([45, 0], None)):
        gseq = torch.tensor(gseq, dtype=torch.int32)
        glen = None if glen is None else torch.tensor(glen, dtype=torch.int32)
        for name, ops in (("V4", v4ops), ("V4.1", v41ops)):
            res = []
            for fn in (S.dequantize_and_gather_k_cache, ops.dequantize_and_gather_k_cache):
                out = torch.full((2, 60, 512), float("nan"), dtype=torch.bfloat16)
                fn(out, cache, gseq, glen, gbt, gbs, 9)
                res.append([out.view(torch.int16)])
            check(f"{name} dequantize_and_gather_k_cache (gather_lens "
                  f"{'set' if glen is not None else 'None'})", *res)

    # combine: the prefills as one chunk
    pseq = seq[3:]
    pg = torch.empty(R - 3, dtype=torch.int32)
    S.prefill_gather_lens(pg, seq, qsl, torch.zeros(R, dtype=torch.int32), R - 3, 3, W)
    ptopk = topk[3:]
    for name, fn_s, fn_v, ratios in (
        ("V4", S.combine_topk_swa_indices, v4ops.combine_topk_swa_indices, (1, 4, 128)),
        ("V4.1", S.combine_topk_swa_indices_v41, v41ops.combine_topk_swa_indices, (0, 1, 2)),
    ):
        for ratio in ratios:
            k = 0 if ratio <= (1 if name == "V4" else 0) else 512
            N = int((pseq // max(ratio, 1)).max()) if k else 0
            M = N + int(pg.max())
            res = []
            for fn in (fn_s, fn_v):
                out = (torch.full((T - 3, 640), 77, dtype=torch.int32),
                       torch.full((T - 3,), 77, dtype=torch.int32))
                fn(ptopk.clone(), qsl[3:].clone(), pseq, pg, W, ratio, k, M, N, out=out)
                res.append(list(out))
            check(f"{name} combine_topk_swa_indices (ratio {ratio})", *res)
    print("all stand-ins match")


if __name__ == "__main__":
    main()
