// flash::attention_fwd_sm90 and flash::attention_bwd_sm90 for CUDA tensors: the Hopper kernels
// behind flash.attention and flash.attention_backward (torch_flash/ops/attention.py defines the
// schemas and calls these ops where the kernels serve the call).
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention_bwd_sm90.h"
#include "attention/attention_fwd_sm90.h"

namespace torch_flash {
namespace {

constexpr const char* kOp = "flash.attention_fwd_sm90: ";
constexpr const char* kBwdOp = "flash.attention_bwd_sm90: ";

// Error messages take numbers as strings: streaming an integer into TORCH_CHECK's message
// crashed (SIGSEGV in the ostream's number formatting) in this extension on the GPU image
// (torch 2.11, on both an H100 and an H200), where streaming strings did not.
std::string num(int64_t value) { return std::to_string(value); }

std::string shape(at::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + num(sizes[i]);
  return out + ")";
}

int to_int(int64_t value, const char* what, const char* op = kOp) {
  TORCH_CHECK(value >= 0 && value <= std::numeric_limits<int>::max(), op, what, " = ", num(value),
              " does not fit the kernel's 32-bit indexing");
  return static_cast<int>(value);
}

void check_input(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.is_cuda(), op, name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == q.device(), op, name, " is on ", t.device(), " but q is on ", q.device());
  TORCH_CHECK(t.dim() == 4, op, name, " must be 4-D (B, H, S, D), got ", shape(t.sizes()));
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, name, " has dtype ", t.scalar_type(), " but q has ",
              q.scalar_type());
  TORCH_CHECK(t.stride(3) == 1, op, name, " must have a contiguous last dim, got strides ", shape(t.strides()));
  // TMA: 16-byte aligned base and strides
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, name, " must be 16-byte aligned");
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.stride(d) * t.element_size() % 16 == 0, op, name, " stride ", num(t.stride(d)),
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

// The checks of both directions: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), Hq % Hkv == 0, fp16/bf16,
// a built head dim, an sm_90 GPU; causal (aligned bottom-right) needs Sq <= Sk.
struct Problem {
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  int device;
};

Problem check_problem(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                      bool built) {
  check_input(op, q, "q", q);
  check_input(op, k, "k", q);
  check_input(op, v, "v", q);
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
              "q, k, v must be float16 or bfloat16, got ", q.scalar_type());
  Problem p{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), q.get_device()};
  TORCH_CHECK(k.size(0) == p.batch && v.size(0) == p.batch, op, "batch sizes differ: q ", shape(q.sizes()), ", k ",
              shape(k.sizes()), ", v ", shape(v.sizes()));
  TORCH_CHECK(k.size(3) == p.head_dim && v.size(3) == p.head_dim, op, "head dims differ: q ", shape(q.sizes()),
              ", k ", shape(k.sizes()), ", v ", shape(v.sizes()));
  TORCH_CHECK(v.size(1) == p.heads_kv && v.size(2) == p.seqlen_k, op, "k ", shape(k.sizes()), " and v ",
              shape(v.sizes()), " differ in heads or keys");
  TORCH_CHECK(p.heads_kv > 0 && p.heads_q % p.heads_kv == 0, op, "q has ", num(p.heads_q),
              " heads, not a multiple of the ", num(p.heads_kv), " heads of k and v");
  TORCH_CHECK(p.seqlen_q > 0 && p.seqlen_k > 0, op, "empty sequences are not supported (Sq ", num(p.seqlen_q),
              ", Sk ", num(p.seqlen_k), ")");
  TORCH_CHECK(p.seqlen_q % 8 == 0, op, "seqlen_q must be a multiple of 8, got ", num(p.seqlen_q));
  TORCH_CHECK(!causal || p.seqlen_q <= p.seqlen_k, op, "causal needs seqlen_q <= seqlen_k, got ", num(p.seqlen_q),
              " and ", num(p.seqlen_k));
  TORCH_CHECK(built, op, "head dim ", num(p.head_dim),
              " is not built (head dims 64, 128, 256, as listed by FLASH_HDIMS at build time)");
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, p.device);
  const int minor = device_attribute(cudaDevAttrComputeCapabilityMinor, p.device);
  TORCH_CHECK(major == 9 && minor == 0, op, "needs an sm_90 GPU (Hopper), got sm_", num(major), num(minor));
  return p;
}

// A buffer the kernels write in full, unfilled: under torch.use_deterministic_algorithms(True)
// at::empty fills new memory with NaN (torch.utils.deterministic.fill_uninitialized_memory), a
// pass as long as the kernel's own write.
at::Tensor empty_written(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::detail::empty_cuda(sizes, options);
}

// A dense tensor of q's shape whose dims 0-2 lie in the order of q's strides, largest first
// (ties in dim order), the last dim contiguous: the forward's out follows q's layout as SDPA's
// does (torch_flash/reference/attention.py, layout_strides, which the op's fake uses). Unfilled,
// as empty_written.
at::Tensor empty_like_layout(const at::Tensor& q) {
  std::array<int64_t, 3> order{0, 1, 2};
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return q.stride(a) > q.stride(b); });
  std::array<int64_t, 4> strides{0, 0, 0, 1};
  int64_t step = q.size(3);
  for (int i = 2; i >= 0; --i) {
    strides[order[i]] = step;
    step *= q.size(order[i]);
  }
  return at::detail::empty_strided_cuda(q.sizes(), strides, q.options());
}

// sinks (Hq,) of any floating dtype on q's device, as fp32 the epilogue reads (a copy only where
// it is not one already).
at::Tensor sinks_fp32(const at::Tensor& sinks, const at::Tensor& q) {
  TORCH_CHECK(sinks.device() == q.device(), kOp, "sinks is on ", sinks.device(), " but q is on ", q.device());
  TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == q.size(1), kOp, "sinks must be (Hq,) = (", num(q.size(1)),
              ",), got ", shape(sinks.sizes()));
  TORCH_CHECK(at::isFloatingType(sinks.scalar_type()), kOp, "sinks must be floating point, got ",
              sinks.scalar_type());
  return sinks.to(at::kFloat).contiguous();
}

// alibi_slopes fp32 (Hq,) or (B, Hq) on q's device, as the kernel reads them (a copy only where
// not contiguous).
at::Tensor alibi_ready(const char* op, const at::Tensor& slopes, const at::Tensor& q) {
  TORCH_CHECK(slopes.device() == q.device(), op, "alibi_slopes is on ", slopes.device(), " but q is on ",
              q.device());
  TORCH_CHECK(slopes.scalar_type() == at::kFloat, op, "alibi_slopes must be float32, got ", slopes.scalar_type());
  const bool per_head = slopes.dim() == 1 && slopes.size(0) == q.size(1);
  TORCH_CHECK(per_head || (slopes.dim() == 2 && slopes.size(0) == q.size(0) && slopes.size(1) == q.size(1)), op,
              "alibi_slopes must be (Hq,) = (", num(q.size(1)), ",) or (B, Hq) = (", num(q.size(0)), ", ",
              num(q.size(1)), "), got ", shape(slopes.sizes()));
  return slopes.contiguous();
}

// q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) with Hq % Hkv == 0, sinks (Hq,) or none, alibi_slopes
// (Hq,) or (B, Hq) fp32 or none -> out (B, Hq, Sq, D) laid out like q (empty_like_layout), lse
// (B, Hq, Sq) fp32, both with the sinks and ALiBi. causal: aligned bottom-right, as
// flash.attention, with Sq <= Sk (every query row sees a key).
std::tuple<at::Tensor, at::Tensor> attention_fwd_sm90(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      double scale, bool causal,
                                                      const std::optional<at::Tensor>& sinks,
                                                      const std::optional<at::Tensor>& alibi_slopes) {
  Entry entry = q.dim() == 4 ? entry_for(q.size(3)) : nullptr;
  const auto [batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, device] =
      check_problem(kOp, q, k, v, causal, entry != nullptr);
  c10::cuda::CUDAGuard guard(q.device());
  auto out = empty_like_layout(q);
  auto lse = empty_written({batch, heads_q, seqlen_q}, q.options().dtype(at::kFloat));
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
  const auto sinks32 = sinks.has_value() ? sinks_fp32(*sinks, q) : at::Tensor();
  p.sinks_head_stride = to_int(group, "group");
  const auto slopes = alibi_slopes.has_value() ? alibi_ready(kOp, *alibi_slopes, q) : at::Tensor();
  p.alibi_batch_stride = slopes.defined() && slopes.dim() == 2 ? to_int(heads_q, "heads") : 0;
  p.alibi_head_stride = to_int(group, "group");
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
    p.sinks = sinks32.defined() ? sinks32.data_ptr<float>() + g : nullptr;  // heads g, g + G, ...
    p.alibi_slopes = slopes.defined() ? slopes.data_ptr<float>() + g : nullptr;
    entry(p, stream);
  }
  return {out, lse};
}

using BwdEntry = void (*)(const AttentionBwdSm90Params&, cudaStream_t);

BwdEntry bwd_entry_for(int64_t head_dim) {
  switch (head_dim) {
#ifdef FLASH_HDIM_64
    case 64: return attention_bwd_sm90_hdim64;
#endif
#ifdef FLASH_HDIM_128
    case 128: return attention_bwd_sm90_hdim128;
#endif
    default: return nullptr;
  }
}

// t as the kernels' TMA descriptors read it: itself where its strides and start are 16-byte
// aligned, else a contiguous copy.
at::Tensor tma_ready(const at::Tensor& t) {
  bool aligned = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d + 1 < t.dim(); ++d) aligned = aligned && t.stride(d) * t.element_size() % 16 == 0;
  return aligned ? t : t.contiguous();
}

// The gradients of attention_fwd_sm90: grad_out and out (B, Hq, Sq, D), lse (B, Hq, Sq) fp32 as
// the forward returned them, its alibi_slopes (or none) -> dq laid out like q, dk and dv like k (empty_like_layout: the
// epilogue stores both alike). dq is summed over the key blocks by bulk reductions: in any order
// by default, in a fixed key-block order (bitwise reproducible) under
// torch.use_deterministic_algorithms(True).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_sm90(const at::Tensor& grad_out, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& out, const at::Tensor& lse,
                                                                  double scale, bool causal,
                                                                  const std::optional<at::Tensor>& alibi_slopes) {
  BwdEntry entry = q.dim() == 4 ? bwd_entry_for(q.size(3)) : nullptr;
  const auto [batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, device] =
      check_problem(kBwdOp, q, k, v, causal, entry != nullptr);
  for (auto [t, name] : {std::pair{&grad_out, "grad_out"}, std::pair{&out, "out"}}) {
    TORCH_CHECK(t->sizes() == q.sizes() && t->scalar_type() == q.scalar_type() && t->device() == q.device(), kBwdOp,
                name, " must match q (", shape(q.sizes()), ", ", q.scalar_type(), "), got ", shape(t->sizes()), ", ",
                t->scalar_type());
  }
  TORCH_CHECK(lse.sizes() == q.sizes().slice(0, 3) && lse.scalar_type() == at::kFloat && lse.device() == q.device(),
              kBwdOp, "lse must be float32 of shape ", shape(q.sizes().slice(0, 3)), ", got ", shape(lse.sizes()),
              ", ", lse.scalar_type());
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  c10::cuda::CUDAGuard guard(q.device());
  const auto grad_out_ = tma_ready(grad_out), out_ = tma_ready(out), lse_ = tma_ready(lse);
  const int64_t group = heads_q / heads_kv;
  auto dq = empty_like_layout(q);
  // with a group, one slice of dk and dv per query head, summed below (one kernel each)
  at::Tensor dk_out = empty_like_layout(k), dv_out = empty_like_layout(k);
  auto dk = group == 1 ? dk_out.unsqueeze(0) : empty_written({group, batch, heads_kv, seqlen_k, head_dim}, q.options());
  auto dv = group == 1 ? dv_out.unsqueeze(0) : empty_written(dk.sizes(), q.options());
  const int64_t rows_acc = (seqlen_q + kBwdQueryRowsMax - 1) / kBwdQueryRowsMax * kBwdQueryRowsMax;
  // Deterministic dQ: each query tile's first turn stores instead of adding, so dq_acc needs no
  // zeros where every tile sees a key: without the causal mask, and with it where Sq <= Sk (as
  // check_problem requires; with Sq > Sk the tiles of rows below Sq - Sk would take no key block).
  const bool every_tile_stored = deterministic && seqlen_k > 0 && (!causal || seqlen_q <= seqlen_k);
  const auto acc_options = q.options().dtype(at::kFloat);
  const std::array<int64_t, 4> acc_shape{batch, heads_q, rows_acc, head_dim};
  auto dq_acc = every_tile_stored ? empty_written(acc_shape, acc_options) : at::zeros(acc_shape, acc_options);
  auto sum_odo = empty_written({batch, heads_q, seqlen_q}, acc_options);
  at::Tensor dq_semaphore;
  if (deterministic) {
    dq_semaphore = at::zeros({batch, heads_q, (seqlen_q + kBwdQueryRows - 1) / kBwdQueryRows},
                             q.options().dtype(at::kInt));
  }

  AttentionBwdSm90Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out_.data_ptr();
  p.grad_out = grad_out_.data_ptr();
  p.lse = lse_.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_acc = dq_acc.data_ptr<float>();
  p.sum_odo = sum_odo.data_ptr<float>();
  p.dq_semaphore = dq_semaphore.defined() ? dq_semaphore.data_ptr<int>() : nullptr;
  p.batch = to_int(batch, "batch", kBwdOp);
  p.heads_q = to_int(heads_q, "heads_q", kBwdOp);
  p.heads_kv = to_int(heads_kv, "heads_kv", kBwdOp);
  p.seqlen_q = to_int(seqlen_q, "seqlen_q", kBwdOp);
  p.seqlen_k = to_int(seqlen_k, "seqlen_k", kBwdOp);
  p.head_dim = to_int(head_dim, "head_dim", kBwdOp);
  to_int(dq_acc.numel(), "B * Hq * Sq * D (Sq rounded up to 128)", kBwdOp);
  to_int(dk[0].numel(), "B * Hkv * Sk * D", kBwdOp);
  auto strides = [&](const at::Tensor& t, const char* name, int& b, int& h, int& r) {
    b = to_int(t.stride(0), name, kBwdOp);
    to_int(t.stride(1) * group, name, kBwdOp);  // the kernels step over a group's heads
    h = static_cast<int>(t.stride(1));
    r = to_int(t.stride(2), name, kBwdOp);
  };
  strides(q, "q strides", p.q_batch_stride, p.q_head_stride, p.q_row_stride);
  strides(out_, "out strides", p.out_batch_stride, p.out_head_stride, p.out_row_stride);
  strides(grad_out_, "grad_out strides", p.grad_out_batch_stride, p.grad_out_head_stride, p.grad_out_row_stride);
  strides(dq, "dq strides", p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride);
  p.k_batch_stride = to_int(k.stride(0), "k.stride(0)", kBwdOp);
  p.k_head_stride = to_int(k.stride(1), "k.stride(1)", kBwdOp);
  p.k_row_stride = to_int(k.stride(2), "k.stride(2)", kBwdOp);
  p.v_batch_stride = to_int(v.stride(0), "v.stride(0)", kBwdOp);
  p.v_head_stride = to_int(v.stride(1), "v.stride(1)", kBwdOp);
  p.v_row_stride = to_int(v.stride(2), "v.stride(2)", kBwdOp);
  p.lse_batch_stride = to_int(lse_.stride(0), "lse.stride(0)", kBwdOp);
  to_int(lse_.stride(1) * group, "lse.stride(1) * group", kBwdOp);
  p.lse_head_stride = static_cast<int>(lse_.stride(1));
  p.dk_batch_stride = to_int(dk.stride(1), "dk.stride(0)", kBwdOp);
  p.dk_head_stride = to_int(dk.stride(2), "dk.stride(1)", kBwdOp);
  p.dk_row_stride = to_int(dk.stride(3), "dk.stride(2)", kBwdOp);
  p.dkv_member_stride = dk.stride(0);
  const auto slopes = alibi_slopes.has_value() ? alibi_ready(kBwdOp, *alibi_slopes, q) : at::Tensor();
  p.alibi_slopes = slopes.defined() ? slopes.data_ptr<float>() : nullptr;
  p.alibi_batch_stride = slopes.defined() && slopes.dim() == 2 ? to_int(heads_q, "heads", kBwdOp) : 0;
  p.alibi_head_stride = 1;
  p.scale = static_cast<float>(scale);
  p.bf16 = q.scalar_type() == at::kBFloat16;
  p.causal = causal;
  p.device = device;
  p.sm_count = device_attribute(cudaDevAttrMultiProcessorCount, device);
  p.l2_bytes = device_attribute(cudaDevAttrL2CacheSize, device);
  Scratch scratch{q.options().dtype(at::kByte), {}};
  p.alloc = &Scratch::alloc;
  p.alloc_ctx = &scratch;
  entry(p, c10::cuda::getCurrentCUDAStream(device).stream());
  if (group > 1) {
    at::sum_out(dk_out, dk, at::IntArrayRef{0});
    at::sum_out(dv_out, dv, at::IntArrayRef{0});
  }
  return {dq, dk_out, dv_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(flash, CUDA, m) {
  m.impl("attention_fwd_sm90", &attention_fwd_sm90);
  m.impl("attention_bwd_sm90", &attention_bwd_sm90);
}

}  // namespace torch_flash
