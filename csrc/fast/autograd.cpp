// The AutogradCUDA-key kernel of the fast path: the op's autograd rule as a C++ node built from
// its spec (torch_flash/ops/_fast.py), so neither the forward nor the engine's backward runs
// Python. Calls whose tensors are not plain (fake, functional, under a functorch transform) go
// to the op's Python rule, as before.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <type_traits>

#include "fast/fast_path.h"

namespace torch_flash::fast {
namespace py = pybind11;
using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// torch 2.13 holds nodes in intrusive_ptrs, earlier versions in shared_ptrs
using NodePtr = decltype(Edge::function);

template <class T, class... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

struct SpecNode final : Node {
  explicit SpecNode(const OpState& state) : state(state) {}

  std::string name() const override { return "flash::" + state.name + " backward"; }

  void release_variables() override {
    for (auto& s : saved) s.reset_data();
    handed.clear();
  }

  variable_list apply(variable_list&& grads) override;
  // The handed-out gradients as backward's returns, scaled in place; false where a backward
  // must recompute them (none held, create_graph, or a graph kept for another backward).
  bool hand_out(const variable_list& grads, torch::jit::Stack& returns);

  const OpState& state;
  std::vector<c10::IValue> args;         // the call's non-tensor arguments (None for tensors)
  std::vector<c10::ScalarType> dtypes;   // each tensor argument's dtype
  std::vector<bool> present;             // whether argument i is a tensor
  std::vector<bool> required;            // whether argument i required a gradient
  std::vector<torch::autograd::SavedVariable> saved;
  // spec.handout's tensors: plain, not saved variables, as scaling them in place would trip a
  // saved variable's version check
  std::vector<at::Tensor> handed;
};

bool SpecNode::hand_out(const variable_list& grads, torch::jit::Stack& returns) {
  if (handed.empty() || c10::GradMode::is_enabled() || torch::autograd::get_current_graph_task_keep_graph()) {
    return false;
  }
  const at::Tensor grad_out = grads[0].defined() ? grads[0] : input_metadata(0).zeros_like();
  for (at::Tensor& t : handed) {
    if (t.numel() > 0) {
      torch::jit::Stack call{t, grad_out};
      state.spec->scale->callBoxed(&call);
    }
    returns.emplace_back(std::move(t));
  }
  handed.clear();  // the caller's now: a later backward recomputes
  return true;
}

variable_list SpecNode::apply(variable_list&& grads) {
  const Spec& spec = *state.spec;
  torch::jit::Stack stack;
  stack.reserve(spec.backward_args.size());
  if (!hand_out(grads, stack)) {
    for (const Source& s : spec.backward_args) {
      switch (s.kind) {
        case Source::kArg:
          stack.push_back(args[s.index]);
          break;
        case Source::kSaved: {
          at::Tensor t = saved[s.index].unpack();
          stack.push_back(t.defined() ? c10::IValue(std::move(t)) : c10::IValue());
          break;
        }
        case Source::kGrad:  // an unused output's gradient is zero, as autograd.Function materialises it
          stack.push_back(grads[s.index].defined() ? grads[s.index] : input_metadata(s.index).zeros_like());
          break;
        case Source::kGradOrNone:
          stack.push_back(grads[s.index].defined() ? c10::IValue(grads[s.index]) : c10::IValue());
          break;
        case Source::kDtypeOf:
          stack.push_back(c10::IValue(dtypes[s.index]));
          break;
        case Source::kNone:
          stack.emplace_back();
          break;
        case Source::kRequiresGrad:
          stack.push_back(c10::IValue(static_cast<bool>(required[s.index])));
          break;
        case Source::kConst:
          stack.push_back(c10::IValue(static_cast<int64_t>(s.index)));
          break;
        case Source::kDefault:
          stack.push_back(spec.backward.schema().arguments()[s.index].default_value().value());
          break;
        case Source::kNotArg:
          stack.push_back(c10::IValue(!args[s.index].toBool()));
          break;
      }
    }
    spec.backward.callBoxed(&stack);
  }
  variable_list out(num_outputs());
  for (size_t i = 0; i < spec.grads.size(); ++i) {
    const auto [ret, cast] = spec.grads[i];
    if (ret < 0 || !present[i] || !should_compute_output(i)) continue;
    at::Tensor g = stack[ret].toTensor();
    if (cast >= 0 && g.scalar_type() != dtypes[cast]) g = g.to(dtypes[cast]);
    out[i] = std::move(g);
  }
  return out;
}

bool requires_grad(const c10::IValue& a) {
  return a.isTensor() && a.toTensor().defined() && a.toTensor().requires_grad();
}

bool needs_grad(c10::ArrayRef<c10::IValue> args) {
  if (!c10::GradMode::is_enabled()) return false;
  for (const c10::IValue& a : args) {
    if (requires_grad(a)) return true;
  }
  return false;
}

bool python_only(const Spec& spec, c10::ArrayRef<c10::IValue> args) {
  for (int i : spec.python_only) {
    if (requires_grad(args[i])) return true;
  }
  for (const auto& [i, value] : spec.python_if) {
    if (args[i] == value) return true;
  }
  return false;
}

void set_histories(c10::ArrayRef<c10::IValue> outputs, const NodePtr& node) {
  for (const c10::IValue& v : outputs) {
    const at::Tensor t = v.isTensor() ? v.toTensor() : at::Tensor();
    if (t.defined() && torch::autograd::isDifferentiableType(t.scalar_type())) {
      torch::autograd::set_history(t, node);
    } else {
      node->add_input_metadata(Node::undefined_input());
    }
  }
}

torch::autograd::edge_list edges_of(c10::ArrayRef<c10::IValue> args) {
  torch::autograd::edge_list edges;
  edges.reserve(args.size());
  for (const c10::IValue& a : args) {
    if (a.isTensor() && a.toTensor().defined()) {
      edges.push_back(torch::autograd::impl::gradient_edge(a.toTensor()));
    } else {
      edges.emplace_back();
    }
  }
  return edges;
}

// The op's Python autograd rule, rule(*args, **kwargs), for calls this file does not serve.
void call_rule(const OpState& state, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  py::gil_scoped_acquire gil;
  const auto [py_args, py_kwargs] = to_python_call(op, torch::jit::pop(*stack, state.num_args));
  PyObject* got = PyObject_Call(state.rule, py_args.ptr(), py_kwargs.ptr());
  if (!got) throw python_error();
  push_returns(op, stack, py::reinterpret_steal<py::object>(got));
}

}  // namespace

void autograd_kernel(OpState& state, const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  const auto args = torch::jit::last(*stack, state.num_args);
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  if (!needs_grad(args)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(below, stack);
    return;
  }
  // plain: nothing between autograd and the CUDA kernel (as ops/_autograd.py, plain)
  const bool plain =
      (below - c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView)).highestPriorityTypeId() ==
      c10::DispatchKey::CUDA;
  if (state.rule && (!plain || !state.spec || python_only(*state.spec, args))) {
    call_rule(state, op, stack);
    return;
  }
  if (!state.spec) {  // an op without a derivative (the backward ops): the error comes at backward
    NodePtr node = make_node<torch::autograd::NotImplemented>("flash::" + state.name, edges_of(args));
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.redispatchBoxed(below, stack);
    }
    set_histories(torch::jit::last(*stack, op.schema().returns().size()), node);
    return;
  }
  const Spec& spec = *state.spec;
  NodePtr node_ptr = make_node<SpecNode>(state);
  auto* node = static_cast<SpecNode*>(node_ptr.get());
  node->set_next_edges(edges_of(args));
  node->args.resize(args.size());
  node->dtypes.assign(args.size(), c10::ScalarType::Undefined);
  node->present.assign(args.size(), false);
  node->required.assign(args.size(), false);
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].isTensor()) {
      const at::Tensor& t = args[i].toTensor();
      node->present[i] = t.defined();
      node->required[i] = requires_grad(args[i]);
      if (t.defined()) node->dtypes[i] = t.scalar_type();
    } else {
      node->args[i] = args[i];
    }
  }
  torch::jit::Stack forward;
  forward.reserve(spec.forward_args.size());
  const c10::OperatorHandle& forward_op = spec.forward ? *spec.forward : op;
  for (const Source& s : spec.forward_args) {
    if (s.kind == Source::kRequiresGrad) {
      forward.push_back(c10::IValue(requires_grad(args[s.index])));
    } else if (s.kind == Source::kDefault) {
      forward.push_back(forward_op.schema().arguments()[s.index].default_value().value());
    } else {
      forward.push_back(args[s.index]);
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    if (spec.forward) {
      spec.forward->callBoxed(&forward);
    } else {
      op.redispatchBoxed(below, &forward);
    }
  }
  std::vector<c10::IValue> outputs;
  outputs.reserve(spec.public_outputs.size());
  for (int j : spec.public_outputs) outputs.push_back(forward[j]);
  set_histories(outputs, node_ptr);
  for (const Source& s : spec.saved) {
    at::Tensor t;
    if (s.kind == Source::kArg) {
      if (args[s.index].isTensor()) t = args[s.index].toTensor();
    } else if (forward[s.index].isTensor()) {
      // the data alone (sharing the version counter): a saved output would hold its own node
      t = forward[s.index].toTensor().tensor_data();
    }
    node->saved.emplace_back(t, /*is_output=*/false);
  }
  for (int j : spec.handout) node->handed.push_back(forward[j].toTensor());
  torch::jit::drop(*stack, state.num_args);
  for (auto& v : outputs) stack->push_back(std::move(v));
}

// spec: (forward op or "", forward_args, public_outputs, saved, backward op, backward_args, grads,
// python_only, python_if, handout, scale op or ""); forward_args, saved and backward_args hold
// (Source kind, index) pairs, grads (backward return, cast) pairs, python_if (argument, bool or
// str value) pairs.
std::unique_ptr<Spec> parse_spec(py::handle obj) {
  if (obj.is_none()) return nullptr;
  const auto t = obj.cast<py::tuple>();
  auto& dispatcher = c10::Dispatcher::singleton();
  auto sources = [](py::handle list) {
    std::vector<Source> out;
    for (auto [kind, index] : list.cast<std::vector<std::pair<int, int>>>()) {
      out.push_back({static_cast<Source::Kind>(kind), index});
    }
    return out;
  };
  auto op_or_none = [&](py::handle name) -> std::optional<c10::OperatorHandle> {
    const auto text = name.cast<std::string>();
    return text.empty() ? std::nullopt : std::optional(dispatcher.findSchemaOrThrow(text.c_str(), ""));
  };
  std::vector<std::pair<int, c10::IValue>> python_if;
  for (py::handle pair : t[8]) {
    const auto entry = pair.cast<py::tuple>();
    const c10::IValue value = py::isinstance<py::bool_>(entry[1]) ? c10::IValue(entry[1].cast<bool>())
                                                                  : c10::IValue(entry[1].cast<std::string>());
    python_if.emplace_back(entry[0].cast<int>(), value);
  }
  auto spec = std::make_unique<Spec>(Spec{
      op_or_none(t[0]), sources(t[1]), t[2].cast<std::vector<int>>(), sources(t[3]),
      dispatcher.findSchemaOrThrow(t[4].cast<std::string>().c_str(), ""), sources(t[5]),
      t[6].cast<std::vector<std::pair<int, int>>>(), t[7].cast<std::vector<int>>(), std::move(python_if),
      t[9].cast<std::vector<int>>(), op_or_none(t[10])});
  TORCH_CHECK(spec->handout.empty() || spec->scale, "torch_flash fast path: a handout without a scale op");
  return spec;
}

}  // namespace torch_flash::fast
