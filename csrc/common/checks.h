// Argument checks shared by the C++ entries. Every message names the argument and
// what was expected, so a bad call from Python reads like a Python error.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <string>

namespace dsv4 {

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "dsv4: ", name, " must be a CUDA tensor, got device ", t.device());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "dsv4: ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device(), "; they must be on the same device");
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, "dsv4: ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name, const char* shape) {
  TORCH_CHECK(t.dim() == dim, "dsv4: ", name, " must be ", dim, "-D ", shape, ", got shape ",
              t.sizes());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "dsv4: ", name, " must be contiguous (call .contiguous()), got strides ",
              t.strides());
}

inline void check_aligned(const at::Tensor& t, int64_t bytes, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0, "dsv4: ", name,
              " must be ", bytes, "-byte aligned (its data pointer is not)");
}

}  // namespace dsv4
