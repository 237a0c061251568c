// flash::linear_cross_entropy_logits_sm90 for CUDA tensors: the Hopper GEMM behind
// flash.linear_cross_entropy's chunk logits (torch_flash/ops/linear_cross_entropy.py defines
// the schema and calls this op where the kernel serves the call; the loss, and the other two
// GEMMs of a chunk, stay in Triton and cuBLAS).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <vector>

#include "linear_cross_entropy/lce_gemm_sm90.h"

namespace torch_flash {
namespace {

constexpr const char* kOp = "flash.linear_cross_entropy_logits_sm90: ";

// numbers as strings: see attention.cpp (streaming integers into TORCH_CHECK crashed on the GPU image)
std::string num(int64_t value) { return std::to_string(value); }

void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& hidden) {
  TORCH_CHECK(t.is_cuda(), kOp, name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == hidden.device(), kOp, name, " is on ", t.device(), " but hidden is on ", hidden.device());
  TORCH_CHECK(t.dim() == 2, kOp, name, " must be 2-D, got ", num(t.dim()), " dims");
  TORCH_CHECK(t.scalar_type() == hidden.scalar_type(), kOp, name, " has dtype ", t.scalar_type(), " but hidden has ",
              hidden.scalar_type());
  TORCH_CHECK(t.is_contiguous(), kOp, name, " must be contiguous");
  // TMA: 16-byte aligned base and rows
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, kOp, name, " must be 16-byte aligned");
  TORCH_CHECK(t.size(1) * t.element_size() % 16 == 0, kOp, name, " rows of ", num(t.size(1)),
              " elements are not a multiple of 16 bytes");
  TORCH_CHECK(t.size(0) <= std::numeric_limits<int>::max() && t.size(1) <= std::numeric_limits<int>::max(), kOp,
              name, " has more than 2^31 rows or columns");
}

// out (C, V) = hidden (C, H) @ weight (V, H)^T, rounded once into the inputs' dtype.
void linear_cross_entropy_logits_sm90(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& out) {
  check_matrix(hidden, "hidden", hidden);
  check_matrix(weight, "weight", hidden);
  check_matrix(out, "out", hidden);
  TORCH_CHECK(hidden.scalar_type() == at::kHalf || hidden.scalar_type() == at::kBFloat16, kOp,
              "hidden, weight and out must be float16 or bfloat16, got ", hidden.scalar_type());
  TORCH_CHECK(weight.size(1) == hidden.size(1), kOp, "weight has ", num(weight.size(1)), " columns but hidden has ",
              num(hidden.size(1)));
  TORCH_CHECK(out.size(0) == hidden.size(0) && out.size(1) == weight.size(0), kOp, "out must be (",
              num(hidden.size(0)), ", ", num(weight.size(0)), "), got (", num(out.size(0)), ", ", num(out.size(1)), ")");
  const int device = hidden.get_device();
  int major = 0, minor = 0, sm_count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  TORCH_CHECK(major == 9 && minor == 0, kOp, "needs an sm_90 GPU (Hopper), got sm_", num(major), num(minor));
  if (out.numel() == 0) return;
  if (hidden.size(1) == 0) {
    out.zero_();
    return;
  }

  c10::cuda::CUDAGuard guard(hidden.device());
  LceGemmSm90Params p{};
  p.a = hidden.data_ptr();
  p.b = weight.data_ptr();
  p.d = out.data_ptr();
  p.m = static_cast<int>(hidden.size(0));
  p.n = static_cast<int>(weight.size(0));
  p.k = static_cast<int>(hidden.size(1));
  p.bf16 = hidden.scalar_type() == at::kBFloat16;
  p.device = device;
  p.sm_count = sm_count;
  // workspace: held until the op returns (the caching allocator hands the memory on only to
  // work queued after it on this stream)
  std::vector<at::Tensor> workspace;
  p.alloc_ctx = &workspace;
  p.alloc = [](void* ctx, size_t bytes) -> void* {
    auto& held = *static_cast<std::vector<at::Tensor>*>(ctx);
    held.push_back(at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().device(at::kCUDA).dtype(at::kByte)));
    return held.back().data_ptr();
  };
  lce_gemm_sm90_logits(p, c10::cuda::getCurrentCUDAStream(device).stream());
}

}  // namespace

TORCH_LIBRARY_IMPL(flash, CUDA, m) { m.impl("linear_cross_entropy_logits_sm90", &linear_cross_entropy_logits_sm90); }

}  // namespace torch_flash
