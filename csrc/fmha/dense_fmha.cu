// C++ entry for dsv4::dense_fmha: validates, launches. dsv4.fmha picks this op for
// head dims 64-256 (the sparse MQA prefill kernel serves DeepSeek V4's 512).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "common/checks.h"
#include "common/dynamic_smem.h"
#include "fmha/dense_fmha.cuh"

namespace dsv4 {
namespace {

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& q) {
  check_cuda(t, name);
  check_same_device(t, q, name, "q");
  check_dtype(t, at::kBFloat16, name);
  check_dim(t, 3, name, "[rows, heads, head_dim]");
  TORCH_CHECK(t.stride(2) == 1, "dsv4: ", name, " must have unit stride along head_dim, got strides ", t.strides());
  TORCH_CHECK(t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0, "dsv4: ", name,
              " row and head strides must be multiples of 8 elements (16 bytes), got strides ", t.strides());
  check_aligned(t, 16, name);
}

void check_index(const at::Tensor& t, const char* name, int64_t n, const at::Tensor& q) {
  check_cuda(t, name);
  check_same_device(t, q, name, "q");
  check_dtype(t, at::kInt, name);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "dsv4: ", name, " must have shape [", n, "], got ", t.sizes());
  check_contiguous(t, name);
}

template <int D>
void launch(const fmha::DenseFmhaParams& p, int64_t q_tiles, int64_t seqs, int64_t heads, cudaStream_t stream) {
  constexpr int smem = fmha::smem_bytes<D>();
  ensure_max_dynamic_smem<fmha::dense_fmha_kernel<D>>(smem);
  fmha::dense_fmha_kernel<D><<<dim3(unsigned(q_tiles * p.num_splits), unsigned(seqs), unsigned(heads)),
                               fmha::kThreads, smem, stream>>>(p);
  if (p.num_splits > 1)
    fmha::dense_fmha_combine_kernel<D><<<dim3(unsigned((p.total_rows + 3) / 4)), 128, 0, stream>>>(p);
}

// Splits from shapes only (graph capture): enough CTAs for ~2 waves, at least 4 KV
// tiles per split, at most 16 splits.
int64_t auto_splits(int64_t ctas, int64_t max_seqlen_kv, int sms) {
  if (ctas >= 2 * sms) return 1;
  const int64_t by_kv = max_seqlen_kv / (4 * fmha::kCols);
  return std::max<int64_t>(1, std::min<int64_t>({(2 * sms + ctas - 1) / ctas, by_kv, 16}));
}

}  // namespace

at::Tensor dense_fmha(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                      const at::Tensor& cu_seqlens_kv, const at::Tensor& n_comp,
                      const c10::optional<at::Tensor>& seq_start_pos, const c10::optional<at::Tensor>& attn_sink,
                      double softmax_scale, int64_t window, bool causal, int64_t ratio, int64_t max_seqlen_q,
                      int64_t max_seqlen_kv, int64_t num_splits, at::Tensor& out) {
  check_rows(q, "q", q);
  check_rows(k, "k", q);
  check_rows(v, "v", q);
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "dsv4: dense_fmha supports head_dim 64, 128 or 256, got q shape ",
              q.sizes());
  TORCH_CHECK(k.size(2) == D && v.size(2) == D, "dsv4: k and v must have head_dim ", D, " like q, got k ", k.sizes(),
              " and v ", v.sizes());
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == Hkv, "dsv4: v must have shape [", k.size(0), ", ", Hkv, ", ", D,
              "] like k, got ", v.sizes());
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "dsv4: q heads (", Hq, ") must be a multiple of k/v heads (", Hkv, ")");
  check_dim(cu_seqlens_q, 1, "cu_seqlens_q", "[S + 1]");
  const int64_t S = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK(S >= 0, "dsv4: cu_seqlens_q must have at least one element");
  check_index(cu_seqlens_q, "cu_seqlens_q", S + 1, q);
  check_index(cu_seqlens_kv, "cu_seqlens_kv", S + 1, q);
  check_index(n_comp, "n_comp", S, q);
  if (seq_start_pos) check_index(*seq_start_pos, "seq_start_pos", S, q);
  if (attn_sink) {
    check_cuda(*attn_sink, "attn_sink");
    check_same_device(*attn_sink, q, "attn_sink", "q");
    check_dtype(*attn_sink, at::kFloat, "attn_sink");
    TORCH_CHECK(attn_sink->dim() == 1 && attn_sink->size(0) == Hq, "dsv4: attn_sink must have shape [", Hq,
                "], got ", attn_sink->sizes());
    check_contiguous(*attn_sink, "attn_sink");
  }
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, "dsv4: softmax_scale must be finite and > 0, got ",
              softmax_scale);
  TORCH_CHECK(ratio >= 1, "dsv4: ratio must be >= 1, got ", ratio);
  TORCH_CHECK(max_seqlen_q >= 0, "dsv4: max_seqlen_q must be >= 0, got ", max_seqlen_q);
  TORCH_CHECK(max_seqlen_kv >= 0, "dsv4: max_seqlen_kv must be >= 0, got ", max_seqlen_kv);
  TORCH_CHECK(num_splits >= 0 && num_splits <= 64, "dsv4: num_splits must be in [0, 64] (0 = choose), got ",
              num_splits);
  TORCH_CHECK(S <= 65535 && Hq <= 65535, "dsv4: dense_fmha supports up to 65535 sequences and heads, got ", S,
              " and ", Hq);
  TORCH_CHECK(window >= INT32_MIN && window <= INT32_MAX && ratio <= INT32_MAX, "dsv4: window/ratio out of range");
  check_cuda(out, "out");
  check_same_device(out, q, "out", "q");
  check_dtype(out, at::kBFloat16, "out");
  TORCH_CHECK(out.sizes() == q.sizes(), "dsv4: out must have shape ", q.sizes(), ", got ", out.sizes());
  TORCH_CHECK(out.stride(2) == 1 && out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0, "dsv4: out must have unit stride "
              "along head_dim and even row/head strides, got strides ", out.strides());
  check_aligned(out, 4, "out");

  const at::cuda::OptionalCUDAGuard guard(q.device());
  at::Tensor lse = at::empty({Tq, Hq}, q.options().dtype(at::kFloat));
  if (Tq == 0 || Hq == 0 || S == 0 || max_seqlen_q == 0) {  // (no 0-size grid: Hq is grid.z)
    // rows of sequences that max_seqlen_q says are empty: nothing visible
    out.zero_();
    lse.fill_(-INFINITY);
    return lse;
  }

  fmha::DenseFmhaParams p;
  p.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
  p.k = reinterpret_cast<const __nv_bfloat16*>(k.data_ptr());
  p.v = reinterpret_cast<const __nv_bfloat16*>(v.data_ptr());
  p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  p.lse = lse.data_ptr<float>();
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.cu_seqlens_kv = cu_seqlens_kv.data_ptr<int32_t>();
  p.n_comp = n_comp.data_ptr<int32_t>();
  p.seq_start_pos = seq_start_pos ? seq_start_pos->data_ptr<int32_t>() : nullptr;
  p.sink = attn_sink ? attn_sink->data_ptr<float>() : nullptr;
  p.q_row = q.stride(0), p.q_head = q.stride(1);
  p.k_row = k.stride(0), p.k_head = k.stride(1);
  p.v_row = v.stride(0), p.v_head = v.stride(1);
  p.o_row = out.stride(0), p.o_head = out.stride(1);
  p.num_heads = int(Hq);
  p.group = int(Hq / Hkv);
  p.window = int(window);
  p.ratio = int(ratio);
  p.causal = causal;
  p.scale_log2 = float(softmax_scale * 1.4426950408889634);

  const int64_t q_tiles = (max_seqlen_q + fmha::kRows - 1) / fmha::kRows;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t splits = num_splits > 0 ? num_splits : auto_splits(q_tiles * S * Hq, max_seqlen_kv, sms);
  TORCH_CHECK(q_tiles * splits <= INT32_MAX, "dsv4: max_seqlen_q too large");
  p.num_splits = int(splits);
  p.total_rows = Tq * Hq;
  at::Tensor part_o, part_ml;
  if (splits > 1) {
    // shapes only: capturable (the caching allocator serves it inside a graph)
    part_o = at::empty({splits, Tq, Hq, D}, q.options().dtype(at::kFloat));
    part_ml = at::empty({splits, Tq, Hq, 2}, q.options().dtype(at::kFloat));
    p.part_o = part_o.data_ptr<float>();
    p.part_ml = part_ml.data_ptr<float>();
  } else {
    p.part_o = p.part_ml = nullptr;
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (D == 64) launch<64>(p, q_tiles, S, Hq, stream);
  else if (D == 128) launch<128>(p, q_tiles, S, Hq, stream);
  else launch<256>(p, q_tiles, S, Hq, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return lse;
}

}  // namespace dsv4

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("dense_fmha", &dsv4::dense_fmha); }
