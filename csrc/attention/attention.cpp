// flash::attention_fwd_sm90 for CUDA tensors: the Hopper forward kernel behind flash.attention
// (torch_flash/ops/attention.py defines the schema and calls this op where the kernel serves
// the call; the backward stays in Triton and reads the lse written here).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention_fwd_sm90.h"

namespace torch_flash {
namespace {

constexpr const char* kOp = "flash.attention_fwd_sm90: ";

// Error messages take numbers as strings: streaming an integer into TORCH_CHECK's message
// crashed (SIGSEGV in the ostream's number formatting) in this extension on the GPU image
// (torch 2.11, on both an H100 and an H200), where streaming strings did not.
std::string num(int64_t value) { return std::to_string(value); }

std::string shape(at::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + num(sizes[i]);
  return out + ")";
}

int to_int(int64_t value, const char* what) {
  TORCH_CHECK(value >= 0 && value <= std::numeric_limits<int>::max(), kOp, what, " = ", num(value),
              " does not fit the kernel's 32-bit indexing");
  return static_cast<int>(value);
}

void check_input(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.is_cuda(), kOp, name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == q.device(), kOp, name, " is on ", t.device(), " but q is on ", q.device());
  TORCH_CHECK(t.dim() == 4, kOp, name, " must be 4-D (B, H, S, D), got ", shape(t.sizes()));
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), kOp, name, " has dtype ", t.scalar_type(), " but q has ",
              q.scalar_type());
  TORCH_CHECK(t.stride(3) == 1, kOp, name, " must have a contiguous last dim, got strides ", shape(t.strides()));
  // TMA: 16-byte aligned base and strides
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, kOp, name, " must be 16-byte aligned");
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.stride(d) * t.element_size() % 16 == 0, kOp, name, " stride ", num(t.stride(d)),
                " of dim ", num(d), " is not a multiple of 16 bytes");
  }
}

int device_attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

// Device memory the kernels ask for (AttentionFwdSm90Params::alloc): tensors held until the
// op returns; the caching allocator hands their memory on only to work queued after them on
// this stream.
struct Scratch {
  at::TensorOptions options;
  std::vector<at::Tensor> buffers;

  static void* alloc(void* self, size_t bytes) {
    auto& scratch = *static_cast<Scratch*>(self);
    scratch.buffers.push_back(at::empty({static_cast<int64_t>(bytes)}, scratch.options));
    return scratch.buffers.back().data_ptr();
  }
};

using Entry = void (*)(const AttentionFwdSm90Params&, cudaStream_t);

Entry entry_for(int64_t head_dim) {
  switch (head_dim) {
#ifdef FLASH_HDIM_64
    case 64: return attention_fwd_sm90_hdim64;
#endif
#ifdef FLASH_HDIM_128
    case 128: return attention_fwd_sm90_hdim128;
#endif
#ifdef FLASH_HDIM_256
    case 256: return attention_fwd_sm90_hdim256;
#endif
    default: return nullptr;
  }
}

// q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) with Hq % Hkv == 0 -> out (B, Hq, Sq, D) contiguous,
// lse (B, Hq, Sq) fp32. causal: aligned bottom-right, as flash.attention, with Sq <= Sk (every
// query row sees a key).
std::tuple<at::Tensor, at::Tensor> attention_fwd_sm90(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      double scale, bool causal) {
  check_input(q, "q", q);
  check_input(k, "k", q);
  check_input(v, "v", q);
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, kOp,
              "q, k, v must be float16 or bfloat16, got ", q.scalar_type());
  const int64_t batch = q.size(0), heads_q = q.size(1), seqlen_q = q.size(2), head_dim = q.size(3);
  const int64_t heads_kv = k.size(1), seqlen_k = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch, kOp, "batch sizes differ: q ", shape(q.sizes()), ", k ",
              shape(k.sizes()), ", v ", shape(v.sizes()));
  TORCH_CHECK(k.size(3) == head_dim && v.size(3) == head_dim, kOp, "head dims differ: q ", shape(q.sizes()), ", k ",
              shape(k.sizes()), ", v ", shape(v.sizes()));
  TORCH_CHECK(v.size(1) == heads_kv && v.size(2) == seqlen_k, kOp, "k ", shape(k.sizes()), " and v ", shape(v.sizes()),
              " differ in heads or keys");
  TORCH_CHECK(heads_kv > 0 && heads_q % heads_kv == 0, kOp, "q has ", num(heads_q),
              " heads, not a multiple of the ", num(heads_kv), " heads of k and v");
  TORCH_CHECK(seqlen_q > 0 && seqlen_k > 0, kOp, "empty sequences are not supported (Sq ", num(seqlen_q),
              ", Sk ", num(seqlen_k), ")");
  TORCH_CHECK(seqlen_q % 8 == 0, kOp, "seqlen_q must be a multiple of 8, got ", num(seqlen_q));
  TORCH_CHECK(!causal || seqlen_q <= seqlen_k, kOp, "causal needs seqlen_q <= seqlen_k, got ", num(seqlen_q),
              " and ", num(seqlen_k));
  Entry entry = entry_for(head_dim);
  TORCH_CHECK(entry != nullptr, kOp, "head dim ", num(head_dim),
              " is not built (head dims 64, 128, 256, as listed by FLASH_HDIMS at build time)");
  const int device = q.get_device();
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
  const int minor = device_attribute(cudaDevAttrComputeCapabilityMinor, device);
  TORCH_CHECK(major == 9 && minor == 0, kOp, "needs an sm_90 GPU (Hopper), got sm_", num(major), num(minor));

  c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({batch, heads_q, seqlen_q, head_dim}, q.options());
  auto lse = at::empty({batch, heads_q, seqlen_q}, q.options().dtype(at::kFloat));
  // GQA: one launch per query head of a group (q heads g, g + G, ... share k/v heads 0, 1, ...)
  const int64_t group = heads_q / heads_kv;
  AttentionFwdSm90Params p{};
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.batch = to_int(batch, "batch");
  p.heads = to_int(heads_kv, "heads");
  p.seqlen_q = to_int(seqlen_q, "seqlen_q");
  p.seqlen_k = to_int(seqlen_k, "seqlen_k");
  p.head_dim = to_int(head_dim, "head_dim");
  p.q_batch_stride = to_int(q.stride(0), "q.stride(0)");
  p.q_head_stride = to_int(q.stride(1) * group, "q.stride(1) * group");
  p.q_row_stride = to_int(q.stride(2), "q.stride(2)");
  p.k_batch_stride = to_int(k.stride(0), "k.stride(0)");
  p.k_head_stride = to_int(k.stride(1), "k.stride(1)");
  p.k_row_stride = to_int(k.stride(2), "k.stride(2)");
  p.v_batch_stride = to_int(v.stride(0), "v.stride(0)");
  p.v_head_stride = to_int(v.stride(1), "v.stride(1)");
  p.v_row_stride = to_int(v.stride(2), "v.stride(2)");
  p.out_batch_stride = to_int(out.stride(0), "out.stride(0)");
  p.out_head_stride = to_int(out.stride(1) * group, "out.stride(1) * group");
  p.out_row_stride = to_int(out.stride(2), "out.stride(2)");
  p.lse_batch_stride = to_int(lse.stride(0), "lse.stride(0)");
  p.lse_head_stride = to_int(lse.stride(1) * group, "lse.stride(1) * group");
  p.scale = static_cast<float>(scale);
  p.bf16 = q.scalar_type() == at::kBFloat16;
  p.causal = causal;
  p.device = device;
  p.sm_count = device_attribute(cudaDevAttrMultiProcessorCount, device);
  Scratch scratch{q.options().dtype(at::kByte), {}};
  p.alloc = &Scratch::alloc;
  p.alloc_ctx = &scratch;
  const auto stream = c10::cuda::getCurrentCUDAStream(device).stream();
  for (int64_t g = 0; g < group; ++g) {
    p.q = static_cast<const char*>(q.data_ptr()) + g * q.stride(1) * q.element_size();
    p.out = static_cast<char*>(out.data_ptr()) + g * out.stride(1) * out.element_size();
    p.lse = lse.data_ptr<float>() + g * lse.stride(1);
    entry(p, stream);
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(flash, CUDA, m) { m.impl("attention_fwd_sm90", &attention_fwd_sm90); }

}  // namespace torch_flash
