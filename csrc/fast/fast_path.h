// The eager fast path (docs/design.md, "Dispatch"): flash ops registered in C++ on the CUDA and
// AutogradCUDA keys, so that a plain eager call never enters Python.
//
// CUDA key: the first calls of an argument signature run the op's Python body; once a call of
// that signature has been recorded (torch_flash/ops/_fast.py: the Triton launches it made, the
// buffers it allocated, the outputs it returned), later calls replay the recipe here: allocate,
// cuLaunchKernel the compiled Triton kernels with the new pointers, return the outputs.
// AutogradCUDA key: an op with an autograd spec (the same data the Python rule is built from)
// records a C++ node whose backward calls the backward op through the dispatcher, so the autograd
// engine's device thread runs no Python either.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch_flash::fast {

// One kernel argument of a recorded launch: a pointer into an input or a fresh buffer, or a
// value (its bytes, little-endian, in the low `size` bytes).
struct Param {
  enum Kind : int { kInput = 0, kAlloc = 1, kValue = 2 };
  Kind kind;
  int index;        // argument position (kInput) or buffer (kAlloc)
  int64_t payload;  // byte offset from the tensor's data pointer, or the value's bits
};

struct Launch {
  void* function;  // CUfunction, loaded (and kept) by Triton
  unsigned grid[3];
  unsigned threads;
  unsigned shared;
  std::vector<Param> params;
};

// A returned tensor: a view of one of the recipe's buffers.
struct Output {
  int alloc;
  c10::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
  int64_t storage_offset;
};

struct Recipe {
  const std::string* path;  // the backend it records (interned), reported as the op's latest path
  int device;
  std::vector<int64_t> allocs;  // byte sizes
  std::vector<Launch> launches;
  std::vector<Output> outputs;
};

// What the autograd node of an op does (torch_flash/ops/_fast.py, Spec, documents the fields).
struct Source {
  enum Kind : int { kArg = 0, kSaved = 1, kGrad = 2, kGradOrNone = 3, kDtypeOf = 4, kNone = 5, kRequiresGrad = 6 };
  Kind kind;
  int index;
};

struct Spec {
  std::optional<c10::OperatorHandle> forward;  // a sibling returning extra state; nullopt: the op
  std::vector<int> forward_args;     // argument positions passed to `forward`
  std::vector<int> public_outputs;   // which of forward's returns the op returns
  std::vector<Source> saved;         // kArg (a tensor argument) or kSaved (forward's return i)
  c10::OperatorHandle backward;
  std::vector<Source> backward_args;
  std::vector<std::pair<int, int>> grads;  // per argument: (backward return or -1, cast to dtype of arg or -1)
  std::vector<int> python_only;  // arguments whose gradient only the Python rule computes
};

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const noexcept;
};

struct Entry {
  std::shared_ptr<const Recipe> recipe;
  int attempts = 0;  // recordings that gave no recipe
};

struct OpState {
  std::string name;  // without the namespace
  size_t num_args = 0;
  PyObject* fallback = nullptr;  // fallback(args, record) -> (result, recipe or None); never freed
  PyObject* rule = nullptr;      // the Python autograd rule (rule(*args, **kwargs)), or null
  std::unique_ptr<Spec> spec;    // null: the op has no C++ autograd node
  std::mutex mutex;
  std::unordered_map<Key, Entry, KeyHash> table;
  std::atomic<const std::string*> last{nullptr};  // the recipe path of the latest call if replayed
  std::atomic<uint64_t> replays{0}, fallbacks{0};
};

// recipes.cpp
// Python calls from a boxed kernel (the GIL held): the arguments as Python objects, in schema
// order or as (args, kwargs) for a call by the schema; the returned object pushed as the returns.
pybind11::tuple to_python(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args);
std::pair<pybind11::tuple, pybind11::dict> to_python_call(const c10::OperatorHandle& op,
                                                          const std::vector<c10::IValue>& args);
void push_returns(const c10::OperatorHandle& op, torch::jit::Stack* stack, pybind11::handle out);
void cuda_kernel(OpState& state, const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);
std::shared_ptr<const Recipe> parse_recipe(pybind11::handle recipe);
void set_backend_key(std::string key);
// autograd.cpp
void autograd_kernel(OpState& state, const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack);
std::unique_ptr<Spec> parse_spec(pybind11::handle spec);
// bind.cpp
void bind(pybind11::module_& m);

// Error messages take numbers as strings (csrc/attention/attention.cpp says why).
inline std::string num(int64_t value) { return std::to_string(value); }

}  // namespace torch_flash::fast
