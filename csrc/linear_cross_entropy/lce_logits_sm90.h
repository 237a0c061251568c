// Plain-C++ interface between the torch binding (linear_cross_entropy.cpp) and the CUTLASS
// kernel (lce_logits_sm90.cu), as csrc/attention's: no torch or CUTLASS types cross it.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace torch_flash {

// Classes and tokens per CTA tile; pairs hold one (max, sum) per class tile and token, for
// tokens padded to a whole tile: (ceil(m / kLceLogitsTileM), ceil(n / kLceLogitsTileN) *
// kLceLogitsTileN, 2) fp32.
constexpr int kLceLogitsTileM = 128;
constexpr int kLceLogitsTileN = 128;

// logits (m, n) = weight (m, k) @ hidden (n, k)^T in the inputs' dtype (tokens contiguous,
// row stride logits_stride), and per class tile and token the pair (max, sum of exp2(z -
// max)) of its rounded logits z in log2 units (z = logit * log2(e)). Strides in elements,
// the last dim contiguous.
struct LceLogitsSm90Params {
  const void* weight;
  const void* hidden;
  void* logits;
  float* pairs;
  int m, n, k;
  int64_t weight_stride, hidden_stride, logits_stride;
  bool bf16;  // else fp16
  int device;
  int sm_count;
  // device memory the launch may use until the call returns, as AttentionFwdSm90Params's
  void* (*alloc)(void* ctx, size_t bytes);
  void* alloc_ctx;
};

// Throws std::runtime_error when the kernel cannot run the problem.
void lce_logits_sm90(const LceLogitsSm90Params& p, cudaStream_t stream);

}  // namespace torch_flash
