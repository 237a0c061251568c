// Python's handle on the fast path: torch_flash/ops/_fast.py enables it op by op.
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "fast/fast_path.h"

namespace torch_flash::fast {
namespace py = pybind11;

namespace {

std::unordered_map<std::string, std::unique_ptr<OpState>>& registry() {
  static auto* ops = new std::unordered_map<std::string, std::unique_ptr<OpState>>();  // lives as long as its kernels
  return *ops;
}

OpState& op_state(const std::string& name) {
  auto it = registry().find(name);
  TORCH_CHECK(it != registry().end(), "torch_flash fast path: flash.", name, " is not enabled");
  return *it->second;
}

struct CudaKernel final : c10::OperatorKernel {
  explicit CudaKernel(OpState* state) : state(state) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    cuda_kernel(*state, op, keys, stack);
  }
  OpState* state;
};

struct AutogradKernel final : c10::OperatorKernel {
  explicit AutogradKernel(OpState* state) : state(state) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    autograd_kernel(*state, op, keys, stack);
  }
  OpState* state;
};

// The Python kernels these replace were registered first; the dispatcher says so in a warning.
struct Quiet final : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

void enable(const std::string& name, py::object fallback, py::object rule, py::object spec, bool autograd,
            bool python_when_keeping_graph) {
  TORCH_CHECK(!registry().count(name), "torch_flash fast path: flash.", name, " is already enabled");
  auto state = std::make_unique<OpState>();
  state->name = name;
  const std::string qualname = "flash::" + name;
  state->num_args = c10::Dispatcher::singleton().findSchemaOrThrow(qualname.c_str(), "").schema().arguments().size();
  state->fallback = fallback.release().ptr();
  state->rule = rule.is_none() ? nullptr : rule.release().ptr();
  state->spec = parse_spec(spec);
  state->python_when_keeping_graph = python_when_keeping_graph;
  OpState* raw = state.get();
  registry().emplace(name, std::move(state));
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  // never destroyed: the kernels stay registered for the life of the process
  auto* cuda = new torch::Library(torch::Library::IMPL, "flash", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  cuda->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<CudaKernel>(raw)));
  if (autograd) {
    auto* lib = new torch::Library(torch::Library::IMPL, "flash", c10::DispatchKey::AutogradCUDA, __FILE__, __LINE__);
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<AutogradKernel>(raw)));
  }
}

}  // namespace

void bind(py::module_& m) {
  m.def("fast_enable", &enable, py::arg("name"), py::arg("fallback"), py::arg("rule"), py::arg("spec"),
        py::arg("autograd"), py::arg("python_when_keeping_graph") = false,
        "Registers flash.<name>'s CUDA kernel in C++, and its AutogradCUDA one where autograd is set; "
        "python_when_keeping_graph: calls inside a backward that keeps its graph run the Python body "
        "(torch_flash/ops/_fast.py)");
  m.def(
      "fast_target_check",
      [](const at::Tensor& summary, int64_t n_classes, int64_t ignore_index, const std::string& op, bool wait) {
        TORCH_CHECK(summary.is_cuda() && summary.scalar_type() == at::kLong && summary.numel() == 3 &&
                        summary.is_contiguous(),
                    "torch_flash fast path: a target summary is 3 contiguous int64 on a GPU");
        const int device = summary.get_device();
        target_check(summary.const_data_ptr(), device, c10::cuda::getCurrentCUDAStream(device).stream(), n_classes,
                     ignore_index, intern(op), wait);
      },
      py::arg("summary"), py::arg("n_classes"), py::arg("ignore_index"), py::arg("op"), py::arg("wait"),
      py::call_guard<py::gil_scoped_release>(),
      "Queue flash.<op>'s check of a (count, min, max) target summary; ValueError where its verdict is in "
      "(with wait: waiting for it) and bad");
  m.def("fast_raise_pending", &raise_pending, py::arg("wait"), py::call_guard<py::gil_scoped_release>(),
        "ValueError for the oldest bad target check whose verdict is in (wait: also those on their way)");
  m.def("fast_set_backend_key", &set_backend_key,
        "The thread-local key of use_backend(): calls under it take the Python path");
  m.def(
      "fast_last",
      [](const std::string& name) -> py::object {
        const std::string* path = op_state(name).last.load(std::memory_order_relaxed);
        return path ? py::object(py::str(*path)) : py::object(py::none());
      },
      "The path of flash.<name>'s latest call where it was a replay, else None");
  m.def(
      "fast_forget", [](const std::string& name) { op_state(name).last.store(nullptr); },
      "Forget that flash.<name>'s latest call was a replay (the Python path ran it since)");
  m.def(
      "fast_stats",
      [] {
        py::dict out;
        for (auto& [name, state] : registry()) {
          std::lock_guard<std::mutex> guard(state->mutex);
          size_t recipes = 0;
          for (const auto& entry : state->table) recipes += entry.second.recipe != nullptr;
          out[py::str(name)] = py::make_tuple(state->replays.load(), state->fallbacks.load(), recipes);
        }
        return out;
      },
      "{op: (replays, Python calls, recipes kept)}");
  m.def(
      "fast_clear",
      [] {
        for (auto& [name, state] : registry()) {
          std::lock_guard<std::mutex> guard(state->mutex);
          state->table.clear();
          state->last.store(nullptr);
        }
      },
      "Drop every recipe (the next calls record again)");
}

}  // namespace torch_flash::fast
