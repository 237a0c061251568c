// The loss ops' deferred target checks (torch_flash/ops/cross_entropy.py, TargetCheck) on the
// CUDA side: the (count, min, max) summary of the non-ignored targets, which the op's kernels
// write on the device, is copied to pinned memory behind an event; the verdict is read once the
// event has completed, by the first loss call after it (or torch_flash.synchronize()), as CUDA
// reports its own errors. Python-path calls and recipe replays share this one queue.
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <deque>

#include "fast/fast_path.h"

namespace torch_flash::fast {

namespace {

struct Pending {
  cudaEvent_t event;
  int device;
  int64_t* host;  // 3 pinned int64: count, min, max
  int64_t n_classes, ignore_index;
  const std::string* op;
};

constexpr int kSlotsPerPage = 128;

struct Queue {
  std::mutex mutex;
  std::deque<Pending> pending;  // oldest first
  std::vector<int64_t*> free_slots;
  std::unordered_map<int, std::vector<cudaEvent_t>> free_events;  // device -> recorded before, read since
};

Queue& queue() {
  static auto* q = new Queue();  // pinned pages and events live as long as the process
  return *q;
}

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "torch_flash target check: ", what, ": ", cudaGetErrorString(err));
}

int64_t* take_slot(Queue& q) {
  if (q.free_slots.empty()) {
    void* page = nullptr;
    check(cudaHostAlloc(&page, kSlotsPerPage * 3 * sizeof(int64_t), cudaHostAllocDefault), "pinned memory");
    for (int i = 0; i < kSlotsPerPage; ++i) q.free_slots.push_back(static_cast<int64_t*>(page) + 3 * i);
  }
  int64_t* slot = q.free_slots.back();
  q.free_slots.pop_back();
  return slot;
}

cudaEvent_t take_event(Queue& q, int device) {
  auto& events = q.free_events[device];
  if (!events.empty()) {
    cudaEvent_t event = events.back();
    events.pop_back();
    return event;
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaEvent_t event;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "event");
  return event;
}

// The verdict of a check whose copy has arrived; its slot and event go back (the lock held).
// Returns the message of a bad target, or an empty string.
std::string take_verdict(Queue& q, const Pending& p, bool late) {
  const int64_t low = p.host[1], high = p.host[2];
  q.free_slots.push_back(p.host);
  q.free_events[p.device].push_back(p.event);
  if (low >= 0 && high < p.n_classes) return {};
  return "flash." + *p.op + ": target contains " + num(low < 0 ? low : high) + ", outside [0, " +
         num(p.n_classes) + ") and not ignore_index=" + num(p.ignore_index) +
         (late ? " (found on the GPU after the call returned; its loss is NaN. CUDA_LAUNCH_BLOCKING=1 raises "
                 "in the call itself)"
               : "");
}

// Pops the oldest checks whose verdict is in (all of them with wait); the message of the first
// bad one, or an empty string (the lock held).
std::string pop_arrived(Queue& q, bool wait) {
  while (!q.pending.empty()) {
    const Pending p = q.pending.front();
    const cudaError_t status = wait ? cudaEventSynchronize(p.event) : cudaEventQuery(p.event);
    if (status == cudaErrorNotReady) return {};
    check(status, "waiting for the verdict");
    q.pending.pop_front();
    std::string bad = take_verdict(q, p, /*late=*/true);
    if (!bad.empty()) return bad;
  }
  return {};
}

}  // namespace

void raise_pending(bool wait) {
  Queue& q = queue();
  std::string bad;
  {
    std::lock_guard<std::mutex> guard(q.mutex);
    bad = pop_arrived(q, wait);
  }
  TORCH_CHECK_VALUE(bad.empty(), bad);
}

void target_check(const void* summary, int device, cudaStream_t stream, int64_t n_classes, int64_t ignore_index,
                  const std::string* op, bool wait) {
  Queue& q = queue();
  std::string bad;
  {
    std::lock_guard<std::mutex> guard(q.mutex);
    Pending p{take_event(q, device), device, take_slot(q), n_classes, ignore_index, op};
    check(cudaMemcpyAsync(p.host, summary, 3 * sizeof(int64_t), cudaMemcpyDeviceToHost, stream), "copy");
    check(cudaEventRecord(p.event, stream), "event");
    const cudaError_t status = wait ? cudaEventSynchronize(p.event) : cudaEventQuery(p.event);
    if (status == cudaErrorNotReady) {
      q.pending.push_back(p);
    } else {
      check(status, "waiting for the verdict");
      bad = take_verdict(q, p, /*late=*/false);
    }
  }
  TORCH_CHECK_VALUE(bad.empty(), bad);
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &status), "capture status");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace torch_flash::fast
