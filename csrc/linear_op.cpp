// tma::linear's CUDA and Autograd kernels in C++: the steady-state call without a trip through Python.
//
// A Python-registered op pays the dispatcher's hand-over to Python and back on every call, and its body reads
// each tensor attribute through Python; on the H200 machine that was most of the op's host time
// (docs/linear.md, "Host cost"). Here the op's CUDA kernel checks the call in C++ and, when the call matches a
// launch the Python kernel already made (same device, dtype, M, N, K, bias or not, promotion argument, and the
// current stream's workspace known), it looks the weight's descriptor up in the device's cache, allocates the
// output and calls the compiled CuTe DSL kernel through the TVM-FFI C ABI. Every other call goes to the Python
// kernel (ops._linear_cuda), unchanged: the first call of a shape (compile, encode, workspace), fallbacks with
// their logged reasons, errors with their messages, descriptor misses (including CaptureMissError).
//
// Nothing here links against TVM-FFI: libtvm_ffi.so is opened by path on the first remembered launch (the
// Python side already loaded it to run the DSL). The few C ABI types used are declared below; the CPU tests call
// a Python TVM-FFI function through `ffi_call_for_test` to check them (tests/test_ops.py).
#include "linear_op.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/dlpack.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

namespace py = pybind11;

namespace {

// ---- the TVM-FFI C ABI (tvm/ffi/c_api.h, tvm/ffi/extra/c_env_api.h of apache-tvm-ffi 0.1) -------------------
struct FfiAny {
  int32_t type_index;
  uint32_t zero_padding;
  union {
    int64_t v_int64;
    void* v_ptr;
  };
};
static_assert(sizeof(FfiAny) == 16, "TVMFFIAny is 16 bytes");
constexpr int32_t kFfiNone = 0;
constexpr int32_t kFfiInt = 1;
constexpr int32_t kFfiDLTensorPtr = 7;
constexpr int32_t kFfiStaticObjectBegin = 64;
struct FfiByteArray {
  const char* data;
  size_t size;
};
// An error object: the 24-byte object header (ref counts, type index, deleter), then kind and message.
struct FfiErrorObject {
  uint64_t combined_ref_count;
  int32_t type_index;
  uint32_t padding;
  void* deleter;
  FfiByteArray kind;
  FfiByteArray message;
};

struct Ffi {
  int (*function_call)(void*, FfiAny*, int32_t, FfiAny*) = nullptr;
  int (*env_set_stream)(int32_t, int32_t, void*, void**) = nullptr;
  void (*error_move_from_raised)(void**) = nullptr;
  int (*object_inc_ref)(void*) = nullptr;
  int (*object_dec_ref)(void*) = nullptr;
};

Ffi ffi;  // set once by load_ffi (under the GIL), read by the kernels after that

void load_ffi(const std::string& path) {
  if (ffi.function_call) return;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib, "torch_tma: cannot open ", path, ": ", dlerror());
  Ffi f;
  f.function_call = reinterpret_cast<decltype(f.function_call)>(dlsym(lib, "TVMFFIFunctionCall"));
  f.env_set_stream = reinterpret_cast<decltype(f.env_set_stream)>(dlsym(lib, "TVMFFIEnvSetStream"));
  f.error_move_from_raised = reinterpret_cast<decltype(f.error_move_from_raised)>(dlsym(lib, "TVMFFIErrorMoveFromRaised"));
  f.object_inc_ref = reinterpret_cast<decltype(f.object_inc_ref)>(dlsym(lib, "TVMFFIObjectIncRef"));
  f.object_dec_ref = reinterpret_cast<decltype(f.object_dec_ref)>(dlsym(lib, "TVMFFIObjectDecRef"));
  TORCH_CHECK(f.function_call && f.env_set_stream && f.error_move_from_raised && f.object_inc_ref && f.object_dec_ref,
              "torch_tma: ", path, " lacks a TVM-FFI C function this build uses (TVMFFIFunctionCall, ",
              "TVMFFIEnvSetStream, TVMFFIErrorMoveFromRaised, TVMFFIObjectIncRef, TVMFFIObjectDecRef)");
  ffi = f;
}

// The TVMFFIObjectHandle of a tvm_ffi.Function (its __chandle__), after loading the library it lives in.
void* ffi_handle(const py::object& function, const std::string& ffi_library) {
  load_ffi(ffi_library);
  void* handle = reinterpret_cast<void*>(function.attr("__chandle__")().cast<uintptr_t>());
  TORCH_CHECK(handle, "torch_tma: the compiled kernel has no TVM-FFI handle");
  return handle;
}

// The message of the error a failed TVMFFIFunctionCall raised; releases the error.
std::string take_ffi_error() {
  void* err = nullptr;
  ffi.error_move_from_raised(&err);
  if (!err) return "unknown error (none raised)";
  auto* e = static_cast<FfiErrorObject*>(err);
  std::string text = std::string(e->kind.data, e->kind.size) + ": " + std::string(e->message.data, e->message.size);
  ffi.object_dec_ref(err);
  return text;
}

DLDataType dl_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16: return {kDLBfloat, 16, 1};
    case c10::ScalarType::Half: return {kDLFloat, 16, 1};
    case c10::ScalarType::Float: return {kDLFloat, 32, 1};
    case c10::ScalarType::Int: return {kDLInt, 32, 1};
    case c10::ScalarType::Long: return {kDLInt, 64, 1};
    default: TORCH_CHECK(false, "torch_tma: no DLPack type for ", t);
  }
}

// A DLTensor view of t: it borrows t's sizes and strides, so t must outlive the call.
DLTensor dl_view(const at::Tensor& t) {
  DLTensor d{};
  d.data = t.data_ptr();
  d.device = {t.is_cuda() ? kDLCUDA : kDLCPU, static_cast<int32_t>(t.is_cuda() ? t.get_device() : 0)};
  d.ndim = static_cast<int32_t>(t.dim());
  d.dtype = dl_dtype(t.scalar_type());
  d.shape = const_cast<int64_t*>(t.sizes().data());
  d.strides = const_cast<int64_t*>(t.strides().data());
  d.byte_offset = 0;
  return d;
}

// Calls a TVM-FFI function with tensors (None for an undefined one), ints, then trailing_nones Nones, with `stream`
// as the environment stream of CUDA device `device` for the duration of the call (what tvm_ffi's Python call does
// for torch tensors). Throws with the function's own error message.
void ffi_call(void* fn, const std::vector<const at::Tensor*>& tensors, const std::vector<int64_t>& ints,
              int64_t trailing_nones, int device, void* stream) {
  std::array<DLTensor, 8> views{};
  std::array<FfiAny, 16> args{};
  TORCH_CHECK(tensors.size() <= views.size() && trailing_nones >= 0 &&
                  tensors.size() + ints.size() + static_cast<size_t>(trailing_nones) <= args.size(),
              "torch_tma: too many arguments for ffi_call");
  size_t n = 0;
  for (size_t i = 0; i < tensors.size(); ++i, ++n) {
    if (tensors[i] == nullptr || !tensors[i]->defined()) {
      args[n].type_index = kFfiNone;
      continue;
    }
    views[i] = dl_view(*tensors[i]);
    args[n].type_index = kFfiDLTensorPtr;
    args[n].v_ptr = &views[i];
  }
  for (int64_t v : ints) {
    args[n].type_index = kFfiInt;
    args[n++].v_int64 = v;
  }
  for (int64_t i = 0; i < trailing_nones; ++i) args[n++].type_index = kFfiNone;
  void* previous = nullptr;
  TORCH_CHECK(ffi.env_set_stream(kDLCUDA, device, stream, &previous) == 0,
              "torch_tma: TVMFFIEnvSetStream failed: ", take_ffi_error());
  FfiAny result{};
  int rc = ffi.function_call(fn, args.data(), static_cast<int32_t>(n), &result);
  std::string error = rc ? take_ffi_error() : std::string();
  ffi.env_set_stream(kDLCUDA, device, previous, nullptr);
  if (!rc && result.type_index >= kFfiStaticObjectBegin) ffi.object_dec_ref(result.v_ptr);
  TORCH_CHECK(rc == 0, "torch_tma: the compiled kernel call failed: ", error);
}

// A reference to a TVM-FFI object held for a scope without the GIL: the function a call runs stays alive even if
// another thread replaces its plan meanwhile.
class FfiRef {
 public:
  explicit FfiRef(void* handle) : handle_(handle) { ffi.object_inc_ref(handle_); }
  ~FfiRef() { ffi.object_dec_ref(handle_); }
  FfiRef(const FfiRef&) = delete;
  FfiRef& operator=(const FfiRef&) = delete;

 private:
  void* handle_;
};

// The descriptor of `weight`: get(weight, box, swizzle=..., l2_promotion=...), as the op's Python kernel calls the
// cache's get, so a hit takes the native hit path (csrc/tma_core.cpp, fast_get: keyword names must be the interned
// strings it compares by identity) with its stream and capture bookkeeping; a miss runs the cache's Python get,
// which encodes (or raises CaptureMissError). Needs the GIL.
py::object lookup_descriptor(const py::object& get, const at::Tensor& weight, const py::object& box,
                             const py::object& swizzle, const py::object& l2) {
  static PyObject* kw_names = [] {
    PyObject* names = PyTuple_New(2);
    PyTuple_SET_ITEM(names, 0, PyUnicode_InternFromString("swizzle"));
    PyTuple_SET_ITEM(names, 1, PyUnicode_InternFromString("l2_promotion"));
    return names;
  }();
  py::object w = py::reinterpret_steal<py::object>(THPVariable_Wrap(weight));
  std::array<PyObject*, 5> args{nullptr, w.ptr(), box.ptr(), swizzle.ptr(), l2.ptr()};
  PyObject* map = PyObject_Vectorcall(get.ptr(), args.data() + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, kw_names);
  if (!map) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(map);
}

// ---- the remembered launches ----------------------------------------------------------------------------------
// (device, dtype, M, N, K, bias or not, the l2_promotion argument)
using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, bool, std::optional<int64_t>>;
struct Plan {
  py::object get;       // the device cache's get (its native hit path)
  py::object box;       // the weight descriptor's box, swizzle and promotion, as get() takes them
  py::object swizzle;
  py::object l2;
  py::object compiled;  // the tvm_ffi.Function the compiled kernel's call ends in, kept alive
  void* fn = nullptr;   // its TVM-FFI handle
  int64_t trailing_nones = 0;  // None arguments after the 8 of linear_out (the kernel's defaults)
  int64_t num_ctas = 0;
};
struct Workspace {
  at::Tensor partials;
  at::Tensor arrivals;
};

struct State {
  std::mutex mutex;  // guards plans and workspaces: the fast path reads them without the GIL
  std::map<PlanKey, Plan> plans;
  std::map<std::pair<int, void*>, Workspace> workspaces;  // (device, raw stream)
  py::object slow_cuda;       // ops._linear_cuda
  py::object autograd_graph;  // ops._linear_autograd_graph(keyset_raw, x, weight, bias, l2_promotion)
  std::atomic<int64_t> fast_calls{0};
  std::atomic<int64_t> slow_calls{0};
};

// Created once, never destroyed: kernels may run during interpreter shutdown, after static destructors would.
State& state() {
  static State* s = new State();
  return *s;
}

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::optional<int64_t>);

const c10::TypedOperatorHandle<LinearFn>& linear_handle() {
  static auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("tma::linear", "").typed<LinearFn>();
  return handle;
}

at::Tensor unpack(const py::object& out) {
  TORCH_CHECK(THPVariable_Check(out.ptr()), "torch_tma: a tma::linear Python kernel returned no tensor");
  return THPVariable_Unpack(out.ptr());
}

at::Tensor slow_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     std::optional<int64_t> l2) {
  py::gil_scoped_acquire gil;
  ++state().slow_calls;
  return unpack(state().slow_cuda(x, weight, bias, py::arg("l2_promotion") = l2));
}

// The steady-state call, or nullopt where the Python kernel must take it. The conditions are those of
// ops._check_args and kernels.linear.unsupported_reason that depend on the tensors; what depends only on
// (device, dtype, M, N, K, bias, promotion) was settled by the Python kernel before it remembered the launch.
std::optional<at::Tensor> try_fast(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias_opt, std::optional<int64_t> l2) {
  const at::Tensor* bias = bias_opt && bias_opt->defined() ? &*bias_opt : nullptr;
  if (weight.dim() != 2 || x.dim() < 1 || !x.is_cuda() || !weight.is_cuda()) return std::nullopt;
  const int64_t N = weight.size(0), K = weight.size(1);
  if (x.size(-1) != K || K == 0) return std::nullopt;
  const int device = weight.get_device();
  if (x.get_device() != device || x.scalar_type() != weight.scalar_type()) return std::nullopt;
  if (bias && (!bias->is_cuda() || bias->get_device() != device || bias->scalar_type() != weight.scalar_type() ||
               bias->dim() != 1 || bias->size(0) != N || bias->stride(0) != 1))
    return std::nullopt;
  if (weight.stride(0) != K || weight.stride(1) != 1) return std::nullopt;
  const int64_t M = x.numel() / K;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  if (cuda->getDevice().index() != device) return std::nullopt;  // the Python kernel switches devices
  void* stream = cuda->getStream(weight.device()).native_handle();
  at::Tensor x2d = x.dim() == 2 ? x : x.reshape({M, K});
  if (x2d.stride(1) != 1 || x2d.stride(0) % 8 || (M > 1 && x2d.stride(0) < K)) return std::nullopt;
  if (reinterpret_cast<uintptr_t>(x2d.data_ptr()) % 16 || reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16)
    return std::nullopt;

  State& s = state();
  const PlanKey key{device, static_cast<int>(weight.scalar_type()), M, N, K, bias != nullptr, l2};
  void* fn = nullptr;
  int64_t num_ctas = 0, trailing_nones = 0, map_ptr = 0;
  Workspace ws;
  std::optional<FfiRef> fn_ref;  // taken under the lock, released after the call
  at::Tensor out;
  {
    // The plan's Python objects and the cache lookup need the GIL, and the launch stays under it: no other
    // thread's cache call (an eviction, a bind displacing the entry) can come between the hit, which records
    // this stream for the slot's retire events, and the kernel that reads the slot.
    py::gil_scoped_acquire gil;
    py::object get, box, swizzle, l2_code;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      auto plan_it = s.plans.find(key);
      auto ws_it = s.workspaces.find({device, stream});
      if (plan_it == s.plans.end() || ws_it == s.workspaces.end()) return std::nullopt;
      const Plan& plan = plan_it->second;
      std::tie(fn, num_ctas, trailing_nones, get, box, swizzle, l2_code) =
          std::make_tuple(plan.fn, plan.num_ctas, plan.trailing_nones, plan.get, plan.box, plan.swizzle, plan.l2);
      ws = ws_it->second;
      fn_ref.emplace(fn);
    }
    py::object map = lookup_descriptor(get, weight, box, swizzle, l2_code);
    // TensorMap's __slots__, read in C (no Python code runs, so no other thread can come in before the launch);
    // an entry evicted while a miss ran Python raises StaleTensorMapError through .ptr.
    static PyObject* attr_evicted = PyUnicode_InternFromString("_evicted");
    static PyObject* attr_ptr = PyUnicode_InternFromString("_ptr");
    const bool evicted = map.attr(py::handle(attr_evicted)).cast<bool>();
    map_ptr = (evicted ? py::object(map.attr("ptr")) : py::object(map.attr(py::handle(attr_ptr)))).cast<int64_t>();
    out = at::empty({M, N}, x.options());
    ffi_call(fn, {&x2d, &weight, bias, &out, &ws.partials, &ws.arrivals}, {map_ptr, num_ctas}, trailing_nones,
             device, stream);
  }
  ++s.fast_calls;
  if (x.dim() == 2) return out;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return out.view(shape);
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       std::optional<int64_t> l2) {
  if (auto out = try_fast(x, weight, bias, l2)) return *out;
  return slow_cuda(x, weight, bias, l2);
}

// The op's Autograd kernel: a call that records no graph and carries no forward-mode tangent goes below autograd
// through the dispatcher (no Python); one that does goes to ops._linear_autograd_graph (torch.autograd.Function,
// gradients and tangents by torch matmuls).
at::Tensor linear_autograd(c10::DispatchKeySet keyset, const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, std::optional<int64_t> l2) {
  const bool has_bias = bias && bias->defined();
  const bool bias_grad = has_bias && bias->requires_grad();
  // a dual tensor (forward AD, torch.func.jvp) need not require grad; level 0 is the one forward AD uses
  auto tangent = [](const at::Tensor& t) { return t._fw_grad(/*level=*/0).defined(); };
  const bool forward_ad = tangent(x) || tangent(weight) || (has_bias && tangent(*bias));
  if ((c10::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() || bias_grad)) || forward_ad) {
    py::gil_scoped_acquire gil;
    return unpack(state().autograd_graph(static_cast<uint64_t>(keyset.raw_repr()), x, weight, bias, l2));
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return linear_handle().redispatch(keyset & c10::after_autograd_keyset, x, weight, bias, l2);
}

torch::Library* native_library = nullptr;  // never destroyed (see state())

void register_kernels(py::object slow, py::object autograd_graph) {
  TORCH_CHECK(!native_library, "torch_tma: tma::linear's native kernels are already registered");
  State& s = state();
  s.slow_cuda = std::move(slow);
  s.autograd_graph = std::move(autograd_graph);
  native_library = new torch::Library(torch::Library::IMPL, "tma", std::nullopt, __FILE__, __LINE__);
  native_library->impl("linear", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(linear_cuda)));
  native_library->impl("linear", torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(linear_autograd)));
}

// weight: the launch's weight (its device, dtype, N and K make the key with M, bias and the promotion argument).
void remember_launch(const at::Tensor& weight, int64_t M, bool has_bias, std::optional<int64_t> l2_arg,
                     py::object get, py::object box, int64_t swizzle, int64_t l2, py::object function,
                     int64_t trailing_nones, int64_t num_ctas, const std::string& ffi_library) {
  TORCH_CHECK(weight.is_cuda() && weight.dim() == 2, "torch_tma: remember_launch needs the launch's CUDA weight");
  void* fn = ffi_handle(function, ffi_library);
  PlanKey key{weight.get_device(), static_cast<int>(weight.scalar_type()), M, weight.size(0), weight.size(1),
              has_bias, l2_arg};
  Plan plan{std::move(get), std::move(box), py::int_(swizzle), py::int_(l2), std::move(function), fn, trailing_nones,
            num_ctas};
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.plans[key] = std::move(plan);
}

// Called from Python (GIL held): the plans' Python objects are released after the lock, under the GIL.
void forget_launches() {
  State& s = state();
  std::map<PlanKey, Plan> forgotten;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    forgotten.swap(s.plans);
  }
}

void remember_workspace(int device, uintptr_t stream, const at::Tensor& partials, const at::Tensor& arrivals) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.workspaces[{device, reinterpret_cast<void*>(stream)}] = Workspace{partials, arrivals};
}

py::dict native_stats() {
  State& s = state();
  py::dict d;
  d["fast_calls"] = s.fast_calls.load();
  d["slow_calls"] = s.slow_calls.load();
  std::lock_guard<std::mutex> lock(s.mutex);
  d["plans"] = s.plans.size();
  d["workspaces"] = s.workspaces.size();
  return d;
}

// Test hook: the CUDA kernel's descriptor lookup on any tensor (CPU tests use a CPU table).
py::object lookup_for_test(py::object get, const at::Tensor& weight, py::object box, int64_t swizzle, int64_t l2) {
  return lookup_descriptor(get, weight, box, py::int_(swizzle), py::int_(l2));
}

// Test hook: fn(*tensors, *ints) through ffi_call on the CPU, stream as the CUDA environment stream of device 0.
void ffi_call_for_test(py::object fn, const std::vector<std::optional<at::Tensor>>& tensors,
                       const std::vector<int64_t>& ints, int64_t trailing_nones, uintptr_t stream,
                       const std::string& ffi_library) {
  void* handle = ffi_handle(fn, ffi_library);
  std::vector<const at::Tensor*> ptrs;
  for (const auto& t : tensors) ptrs.push_back(t ? &*t : nullptr);
  ffi_call(handle, ptrs, ints, trailing_nones, 0, reinterpret_cast<void*>(stream));
}

}  // namespace

void register_linear_op(py::module& m) {
  m.def("linear_register_kernels", &register_kernels,
        "register tma::linear's CUDA and Autograd kernels (C++), with the Python kernels they hand calls to");
  m.def("linear_remember_launch", &remember_launch, "let the CUDA kernel make this launch without Python");
  m.def("linear_forget_launches", &forget_launches, "drop every remembered launch (the next call plans again)");
  m.def("linear_remember_workspace", &remember_workspace, "the split-K workspace of a (device, stream)");
  m.def("linear_native_stats", &native_stats, "calls made by the C++ kernel and handed to Python; sizes");
  m.def("linear_lookup_for_test", &lookup_for_test, "the CUDA kernel's descriptor lookup, on any tensor");
  m.def("ffi_call_for_test", &ffi_call_for_test, "call a TVM-FFI function the way the CUDA kernel does");
}
