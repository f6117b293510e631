// The one place where dsv4's op schemas are defined (test-only ops are in their own
// dsv4_testing library, csrc/testing/). Each kernel family's launcher binds its CUDA
// entries next to its argument checks (TORCH_LIBRARY_IMPL in csrc/<family>/*.cu).
// dsv4/_ops.py mirrors these strings for installs without the extension;
// tests/test_ops_registry.py checks that the two agree.
#include <Python.h>
#include <torch/library.h>

// `import dsv4._C` loads this library, which runs the registrations. The module
// itself is empty: no pybind, so the extension is abi3 (one build serves every
// Python >= 3.10).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(dsv4, m) {
  // csrc/quantize
  m.def("quantize_nvfp4(Tensor x, Tensor global_scale) -> (Tensor, Tensor)");
  // csrc/moe
  m.def(
      "nvfp4_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w13_scale, "
      "Tensor w13_scale_2, Tensor w2, Tensor w2_scale, Tensor w2_scale_2, Tensor? a13_scale, "
      "Tensor? a2_scale, Tensor? expert_map, float? swiglu_limit, str activation, int cta_mode, "
      "Tensor(a!) out) -> ()");
  // MXFP4 W4A8 MoE (CUDA: csrc/moe/mxfp4_moe.cu)
  m.def(
      "mxfp4_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w13_scale, Tensor w2, "
      "Tensor w2_scale, Tensor? expert_map, float? swiglu_limit, str activation, bool ue8m0, "
      "Tensor(a!) out) -> ()");
  // csrc/attention
  m.def(
      "sparse_mqa_decode(Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, "
      "Tensor? attn_sink, float softmax_scale, Tensor? extra_kv_cache, Tensor? extra_indices, "
      "Tensor? extra_topk_length, Tensor(a!) out, bool batch_invariant=False) -> Tensor");
  m.def(
      "sparse_mqa_prefill(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, "
      "Tensor? attn_sink, float softmax_scale, Tensor(a!) out) -> Tensor");
  // csrc/fmha
  m.def(
      "dense_fmha(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_kv, Tensor n_comp, "
      "Tensor? seq_start_pos, Tensor? attn_sink, float softmax_scale, int window, bool causal, int ratio, "
      "int max_seqlen_q, int max_seqlen_kv, int num_splits, Tensor(a!) out) -> Tensor");
}
