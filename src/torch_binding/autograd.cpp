// The autograd formula of fusemoe's forward ops in C++ (issue 17's host time): the Python module
// _fusemoe_autograd, built against one PyTorch release (its C++ API, not the stable ABI), which
// fusemoe.ops uses for eager calls where nothing runs above autograd (ops._direct) when the
// running torch is the one it was built for (fusemoe._native). Elsewhere (torch.compile, modes,
// functorch, the ctypes path, another torch) the Python formula of ops.py does the same work.
//
// forward(op, *op_args) runs the forward op below autograd and links its y to a Node whose
// backward calls the op's backward (or backward_into for grad_in_place) through the dispatcher:
// no Python on the backward's path and none per call on the forward's but the entry. The math
// and the saved tensors are ops._save_for_backward / ops._gradients'; z is saved, never a
// differentiable output. The ops are found by name (the stable-ABI binding defines them), so
// this module holds no kernel and no check of its own: the ops' kernels check every argument.
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fusemoe::torch_autograd {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// One forward op and its two backward ops (names as the binding defines them).
struct OpFamily {
  c10::OperatorHandle forward, backward, backward_into;
  size_t num_tensors;  // the forward's tensor arguments, first: x, topk_idx, topk_weights, weights...
  size_t num_weights;  // w13, w2 or w1, w3, w2, starting at argument 3
};

// A deque: nodes keep pointers to their family, which a later registration must not move.
std::deque<OpFamily>& families() {
  static std::deque<OpFamily> registered;  // appended under the GIL only (register_ops)
  return registered;
}

// The binding's last error on this thread (fusemoe_torch_last_error) and the Python class of each
// of its kinds, given once by fusemoe.ops (init), so an error keeps the class the Python formula
// raises: FusemoeError, FusemoeOutOfMemoryError, ValueError.
using LastErrorFn = const char* (*)(int32_t*);
LastErrorFn g_last_error = nullptr;
PyObject* g_error_classes[4] = {nullptr, nullptr, nullptr, nullptr};

// Called with an exception an op threw: raises it again as the Python exception of its kind when
// it is the binding's own last error (python_error carries it through the autograd engine's
// threads to backward()'s caller), else rethrows it as it is.
[[noreturn]] void rethrow_as_fusemoe_error(const std::exception& e) {
  int32_t kind = 0;
  const char* message = g_last_error ? g_last_error(&kind) : nullptr;
  // What Python would show of it: a c10::Error's message without its C++ backtrace.
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const char* text = c10_error ? c10_error->what_without_backtrace() : e.what();
  if (message != nullptr && kind > 0 && kind < 4 && g_error_classes[kind] != nullptr &&
      std::string(message) == text) {
    pybind11::gil_scoped_acquire gil;
    PyErr_SetString(g_error_classes[kind], message);
    python_error error;
    error.persist();
    throw error;
  }
  throw;
}

// Backward calls that took grad_in_place's path (ops._in_place_backward_count, for tests).
std::atomic<int64_t> g_in_place_backwards{0};

// The op's call below autograd on an IValue stack (its arguments in, its returns out).
void call_below_autograd(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  try {
    op.callBoxed(&stack);
  } catch (const python_error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow_as_fusemoe_error(e);
  }
}

// The backward of one forward call: the input order of the forward op's tensors, their
// gradients in that order (none for topk_idx and the FP8 weight buffer).
struct ExpertsBackward final : Node {
  const OpFamily* family = nullptr;
  std::vector<SavedVariable> saved;  // the forward's tensor arguments, then z
  std::string impl;
  std::optional<double> swiglu_clamp;
  // grad_in_place: the leaf weights themselves, kept outside the saved tensors so that saved-
  // tensor hooks (checkpointing, offloading) cannot hand back a copy whose .grad nobody sees.
  std::vector<at::Tensor> params;

  std::string name() const override { return "fusemoe::MoEExpertsBackward"; }

  void release_variables() override {
    for (auto& s : saved) s.reset_data();
    params.clear();
  }

  variable_list apply(variable_list&& grads) override {
    variable_list result(family->num_tensors);
    if (!grads[0].defined()) return result;  // no gradient reached y: every gradient is zero
    torch::jit::Stack stack;
    stack.reserve(2 * family->num_tensors + 6);
    // dy may arrive expanded (e.g. from y.sum()) or in another layout: the ops need it dense.
    stack.emplace_back(grads[0].contiguous());
    std::vector<at::Tensor> tensors;
    tensors.reserve(saved.size());
    for (auto& s : saved) tensors.push_back(s.unpack());
    const at::Tensor& z = tensors.back();
    for (size_t i = 0; i < family->num_tensors; ++i) stack.emplace_back(tensors[i]);
    const bool in_place = !params.empty();
    bool fresh = false;
    std::vector<at::Tensor> weight_grads;
    if (in_place) {
      g_in_place_backwards.fetch_add(1, std::memory_order_relaxed);
      // As ops._backward_into_grads: written into fresh .grad when none exists, else added.
      fresh = true;
      for (auto& p : params) fresh = fresh && !p.grad().defined();
      for (auto& p : params) {
        if (fresh) {
          weight_grads.push_back(at::empty_like(p));
        } else {
          if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
          weight_grads.push_back(p.grad());
        }
        stack.emplace_back(weight_grads.back());
      }
      stack.emplace_back(!fresh);  // accumulate
    }
    stack.emplace_back(impl);
    stack.emplace_back(z.numel() ? c10::IValue(z) : c10::IValue());
    stack.emplace_back(swiglu_clamp ? c10::IValue(*swiglu_clamp) : c10::IValue());
    call_below_autograd(in_place ? family->backward_into : family->backward, stack);
    result[0] = std::move(stack[0]).toTensor();  // dx
    result[2] = std::move(stack[1]).toTensor();  // d_topk_weights
    if (in_place) {
      if (fresh) {
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = weight_grads[i];
      }
    } else {
      for (size_t i = 0; i < family->num_weights; ++i) result[3 + i] = std::move(stack[2 + i]).toTensor();
    }
    return result;
  }
};

// ---- the Python entry points ----

bool is_tensor(PyObject* o) { return THPVariable_Check(o); }

// forward(family, *op_args) -> (y, z): the forward op of `family` with autograd linked, or
// NotImplemented when an argument is not what its schema takes (ops.py then calls the op the
// usual way, which raises PyTorch's message).
PyObject* forward(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 1 || !PyLong_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "_fusemoe_autograd.forward(family, *op_args)");
    return nullptr;
  }
  const long index = PyLong_AsLong(args[0]);
  if (index < 0 || index >= static_cast<long>(families().size())) {
    PyErr_SetString(PyExc_ValueError, "_fusemoe_autograd.forward: unknown op family");
    return nullptr;
  }
  const OpFamily& family = families()[index];
  const size_t n = family.num_tensors;
  // Arguments: n tensors, impl, then optional grad_in_place, save_z, swiglu_clamp.
  const Py_ssize_t num_args = nargs - 1;
  PyObject* const* a = args + 1;
  if (num_args < static_cast<Py_ssize_t>(n + 1) || num_args > static_cast<Py_ssize_t>(n + 4)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  for (size_t i = 0; i < n; ++i) {
    if (!is_tensor(a[i])) Py_RETURN_NOTIMPLEMENTED;
  }
  if (!PyUnicode_Check(a[n])) Py_RETURN_NOTIMPLEMENTED;
  bool grad_in_place = false, save_z = false;
  std::optional<double> swiglu_clamp;
  if (num_args > static_cast<Py_ssize_t>(n + 1)) {
    if (!PyBool_Check(a[n + 1])) Py_RETURN_NOTIMPLEMENTED;
    grad_in_place = a[n + 1] == Py_True;
  }
  if (num_args > static_cast<Py_ssize_t>(n + 2)) {
    if (!PyBool_Check(a[n + 2])) Py_RETURN_NOTIMPLEMENTED;
    save_z = a[n + 2] == Py_True;
  }
  if (num_args > static_cast<Py_ssize_t>(n + 3) && a[n + 3] != Py_None) {
    if (PyBool_Check(a[n + 3]) || !(PyFloat_Check(a[n + 3]) || PyLong_Check(a[n + 3]))) {
      Py_RETURN_NOTIMPLEMENTED;
    }
    swiglu_clamp = PyFloat_AsDouble(a[n + 3]);
    if (PyErr_Occurred()) return nullptr;
  }
  std::vector<at::Tensor> tensors;
  tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) tensors.push_back(THPVariable_Unpack(a[i]));
  const char* impl_utf8 = PyUnicode_AsUTF8(a[n]);
  if (impl_utf8 == nullptr) return nullptr;
  std::string impl(impl_utf8);

  torch::jit::Stack stack;
  stack.reserve(n + 4);
  for (auto& t : tensors) stack.emplace_back(t);
  stack.emplace_back(impl);
  stack.emplace_back(grad_in_place);
  stack.emplace_back(save_z);
  stack.emplace_back(swiglu_clamp ? c10::IValue(*swiglu_clamp) : c10::IValue());
  bool requires_grad = false;
  if (at::GradMode::is_enabled()) {
    for (auto& t : tensors) requires_grad = requires_grad || t.requires_grad();
  }
  {
    pybind11::gil_scoped_release no_gil;
    at::AutoGradMode no_grad(false);  // as torch.autograd.Function's forward
    call_below_autograd(family.forward, stack);
  }
  at::Tensor y = std::move(stack[0]).toTensor();
  at::Tensor z = std::move(stack[1]).toTensor();
  if (requires_grad) {
#ifdef FUSEMOE_TORCH_SHARED_NODES
    auto node = std::shared_ptr<ExpertsBackward>(new ExpertsBackward(), torch::autograd::deleteNode);
#else
    auto node = c10::make_intrusive<ExpertsBackward>();
#endif
    node->family = &family;
    node->set_next_edges(torch::autograd::collect_next_edges(at::ArrayRef<at::Tensor>(tensors)));
    node->saved.reserve(n + 1);
    for (auto& t : tensors) node->saved.emplace_back(t, /*is_output=*/false);
    node->saved.emplace_back(z, /*is_output=*/false);
    node->impl = std::move(impl);
    node->swiglu_clamp = swiglu_clamp;
    if (grad_in_place) {
      bool leaves = true;
      for (size_t i = 3; i < 3 + family.num_weights; ++i) {
        leaves = leaves && tensors[i].is_leaf() && tensors[i].requires_grad();
      }
      if (leaves) node->params.assign(tensors.begin() + 3, tensors.begin() + 3 + family.num_weights);
    }
    torch::autograd::set_history(y, node);  // z stays outside the graph (no gradient)
  }
  PyObject* y_py = THPVariable_Wrap(std::move(y));
  if (!y_py) return nullptr;
  PyObject* z_py = THPVariable_Wrap(std::move(z));
  if (!z_py) {
    Py_DECREF(y_py);
    return nullptr;
  }
  PyObject* out = PyTuple_Pack(2, y_py, z_py);
  Py_DECREF(y_py);
  Py_DECREF(z_py);
  return out;
  END_HANDLE_TH_ERRORS
}

// register_ops(forward, backward, backward_into, num_tensors, num_weights) -> family index.
PyObject* register_ops(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  const char *forward_name, *backward_name, *backward_into_name;
  Py_ssize_t num_tensors, num_weights;
  if (!PyArg_ParseTuple(args, "sssnn", &forward_name, &backward_name, &backward_into_name,
                        &num_tensors, &num_weights)) {
    return nullptr;
  }
  if (num_weights < 1 || num_tensors < 3 + num_weights) {
    PyErr_SetString(PyExc_ValueError, "register_ops: num_tensors must be >= 3 + num_weights >= 4");
    return nullptr;
  }
  auto& dispatcher = c10::Dispatcher::singleton();
  families().push_back(OpFamily{dispatcher.findSchemaOrThrow(forward_name, ""),
                                dispatcher.findSchemaOrThrow(backward_name, ""),
                                dispatcher.findSchemaOrThrow(backward_into_name, ""),
                                static_cast<size_t>(num_tensors), static_cast<size_t>(num_weights)});
  return PyLong_FromSsize_t(static_cast<Py_ssize_t>(families().size()) - 1);
  END_HANDLE_TH_ERRORS
}

// init(last_error_address, fusemoe_error, out_of_memory_error, value_error).
PyObject* init(PyObject* /*self*/, PyObject* args) {
  PyObject* address;
  PyObject* classes[3];
  if (!PyArg_ParseTuple(args, "OOOO", &address, &classes[0], &classes[1], &classes[2])) return nullptr;
  g_last_error = reinterpret_cast<LastErrorFn>(PyLong_AsVoidPtr(address));
  if (PyErr_Occurred()) return nullptr;
  for (int kind = 1; kind <= 3; ++kind) {
    Py_INCREF(classes[kind - 1]);
    Py_XDECREF(g_error_classes[kind]);
    g_error_classes[kind] = classes[kind - 1];
  }
  Py_RETURN_NONE;
}

PyObject* in_place_backwards(PyObject* /*self*/, PyObject* /*args*/) {
  return PyLong_FromLongLong(g_in_place_backwards.load(std::memory_order_relaxed));
}

PyMethodDef methods[] = {
    {"forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forward)), METH_FASTCALL,
     "forward(family, *op_args) -> (y, z) with the C++ backward linked, or NotImplemented"},
    {"register_ops", register_ops, METH_VARARGS,
     "register_ops(forward, backward, backward_into, num_tensors, num_weights) -> family"},
    {"in_place_backwards", in_place_backwards, METH_NOARGS,
     "backward calls that wrote the weight gradients into .grad (grad_in_place)"},
    {"init", init, METH_VARARGS, "init(last_error_address, fusemoe_error, oom_error, value_error)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_fusemoe_autograd",
                          "fusemoe's autograd formula in C++ (src/torch_binding/autograd.cpp)", -1,
                          methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace
}  // namespace fusemoe::torch_autograd

PyMODINIT_FUNC PyInit__fusemoe_autograd() {
  PyObject* module = PyModule_Create(&fusemoe::torch_autograd::module_def);
  if (module == nullptr) return nullptr;
  // The release this module was compiled against: fusemoe._native loads it only under that one.
  if (PyModule_AddStringConstant(module, "TORCH_VERSION", FUSEMOE_TORCH_VERSION) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
