// The CUDA-key kernel of the fast path: replay a recorded recipe, or run the op's Python body
// (recording it when asked). fast_path.h describes the scheme.
#include <ATen/ATen.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <cstring>
#include <set>

#include "fast/fast_path.h"

namespace torch_flash::fast {
namespace py = pybind11;

namespace {

// Recordings of one signature that may give no recipe (the first call compiles its kernels;
// a signature on the reference path never gives one) before its calls stop trying.
constexpr int kMaxAttempts = 3;
// signatures kept per op before its table starts afresh (shapes can vary without bound)
constexpr size_t kMaxRecipes = 4096;

using LaunchFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, CUstream, void**, void**);
using ParamInfoFn = CUresult (*)(CUfunction, size_t, size_t*, size_t*);

// Driver entry points through the runtime, so the extension does not link libcuda.
template <class Fn>
Fn driver_entry(const char* symbol, unsigned version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &status);
  TORCH_CHECK(err == cudaSuccess && status == cudaDriverEntryPointSuccess && fn,
              "torch_flash fast path: the CUDA driver has no ", symbol);
  return reinterpret_cast<Fn>(fn);
}

LaunchFn launch_kernel() {
  static const LaunchFn fn = driver_entry<LaunchFn>("cuLaunchKernel", 12000);
  return fn;
}

ParamInfoFn param_info() {
  static const ParamInfoFn fn = driver_entry<ParamInfoFn>("cuFuncGetParamInfo", 12040);
  return fn;
}

std::string& backend_key() {
  static std::string key;
  return key;
}

// use_backend(...) in force on this thread: the Python path decides every call (torch < 2.13
// leaves None under the key when the block exits)
bool backend_forced() {
  const std::string& key = backend_key();
  if (key.empty() || !at::impl::ThreadLocalPythonObjects::contains(key)) return false;
  return at::impl::ThreadLocalPythonObjects::get(key)->ptr(getPyInterpreter()) != Py_None;
}

void push_tensor_key(Key& key, const at::Tensor& t) {
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.get_device());
  key.push_back(t.dim());
  for (int64_t s : t.sizes()) key.push_back(s);
  for (int64_t s : t.strides()) key.push_back(s);
  // the one thing Triton reads of a pointer; conj/neg bits would change what the data means
  key.push_back((reinterpret_cast<uintptr_t>(t.const_data_ptr()) & 15) | (t.is_conj() << 4) | (t.is_neg() << 5));
}

// Inputs that share a storage (a packed qkv, one cu_seqlens passed twice): a recipe addresses
// each through the first of them, which holds while the later ones keep their byte distance.
void push_alias_key(Key& key, c10::ArrayRef<c10::IValue> args, size_t i, const at::Tensor& t) {
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  for (size_t j = 0; j < i; ++j) {
    if (!args[j].isTensor() || !args[j].toTensor().defined()) continue;
    const at::Tensor& u = args[j].toTensor();
    if (u.storage().unsafeGetStorageImpl() == storage) {
      key.push_back(static_cast<int64_t>(j));
      key.push_back(static_cast<const char*>(t.const_data_ptr()) - static_cast<const char*>(u.const_data_ptr()));
      return;
    }
  }
  key.push_back(-1);
}

// What the Python body's plan and path depend on (torch_flash/ops/_plans.py, signature): every
// tensor's dtype, device, shape, strides, 16-byte alignment and the earlier input it shares a
// storage with, every other argument's value. False for arguments the key cannot hold (those
// calls always take the Python path).
bool make_key(c10::ArrayRef<c10::IValue> args, Key& key) {
  key.clear();
  key.push_back(c10::cuda::current_device());
  // global switches a plan may read (attention's backward chooses cuDNN by them)
  auto& context = at::globalContext();
  key.push_back(context.deterministicAlgorithms() | (context.userEnabledCuDNNSDP() << 1));
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = args[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        key.push_back(1);
        continue;
      }
      if (!t.is_cuda() || t.layout() != at::kStrided) return false;
      key.push_back(2);
      push_tensor_key(key, t);
      push_alias_key(key, args, i, t);
    } else if (v.isNone()) {
      key.push_back(3);
    } else if (v.isInt()) {  // ScalarType and MemoryFormat arguments too
      key.push_back(4);
      key.push_back(v.toInt());
    } else if (v.isDouble()) {
      const double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.push_back(5);
      key.push_back(bits);
    } else if (v.isBool()) {
      key.push_back(6 + v.toBool());
    } else if (v.isIntList()) {
      key.push_back(8);
      const auto list = v.toIntList();
      key.push_back(static_cast<int64_t>(list.size()));
      for (int64_t x : list) key.push_back(x);
    } else if (v.isString()) {
      const auto& s = v.toStringRef();
      key.push_back(9);
      key.push_back(static_cast<int64_t>(s.size()));
      for (size_t i = 0; i < s.size(); i += 8) {
        int64_t word = 0;
        std::memcpy(&word, s.data() + i, std::min<size_t>(8, s.size() - i));
        key.push_back(word);
      }
    } else {
      return false;
    }
  }
  return true;
}

// A replay's memory: the call's inputs, the buffers it allocated, the op calls' outputs so far.
struct Memory {
  c10::ArrayRef<c10::IValue> args;
  const std::vector<at::Tensor>& kept;
  std::vector<c10::Storage> buffers;
  std::vector<at::Tensor> produced;

  const at::Tensor& input(int index) const { return args[index].toTensor(); }

  const c10::Storage& storage(const Param& p) const {
    return p.kind == Param::kAlloc ? buffers[p.index]
        : p.kind == Param::kProduced ? produced[p.index].storage() : kept[p.index].storage();
  }

  int64_t address(const Param& p) const {
    switch (p.kind) {
      case Param::kInput:
        return reinterpret_cast<int64_t>(input(p.index).const_data_ptr()) + p.payload;
      case Param::kAlloc:
      case Param::kProduced:
      case Param::kKept:
        return reinterpret_cast<int64_t>(storage(p).data()) + p.payload;
      case Param::kValue:
        break;
    }
    return p.payload;
  }

  at::Tensor tensor(const TensorRef& ref) const {
    const size_t item = c10::elementSize(ref.dtype);
    int64_t offset = ref.base.payload;  // bytes from the start of the storage
    const bool from_input = ref.base.kind == Param::kInput;
    if (from_input) {
      const at::Tensor& whole = input(ref.base.index);
      if (offset == 0 && whole.scalar_type() == ref.dtype && whole.sizes() == c10::IntArrayRef(ref.sizes) &&
          whole.strides() == c10::IntArrayRef(ref.strides)) {
        return whole;
      }
      offset += whole.storage_offset() * whole.element_size();
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(from_input ? input(ref.base.index).storage() : storage(ref.base)),
        c10::DispatchKeySet(c10::DispatchKey::CUDA), caffe2::TypeMeta::fromScalarType(ref.dtype));
    impl->set_sizes_and_strides(ref.sizes, ref.strides, offset / static_cast<int64_t>(item));
    return at::Tensor(std::move(impl));
  }
};

void launch(const OpState& state, const Memory& memory, const Launch& launch, CUstream stream) {
  if (!launch.grid[0] || !launch.grid[1] || !launch.grid[2]) return;  // as Triton: nothing to launch
  const size_t n = launch.params.size();
  c10::SmallVector<int64_t, 32> slots(n);
  c10::SmallVector<void*, 32> pointers(n);
  for (size_t i = 0; i < n; ++i) {
    slots[i] = memory.address(launch.params[i]);
    pointers[i] = &slots[i];
  }
  const CUresult err = launch_kernel()(reinterpret_cast<CUfunction>(launch.function), launch.grid[0], launch.grid[1],
                                       launch.grid[2], launch.threads, 1, 1, launch.shared, stream, pointers.data(),
                                       nullptr);
  TORCH_CHECK(err == CUDA_SUCCESS, "flash.", state.name, ": launching its recorded kernel failed (CUresult ", num(err),
              ")");
}

void call(Memory& memory, const Call& call) {
  torch::jit::Stack stack;
  stack.reserve(call.tensors.size());
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    if (call.tensors[i]) {
      stack.emplace_back(memory.tensor(*call.tensors[i]));
    } else {
      stack.push_back(call.values[i]);
    }
  }
  call.op.callBoxed(stack);
  for (size_t i = 0; i < call.returns; ++i) {
    memory.produced.push_back(stack[i].isTensor() ? stack[i].toTensor() : at::Tensor());
  }
}

std::vector<at::Tensor> replay(const OpState& state, const Recipe& recipe, c10::ArrayRef<c10::IValue> args) {
  c10::Allocator* allocator = c10::cuda::CUDACachingAllocator::get();
  Memory memory{args, recipe.kept, {}, {}};
  memory.buffers.reserve(recipe.allocs.size());
  for (int64_t nbytes : recipe.allocs) {
    memory.buffers.emplace_back(c10::Storage::use_byte_size_t(), nbytes, allocator, /*resizable=*/false);
  }
  const CUstream stream = c10::cuda::getCurrentCUDAStream(recipe.device).stream();
  // target checks, as the Python path makes them: none while a CUDA graph is captured
  const bool checking = !recipe.checks.empty() && !stream_capturing(stream);
  if (checking) raise_pending(false);
  for (const Step& step : recipe.steps) {
    switch (step.kind) {
      case Step::kLaunch:
        launch(state, memory, recipe.launches[step.index], stream);
        break;
      case Step::kCheck:
        if (checking) {
          const Check& c = recipe.checks[step.index];
          target_check(reinterpret_cast<const void*>(memory.address(c.summary)), recipe.device, stream, c.n_classes,
                       c.ignore_index, c.op, c.wait);
        }
        break;
      case Step::kCall:
        call(memory, recipe.calls[step.index]);
        break;
    }
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(recipe.outputs.size());
  for (const TensorRef& o : recipe.outputs) outputs.push_back(memory.tensor(o));
  return outputs;
}

// The op's Python body: fallback(args, record) -> (result, recipe or None).
void call_python(OpState& state, const c10::OperatorHandle& op, torch::jit::Stack* stack, const Key* key) {
  py::gil_scoped_acquire gil;
  const py::tuple py_args = to_python(op, torch::jit::pop(*stack, state.num_args));
  PyObject* got = PyObject_CallFunctionObjArgs(state.fallback, py_args.ptr(), key ? Py_True : Py_False, nullptr);
  if (!got) throw python_error();
  const py::tuple result = py::reinterpret_steal<py::tuple>(got);
  push_returns(op, stack, result[0]);
  if (!key) return;
  std::shared_ptr<const Recipe> recipe;
  try {  // a recipe the driver or pybind refuses is no recipe; the call itself succeeded
    recipe = parse_recipe(result[1]);
  } catch (const std::exception&) {
    PyErr_Clear();
  }
  std::lock_guard<std::mutex> guard(state.mutex);
  if (state.table.size() >= kMaxRecipes) state.table.clear();
  Entry& entry = state.table[*key];
  if (recipe) {
    entry.recipe = std::move(recipe);
  } else {
    ++entry.attempts;
  }
}

}  // namespace

namespace {

// toPyObject turns a dtype argument (an int inside an IValue) into an int: the schema says which
// ints are dtypes
py::object arg_to_python(const c10::Argument& arg, const c10::IValue& v) {
  if (v.isInt()) {
    c10::TypePtr type = arg.real_type();
    if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
    if (type->kind() == c10::TypeKind::ScalarTypeType) return py::cast(static_cast<at::ScalarType>(v.toInt()));
  }
  return torch::jit::toPyObject(v);
}

}  // namespace

py::tuple to_python(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  const auto& schema = op.schema().arguments();
  py::tuple out(args.size());
  for (size_t i = 0; i < args.size(); ++i) out[i] = arg_to_python(schema[i], args[i]);
  return out;
}

std::pair<py::tuple, py::dict> to_python_call(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  const auto& schema = op.schema().arguments();
  size_t positional = 0;
  while (positional < schema.size() && !schema[positional].kwarg_only()) ++positional;
  py::tuple py_args(positional);
  py::dict py_kwargs;
  for (size_t i = 0; i < args.size(); ++i) {
    py::object v = arg_to_python(schema[i], args[i]);
    if (i < positional) {
      py_args[i] = std::move(v);
    } else {
      py_kwargs[py::str(schema[i].name())] = std::move(v);
    }
  }
  return {py_args, py_kwargs};
}

void push_returns(const c10::OperatorHandle& op, torch::jit::Stack* stack, py::handle out) {
  const auto& returns = op.schema().returns();
  if (returns.empty()) return;  // an in-place op returning nothing: its body returns None
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(out, returns[0].real_type()));
    return;
  }
  const auto items = out.cast<py::tuple>();
  TORCH_CHECK(items.size() == returns.size(), "torch_flash fast path: ", op.schema().name(), " returned ",
              num(items.size()), " values, its schema ", num(returns.size()));
  for (size_t i = 0; i < returns.size(); ++i) stack->push_back(torch::jit::toIValue(items[i], returns[i].real_type()));
}

size_t KeyHash::operator()(const Key& key) const noexcept {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  return static_cast<size_t>(h);
}

void set_backend_key(std::string key) { backend_key() = std::move(key); }

const std::string* intern(const std::string& text) {
  static std::mutex mutex;
  static std::set<std::string> texts;
  std::lock_guard<std::mutex> guard(mutex);
  return &*texts.insert(text).first;
}

namespace {

// (kind, index, payload, ...): the first three items
Param parse_param(py::handle obj) {
  const auto t = obj.cast<py::tuple>();
  return {static_cast<Param::Kind>(t[0].cast<int>()), t[1].cast<int>(), t[2].cast<int64_t>()};
}

// (kind, index, byte offset, dtype, sizes, strides)
TensorRef parse_tensor(py::handle obj) {
  const auto t = obj.cast<py::tuple>();
  return {parse_param(t), t[3].cast<c10::ScalarType>(), t[4].cast<std::vector<int64_t>>(),
          t[5].cast<std::vector<int64_t>>()};
}

// (function, (gx, gy, gz), threads, shared, [(kind, index, payload, size)]); nullopt where the
// kernel's parameters (as the driver reports them) are not what the recipe passes.
std::optional<Launch> parse_launch(const py::tuple& t) {
  Launch launch;
  launch.function = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  const auto grid = t[1].cast<std::vector<unsigned>>();
  TORCH_CHECK(grid.size() == 3, "torch_flash fast path: a recipe's grid has 3 dimensions");
  std::copy(grid.begin(), grid.end(), launch.grid);
  launch.threads = t[2].cast<unsigned>();
  launch.shared = t[3].cast<unsigned>();
  const auto function = reinterpret_cast<CUfunction>(launch.function);
  size_t index = 0, offset = 0, size = 0;
  for (py::handle p : t[4]) {
    const auto pt = p.cast<py::tuple>();
    if (param_info()(function, index++, &offset, &size) != CUDA_SUCCESS || size != pt[3].cast<size_t>()) {
      return std::nullopt;
    }
    launch.params.push_back(parse_param(pt));
  }
  if (param_info()(function, index, &offset, &size) == CUDA_SUCCESS) return std::nullopt;  // more than recorded
  return launch;
}

// (qualified name, overload, [("tensor", tensor) or ("value", value)]) in schema order
Call parse_call(const py::tuple& t) {
  const auto name = t[0].cast<std::string>(), overload = t[1].cast<std::string>();
  Call call{c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str()), {}, {}, 0};
  const auto& schema = call.op.schema();
  call.returns = schema.returns().size();
  size_t i = 0;
  for (py::handle a : t[2]) {
    const auto at = a.cast<py::tuple>();
    if (at[0].cast<std::string>() == "tensor") {
      call.tensors.emplace_back(parse_tensor(at[1]));
      call.values.emplace_back();
    } else {
      call.tensors.emplace_back();
      call.values.push_back(torch::jit::toIValue(at[1], schema.arguments()[i].real_type()));
    }
    ++i;
  }
  TORCH_CHECK(i == schema.arguments().size(), "torch_flash fast path: a recorded call of ", name, " has ", num(i),
              " arguments");
  return call;
}

}  // namespace

// recipe: (path, device, [nbytes], [(kind, step)], [output tensor], [kept tensor]), or None; a step is
// ("launch", launch), ("check", ((kind, index, payload), n_classes, ignore_index, op, wait)) or
// ("call", call), as parsed above. Returns null where a kernel's parameters are not what the
// recipe passes.
std::shared_ptr<const Recipe> parse_recipe(py::handle obj) {
  if (obj.is_none()) return nullptr;
  const auto t = obj.cast<py::tuple>();
  auto recipe = std::make_shared<Recipe>();
  recipe->path = intern(t[0].cast<std::string>());
  recipe->device = t[1].cast<int>();
  recipe->allocs = t[2].cast<std::vector<int64_t>>();
  for (py::handle s : t[3]) {
    const auto st = s.cast<py::tuple>();
    const auto kind = st[0].cast<std::string>();
    const auto body = st[1].cast<py::tuple>();
    if (kind == "launch") {
      auto launch = parse_launch(body);
      if (!launch) return nullptr;
      recipe->steps.push_back({Step::kLaunch, recipe->launches.size()});
      recipe->launches.push_back(std::move(*launch));
    } else if (kind == "check") {
      recipe->steps.push_back({Step::kCheck, recipe->checks.size()});
      recipe->checks.push_back({parse_param(body[0]), body[1].cast<int64_t>(), body[2].cast<int64_t>(),
                                intern(body[3].cast<std::string>()), body[4].cast<bool>()});
    } else {
      TORCH_CHECK(kind == "call", "torch_flash fast path: unknown recipe step ", kind);
      recipe->steps.push_back({Step::kCall, recipe->calls.size()});
      recipe->calls.push_back(parse_call(body));
    }
  }
  for (py::handle o : t[4]) recipe->outputs.push_back(parse_tensor(o));
  recipe->kept = t[5].cast<std::vector<at::Tensor>>();
  return recipe;
}

void cuda_kernel(OpState& state, const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto args = torch::jit::last(*stack, state.num_args);
  Key key;
  bool record = false;
  // a body that refuses backwards keeping their graph must see every such call
  const bool keeping_graph = state.python_when_keeping_graph &&
                             torch::autograd::get_current_graph_task_id() != -1 &&
                             torch::autograd::get_current_graph_task_keep_graph();
  if (!keeping_graph && !backend_forced() && make_key(args, key)) {
    std::shared_ptr<const Recipe> recipe;
    {
      std::lock_guard<std::mutex> guard(state.mutex);
      const auto it = state.table.find(key);
      if (it != state.table.end()) {
        recipe = it->second.recipe;
        record = !recipe && it->second.attempts < kMaxAttempts;
      } else {
        record = true;
      }
    }
    if (recipe) {
      std::vector<at::Tensor> outputs = replay(state, *recipe, args);
      torch::jit::drop(*stack, state.num_args);
      for (auto& t : outputs) stack->emplace_back(std::move(t));
      state.last.store(recipe->path, std::memory_order_relaxed);
      state.replays.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  // a call captured into a CUDA graph skips what a replay must do (the loss ops' target checks)
  if (record) record = !stream_capturing(c10::cuda::getCurrentCUDAStream().stream());
  state.last.store(nullptr, std::memory_order_relaxed);
  state.fallbacks.fetch_add(1, std::memory_order_relaxed);
  call_python(state, op, stack, record ? &key : nullptr);
}

}  // namespace torch_flash::fast
