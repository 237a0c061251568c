// flash::linear_cross_entropy_logits_sm90 for CUDA tensors: the Hopper logits GEMM with the
// loss's statistics in its epilogue (lce_logits_sm90.h). torch_flash/ops/linear_cross_entropy.py
// defines the schema; kernels/triton/cross_entropy.py calls the op per chunk where it serves.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <vector>

#include "linear_cross_entropy/lce_logits_sm90.h"

namespace torch_flash {
namespace {

constexpr const char* kOp = "flash.linear_cross_entropy_logits_sm90: ";

// numbers as strings in messages, as csrc/attention/attention.cpp says why
std::string num(int64_t value) { return std::to_string(value); }

std::string shape(at::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + num(sizes[i]);
  return out + ")";
}

int to_int(int64_t value, const char* what) {
  TORCH_CHECK(value > 0 && value <= std::numeric_limits<int>::max(), kOp, what, " = ", num(value),
              " must be positive and fit 32 bits");
  return static_cast<int>(value);
}

// 2-D, last dim contiguous, base and row stride 16-byte aligned (TMA)
void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& weight) {
  TORCH_CHECK(t.is_cuda(), kOp, name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == weight.device(), kOp, name, " is on ", t.device(), " but weight is on ", weight.device());
  TORCH_CHECK(t.dim() == 2, kOp, name, " must be 2-D, got ", shape(t.sizes()));
  TORCH_CHECK(t.scalar_type() == weight.scalar_type(), kOp, name, " has dtype ", t.scalar_type(),
              " but weight has ", weight.scalar_type());
  TORCH_CHECK(t.stride(1) == 1, kOp, name, " must have a contiguous last dim, got strides ", shape(t.strides()));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, kOp, name, " must be 16-byte aligned");
  TORCH_CHECK(t.stride(0) * t.element_size() % 16 == 0, kOp, name, " row stride ", num(t.stride(0)),
              " is not a multiple of 16 bytes");
}

struct Scratch {
  at::TensorOptions options;
  std::vector<at::Tensor> buffers;

  static void* alloc(void* self, size_t bytes) {
    auto& scratch = *static_cast<Scratch*>(self);
    scratch.buffers.push_back(at::empty({static_cast<int64_t>(bytes)}, scratch.options));
    return scratch.buffers.back().data_ptr();
  }
};

void linear_cross_entropy_logits_sm90(const at::Tensor& weight, const at::Tensor& hidden, const at::Tensor& logits,
                                      const at::Tensor& pairs) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf, kOp,
              "weight must be bfloat16 or float16, got ", weight.scalar_type());
  check_matrix(weight, "weight", weight);
  check_matrix(hidden, "hidden", weight);
  check_matrix(logits, "logits", weight);
  const int64_t m = weight.size(0), n = hidden.size(0), k = weight.size(1);
  TORCH_CHECK(hidden.size(1) == k, kOp, "hidden has shape ", shape(hidden.sizes()), " but weight has ",
              shape(weight.sizes()), ": their last dims (H) must match");
  TORCH_CHECK(logits.size(0) == m && logits.size(1) == n, kOp, "logits must have shape ", shape({m, n}),
              " (classes, tokens), got ", shape(logits.sizes()));
  const int64_t tiles = (m + kLceLogitsTileM - 1) / kLceLogitsTileM;
  const int64_t padded = (n + kLceLogitsTileN - 1) / kLceLogitsTileN * kLceLogitsTileN;
  TORCH_CHECK(pairs.is_cuda() && pairs.device() == weight.device() && pairs.scalar_type() == at::kFloat &&
                  pairs.is_contiguous() && pairs.dim() == 3 && pairs.size(0) == tiles && pairs.size(1) == padded &&
                  pairs.size(2) == 2,
              kOp, "pairs must be a contiguous float32 CUDA tensor of shape ", shape({tiles, padded, 2}),
              " on weight's device, got ", pairs.scalar_type(), " ", shape(pairs.sizes()), " on ", pairs.device());
  const int device = weight.get_device();
  c10::cuda::CUDAGuard guard(device);
  int sm_count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  Scratch scratch{weight.options().dtype(at::kByte), {}};
  LceLogitsSm90Params p{weight.data_ptr(),
                        hidden.data_ptr(),
                        logits.data_ptr(),
                        pairs.data_ptr<float>(),
                        to_int(m, "weight.size(0)"),
                        to_int(n, "hidden.size(0)"),
                        to_int(k, "weight.size(1)"),
                        weight.stride(0),
                        hidden.stride(0),
                        logits.stride(0),
                        weight.scalar_type() == at::kBFloat16,
                        device,
                        sm_count,
                        &Scratch::alloc,
                        &scratch};
  lce_logits_sm90(p, c10::cuda::getCurrentCUDAStream(device).stream());
}

}  // namespace
}  // namespace torch_flash

TORCH_LIBRARY_IMPL(flash, CUDA, m) { m.impl("linear_cross_entropy_logits_sm90", &torch_flash::linear_cross_entropy_logits_sm90); }
