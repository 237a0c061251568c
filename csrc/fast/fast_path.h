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
#include <cuda_runtime_api.h>
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

// Where a recipe finds memory: an input (its argument position), a buffer it allocates, a
// tensor an op call of the recipe returned, or a tensor from outside the call that the recipe
// keeps (a cached stand-in); or a value (kernel arguments only).
struct Param {
  enum Kind : int { kInput = 0, kAlloc = 1, kValue = 2, kProduced = 3, kKept = 4 };
  Kind kind;
  int index;        // argument position, buffer, op-call output or kept tensor
  int64_t payload;  // byte offset (from an input's data, from the start of the others' storage), or the value's bits
};

struct Launch {
  void* function;  // CUfunction, loaded (and kept) by Triton
  unsigned grid[3];
  unsigned threads;
  unsigned shared;
  std::vector<Param> params;
};

// A tensor the recipe passes to an op call or returns: a view of an input, buffer or op output.
struct TensorRef {
  Param base;
  c10::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
};

// A loss op's deferred target check (checks.cpp): `summary` points at the (count, min, max) int64
// summary of the non-ignored targets.
struct Check {
  Param summary;
  int64_t n_classes, ignore_index;
  const std::string* op;  // interned
  bool wait;              // read the verdict in the call (else: at a later loss call)
};

// An op called through the dispatcher (csrc/attention's kernels, cuDNN's backward, copies):
// its arguments (a tensor, or the value itself), its returns appended to the recipe's outputs of
// op calls.
struct Call {
  c10::OperatorHandle op;
  std::vector<std::optional<TensorRef>> tensors;
  std::vector<c10::IValue> values;  // where tensors[i] is empty
  size_t returns;
};

struct Step {
  enum Kind : int { kLaunch, kCheck, kCall };
  Kind kind;
  size_t index;  // into launches, checks or calls
};

struct Recipe {
  const std::string* path;  // the backend it records (interned), reported as the op's latest path
  int device;
  std::vector<int64_t> allocs;  // byte sizes
  std::vector<Step> steps;
  std::vector<Launch> launches;
  std::vector<Check> checks;
  std::vector<Call> calls;
  std::vector<at::Tensor> kept;
  std::vector<TensorRef> outputs;
};

// What the autograd node of an op does (torch_flash/ops/_fast.py, Spec, documents the fields).
struct Source {
  enum Kind : int {
    kArg = 0, kSaved = 1, kGrad = 2, kGradOrNone = 3, kDtypeOf = 4, kNone = 5, kRequiresGrad = 6, kConst = 7,
    kDefault = 8,  // index: the argument's position in the called op's schema
    kNotArg = 9    // the negation of bool argument index
  };
  Kind kind;
  int index;
};

struct Spec {
  std::optional<c10::OperatorHandle> forward;  // a sibling returning extra state; nullopt: the op
  std::vector<Source> forward_args;  // kArg (the call's argument), kRequiresGrad or kDefault
  std::vector<int> public_outputs;   // which of forward's returns the op returns
  std::vector<Source> saved;         // kArg (a tensor argument) or kSaved (forward's return i)
  c10::OperatorHandle backward;
  std::vector<Source> backward_args;
  std::vector<std::pair<int, int>> grads;  // per argument: (backward return or -1, cast to dtype of arg or -1)
  std::vector<int> python_only;  // arguments that, requiring a gradient, send the call to the Python rule
  std::vector<std::pair<int, c10::IValue>> python_if;  // an argument equal to the value: the Python rule
  std::vector<int> handout;  // forward's returns that are backward's for an upstream gradient of one
  std::optional<c10::OperatorHandle> scale;  // scale(grad, grad_out): a handed-out gradient in place
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
  bool python_when_keeping_graph = false;  // inside a backward that keeps its graph: the Python body
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
const std::string* intern(const std::string& text);
// checks.cpp: raise (ValueError) for the oldest bad target check whose verdict is in, once; wait:
// also for those still on their way. target_check: queue one (or read it at once with wait); its
// callers have raised the pending ones first (TargetCheck's constructor, a replay's start).
void raise_pending(bool wait);
void target_check(const void* summary, int device, cudaStream_t stream, int64_t n_classes, int64_t ignore_index,
                  const std::string* op, bool wait);
bool stream_capturing(cudaStream_t stream);
// autograd.cpp
void autograd_kernel(OpState& state, const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack);
std::unique_ptr<Spec> parse_spec(pybind11::handle spec);
// bind.cpp
void bind(pybind11::module_& m);

// Error messages take numbers as strings (csrc/attention/attention.cpp says why).
inline std::string num(int64_t value) { return std::to_string(value); }

}  // namespace torch_flash::fast
