// torch_tma native core: the CUDA driver resolved at run time, cuTensorMapEncodeTiled, and the descriptor table
// (key -> entry) whose hit path is the hot path of every kernel launch that uses a cached descriptor.
//
// Nothing here links against libcuda: the driver is dlopen'ed on first use, so `import torch_tma` works on a
// machine with no driver and only a device feature fails, naming what is missing. Streams and events go through
// c10 (torch's device-generic interface), so this file needs torch's headers and a host compiler, not nvcc.
#include "linear_op.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// ---- the driver, resolved at run time ---------------------------------------------------------------------
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUstream = void*;
struct alignas(64) CUtensorMap { uint64_t opaque[16]; };

struct Driver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_get_device)(CUdevice*) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*primary_ctx_release)(CUdevice) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*stream_is_capturing)(CUstream, int*) = nullptr;
  CUresult (*encode_tiled)(CUtensorMap*, int, uint32_t, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                           const uint32_t*, int, int, int, int) = nullptr;
  std::string error;  // why the driver is unusable; empty when it is loaded
};

template <typename F>
void resolve(void* lib, const char* name, F& fn, std::string& error) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!fn && error.empty()) error = std::string("libcuda.so.1 has no symbol ") + name + " (driver too old?)";
}

const Driver& driver() {
  static Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* why = dlerror();
      d.error = std::string("the NVIDIA driver library libcuda.so.1 could not be loaded (") + (why ? why : "?") +
                "): TMA descriptors need an NVIDIA driver and a Hopper (sm_90) or newer GPU";
      return d;
    }
    resolve(lib, "cuInit", d.init, d.error);
    resolve(lib, "cuGetErrorName", d.get_error_name, d.error);
    resolve(lib, "cuDeviceGet", d.device_get, d.error);
    resolve(lib, "cuCtxGetCurrent", d.ctx_get_current, d.error);
    resolve(lib, "cuCtxGetDevice", d.ctx_get_device, d.error);
    resolve(lib, "cuDevicePrimaryCtxRetain", d.primary_ctx_retain, d.error);
    resolve(lib, "cuDevicePrimaryCtxRelease_v2", d.primary_ctx_release, d.error);
    resolve(lib, "cuCtxPushCurrent_v2", d.ctx_push, d.error);
    resolve(lib, "cuCtxPopCurrent_v2", d.ctx_pop, d.error);
    resolve(lib, "cuStreamIsCapturing", d.stream_is_capturing, d.error);
    resolve(lib, "cuTensorMapEncodeTiled", d.encode_tiled, d.error);
    if (d.error.empty()) {
      CUresult r = d.init(0);
      const char* name = nullptr;
      if (r != 0)  // named here: error_name() goes through driver(), which is still being built
        d.error = std::string("cuInit(0) failed with ") +
                  (d.get_error_name(r, &name) == 0 && name ? name : "CUresult " + std::to_string(r)) +
                  ": no usable NVIDIA GPU";
    }
    return d;
  }();
  return d;
}

const Driver& require_driver() {
  const Driver& d = driver();
  TORCH_CHECK(d.error.empty(), "torch_tma: ", d.error);
  return d;
}

std::string error_name(CUresult r) {
  const char* name = nullptr;
  if (driver().get_error_name && driver().get_error_name(r, &name) == 0 && name) return name;
  return "CUresult " + std::to_string(r);
}

#define TMA_DRIVER_CHECK(call)                                                                             \
  do {                                                                                                     \
    CUresult r_ = (call);                                                                                  \
    TORCH_CHECK(r_ == 0, "torch_tma: ", #call, " failed with ", error_name(r_), " (", __FILE__, ":", __LINE__, \
                ")");                                                                                      \
  } while (0)

// Encoding needs a current context (CUDA_ERROR_INVALID_CONTEXT without one, seen on the H200). Torch uses each
// device's primary context, so that is the one made current, and only for the duration of the call.
class PrimaryContextScope {
 public:
  explicit PrimaryContextScope(int device_index) {
    const Driver& d = require_driver();
    CUcontext current = nullptr;
    TMA_DRIVER_CHECK(d.ctx_get_current(&current));
    if (current) {
      CUdevice dev = -1;
      TMA_DRIVER_CHECK(d.ctx_get_device(&dev));
      if (dev == device_index) return;
    }
    CUdevice dev = 0;
    TMA_DRIVER_CHECK(d.device_get(&dev, device_index));
    CUcontext primary = nullptr;
    TMA_DRIVER_CHECK(d.primary_ctx_retain(&primary, dev));  // torch holds the same context too
    CUresult pushed = d.ctx_push(primary);
    if (pushed != 0) d.primary_ctx_release(dev);
    TMA_DRIVER_CHECK(pushed);
    retained_ = dev;
  }
  ~PrimaryContextScope() {  // pop and release what the constructor pushed and retained (errors cannot be thrown here)
    if (retained_ >= 0) {
      CUcontext popped = nullptr;
      driver().ctx_pop(&popped);
      driver().primary_ctx_release(retained_);
    }
  }

 private:
  CUdevice retained_ = -1;  // the device whose primary context was retained and pushed, or -1
};

template <typename T>
std::vector<T> to_vector(const py::sequence& seq) {
  std::vector<T> out;
  out.reserve(seq.size());
  for (auto item : seq) out.push_back(item.cast<T>());
  return out;
}

// Returns the 128 descriptor bytes. Inputs are in driver order; validation happened in Python (spec.py), so a
// failure here is the driver disagreeing with the validator and is reported by the CUresult's name.
py::bytes encode_tiled(int data_type, uint64_t address, const py::sequence& dims, const py::sequence& strides,
                       const py::sequence& box, const py::sequence& elem_strides, int interleave, int swizzle,
                       int l2_promotion, int oob_fill, int device_index) {
  const Driver& d = require_driver();
  auto g = to_vector<uint64_t>(dims);
  auto s = to_vector<uint64_t>(strides);
  auto b = to_vector<uint32_t>(box);
  auto e = to_vector<uint32_t>(elem_strides);
  s.push_back(0);  // never read by the driver; keeps the pointer valid for rank 1 (no outer strides)
  CUtensorMap map{};
  CUresult r;
  {
    PrimaryContextScope scope(device_index);
    r = d.encode_tiled(&map, data_type, static_cast<uint32_t>(g.size()), reinterpret_cast<void*>(address), g.data(),
                       s.data(), b.data(), e.data(), interleave, swizzle, l2_promotion, oob_fill);
  }
  if (r != 0) throw py::value_error("cuTensorMapEncodeTiled returned " + error_name(r));
  return py::bytes(reinterpret_cast<const char*>(map.opaque), sizeof(map.opaque));
}

std::string driver_status() { return driver().error; }

bool stream_is_capturing(const c10::Stream& stream) {
  const Driver& d = require_driver();
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  TMA_DRIVER_CHECK(d.stream_is_capturing(static_cast<CUstream>(stream.native_handle()), &status));
  return status != 0;
}

// ---- the table ----------------------------------------------------------------------------------------------
// Keys are flat int64 vectors: a tag, then the inputs. Tag 1: torch-order tensor arguments of get(); tag 2: a
// TensorMapSpec's fields (driver order). The two never collide; the same descriptor reached both ways may
// occupy two slots, which costs 128 bytes and nothing else.
using Key = std::vector<int64_t>;
struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Entry {
  Key key;
  py::object value;            // the Python TensorMap
  uint64_t last_use = 0;       // LRU clock
  bool pinned = false;         // bound handles
  bool captured = false;       // handed out during CUDA-graph capture: the graph may read it forever
  std::vector<c10::Stream> streams;  // streams current at each hand-out since the last retire
  std::vector<c10::Event> retire_events;
  // fingerprint of the bound source tensor (bound entries only)
  int64_t bound_ptr = 0;
  Key bound_shape;
  int64_t slot = 0;  // device address of the 128-byte slot (bound entries)
};

// One key entry: an int (not a bool, which would key True as 1) within int64.
int64_t key_int(PyObject* v, const char* what) {
  if (!PyLong_Check(v) || PyBool_Check(v)) throw py::type_error(std::string(what) + " entries must be ints");
  int64_t out = PyLong_AsLongLong(v);
  if (out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(std::string(what) + " entry " + py::repr(v).cast<std::string>() + " is outside int64");
  }
  return out;
}

// Appends a sequence of ints (length first), or -1 for None. Raw CPython: this runs on every get().
void append_seq(Key& k, py::handle seq, const char* what) {
  PyObject* obj = seq.ptr();
  if (obj == Py_None) {
    k.push_back(-1);
    return;
  }
  // Sequences only: PySequence_Fast would drain a one-shot iterable (an iterator, a generator) before the Python
  // path sees it.
  if (!PySequence_Check(obj)) throw py::type_error(std::string(what) + " must be a sequence");
  PyObject* fast = PySequence_Fast(obj, what);
  if (!fast) throw py::error_already_set();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  k.push_back(n);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) k.push_back(key_int(items[i], what));
  } catch (...) {
    Py_DECREF(fast);
    throw;
  }
  Py_DECREF(fast);
}

void tensor_key_into(Key& k, const at::Tensor& t, py::handle box, py::handle elem_strides, int64_t interleave,
                     int64_t swizzle, int64_t l2, int64_t oob, int64_t data_type) {
  k.clear();
  k.push_back(1);
  k.push_back(static_cast<int64_t>(t.device().type()));
  k.push_back(t.device().index());
  k.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
  k.push_back(static_cast<int64_t>(t.scalar_type()));
  k.push_back(t.dim());
  for (auto v : t.sizes()) k.push_back(v);
  for (auto v : t.strides()) k.push_back(v);
  append_seq(k, box, "box");
  append_seq(k, elem_strides, "elem_strides");
  k.insert(k.end(), {interleave, swizzle, l2, oob, data_type});
}

Key tensor_key(const at::Tensor& t, py::handle box, py::handle elem_strides, int64_t interleave, int64_t swizzle,
               int64_t l2, int64_t oob, int64_t data_type) {
  Key k;
  tensor_key_into(k, t, box, elem_strides, interleave, swizzle, l2, oob, data_type);
  return k;
}

Key tuple_key(const py::tuple& fields) {
  Key k{2};
  for (auto item : fields) {
    if (PyLong_Check(item.ptr())) {
      k.push_back(key_int(item.ptr(), "spec key"));
    } else {
      append_seq(k, item, "spec key");
    }
  }
  return k;
}

Key fingerprint_shape(const at::Tensor& t) {
  Key k{static_cast<int64_t>(t.scalar_type()), static_cast<int64_t>(t.device().type()), t.device().index(), t.dim()};
  for (auto v : t.sizes()) k.push_back(v);
  for (auto v : t.strides()) k.push_back(v);
  return k;
}

class Table {
 public:
  // A CUDA table tracks streams, capture and events; a CPU table (tests on machines without a GPU) keeps only
  // the bookkeeping: keys, LRU order, pins.
  Table(const std::string& device_type, int device_index)
      : device_(c10::Device(device_type).type(), static_cast<c10::DeviceIndex>(device_index)) {}

  // Hot path: one hash lookup; on a hit, LRU touch, note the stream the caller will launch on, and pin the entry
  // for good if that stream is being captured.
  py::object lookup(const at::Tensor& t, py::handle box, py::handle elem_strides, int64_t interleave,
                    int64_t swizzle, int64_t l2, int64_t oob, int64_t data_type) {
    thread_local Key scratch;  // lookups reuse one buffer: no allocation on the hot path
    tensor_key_into(scratch, t, box, elem_strides, interleave, swizzle, l2, oob, data_type);
    return hit(scratch);
  }
  py::object lookup_spec(const py::tuple& fields) { return hit(tuple_key(fields)); }

  int64_t insert(const at::Tensor& t, py::handle box, py::handle elem_strides, int64_t interleave, int64_t swizzle,
                 int64_t l2, int64_t oob, int64_t data_type, py::object value) {
    return add(tensor_key(t, box, elem_strides, interleave, swizzle, l2, oob, data_type), std::move(value));
  }
  int64_t insert_spec(const py::tuple& fields, py::object value) { return add(tuple_key(fields), std::move(value)); }

  // An entry with no key: a bound handle whose key is taken by another bound handle, or one between keys.
  int64_t insert_unkeyed(py::object value) { return add(Key{}, std::move(value)); }

  // Move an entry to a new key (a bound handle after refresh). Returns the id of an unpinned entry that held the
  // new key and was unlinked to make room (the caller retires its slot), -1 if none, or -2 if a pinned entry
  // holds it (the entry stays unkeyed; its pointer still works, get() does not find it).
  int64_t rekey(int64_t id, const at::Tensor& t, py::handle box, py::handle elem_strides, int64_t interleave,
                int64_t swizzle, int64_t l2, int64_t oob, int64_t data_type) {
    return move_key(id, tensor_key(t, box, elem_strides, interleave, swizzle, l2, oob, data_type));
  }
  int64_t rekey_spec(int64_t id, const py::tuple& fields) { return move_key(id, tuple_key(fields)); }

  // Bound handles: remember the source tensor's address, dtype, shape and strides; `current_ptr` returns the slot
  // address while they still match and 0 once the tensor moved (the caller refreshes).
  void set_fingerprint(int64_t id, const at::Tensor& t, int64_t slot) {
    Entry& e = entry(id);
    e.slot = slot;
    e.bound_ptr = reinterpret_cast<int64_t>(t.data_ptr());
    e.bound_shape = fingerprint_shape(t);
  }
  bool matches(int64_t id, const at::Tensor& t) {
    Entry& e = entry(id);
    if (reinterpret_cast<int64_t>(t.data_ptr()) != e.bound_ptr) return false;
    const Key& s = e.bound_shape;
    if (s.size() != static_cast<size_t>(4 + 2 * t.dim()) || s[0] != static_cast<int64_t>(t.scalar_type()) ||
        s[1] != static_cast<int64_t>(t.device().type()) || s[2] != t.device().index())
      return false;
    size_t i = 4;
    for (auto v : t.sizes())
      if (s[i++] != v) return false;
    for (auto v : t.strides())
      if (s[i++] != v) return false;
    return true;
  }

  // The bound handle's hot path in one call: the slot address if the source tensor is unchanged, else 0.
  int64_t current_ptr(int64_t id, const at::Tensor& t) {
    if (!matches(id, t)) return 0;
    Entry& e = entry(id);
    note_use(e);
    return e.slot;
  }

  // Before a slot is rewritten in place on the current stream: make that stream wait for every other stream
  // that was handed this entry, so no kernel there can read a half-written or newer descriptor too early.
  void order_after_uses(int64_t id) {
    Entry& e = entry(id);
    if (!device_.is_cuda()) return;
    c10::Stream current = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device_);
    for (const auto& s : e.streams) {
      if (s == current) continue;
      c10::Event ev(c10::DeviceType::CUDA);
      ev.record(s);
      ev.block(current);
    }
    e.streams.assign(1, current);
  }

  py::object value(int64_t id) { return entry(id).value; }
  void set_pinned(int64_t id, bool pinned) { entry(id).pinned = pinned; }

  // Unlink an entry from the table (no more hits) and record, on every stream it was handed out on, an event
  // after which no kernel launched so far can still read its slot.
  void retire(int64_t id) {
    Entry& e = entry(id);
    if (!e.key.empty()) by_key_.erase(e.key);
    e.key.clear();
    record_retire_events(e);
  }
  // Rewriting a slot in place (refresh) is ordered by the write's own stream; other streams that used the old
  // contents get events so the caller can order against them. Returns true when all earlier uses have finished.
  bool retired(int64_t id) {
    for (auto& ev : entry(id).retire_events)
      if (!ev.query()) return false;
    return true;
  }
  void wait_retired(int64_t id) {
    py::gil_scoped_release nogil;
    for (auto& ev : entry(id).retire_events) ev.synchronize();
  }
  py::object erase(int64_t id) {
    auto it = entries_.find(id);
    TORCH_CHECK(it != entries_.end(), "torch_tma: no table entry ", id);
    if (!it->second.key.empty()) by_key_.erase(it->second.key);
    py::object value = std::move(it->second.value);
    entries_.erase(it);
    return value;
  }

  // Unpinned, never-captured, keyed entries, least recently used first: the eviction candidates.
  std::vector<int64_t> lru_candidates() const {
    std::vector<std::pair<uint64_t, int64_t>> order;
    for (const auto& [id, e] : entries_)
      if (!e.pinned && !e.captured && !e.key.empty()) order.emplace_back(e.last_use, id);
    std::sort(order.begin(), order.end());
    std::vector<int64_t> ids;
    ids.reserve(order.size());
    for (auto& p : order) ids.push_back(p.second);
    return ids;
  }

  py::dict entry_state(int64_t id) {
    Entry& e = entry(id);
    py::dict d;
    d["keyed"] = !e.key.empty();
    d["pinned"] = e.pinned;
    d["captured"] = e.captured;
    d["last_use"] = e.last_use;
    d["streams"] = e.streams.size();
    return d;
  }
  std::vector<py::object> values() const {
    std::vector<py::object> out;
    for (const auto& [id, e] : entries_) out.push_back(e.value);
    return out;
  }
  int64_t hits() const { return hits_; }
  size_t size() const { return entries_.size(); }

 private:
  Entry& entry(int64_t id) {
    auto it = entries_.find(id);
    TORCH_CHECK(it != entries_.end(), "torch_tma: no table entry ", id);
    return it->second;
  }

  py::object hit(const Key& k) {
    auto it = by_key_.find(k);
    if (it == by_key_.end()) return py::none();
    Entry& e = entries_.find(it->second)->second;
    note_use(e);
    ++hits_;
    return e.value;
  }

  // Records the stream the caller will launch on, and pins the entry for good if that stream is capturing a
  // CUDA graph. The default stream (id 0) cannot capture (CUDA refuses capture on the legacy stream), so the
  // driver is asked only for other streams: that keeps eager hits on the default stream ~0.2 us cheaper.
  void note_use(Entry& e) {
    e.last_use = ++clock_;
    if (!device_.is_cuda()) return;
    c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device_);
    bool known = false;
    for (const auto& s : e.streams) known |= (s == stream);
    if (!known) e.streams.push_back(stream);
    if (!e.captured && stream.id() != 0 && stream_is_capturing(stream)) e.captured = true;
  }

  int64_t add(Key k, py::object value) {
    int64_t id = next_id_++;
    Entry e;
    e.value = std::move(value);
    e.key = k;
    if (!k.empty()) {
      TORCH_CHECK(by_key_.find(k) == by_key_.end(), "torch_tma: duplicate table key");
      by_key_.emplace(std::move(k), id);
    }
    entries_.emplace(id, std::move(e));
    note_use(entries_.find(id)->second);
    return id;
  }

  int64_t move_key(int64_t id, Key k) {
    Entry& e = entry(id);
    if (!e.key.empty()) by_key_.erase(e.key);
    e.key.clear();
    int64_t displaced = -1;
    auto it = by_key_.find(k);
    if (it != by_key_.end()) {
      Entry& other = entries_.find(it->second)->second;
      if (other.pinned || other.captured) return -2;
      displaced = it->second;  // the caller retires it (retire() records its events, from the streams it keeps)
      other.key.clear();
      by_key_.erase(it);
    }
    e.key = k;
    by_key_.emplace(std::move(k), id);
    return displaced;
  }

  void record_retire_events(Entry& e) {
    e.retire_events.clear();
    if (!device_.is_cuda()) return;
    for (const auto& s : e.streams) {
      c10::Event ev(c10::DeviceType::CUDA);
      ev.record(s);
      e.retire_events.push_back(std::move(ev));
    }
    e.streams.clear();
  }

  c10::Device device_;
  std::unordered_map<Key, int64_t, KeyHash> by_key_;
  std::unordered_map<int64_t, Entry> entries_;
  int64_t next_id_ = 1;
  uint64_t clock_ = 0;
  int64_t hits_ = 0;
};


// ---- fast paths: raw CPython vectorcall, no pybind dispatch --------------------------------------------------
// cache.get(tensor, box, *, swizzle=, l2_promotion=, interleave=, oob_fill=, elem_strides=, data_type=) on a hit
// (box positional or by keyword),
// and BoundTensorMap.ptr. Anything unusual (a keyword passed by a non-interned name, a non-int, a miss) goes to
// the Python implementation with the same arguments, which validates and explains.
PyObject* kw_box = nullptr;
PyObject* kw_swizzle = nullptr;
PyObject* kw_l2 = nullptr;
PyObject* kw_interleave = nullptr;
PyObject* kw_oob = nullptr;
PyObject* kw_es = nullptr;
PyObject* kw_dt = nullptr;
PyObject* attr_native = nullptr;
PyObject* attr_parameters = nullptr;
PyObject* attr_buffers = nullptr;
PyObject* attr_refresh = nullptr;
PyObject* attr_src = nullptr;
PyObject* attr_src_attr = nullptr;

// The native get's `self` is a tuple (capsule holding the Table*, the Table object, the Python miss handler): a
// tuple is tracked by the garbage collector, so the cycle cache -> get -> miss handler -> cache stays collectable.
bool int_arg(PyObject* v, int64_t& out, int64_t none_value) {
  if (v == Py_None) {
    out = none_value;
    return true;
  }
  // Enum codes are ints >= 0; anything else (a bool, -1 for data_type) goes to the Python path, which names it.
  if (!PyLong_Check(v) || PyBool_Check(v)) return false;
  out = PyLong_AsLongLong(v);
  if (out < 0) {
    PyErr_Clear();
    return false;
  }
  return true;
}

PyObject* fast_get(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* table = static_cast<Table*>(PyCapsule_GetPointer(PyTuple_GET_ITEM(self, 0), "torch_tma.Table"));
  PyObject* miss = PyTuple_GET_ITEM(self, 2);
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if ((nargs == 1 || nargs == 2) && THPVariable_Check(args[0])) {
    PyObject* box = nargs == 2 ? args[1] : nullptr;  // positional, or box= among the keywords
    PyObject* es = Py_None;
    int64_t sw = 0, l2 = 2, il = 0, oob = 0, dt = -1;  // the Python signature's defaults
    bool ok = true;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; ok && i < nkw; ++i) {
      PyObject* name = PyTuple_GET_ITEM(kwnames, i);
      PyObject* value = args[nargs + i];
      if (name == kw_box && box == nullptr) box = value;
      else if (name == kw_swizzle) ok = int_arg(value, sw, -2);
      else if (name == kw_l2) ok = int_arg(value, l2, -2);
      else if (name == kw_interleave) ok = int_arg(value, il, -2);
      else if (name == kw_oob) ok = int_arg(value, oob, -2);
      else if (name == kw_dt) ok = int_arg(value, dt, -1);
      else if (name == kw_es) es = value;
      else ok = false;
    }
    if (ok && box != nullptr) {
      try {
        py::object hit = table->lookup(THPVariable_Unpack(args[0]), box, es, il, sw, l2, oob, dt);
        if (!hit.is_none()) return hit.release().ptr();
      } catch (const std::exception&) {
        PyErr_Clear();  // the Python path repeats the lookup and reports the problem properly
      }
    }
  }
  return PyObject_Vectorcall(miss, args, nargsf, kwnames);
}

PyMethodDef fast_get_def = {"get", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_get)),
                            METH_FASTCALL | METH_KEYWORDS,
                            "TensorMapCache.get's hit path (native); misses go to the Python implementation"};

py::object make_fast_get(py::object table, py::object miss) {
  py::object capsule =
      py::reinterpret_steal<py::object>(PyCapsule_New(table.cast<Table*>(), "torch_tma.Table", nullptr));
  py::tuple self = py::make_tuple(capsule, table, miss);
  return py::reinterpret_steal<py::object>(PyCFunction_NewEx(&fast_get_def, self.ptr(), nullptr));
}

// A bound handle's source lives in the handle's own __dict__ (so reference cycles through modules stay visible to
// the garbage collector): `_src` and `_src_attr`, where _src_attr is None (the source is the tensor), a str (the
// source is a module: read its _parameters/_buffers like nn.Module.__getattr__, without its Python frame), or
// Ellipsis (the source is a zero-argument callable).
struct BoundState {
  PyObject* table_obj;
  Table* table;
  int64_t id;
};

void free_bound_state(PyObject* capsule) {
  auto* st = static_cast<BoundState*>(PyCapsule_GetPointer(capsule, "torch_tma.BoundState"));
  Py_XDECREF(st->table_obj);
  delete st;
}

py::object make_bound_state(py::object table, int64_t id) {
  auto* st = new BoundState{table.ptr(), table.cast<Table*>(), id};
  Py_INCREF(st->table_obj);
  return py::reinterpret_steal<py::object>(PyCapsule_New(st, "torch_tma.BoundState", free_bound_state));
}

// New reference to the source's current tensor, or nullptr with an exception set.
PyObject* bound_source(PyObject* src, PyObject* attr) {
  if (attr == Py_None) {
    Py_INCREF(src);
    return src;
  }
  if (attr == Py_Ellipsis) return PyObject_CallNoArgs(src);
  PyObject* dict = PyObject_GenericGetDict(src, nullptr);
  if (dict) {
    for (PyObject* which : {attr_parameters, attr_buffers}) {
      PyObject* d = PyDict_GetItemWithError(dict, which);
      PyObject* t = d && PyDict_Check(d) ? PyDict_GetItemWithError(d, attr) : nullptr;
      if (t && t != Py_None) {
        Py_INCREF(t);
        Py_DECREF(dict);
        return t;
      }
    }
    Py_DECREF(dict);
  }
  PyErr_Clear();
  return PyObject_GetAttr(src, attr);
}

// BoundTensorMap.ptr: the slot address if the source tensor still has the address, dtype, shape and strides it
// was encoded for; otherwise handle._refresh_and_ptr() (Python) refreshes in place and returns the same address
// (or, once close() has removed _native, raises StaleTensorMapError).
PyObject* bound_ptr(PyObject*, PyObject* handle) {
  // Strong references throughout: reading the source may run Python (a callable, a module's attribute lookup)
  // that closes the handle or replaces its items, or lets another thread do so.
  auto dict = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(handle, nullptr));
  if (!dict) return nullptr;
  auto item = [&](PyObject* name) {
    return py::reinterpret_borrow<py::object>(PyDict_GetItemWithError(dict.ptr(), name));
  };
  py::object capsule = item(attr_native), src = item(attr_src), attr = item(attr_src_attr);
  if (PyErr_Occurred()) return nullptr;
  if (!capsule) return PyObject_CallMethodNoArgs(handle, attr_refresh);  // closed: refresh() says so
  if (!src || !attr) {
    PyErr_SetString(PyExc_AttributeError, "BoundTensorMap is not initialised");
    return nullptr;
  }
  auto* st = static_cast<BoundState*>(PyCapsule_GetPointer(capsule.ptr(), "torch_tma.BoundState"));
  if (!st) return nullptr;
  auto t = py::reinterpret_steal<py::object>(bound_source(src.ptr(), attr.ptr()));
  if (!t) return nullptr;
  // Closed while the source ran: the slot may be given back already; refresh() raises StaleTensorMapError.
  if (PyDict_GetItemWithError(dict.ptr(), attr_native) != capsule.ptr()) {
    if (PyErr_Occurred()) return nullptr;
    return PyObject_CallMethodNoArgs(handle, attr_refresh);
  }
  int64_t ptr = 0;
  if (THPVariable_Check(t.ptr())) {
    try {
      ptr = st->table->current_ptr(st->id, THPVariable_Unpack(t.ptr()));
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  if (ptr) return PyLong_FromLongLong(ptr);
  return PyObject_CallMethodNoArgs(handle, attr_refresh);
}

PyMethodDef bound_ptr_def = {"bound_ptr", bound_ptr, METH_O,
                             "BoundTensorMap.ptr's getter: slot address, refreshing in place if the source moved"};

void intern_names() {
  kw_box = PyUnicode_InternFromString("box");
  kw_swizzle = PyUnicode_InternFromString("swizzle");
  kw_l2 = PyUnicode_InternFromString("l2_promotion");
  kw_interleave = PyUnicode_InternFromString("interleave");
  kw_oob = PyUnicode_InternFromString("oob_fill");
  kw_es = PyUnicode_InternFromString("elem_strides");
  kw_dt = PyUnicode_InternFromString("data_type");
  attr_native = PyUnicode_InternFromString("_native");
  attr_parameters = PyUnicode_InternFromString("_parameters");
  attr_buffers = PyUnicode_InternFromString("_buffers");
  attr_refresh = PyUnicode_InternFromString("_refresh_and_ptr");
  attr_src = PyUnicode_InternFromString("_src");
  attr_src_attr = PyUnicode_InternFromString("_src_attr");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_tma native core: driver entry points resolved at run time, and the descriptor table";
  m.def("encode_tiled", &encode_tiled, "cuTensorMapEncodeTiled; returns the 128 descriptor bytes",
        py::arg("data_type"), py::arg("address"), py::arg("dims"), py::arg("strides"), py::arg("box"),
        py::arg("elem_strides"), py::arg("interleave"), py::arg("swizzle"), py::arg("l2_promotion"),
        py::arg("oob_fill"), py::arg("device_index"));
  intern_names();
  m.def("make_fast_get", &make_fast_get, "a native get(tensor, box, **encoding) bound to a table and a miss handler");
  m.def("make_bound_state", &make_bound_state, "the native state behind BoundTensorMap.ptr", py::arg("table"),
        py::arg("entry_id"));
  m.add_object("bound_ptr", py::reinterpret_steal<py::object>(PyCFunction_NewEx(&bound_ptr_def, nullptr, nullptr)));
  m.def("driver_status", &driver_status, "empty if the driver is usable, else why not (loads it on first call)");
  py::class_<Table>(m, "Table")
      .def(py::init<const std::string&, int>())
      .def("lookup", &Table::lookup)
      .def("lookup_spec", &Table::lookup_spec)
      .def("insert", &Table::insert)
      .def("insert_spec", &Table::insert_spec)
      .def("insert_unkeyed", &Table::insert_unkeyed)
      .def("rekey", &Table::rekey)
      .def("rekey_spec", &Table::rekey_spec)
      .def("set_fingerprint", &Table::set_fingerprint)
      .def("matches", &Table::matches)
      .def("current_ptr", &Table::current_ptr)
      .def("order_after_uses", &Table::order_after_uses)
      .def("value", &Table::value)
      .def("set_pinned", &Table::set_pinned)
      .def("retire", &Table::retire)
      .def("retired", &Table::retired)
      .def("wait_retired", &Table::wait_retired)
      .def("erase", &Table::erase)
      .def("lru_candidates", &Table::lru_candidates)
      .def("entry_state", &Table::entry_state)
      .def("values", &Table::values)
      .def_property_readonly("hits", &Table::hits)
      .def("__len__", &Table::size);
  register_linear_op(m);
}
