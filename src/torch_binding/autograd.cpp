// The autograd formula of fusemoe's forward ops in C++ (issue 17's host time): the Python module
// _fusemoe_autograd, built against one PyTorch release (its C++ API, not the stable ABI), which
// fusemoe.ops uses for eager calls where nothing runs above autograd (ops._direct) when the
// running torch is the one it was built for (fusemoe._native). Elsewhere (torch.compile, modes,
// functorch, the ctypes path, another torch) the Python formula of ops.py does the same work.
//
// forward(family, *op_args) runs the forward op below autograd inside a torch::autograd::Function
// (MoEExperts), whose backward calls the op's backward (or backward_into for grad_in_place)
// through the dispatcher: no Python on the backward's path and none per call on the forward's
// but the entry; without a gradient to compute it calls the op alone. The math
// and the saved tensors are ops._save_for_backward / ops._gradients'; z is saved, never a
// differentiable output. The ops are found by name (the stable-ABI binding defines them), so
// this module holds no kernel and no check of its own: the ops' kernels check every argument.
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace fusemoe::torch_autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One forward op and its two backward ops (names as the binding defines them).
struct OpFamily {
  c10::OperatorHandle forward, backward, backward_into;
  size_t num_tensors;  // the forward's tensor arguments, first: x, topk_idx, topk_weights, weights...
  size_t num_weights;  // w13, w2 or w1, w3, w2, starting at argument 3
  // The forward's bool arguments after swiglu_clamp, which both backward ops take last, in the same
  // order (the FP8 ops' fp8_weight_grads); passed around as bits (bit i: option i).
  size_t num_options;
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

// Whether this backward runs inside a compiled autograd graph (ops._compiled_autograd_running):
// there it is an opaque call whose weight gradients the graph itself accumulates, and a .grad
// written here would be overwritten, so grad_in_place returns them instead. That graph calls the
// node from Python, holding the GIL; the engine calls it with the GIL released, so an eager
// backward answers without taking the GIL (which another Python thread may hold for ms).
bool compiled_autograd_running() {
  if (!PyGILState_Check()) return false;
  static PyObject* const name = PyUnicode_InternFromString("torch._dynamo.compiled_autograd");
  PyObject* module = PyImport_GetModule(name);  // only if imported: compiled autograd imports it
  bool running = false;
  if (module != nullptr) {
    PyObject* flag = PyObject_GetAttrString(module, "in_compiled_autograd_region");
    running = flag != nullptr && PyObject_IsTrue(flag) == 1;
    Py_XDECREF(flag);
    Py_DECREF(module);
  }
  PyErr_Clear();  // no module or no attribute: not running
  return running;
}

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

// Pushes the family's options (bits, see OpFamily::num_options) onto an op's stack.
void push_options(const OpFamily& family, int64_t option_bits, torch::jit::Stack& stack) {
  for (size_t i = 0; i < family.num_options; ++i) stack.emplace_back(((option_bits >> i) & 1) != 0);
}

// The forward op of `family` below autograd: (y, z).
std::pair<at::Tensor, at::Tensor> call_forward_op(const OpFamily& family, at::TensorList tensors,
                                                  const std::string& impl, bool grad_in_place,
                                                  bool save_z, std::optional<double> swiglu_clamp,
                                                  int64_t option_bits) {
  torch::jit::Stack stack;
  stack.reserve(tensors.size() + 4 + family.num_options);
  for (const auto& t : tensors) stack.emplace_back(t);
  stack.emplace_back(impl);
  stack.emplace_back(grad_in_place);
  stack.emplace_back(save_z);
  stack.emplace_back(swiglu_clamp ? c10::IValue(*swiglu_clamp) : c10::IValue());
  push_options(family, option_bits, stack);
  call_below_autograd(family.forward, stack);
  return {std::move(stack[0]).toTensor(), std::move(stack[1]).toTensor()};
}

// saved_data's key of the i-th weight kept for grad_in_place.
std::string param_key(size_t i) { return "param" + std::to_string(i); }

// The leaf weights whose .grad this backward writes (grad_in_place), or none (ops._in_place_path):
// kept at the forward, each existing .grad contiguous (what the kernels write; autograd adds into
// any other), every weight's gradient wanted by this pass (torch.autograd.grad(y, x) and
// backward(inputs=[x]) must leave .grad alone; the weights' edges are 3 on), and not under
// compiled autograd.
std::vector<at::Tensor> in_place_params(AutogradContext* ctx, size_t num_weights) {
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < num_weights; ++i) {
    const auto entry = ctx->saved_data.find(param_key(i));
    if (entry == ctx->saved_data.end() || !ctx->needs_input_grad(3 + i)) return {};
    at::Tensor param = entry->second.toTensor();
    if (param.grad().defined() && !param.grad().is_contiguous()) return {};
    params.push_back(std::move(param));
  }
  if (!params.empty() && compiled_autograd_running()) {
    TORCH_WARN_ONCE("fusemoe: grad_in_place=True under compiled autograd returns the weight "
                    "gradients to autograd, which adds them to .grad (the compiled graph owns .grad)");
    return {};
  }
  return params;
}

}  // namespace
}  // namespace fusemoe::torch_autograd

namespace fusemoe {
using torch_autograd::call_below_autograd;
using torch_autograd::call_forward_op;
using torch_autograd::families;
using torch_autograd::g_in_place_backwards;
using torch_autograd::in_place_params;
using torch_autograd::OpFamily;
using torch_autograd::param_key;
using torch_autograd::push_options;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Outside the anonymous namespace: its node's name (grad_fn.name()) is "fusemoe::MoEExperts".
// The forward op of one family with autograd: a torch::autograd::Function (so its node, a
// CppNode, also runs under compiled autograd, as an opaque call). Inputs: the family, the op's
// tensors (each an autograd input through the TensorList), its other arguments, and where to put
// z, which stays outside the graph (no gradient, created without one).
struct MoEExperts : torch::autograd::Function<MoEExperts> {
  static variable_list forward(AutogradContext* ctx, int64_t family_index, at::TensorList tensors,
                               const std::string& impl, bool grad_in_place, bool save_z,
                               std::optional<double> swiglu_clamp, int64_t option_bits, at::Tensor* z_out) {
    const OpFamily& family = families()[family_index];
    at::Tensor y;
    std::tie(y, *z_out) = call_forward_op(family, tensors, impl, grad_in_place, save_z, swiglu_clamp, option_bits);
    // What ops._save_for_backward saves: the op's tensors and z, through saved-tensor hooks.
    variable_list to_save(tensors.begin(), tensors.end());
    to_save.push_back(*z_out);
    ctx->save_for_backward(to_save);
    ctx->saved_data["family"] = family_index;
    ctx->saved_data["impl"] = impl;
    ctx->saved_data["swiglu_clamp"] = swiglu_clamp ? c10::IValue(*swiglu_clamp) : c10::IValue();
    ctx->saved_data["options"] = option_bits;
    if (grad_in_place) {
      // The leaf weights themselves, outside the saved tensors: a hook's unpack may hand back a
      // copy, whose .grad nobody would see. One entry each: compiled autograd lifts tensors of
      // saved_data into its graph, but not a list of them.
      const auto weights = tensors.slice(3, family.num_weights);
      bool leaves = true;
      for (const auto& w : weights) leaves = leaves && w.is_leaf() && w.requires_grad();
      if (leaves) {
        for (size_t i = 0; i < weights.size(); ++i) ctx->saved_data[param_key(i)] = weights[i];
      }
    }
    ctx->set_materialize_grads(false);  // no gradient reaches y: none to compute
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const OpFamily& family = families()[ctx->saved_data["family"].toInt()];
    const size_t n = family.num_tensors;
    // Gradients per forward input: family, then the tensors, then the 6 other arguments.
    variable_list result(1 + n + 6);
    if (!grads[0].defined()) return result;
    // As ops._refuse_create_graph: the gradients below are constants of autograd's graph.
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "fusemoe: the backward of the fusemoe ops is not differentiable, so "
                "create_graph=True (double backward) through them is not supported");
    variable_list saved = ctx->get_saved_variables();  // the op's tensors, then z
    const at::Tensor& z = saved.back();
    torch::jit::Stack stack;
    stack.reserve(2 * n + 8 + family.num_options);
    // dy may arrive expanded (e.g. from y.sum()) or in another layout: the ops need it dense.
    stack.emplace_back(grads[0].contiguous());
    for (size_t i = 0; i < n; ++i) stack.emplace_back(saved[i]);
    const std::vector<at::Tensor> params = in_place_params(ctx, family.num_weights);
    const bool in_place = !params.empty();
    std::vector<at::Tensor> weight_grads;
    bool fresh = true;
    if (in_place) {
      g_in_place_backwards.fetch_add(1, std::memory_order_relaxed);
      // As ops._backward_into_grads: written into fresh .grad when none exists, else added.
      for (const auto& p : params) fresh = fresh && !p.grad().defined();
      for (const auto& p : params) {
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
    stack.emplace_back(ctx->saved_data["impl"]);
    stack.emplace_back(z.numel() ? c10::IValue(z) : c10::IValue());
    stack.emplace_back(ctx->saved_data["swiglu_clamp"]);
    if (!in_place) {
      // As ops._gradients: a frozen weight's gradient is not computed (gate_up_grad covers every
      // weight but the last, down_grad the last).
      bool gate_up_grad = false;
      for (size_t i = 0; i + 1 < family.num_weights; ++i) gate_up_grad = gate_up_grad || ctx->needs_input_grad(3 + i);
      stack.emplace_back(gate_up_grad);
      stack.emplace_back(ctx->needs_input_grad(3 + family.num_weights - 1));
    }
    push_options(family, ctx->saved_data["options"].toInt(), stack);
    call_below_autograd(in_place ? family.backward_into : family.backward, stack);
    result[1] = std::move(stack[0]).toTensor();  // dx
    result[3] = std::move(stack[1]).toTensor();  // d_topk_weights
    if (!in_place) {
      for (size_t i = 0; i < family.num_weights; ++i) {
        if (ctx->needs_input_grad(3 + i)) result[4 + i] = std::move(stack[2 + i]).toTensor();
      }
    } else if (fresh) {
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = weight_grads[i];
    }
    return result;
  }
};

}  // namespace fusemoe

namespace fusemoe::torch_autograd {
namespace {

// ---- the Python entry points ----

// forward(family, *op_args) -> (y, z): the forward op of `family`, with autograd linked when a
// gradient is needed (grad mode on and an input that requires one), or
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
  // Arguments: n tensors, impl, then optional grad_in_place, save_z, swiglu_clamp and the options.
  const Py_ssize_t num_args = nargs - 1;
  PyObject* const* a = args + 1;
  if (num_args < static_cast<Py_ssize_t>(n + 1) ||
      num_args > static_cast<Py_ssize_t>(n + 4 + family.num_options)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  for (size_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(a[i])) Py_RETURN_NOTIMPLEMENTED;
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
  int64_t option_bits = 0;
  for (Py_ssize_t i = static_cast<Py_ssize_t>(n + 4); i < num_args; ++i) {
    if (!PyBool_Check(a[i])) Py_RETURN_NOTIMPLEMENTED;
    if (a[i] == Py_True) option_bits |= int64_t{1} << (i - static_cast<Py_ssize_t>(n + 4));
  }
  std::vector<at::Tensor> tensors;
  tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) tensors.push_back(THPVariable_Unpack(a[i]));
  const char* impl_utf8 = PyUnicode_AsUTF8(a[n]);
  if (impl_utf8 == nullptr) return nullptr;
  std::string impl(impl_utf8);

  bool requires_grad = false;
  if (at::GradMode::is_enabled()) {
    for (const auto& t : tensors) requires_grad = requires_grad || t.requires_grad();
  }
  at::Tensor y, z;
  {
    pybind11::gil_scoped_release no_gil;
    if (requires_grad) {
      y = fusemoe::MoEExperts::apply(static_cast<int64_t>(index), at::TensorList(tensors), impl,
                                     grad_in_place, save_z, swiglu_clamp, option_bits, &z)[0];
    } else {  // no gradient to compute: the op alone, as the Python path calls it then
      std::tie(y, z) = call_forward_op(family, tensors, impl, grad_in_place, save_z, swiglu_clamp, option_bits);
    }
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
  OpFamily family{dispatcher.findSchemaOrThrow(forward_name, ""), dispatcher.findSchemaOrThrow(backward_name, ""),
                  dispatcher.findSchemaOrThrow(backward_into_name, ""), static_cast<size_t>(num_tensors),
                  static_cast<size_t>(num_weights), 0};
  // The options: whatever follows (tensors, impl, grad_in_place, save_z, swiglu_clamp), each a bool
  // that ends both backward schemas too.
  const auto& arguments = family.forward.schema().arguments();
  const size_t fixed = family.num_tensors + 4;
  family.num_options = arguments.size() > fixed ? arguments.size() - fixed : 0;
  for (size_t i = fixed; i < arguments.size(); ++i) {
    const std::string& name = arguments[i].name();
    bool ok = arguments[i].type()->kind() == c10::TypeKind::BoolType && family.num_options <= 62;
    for (const auto* op : {&family.backward, &family.backward_into}) {
      const auto& b = op->schema().arguments();
      const size_t at = b.size() - family.num_options + (i - fixed);
      ok = ok && b.size() >= family.num_options && b[at].name() == name;
    }
    if (!ok) {
      PyErr_Format(PyExc_ValueError, "register_ops: %s's argument %s is no bool option both backward ops end with",
                   forward_name, name.c_str());
      return nullptr;
    }
  }
  families().push_back(std::move(family));
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

// The release it serves is in its file name, by which fusemoe._native finds it.
PyMODINIT_FUNC PyInit__fusemoe_autograd() { return PyModule_Create(&fusemoe::torch_autograd::module_def); }
