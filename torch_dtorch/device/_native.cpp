// dtorch's native eager fast path (see torch_dtorch/device/native.py and docs/design/decisions.md).
//
// 1. The tensor table. A dtorch tensor is a storage-less PrivateUse1 tensor; its storage's DataPtr carries an
//    `Entry` (operand, generation, layout id, shape) as its context and `on_delete` as its deleter. Looking a
//    tensor up is two pointer loads; when the last tensor over a storage dies, the deleter queues the entry and
//    the next op (or `drain()`) calls the operand's free callback with the GIL held.
// 2. The fast kernel. Every overload with a Python `FastOp` gets a boxed C++ kernel on PrivateUse1. It keys the
//    call by the layout id of each tensor argument and the value of each constant; on a hit it asks Python to
//    record the operator (`_native_hit`, one call) and makes the output tensors itself. On a miss it redispatches
//    to the Python kernel (registered on PrivateUse2) and keeps the template that call learned.
#include <torch/extension.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kUnknown = -1;  // layout not computed yet
constexpr int64_t kNoFast = -2;   // an unbound operand: never on the fast path

struct Entry {
  PyObject* operand;  // strong
  PyObject* on_free;  // strong
  int64_t generation;
  int64_t layout;
  int64_t serial;
  c10::SmallVector<int64_t, 6> sizes;
};

std::mutex g_dead_mu;
std::vector<Entry*> g_dead;
std::atomic<size_t> g_dead_n{0};
std::atomic<int64_t> g_live{0};

// under the GIL
int64_t g_serial = 0;
int64_t g_generation = -1;
uint64_t g_epoch = 0;
PyObject* g_on_free = nullptr;  // the current runtime's free callback
PyObject* g_hit = nullptr;      // _native_hit(template, inputs) -> list of operands | None
PyObject* g_layout = nullptr;   // layout_of_operand(operand) -> int (kNoFast: unbound)
PyObject* g_take = nullptr;     // take_learned() -> the template the Python kernel used on this thread | None
bool g_draining = false;
int64_t g_hits = 0;
int64_t g_misses = 0;
std::unordered_map<std::string, int64_t> g_strings;

py::object take_learned() {
  py::object r = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(g_take));
  if (!r) {
    throw py::error_already_set();
  }
  return r;
}

void on_delete(void* ctx) {
  std::lock_guard<std::mutex> guard(g_dead_mu);
  g_dead.push_back(static_cast<Entry*>(ctx));
  g_dead_n.store(g_dead.size(), std::memory_order_relaxed);
}

inline Entry* entry_of(const at::Tensor& t) {
  if (!t.defined()) {
    return nullptr;
  }
  auto* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->device_type() != c10::DeviceType::PrivateUse1) {
    return nullptr;
  }
  const auto& dp = impl->unsafe_storage().data_ptr();
  if (dp.get_deleter() != &on_delete) {
    return nullptr;
  }
  return static_cast<Entry*>(dp.get_context());
}

// Calls the free callback of every storage that died (GIL held). Errors are reported, never raised: a free
// must not fail the op that happens to run it.
int64_t drain_locked() {
  if (g_draining || g_dead_n.load(std::memory_order_relaxed) == 0) {
    return 0;
  }
  g_draining = true;
  int64_t n = 0;
  for (;;) {
    std::vector<Entry*> dead;
    {
      std::lock_guard<std::mutex> guard(g_dead_mu);
      dead.swap(g_dead);
      g_dead_n.store(0, std::memory_order_relaxed);
    }
    if (dead.empty()) {
      break;
    }
    for (Entry* e : dead) {
      PyObject* r = PyObject_CallFunctionObjArgs(e->on_free, e->operand, nullptr);
      if (r == nullptr) {
        PyErr_WriteUnraisable(e->on_free);
      } else {
        Py_DECREF(r);
      }
      Py_DECREF(e->operand);
      Py_DECREF(e->on_free);
      delete e;
      ++n;
    }
  }
  g_live.fetch_sub(n, std::memory_order_relaxed);
  g_draining = false;
  return n;
}

at::Tensor make_tensor(Entry* e, at::ScalarType dtype, bool normal) {
  c10::DataPtr ptr(nullptr, e, &on_delete, c10::Device(c10::DeviceType::PrivateUse1, 0));
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, std::move(ptr), nullptr, false);
  std::optional<c10::InferenceMode> guard;
  if (normal && c10::InferenceMode::is_enabled()) {
    // a view of a normal tensor made under inference_mode is a normal tensor (autograd links it to its base)
    guard.emplace(false);
  }
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      caffe2::TypeMeta::fromScalarType(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(e->sizes);
  g_live.fetch_add(1, std::memory_order_relaxed);
  return t;
}

Entry* new_entry(PyObject* operand, PyObject* on_free, int64_t generation, int64_t layout, c10::IntArrayRef sizes) {
  Py_INCREF(operand);
  Py_INCREF(on_free);
  auto* e = new Entry{operand, on_free, generation, layout, ++g_serial, {}};
  e->sizes.assign(sizes.begin(), sizes.end());
  return e;
}

// ---- call keys -----------------------------------------------------------------------------------------------

enum Tag : int64_t {
  kNone = 1, kInt, kDouble, kBool, kIntList, kDoubleList, kBoolList, kString, kDevice, kTensor, kWrapped, kTensorList
};

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ULL ^ k.size();
    for (int64_t v : k) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ULL;
      h ^= h >> 29;
    }
    return static_cast<size_t>(h);
  }
};

inline int64_t double_bits(double d) {
  int64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  return bits;
}

// A strong reference that is dropped only while Python runs and this thread holds the GIL: kernels live in the
// dispatcher, which C++ may destroy after the interpreter is gone (then the reference is leaked, harmlessly).
class PyRef {
 public:
  PyRef() = default;
  explicit PyRef(py::object o) : p_(o.release().ptr()) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (p_ != nullptr && Py_IsInitialized() && PyGILState_Check()) {
      Py_DECREF(p_);
    }
  }
  PyObject* get() const { return p_; }

 private:
  PyObject* p_ = nullptr;
};

template <typename List, typename Conv>
void push_list(Key& key, Tag tag, const List& list, Conv conv) {
  key.push_back(tag);
  key.push_back(static_cast<int64_t>(list.size()));
  for (auto x : list) {
    key.push_back(conv(x));
  }
}

// A Python number in a tensor slot, keyed by its dtype and value; false for any other tensor.
bool wrapped_number_key(const at::Tensor& t, Key& key) {
  if (!t.defined()) {
    return false;
  }
  auto* impl = t.unsafeGetTensorImpl();
  if (!impl->is_wrapped_number() || impl->device_type() != c10::DeviceType::CPU) {
    return false;
  }
  int64_t bits;
  switch (t.scalar_type()) {
    case at::kDouble:
      bits = double_bits(*static_cast<const double*>(impl->data()));
      break;
    case at::kLong:
      bits = *static_cast<const int64_t*>(impl->data());
      break;
    case at::kBool:
      bits = *static_cast<const bool*>(impl->data());
      break;
    default:
      return false;  // complex numbers: the full path
  }
  key.push_back(kWrapped);
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(bits);
  return true;
}

struct OutSpec {
  c10::SmallVector<int64_t, 6> sizes;
  at::ScalarType dtype;
  int64_t layout;
};

struct Template {
  explicit Template(py::object o) : tpl(std::move(o)) {}
  PyRef tpl;
  std::vector<OutSpec> outs;
};

enum Kind : int { kSingle = 0, kTuple = 1, kList = 2 };

class FastPathHandler : public c10::OperatorKernel {
 public:
  FastPathHandler(py::object fastop, int kind, bool view, std::vector<int64_t> tensor_args, int64_t list_pos)
      : fastop_(std::move(fastop)),
        kind_(kind),
        view_(view),
        tensor_args_(std::move(tensor_args)),
        list_pos_(list_pos) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t n = op.schema().arguments().size();
    py::gil_scoped_acquire gil;
    drain_locked();
    if (epoch_ != g_epoch) {
      cache_.clear();
      epoch_ = g_epoch;
    }
    Key key;
    key.reserve(2 * n + 1);
    Entry* found[16];
    c10::SmallVector<Entry*, 8> elements;  // a list op's tensors (``cat``'s), in order: its inputs
    const bool keyed = g_generation >= 0 && n <= 16 && make_key(stack, n, key, found, elements);
    if (keyed) {
      auto it = cache_.find(key);
      // a counted reference: Python code run by the hit may let another thread clear the cache
      std::shared_ptr<const Template> tpl = it != cache_.end() ? it->second : nullptr;
      if (tpl && hit(*tpl, stack, n, found, elements)) {
        ++g_hits;
        return;
      }
    }
    ++g_misses;
    take_learned();  // a template left by a direct Python call on this thread is not this call's
    // the Python kernel: the full path (rules, planning), which also learns a template for these layouts
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), stack);
    py::object learned = take_learned();
    if (keyed && !learned.is_none() && learned.attr("owner").ptr() == fastop_.get()) {
      learn(std::move(key), std::move(learned), stack, op.schema().returns().size());
    }
  }

 private:
  // The key of the call on the stack: tagged constants and the layout id of every tensor. False: not keyable.
  // The bound dtorch tensor ``t``'s entry with its layout known; nullptr when it cannot be keyed (another
  // runtime's, a stale shape, unbound).
  static Entry* keyable(const at::Tensor& t) {
    Entry* e = entry_of(t);
    if (e == nullptr || e->generation != g_generation || t.sizes() != c10::IntArrayRef(e->sizes)) {
      return nullptr;
    }
    if (e->layout == kUnknown) {
      py::object lid =
          py::reinterpret_steal<py::object>(PyObject_CallFunctionObjArgs(g_layout, e->operand, nullptr));
      if (!lid) {
        throw py::error_already_set();
      }
      e->layout = lid.cast<int64_t>();
    }
    return e->layout == kNoFast ? nullptr : e;
  }

  bool make_key(torch::jit::Stack* stack, size_t n, Key& key, Entry** found,
                c10::SmallVector<Entry*, 8>& elements) {
    auto args = torch::jit::last(*stack, n);
    for (size_t i = 0; i < n; ++i) {
      const c10::IValue& v = args[i];
      found[i] = nullptr;
      if (static_cast<int64_t>(i) == list_pos_) {
        // the op's one Tensor[] argument (``cat``): keyed by every element's layout
        if (!v.isTensorList()) {
          return false;
        }
        auto list = v.toTensorList();
        if (list.empty()) {
          return false;
        }
        key.push_back(kTensorList);
        key.push_back(static_cast<int64_t>(list.size()));
        for (size_t k = 0; k < list.size(); ++k) {
          const at::Tensor t = list.get(k);
          Entry* e = keyable(t);
          if (e == nullptr) {
            return false;
          }
          key.push_back(e->layout);
          elements.push_back(e);
        }
        continue;
      }
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        if (entry_of(t) == nullptr) {
          // ``x + 1.0``: Python numbers reach aten as wrapped 0-d CPU tensors (the Python kernel sees the number)
          if (!wrapped_number_key(t, key)) {
            return false;
          }
          continue;
        }
        Entry* e = keyable(t);
        if (e == nullptr) {
          return false;
        }
        key.push_back(kTensor);
        key.push_back(e->layout);
        found[i] = e;
      } else if (v.isNone()) {
        key.push_back(kNone);
      } else if (v.isInt()) {
        key.push_back(kInt);
        key.push_back(v.toInt());
      } else if (v.isSymInt()) {
        auto c = v.toSymInt().maybe_as_int();
        if (!c.has_value()) {
          return false;
        }
        key.push_back(kInt);
        key.push_back(*c);
      } else if (v.isDouble()) {
        key.push_back(kDouble);
        key.push_back(double_bits(v.toDouble()));
      } else if (v.isBool()) {
        key.push_back(kBool);
        key.push_back(v.toBool());
      } else if (v.isIntList()) {
        push_list(key, kIntList, v.toIntList(), [](int64_t x) { return x; });
      } else if (v.isDoubleList()) {
        push_list(key, kDoubleList, v.toDoubleList(), [](double x) { return double_bits(x); });
      } else if (v.isBoolList()) {
        push_list(key, kBoolList, v.toBoolList(), [](bool x) { return static_cast<int64_t>(x); });
      } else if (v.isList()) {
        // SymInt[] (view sizes, ...) arrives as a generic list of ints
        auto l = v.toListRef();
        key.push_back(kIntList);
        key.push_back(static_cast<int64_t>(l.size()));
        for (const c10::IValue& x : l) {
          if (x.isInt()) {
            key.push_back(x.toInt());
          } else if (x.isSymInt()) {
            auto c = x.toSymInt().maybe_as_int();
            if (!c.has_value()) {
              return false;
            }
            key.push_back(*c);
          } else {
            return false;
          }
        }
      } else if (v.isString()) {
        // interned: ids are never reused, so equal ids mean equal strings
        auto [it, _] = g_strings.emplace(v.toStringRef(), static_cast<int64_t>(g_strings.size()));
        key.push_back(kString);
        key.push_back(it->second);
      } else if (v.isDevice()) {
        auto d = v.toDevice();
        key.push_back(kDevice);
        key.push_back(static_cast<int64_t>(d.type()) * 65536 + d.index());
      } else {
        return false;  // tensor lists, complex scalars, generators, ...: the full path
      }
    }
    return true;
  }

  bool hit(const Template& tpl, torch::jit::Stack* stack, size_t n, Entry** found,
           const c10::SmallVector<Entry*, 8>& elements) {
    const bool listed = list_pos_ >= 0;
    const size_t slots = listed ? elements.size() : tensor_args_.size();
    py::list inputs(slots);
    for (size_t s = 0; s < slots; ++s) {
      Entry* e = listed ? elements[s] : found[tensor_args_[s]];
      PyObject* x = e != nullptr ? e->operand : Py_None;
      Py_INCREF(x);
      PyList_SET_ITEM(inputs.ptr(), s, x);
    }
    py::object outs = py::reinterpret_steal<py::object>(
        PyObject_CallFunctionObjArgs(g_hit, tpl.tpl.get(), inputs.ptr(), nullptr));
    if (!outs) {
      throw py::error_already_set();
    }
    if (outs.is_none()) {
      return false;  // the runtime went away meanwhile: the full path raises the proper error
    }
    bool normal = false;
    if (view_) {
      const c10::IValue& a0 = torch::jit::last(*stack, n)[0];
      normal = a0.isTensor() && !a0.toTensor().is_inference();
    }
    const size_t m = tpl.outs.size();
    if (!PyList_Check(outs.ptr()) || static_cast<size_t>(PyList_GET_SIZE(outs.ptr())) != m) {
      throw std::runtime_error("dtorch native fast path: the recorder returned " +
                               std::string(py::str(py::repr(outs))) + ", expected a list of " +
                               std::to_string(m) + " output operands (internal error, please report)");
    }
    std::vector<at::Tensor> made;
    made.reserve(m);
    for (size_t k = 0; k < m; ++k) {
      const OutSpec& spec = tpl.outs[k];
      PyObject* operand = PyList_GET_ITEM(outs.ptr(), k);
      Entry* e = new_entry(operand, g_on_free, g_generation, spec.layout, spec.sizes);
      made.push_back(make_tensor(e, spec.dtype, normal));
    }
    torch::jit::drop(*stack, n);
    if (kind_ == kList) {
      c10::List<at::Tensor> list;
      list.reserve(m);
      for (auto& t : made) {
        list.push_back(std::move(t));
      }
      torch::jit::push(*stack, std::move(list));
    } else {
      for (auto& t : made) {
        torch::jit::push(*stack, std::move(t));
      }
    }
    return true;
  }

  void learn(Key key, py::object learned, torch::jit::Stack* stack, size_t returns) {
    std::vector<at::Tensor> outs;
    auto rets = torch::jit::last(*stack, returns);
    for (const c10::IValue& r : rets) {
      if (r.isTensor()) {
        outs.push_back(r.toTensor());
      } else if (r.isTensorList()) {
        for (const at::Tensor& t : r.toTensorList().vec()) {
          outs.push_back(t);
        }
      } else {
        return;
      }
    }
    py::sequence layouts = learned.attr("out_layouts");
    if (py::len(layouts) != outs.size() || (kind_ == kSingle && outs.size() != 1)) {
      return;
    }
    auto tpl = std::make_shared<Template>(std::move(learned));
    for (size_t k = 0; k < outs.size(); ++k) {
      const at::Tensor& t = outs[k];
      OutSpec spec{{}, t.scalar_type(), layouts[k].cast<int64_t>()};
      spec.sizes.assign(t.sizes().begin(), t.sizes().end());
      tpl->outs.push_back(std::move(spec));
    }
    if (cache_.size() >= 4096) {
      cache_.clear();
    }
    cache_.emplace(std::move(key), std::move(tpl));
  }

  PyRef fastop_;
  int kind_;
  bool view_;
  std::vector<int64_t> tensor_args_;  // argument index of every tensor slot, in schema order
  int64_t list_pos_;                  // the argument index of the op's one Tensor[] argument; -1: none
  std::unordered_map<Key, std::shared_ptr<const Template>, KeyHash> cache_;
  uint64_t epoch_ = 0;
};

// never destroyed (see PyRef)
auto* g_libs = new std::vector<std::unique_ptr<torch::Library>>();

// ---- Python API ----------------------------------------------------------------------------------------------

at::ScalarType to_scalar_type(py::handle dtype) {
  if (!THPDtype_Check(dtype.ptr())) {
    throw py::type_error("expected a torch.dtype");
  }
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

const at::Tensor& unpack(py::handle t) {
  if (!THPVariable_Check(t.ptr())) {
    throw py::type_error("expected a tensor");
  }
  return THPVariable_Unpack(t.ptr());
}

py::object wrap(py::object operand, py::object on_free, int64_t generation, int64_t layout,
                const std::vector<int64_t>& sizes, py::handle dtype, bool normal) {
  drain_locked();
  Entry* e = new_entry(operand.ptr(), on_free.ptr(), generation, layout, sizes);
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(make_tensor(e, to_scalar_type(dtype), normal)));
}

// (operand, generation, shape, layout id or None, serial) of a tensor of ours; None otherwise
py::object lookup(py::handle t) {
  Entry* e = entry_of(unpack(t));
  if (e == nullptr) {
    return py::none();
  }
  py::tuple shape(e->sizes.size());
  for (size_t i = 0; i < e->sizes.size(); ++i) {
    shape[i] = py::int_(e->sizes[i]);
  }
  py::object layout = e->layout >= 0 ? py::object(py::int_(e->layout)) : py::object(py::none());
  return py::make_tuple(py::reinterpret_borrow<py::object>(e->operand), e->generation, shape, layout, e->serial);
}

void set_layout(py::handle t, int64_t layout) {
  Entry* e = entry_of(unpack(t));
  if (e != nullptr) {
    e->layout = layout;
  }
}

bool bind(py::handle t, py::object operand, py::object on_free, int64_t generation) {
  const at::Tensor& tensor = unpack(t);
  Entry* e = entry_of(tensor);
  if (e == nullptr) {
    return false;
  }
  Py_INCREF(operand.ptr());
  Py_INCREF(on_free.ptr());
  Py_DECREF(e->operand);
  Py_DECREF(e->on_free);
  e->operand = operand.ptr();
  e->on_free = on_free.ptr();
  e->generation = generation;
  e->layout = kUnknown;
  e->serial = ++g_serial;
  e->sizes.assign(tensor.sizes().begin(), tensor.sizes().end());
  return true;
}

// whether each tensor is still bound as when its serial was taken: a rebinding or a new storage changes it
bool same_serials(const py::sequence& tensors, const std::vector<int64_t>& expected) {
  py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(tensors.ptr(), "expected a sequence"));
  if (!fast) {
    throw py::error_already_set();
  }
  const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(fast.ptr()));
  if (n != expected.size()) {
    return false;
  }
  for (size_t i = 0; i < n; ++i) {
    PyObject* t = PySequence_Fast_GET_ITEM(fast.ptr(), i);
    Entry* e = THPVariable_Check(t) ? entry_of(THPVariable_Unpack(t)) : nullptr;
    if (e == nullptr || e->serial != expected[i]) {
      return false;
    }
  }
  return true;
}

void set_runtime(int64_t generation, py::object on_free) {
  g_generation = generation;
  ++g_epoch;
  PyObject* old = g_on_free;
  g_on_free = on_free.is_none() ? nullptr : on_free.release().ptr();
  Py_XDECREF(old);
  if (g_on_free == nullptr) {
    g_generation = -1;
  }
}

void set_hooks(py::object hit_fn, py::object layout_fn, py::object take_fn) {
  g_hit = hit_fn.release().ptr();
  g_layout = layout_fn.release().ptr();
  g_take = take_fn.release().ptr();
}

void invalidate() { ++g_epoch; }

void register_kernel(const std::string& ns, const std::string& name, py::object fastop, int kind, bool view,
                     std::vector<int64_t> tensor_args, int64_t list_pos) {
  auto lib = std::make_unique<torch::Library>(
      torch::Library::IMPL, ns, std::make_optional(c10::DispatchKey::PrivateUse1), __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                              std::make_unique<FastPathHandler>(std::move(fastop), kind, view, std::move(tensor_args), list_pos)));
  g_libs->push_back(std::move(lib));
}

// Whether autograd must see the call on the stack: grad mode on and an input (or a list element) requires grad.
bool needs_grad(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!c10::GradMode::is_enabled()) {
    return false;
  }
  const size_t n = op.schema().arguments().size();
  for (const c10::IValue& v : torch::jit::last(*stack, n)) {
    if (v.isTensor()) {
      if (v.toTensor().requires_grad()) {
        return true;
      }
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (t.defined() && t.requires_grad()) {
          return true;
        }
      }
    } else if (v.isList()) {
      for (const c10::IValue& x : v.toListRef()) {
        if (x.isTensor() && x.toTensor().requires_grad()) {
          return true;
        }
      }
    }
  }
  return false;
}

// The AutogradPrivateUse1 kernel of a composite op: where autograd must see the call, the kernel of ``grad_key``
// (CompositeImplicitAutograd: the op decomposes into primitives; AutogradPrivateUse2: the op's own autograd kernel,
// registered there from Python), else on below autograd whole (to the fast kernel).
class CompositeAutograd final : public c10::OperatorKernel {
 public:
  explicit CompositeAutograd(c10::DispatchKey grad_key) : grad_key_(grad_key) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    if (needs_grad(op, stack)) {
      op.callBoxedForDispatchKey(grad_key_, *stack);
    } else {
      op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
    }
  }

 private:
  c10::DispatchKey grad_key_;
};

void register_composite(const std::string& ns, const std::string& name, bool own_autograd) {
  auto lib = std::make_unique<torch::Library>(
      torch::Library::IMPL, ns, std::make_optional(c10::DispatchKey::AutogradPrivateUse1), __FILE__, __LINE__);
  const auto grad_key =
      own_autograd ? c10::DispatchKey::AutogradPrivateUse2 : c10::DispatchKey::CompositeImplicitAutograd;
  lib->impl(name.c_str(),
            torch::CppFunction::makeFromBoxedFunctor(std::make_unique<CompositeAutograd>(grad_key)));
  g_libs->push_back(std::move(lib));
}

py::dict stats() {
  py::dict d;
  d["hit"] = g_hits;
  d["miss"] = g_misses;
  d["live"] = g_live.load();
  d["dead"] = static_cast<int64_t>(g_dead_n.load());
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("wrap", &wrap);
  m.def("lookup", &lookup);
  m.def("set_layout", &set_layout);
  m.def("bind", &bind);
  m.def("same_serials", &same_serials);
  m.def("drain", [] { return drain_locked(); });
  m.def("live", [] { return g_live.load(); });
  m.def("set_runtime", &set_runtime);
  m.def("set_hooks", &set_hooks);
  m.def("invalidate", &invalidate);
  m.def("register_kernel", &register_kernel);
  m.def("register_composite", &register_composite, py::arg("ns"), py::arg("name"), py::arg("own_autograd") = false);
  m.def("stats", &stats);
}
