// The workers' native replay loop (issue 20, item 2): runs of resolved fast-path ops executed in C++ with the GIL
// released, so worker threads run in parallel with each other and with the controller.
//
// A resolved call (``resolve``) is an operator handle, a boxed argument stack in schema order with the constants in
// place, and the stack positions of the tensor inputs. ``run_chain`` replays a run of such calls: it takes the run's
// external input tensors, executes every step on an environment id -> tensor, and returns the outputs still alive
// at its end and the failures (a step whose input failed is skipped and reported with the failing step). A *free
// step* (``kFreeStep``) drops tensors the chain made and the controller freed meanwhile, so a chain's intermediates
// die when torch's would, not at the chain's end (a chain of 64 ops held all 64 outputs: gigabytes at full size).
// Python publishes the results as blobs (runtime/native_replay.py, executor/worker.py).

#include <torch/extension.h>

#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

struct Resolved {
  c10::OperatorHandle op;
  std::vector<c10::IValue> stack;                 // schema-ordered arguments, tensor inputs left undefined
  std::vector<std::pair<int64_t, int64_t>> slots;  // (stack position, index among the call's present inputs)
  // Tensor[] arguments (``cat``'s tensors): (stack position, input index of each element)
  std::vector<std::pair<int64_t, std::vector<int64_t>>> lists;
  int64_t num_returns;
  std::string name;
};

constexpr int64_t kFreeStep = -1;  // ``kFreeStep, n, ids...``: the chain's tensors of ``ids`` die here
// A free step's tensors that Python also wraps (the chain's external inputs, and in-place outputs that are them)
// are kept until the chain ends, up to this many bytes: dropping the last C++ reference of a Python-wrapped
// tensor decrefs its PyObject, which takes the GIL, and a worker thread waiting for the GIL that the controller
// holds stalls for up to the interpreter's switch interval (5 ms) per drop. Past the limit the kept tensors are
// dropped under the GIL at once (big tensors go promptly; the wait is small next to their kernels).
constexpr int64_t kDeferBytes = 64LL << 20;

std::mutex g_mutex;
std::atomic<int64_t> g_peak{0};  // the most tensors a chain held at once since ``take_peak`` (tests)
std::atomic<int64_t> g_end{0};   // the most tensors a chain still held at its end since ``take_peak`` (tests)

void raise_to(std::atomic<int64_t>& a, int64_t v) {
  int64_t prev = a.load();
  while (v > prev && !a.compare_exchange_weak(prev, v)) {
  }
}
std::deque<Resolved> g_calls;  // a deque: references stay valid while it grows
std::vector<int64_t> g_free;   // released entries, reused by ``resolve``

c10::OperatorHandle find_op(const std::string& name, const std::string& overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
}

// Resolve ``op(*args, **kwargs)`` where ``inputs[k]`` (the call's present tensor inputs, this rank's shards) sit at
// the positions ``positions[k]`` of ``args``. Returns a handle, or -1 when the call cannot be replayed natively
// (an argument that does not convert, a return that is not a plain tensor).
int64_t resolve(const std::string& name, const std::string& overload, py::tuple args, py::dict kwargs,
                std::vector<int64_t> positions, std::vector<int64_t> elements) {
  c10::OperatorHandle op = find_op(name, overload);
  const c10::FunctionSchema& schema = op.schema();
  for (const auto& ret : schema.returns()) {
    if (!ret.type()->isSubtypeOf(*c10::TensorType::get())) return -1;  // lists, scalars: the general path
  }
  const auto& arguments = schema.arguments();
  std::vector<c10::IValue> stack;
  stack.reserve(arguments.size());
  std::vector<std::pair<int64_t, int64_t>> slots;
  std::vector<std::pair<int64_t, std::vector<int64_t>>> lists;
  if (elements.size() != positions.size()) return -1;
  size_t nargs = py::len(args);
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto& a = arguments[i];
    py::object value;
    bool have = false;
    if (!a.kwarg_only() && i < nargs) {
      value = args[i];
      have = true;
    } else if (kwargs.contains(a.name())) {
      value = kwargs[py::str(a.name())];
      have = true;
    }
    int64_t input = -1;
    std::vector<int64_t> members;  // a Tensor[] argument: the input index of each element, in order
    if (have && !a.kwarg_only() && i < nargs) {
      for (size_t k = 0; k < positions.size(); ++k) {
        if (positions[k] != static_cast<int64_t>(i)) continue;
        if (elements[k] < 0) {
          input = static_cast<int64_t>(k);
        } else {
          if (members.size() <= static_cast<size_t>(elements[k])) members.resize(elements[k] + 1, -1);
          members[elements[k]] = static_cast<int64_t>(k);
        }
      }
    }
    if (!members.empty()) {
      if (!a.type()->isSubtypeOf(*c10::ListType::ofTensors())) return -1;
      for (int64_t k : members) {
        if (k < 0) return -1;  // an element that is no input
      }
      lists.emplace_back(static_cast<int64_t>(i), std::move(members));
      stack.emplace_back();
      continue;
    }
    if (input >= 0) {
      if (!a.type()->isSubtypeOf(*c10::TensorType::get()) &&
          !a.type()->isSubtypeOf(*c10::OptionalType::ofTensor())) {
        return -1;
      }
      slots.emplace_back(static_cast<int64_t>(i), input);
      stack.emplace_back();
      continue;
    }
    if (!have) {
      if (!a.default_value().has_value()) return -1;
      stack.push_back(*a.default_value());
      continue;
    }
    if (a.type()->isSubtypeOf(*c10::TensorType::get()) && !THPVariable_Check(value.ptr())) {
      // a Python number in a tensor slot (``x * 2.0``): the 0-d "wrapped number" tensor torch's own bindings make
      c10::Scalar scalar;
      if (py::isinstance<py::bool_>(value)) {
        scalar = c10::Scalar(value.cast<bool>());
      } else if (py::isinstance<py::int_>(value)) {
        scalar = c10::Scalar(value.cast<int64_t>());
      } else if (py::isinstance<py::float_>(value)) {
        scalar = c10::Scalar(value.cast<double>());
      } else {
        return -1;
      }
      at::Tensor t = c10::scalar_to_tensor(scalar);
      t.unsafeGetTensorImpl()->set_wrapped_number(true);
      stack.emplace_back(std::move(t));
      continue;
    }
    try {
      stack.push_back(torch::jit::toIValue(value, a.type()));
    } catch (const std::exception&) {
      return -1;
    }
    if (stack.back().isTensor() || stack.back().isTensorList()) return -1;  // tensor constants: general path
  }
  size_t named = slots.size();
  for (const auto& l : lists) named += l.second.size();
  if (named != positions.size()) return -1;
  Resolved entry{op, std::move(stack), std::move(slots), std::move(lists),
                 static_cast<int64_t>(schema.returns().size()), name + "." + overload};
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_free.empty()) {
    int64_t handle = g_free.back();
    g_free.pop_back();
    g_calls[static_cast<size_t>(handle)] = std::move(entry);
    return handle;
  }
  g_calls.push_back(std::move(entry));
  return static_cast<int64_t>(g_calls.size()) - 1;
}

// The owner of ``handles`` forgets them (a worker clearing its table, or shutting down): they are reused.
void release(const std::vector<int64_t>& handles) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (int64_t h : handles) {
    Resolved& r = g_calls.at(static_cast<size_t>(h));
    r.stack.clear();
    r.slots.clear();
    r.lists.clear();
    g_free.push_back(h);
  }
}

int64_t live() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<int64_t>(g_calls.size() - g_free.size());
}

// Run a chain. ``steps`` is flat: per step ``handle, n_in, in_ids..., n_out, out_ids...``, or a free step
// ``kFreeStep, n, ids...``. Returns ``(out_ids, out_tensors, failed)``: the outputs not freed inside the chain, and
// ``(step, origin_step, message)`` per failure (steps count ops only; ``origin_step`` is the step whose failure
// poisoned this one, itself when it raised).
py::tuple run_chain(const std::vector<int64_t>& steps, const std::vector<int64_t>& ext_ids, py::list ext_tensors) {
  std::vector<int64_t> out_ids;
  std::vector<at::Tensor> out_tensors;
  std::vector<std::tuple<int64_t, int64_t, std::string>> failed;
  std::unordered_map<int64_t, at::Tensor> env;
  env.reserve(ext_ids.size() * 2 + 16);
  std::unordered_set<const c10::TensorImpl*> wrapped;  // the external inputs' tensors: Python wraps them
  wrapped.reserve(ext_ids.size() * 2);
  for (size_t i = 0; i < ext_ids.size(); ++i) {
    auto it = env.emplace(ext_ids[i], py::cast<at::Tensor>(ext_tensors[i])).first;
    wrapped.insert(it->second.unsafeGetTensorImpl());
  }
  ext_tensors.attr("clear")();  // the chain holds its inputs alone: a free step can drop one mid-chain
  std::vector<at::Tensor> kept;  // wrapped tensors freed mid-chain: dropped with the GIL held (kDeferBytes)
  {
    py::gil_scoped_release no_gil;
    int64_t kept_bytes = 0;
    // the chain lets go of ``t``: now, or (a wrapped tensor) when the chain ends
    auto let_go = [&](at::Tensor&& t) {
      if (wrapped.count(t.unsafeGetTensorImpl()) == 0) {
        t.reset();
        return;
      }
      kept_bytes += static_cast<int64_t>(t.numel() * t.element_size());
      kept.push_back(std::move(t));
      if (kept_bytes > kDeferBytes) {
        py::gil_scoped_acquire gil;
        kept.clear();
        kept_bytes = 0;
      }
    };
    std::unordered_map<int64_t, int64_t> poisoned;  // id -> the step whose failure it carries
    std::vector<const Resolved*> calls;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      for (size_t p = 0; p < steps.size();) {
        if (steps[p] == kFreeStep) {
          p += 2 + static_cast<size_t>(steps[p + 1]);
          continue;
        }
        calls.push_back(&g_calls.at(static_cast<size_t>(steps[p])));
        int64_t n_in = steps[p + 1];
        int64_t n_out = steps[p + 2 + n_in];
        p += 3 + n_in + n_out;
      }
    }
    size_t p = 0;
    std::vector<c10::IValue> stack;
    std::vector<int64_t> made;  // ids the chain wrote, in order (an in-place op writes its input's id again)
    size_t peak = env.size();
    for (int64_t step = 0; p < steps.size(); ++step) {
      if (steps[p] == kFreeStep) {
        int64_t n = steps[p + 1];
        for (int64_t k = 0; k < n; ++k) {
          auto it = env.find(steps[p + 2 + static_cast<size_t>(k)]);
          if (it == env.end()) continue;
          let_go(std::move(it->second));
          env.erase(it);
        }
        p += 2 + static_cast<size_t>(n);
        --step;  // (not an op)
        continue;
      }
      const Resolved& call = *calls[static_cast<size_t>(step)];
      int64_t n_in = steps[p + 1];
      const int64_t* in_ids = &steps[p + 2];
      int64_t n_out = steps[p + 2 + n_in];
      const int64_t* o_ids = &steps[p + 3 + n_in];
      p += 3 + n_in + n_out;
      int64_t origin = -1;
      for (int64_t k = 0; k < n_in && origin < 0; ++k) {
        auto it = poisoned.find(in_ids[k]);
        if (it != poisoned.end()) origin = it->second;
      }
      std::string message;
      if (origin < 0) {
        stack = call.stack;
        for (const auto& [pos, k] : call.slots) {
          auto it = env.find(in_ids[k]);
          if (it == env.end()) {
            origin = step;
            message = "input missing from the chain";
            break;
          }
          stack[static_cast<size_t>(pos)] = it->second;
        }
        for (size_t l = 0; l < call.lists.size() && origin < 0; ++l) {
          const auto& [pos, members] = call.lists[l];
          c10::List<at::Tensor> list;
          list.reserve(members.size());
          for (int64_t k : members) {
            auto it = env.find(in_ids[k]);
            if (it == env.end()) {
              origin = step;
              message = "input missing from the chain";
              break;
            }
            list.push_back(it->second);
          }
          stack[static_cast<size_t>(pos)] = std::move(list);
        }
        if (origin < 0) {
          try {
            call.op.callBoxed(&stack);
            if (static_cast<int64_t>(stack.size()) != n_out) {
              origin = step;
              message = "the local kernel returned " + std::to_string(stack.size()) +
                        " tensors, the operator has " + std::to_string(n_out) + " outputs";
            } else {
              for (int64_t o = 0; o < n_out; ++o) {
                at::Tensor& slot = env[o_ids[o]];
                at::Tensor made_t = stack[static_cast<size_t>(o)].toTensor();
                if (slot.defined() && !slot.is_same(made_t)) let_go(std::move(slot));
                slot = std::move(made_t);
                made.push_back(o_ids[o]);
              }
              stack.clear();  // (the stack's references would keep the last outputs alive past a free step)
              peak = std::max(peak, env.size());
            }
          } catch (const std::exception& e) {
            origin = step;
            message = e.what();
          }
        }
      }
      if (origin >= 0) {
        for (int64_t o = 0; o < n_out; ++o) poisoned[o_ids[o]] = origin;
        failed.emplace_back(step, origin, message);
      }
    }
    std::unordered_set<int64_t> seen;
    for (int64_t id : made) {
      auto it = env.find(id);
      if (it == env.end() || !seen.insert(id).second) continue;  // freed inside the chain, or listed already
      out_ids.push_back(id);
      out_tensors.push_back(it->second);
    }
    raise_to(g_peak, static_cast<int64_t>(peak));
    raise_to(g_end, static_cast<int64_t>(env.size()));
  }
  py::list failures;
  for (auto& [step, origin, message] : failed) failures.append(py::make_tuple(step, origin, message));
  return py::make_tuple(out_ids, out_tensors, failures);
}

// --- the worker's hot lane (executor/worker.py ``Worker.run_batch``, runtime/native_replay.py ``NativeChain``) ---

// One chain's Python containers (NativeChain's ``_steps``, ``_ops``, ``_ext``, ``_produced``, ``_dropped``), the
// worker's blob table, and ``wait``: ``None`` or a callable taking the list of blobs a chain reads first (a CUDA
// stream's cross-stream wait).
struct ChainRefs {
  py::list steps;
  py::list ops;
  py::dict ext;
  py::set produced;
  py::set dropped;
  py::dict blobs;
  py::object wait;
};

// ``NativeChain._refs()``: ``(steps, ops, ext, produced, dropped, blobs, wait)``
ChainRefs refs_of(const py::tuple& t) {
  if (t.size() != 7) throw py::value_error("a chain's containers: (steps, ops, ext, produced, dropped, blobs, wait)");
  return ChainRefs{t[0].cast<py::list>(), t[1].cast<py::list>(), t[2].cast<py::dict>(), t[3].cast<py::set>(),
                   t[4].cast<py::set>(),  t[5].cast<py::dict>(), t[6].cast<py::object>()};
}

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);  // kept for the process's life
  if (o == nullptr) throw py::error_already_set();
  return o;
}

// ``blobs.pop(i, None)``
void drop_blob(const py::dict& blobs, PyObject* i) {
  if (PyDict_DelItem(blobs.ptr(), i) < 0) {
    if (!PyErr_ExceptionMatches(PyExc_KeyError)) throw py::error_already_set();
    PyErr_Clear();
  }
}

py::object attr(PyObject* o, PyObject* name) {
  PyObject* v = PyObject_GetAttr(o, name);
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

// ``NativeChain.add``: queue one op whose present inputs (slot order) are ``in_ids`` and outputs ``out_ids`` (lists
// of ints). False (nothing queued) when an input is neither made by the chain nor a healthy blob.
bool chain_add(ChainRefs& c, PyObject* handle, PyObject* op, PyObject* in_ids, PyObject* out_ids, PyObject* site) {
  static PyObject* s_error = interned("error");
  static PyObject* s_tensor = interned("tensor");
  Py_ssize_t n_in = PyList_GET_SIZE(in_ids);
  Py_ssize_t n_out = PyList_GET_SIZE(out_ids);
  std::vector<std::pair<PyObject*, py::object>> fresh;  // (id, its blob's tensor)
  py::list fresh_blobs;
  for (Py_ssize_t k = 0; k < n_in; ++k) {
    PyObject* i = PyList_GET_ITEM(in_ids, k);
    int r = PySet_Contains(c.produced.ptr(), i);
    if (r < 0) throw py::error_already_set();
    if (r) continue;
    r = PyDict_Contains(c.ext.ptr(), i);
    if (r < 0) throw py::error_already_set();
    if (r) continue;
    bool again = false;
    for (const auto& f : fresh) {
      int eq = PyObject_RichCompareBool(f.first, i, Py_EQ);
      if (eq < 0) throw py::error_already_set();
      if (eq) {
        again = true;
        break;
      }
    }
    if (again) continue;
    PyObject* b = PyDict_GetItemWithError(c.blobs.ptr(), i);  // borrowed
    if (b == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return false;
    }
    if (attr(b, s_error).ptr() != Py_None) return false;
    py::object t = attr(b, s_tensor);
    if (t.ptr() == Py_None) return false;
    fresh.emplace_back(i, std::move(t));
    fresh_blobs.append(py::handle(b));
  }
  if (!fresh.empty() && !c.wait.is_none()) c.wait(fresh_blobs);
  for (const auto& f : fresh) {
    if (PyDict_SetItem(c.ext.ptr(), f.first, f.second.ptr()) < 0) throw py::error_already_set();
  }
  PyObject* steps = c.steps.ptr();
  auto append = [&](PyObject* v) {
    if (PyList_Append(steps, v) < 0) throw py::error_already_set();
  };
  auto append_int = [&](Py_ssize_t v) { append(py::int_(v).ptr()); };
  append(handle);
  append_int(n_in);
  for (Py_ssize_t k = 0; k < n_in; ++k) append(PyList_GET_ITEM(in_ids, k));
  append_int(n_out);
  for (Py_ssize_t k = 0; k < n_out; ++k) {
    PyObject* o = PyList_GET_ITEM(out_ids, k);
    append(o);
    if (PySet_Add(c.produced.ptr(), o) < 0 || PySet_Discard(c.dropped.ptr(), o) < 0) throw py::error_already_set();
  }
  c.ops.append(py::make_tuple(py::handle(op), py::handle(site)));
  return true;
}

bool add(py::tuple chain, py::object handle, py::object op, py::list in_ids, py::list out_ids, py::object site) {
  ChainRefs c = refs_of(chain);
  return chain_add(c, handle.ptr(), op.ptr(), in_ids.ptr(), out_ids.ptr(), site.ptr());
}

// ``NativeChain.free``: a ``Free`` inside the chain. The blobs of ``ids`` go at once; the tensors the chain made or
// read of those ids go at this point of the chain (a free step), and what it made of them is not published.
void chain_free(ChainRefs& c, PyObject* ids) {
  py::list gone;
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(ids, "a Free's operand ids"));
  if (!seq) throw py::error_already_set();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* i = PySequence_Fast_GET_ITEM(seq.ptr(), k);
    int made = PySet_Contains(c.produced.ptr(), i);
    if (made < 0) throw py::error_already_set();
    if (made) {
      if (PySet_Add(c.dropped.ptr(), i) < 0) throw py::error_already_set();
      gone.append(py::handle(i));
    } else {
      int read = PyDict_Contains(c.ext.ptr(), i);
      if (read < 0) throw py::error_already_set();
      if (read) gone.append(py::handle(i));  // (its blob goes now; the chain holds the tensor until this point)
    }
    drop_blob(c.blobs, i);
  }
  Py_ssize_t n_gone = PyList_GET_SIZE(gone.ptr());
  if (n_gone) {  // the native loop drops them at this point of the chain, not at its end
    c.steps.append(kFreeStep);
    c.steps.append(n_gone);
    for (Py_ssize_t k = 0; k < n_gone; ++k) c.steps.append(py::handle(PyList_GET_ITEM(gone.ptr(), k)));
  }
}

void free_ids(py::tuple chain, py::object ids) {
  ChainRefs c = refs_of(chain);
  chain_free(c, ids.ptr());
}

// The ids of ``operands`` (a list of operands or ``None``s), ``None``s left out.
py::list ids_of(PyObject* operands) {
  static PyObject* s_id = interned("id");
  if (!PyList_Check(operands)) throw py::type_error("a FastRun's inputs/outputs must be a list");
  Py_ssize_t n = PyList_GET_SIZE(operands);
  py::list out;
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* x = PyList_GET_ITEM(operands, k);
    if (x == Py_None) continue;
    out.append(attr(x, s_id));
  }
  return out;
}

// ``Worker.run_batch``'s hot lane from ``batch[start]``: queue every consecutive ``FastRun`` whose plan this worker
// resolved to a native call (``resolved[key]``, ``key`` the plan or ``key_of(run)`` for a plan whose constants vary)
// onto the chain, and every ``Free`` while the chain holds ops (``chain_free``); runs for other devices are skipped.
// Stops at the first instruction it cannot queue (another type, an unresolved plan, a plan with moves, one
// ``replayable(plan, checked)`` rejects, an input the chain cannot read). Returns ``(its index, ops queued)``.
py::tuple queue_runs(py::tuple chain, py::object batch, int64_t start, py::handle fastrun, py::handle free_type,
                     py::dict resolved, py::set checked, py::object replayable, py::object key_of,
                     py::handle unresolved, py::object device) {
  static PyObject* s_plan = interned("plan");
  static PyObject* s_varies = interned("varies");
  static PyObject* s_native = interned("native");
  static PyObject* s_nmoves = interned("nmoves");
  static PyObject* s_assign = interned("assign");
  static PyObject* s_devices = interned("devices");
  static PyObject* s_inputs = interned("inputs");
  static PyObject* s_outputs = interned("outputs");
  static PyObject* s_op = interned("op");
  static PyObject* s_site = interned("call_site");
  static PyObject* s_ids = interned("operand_ids");
  ChainRefs c = refs_of(chain);
  // a list or tuple as is (the thread runner's batches are tuples)
  py::object items = py::reinterpret_steal<py::object>(PySequence_Fast(batch.ptr(), "a batch"));
  if (!items) throw py::error_already_set();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(items.ptr());
  Py_ssize_t i = static_cast<Py_ssize_t>(start);
  int64_t queued = 0;
  for (; i < n; ++i) {
    PyObject* run = PySequence_Fast_GET_ITEM(items.ptr(), i);
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(run));
    if (type == free_type.ptr() && PyList_GET_SIZE(c.ops.ptr()) > 0) {  // a Free inside the chain
      chain_free(c, attr(run, s_ids).ptr());
      continue;
    }
    if (type != fastrun.ptr()) break;
    py::object plan = attr(run, s_plan);
    int varies = PyObject_IsTrue(attr(plan.ptr(), s_varies).ptr());
    if (varies < 0) throw py::error_already_set();
    py::object key = varies ? key_of(py::handle(run)) : plan;
    PyObject* call = PyDict_GetItemWithError(resolved.ptr(), key.ptr());  // borrowed
    if (call == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      break;
    }
    if (call == Py_None || call == unresolved.ptr()) break;
    py::object native = attr(call, s_native);
    if (PyLong_AsLongLong(native.ptr()) < 0) {
      if (PyErr_Occurred()) throw py::error_already_set();
      break;
    }
    int moves = PyObject_IsTrue(attr(plan.ptr(), s_nmoves).ptr());
    if (moves < 0) throw py::error_already_set();
    if (moves) break;
    int known = PySet_Contains(checked.ptr(), plan.ptr());
    if (known < 0) throw py::error_already_set();
    if (!known && !replayable(plan, checked).cast<bool>()) break;
    py::object devices = attr(attr(plan.ptr(), s_assign).ptr(), s_devices);
    int here = PySequence_Contains(devices.ptr(), device.ptr());
    if (here < 0) throw py::error_already_set();
    if (!here) continue;  // not a device of this op
    py::list in_ids = ids_of(attr(run, s_inputs).ptr());
    py::list out_ids = ids_of(attr(run, s_outputs).ptr());
    if (!chain_add(c, native.ptr(), attr(plan.ptr(), s_op).ptr(), in_ids.ptr(), out_ids.ptr(),
                   attr(run, s_site).ptr())) {
      break;
    }
    ++queued;
  }
  return py::make_tuple(static_cast<int64_t>(i), queued);
}

// ``words.append(v)`` for a C integer
void append_int(PyObject* words, int64_t v) {
  PyObject* o = PyLong_FromLongLong(v);
  if (o == nullptr) throw py::error_already_set();
  int r = PyList_Append(words, o);
  Py_DECREF(o);
  if (r < 0) throw py::error_already_set();
}

// Process mode's controller lane (cluster/codec/hits.py, ``HitEncoding``), the twin of ``queue_records``: from
// ``batch[start]``, append to ``words`` the hit record (``hid << 2, first operator id, first output id, slot
// ids...``; an absent slot is -1) of every ``FastRun`` whose template the decoders know (``hit_table[plan]``) and
// whose inputs they know (``known[id] is operand``), registering its outputs in ``known``, and the free record
// (``n << 2 | free_kind, ids...``) of every ``Free``, dropping its ids from ``known``. Stops at the first
// instruction it cannot encode — another type, a call site, Python-path arguments, an output that requires grad,
// an input or template the decoders do not know yet — and returns its index (``HitEncoding._hit`` takes it).
int64_t encode_hits(py::object batch, int64_t start, py::handle fastrun, py::handle free_type, py::dict known,
                    py::dict hit_table, py::list words, int64_t free_kind) {
  static PyObject* s_plan = interned("plan");
  static PyObject* s_args = interned("args");
  static PyObject* s_site = interned("call_site");
  static PyObject* s_inputs = interned("inputs");
  static PyObject* s_outputs = interned("outputs");
  static PyObject* s_first_op = interned("first_op");
  static PyObject* s_first_id = interned("first_id");
  static PyObject* s_ids = interned("operand_ids");
  static PyObject* s_id = interned("id");
  static PyObject* s_grad = interned("requires_grad");
  py::object items = py::reinterpret_steal<py::object>(PySequence_Fast(batch.ptr(), "a batch"));
  if (!items) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items.ptr());
  PyObject* w = words.ptr();
  PyObject* k = known.ptr();
  std::vector<py::object> ids;  // the slots' ids (None: absent), kept alive until appended
  Py_ssize_t i = static_cast<Py_ssize_t>(start);
  for (; i < n; ++i) {
    PyObject* run = PySequence_Fast_GET_ITEM(items.ptr(), i);
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(run));
    if (type == free_type.ptr()) {
      py::object fids = attr(run, s_ids);
      if (!PyList_Check(fids.ptr())) break;
      const Py_ssize_t m = PyList_GET_SIZE(fids.ptr());
      if (m == 0) continue;
      for (Py_ssize_t q = 0; q < m; ++q) drop_blob(known, PyList_GET_ITEM(fids.ptr(), q));
      append_int(w, (static_cast<int64_t>(m) << 2) | free_kind);
      for (Py_ssize_t q = 0; q < m; ++q) {
        if (PyList_Append(w, PyList_GET_ITEM(fids.ptr(), q)) < 0) throw py::error_already_set();
      }
      continue;
    }
    if (type != fastrun.ptr()) break;
    if (attr(run, s_site).ptr() != Py_None || attr(run, s_args).ptr() != Py_None) break;
    py::object outs = attr(run, s_outputs);
    py::object ins = attr(run, s_inputs);
    if (!PyList_Check(outs.ptr()) || !PyList_Check(ins.ptr())) break;
    bool ok = true;
    const Py_ssize_t n_out = PyList_GET_SIZE(outs.ptr());
    for (Py_ssize_t q = 0; q < n_out && ok; ++q) {
      int g = PyObject_IsTrue(attr(PyList_GET_ITEM(outs.ptr(), q), s_grad).ptr());
      if (g < 0) throw py::error_already_set();
      ok = g == 0;  // outputs that require grad key their template by the flags: the Python encoder's
    }
    if (!ok) break;
    ids.clear();
    const Py_ssize_t n_in = PyList_GET_SIZE(ins.ptr());
    for (Py_ssize_t q = 0; q < n_in && ok; ++q) {
      PyObject* x = PyList_GET_ITEM(ins.ptr(), q);
      if (x == Py_None) {
        ids.push_back(py::none());
        continue;
      }
      py::object xid = attr(x, s_id);
      PyObject* got = PyDict_GetItemWithError(k, xid.ptr());  // borrowed
      if (got == nullptr && PyErr_Occurred()) throw py::error_already_set();
      ok = got == x;  // else an input the decoder does not know: the JSON path defines it
      ids.push_back(std::move(xid));
    }
    if (!ok) break;
    py::object plan = attr(run, s_plan);
    PyObject* hid = PyDict_GetItemWithError(hit_table.ptr(), plan.ptr());  // borrowed
    if (hid == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      break;  // the template's first hit: the Python encoder defines it
    }
    const int64_t h = PyLong_AsLongLong(hid);
    if (h == -1 && PyErr_Occurred()) throw py::error_already_set();
    append_int(w, h << 2);
    if (PyList_Append(w, attr(run, s_first_op).ptr()) < 0 || PyList_Append(w, attr(run, s_first_id).ptr()) < 0) {
      throw py::error_already_set();
    }
    for (const py::object& x : ids) {
      if (x.is_none()) {
        append_int(w, -1);
      } else if (PyList_Append(w, x.ptr()) < 0) {
        throw py::error_already_set();
      }
    }
    for (Py_ssize_t q = 0; q < n_out; ++q) {
      PyObject* o = PyList_GET_ITEM(outs.ptr(), q);
      if (PyDict_SetItem(k, attr(o, s_id).ptr(), o) < 0) throw py::error_already_set();
    }
  }
  return static_cast<int64_t>(i);
}

// Process mode's hit records (cluster/codec/hit_worker.py): from word ``p`` to ``end`` of a batch's hit frame
// (``words``, a list of ints), queue every hit record whose template (``hts[w >> 2]``) this worker resolved to a
// native call (``resolved[template.tm]``) onto the chain, skip records of other devices, and apply every free record
// (kind ``free_kind``: ``chain_free`` while the chain holds ops, else the blobs go). A hit record is
// ``w, node id, first output id, slot ids...`` (an absent slot is -1). Stops at the first hit it cannot queue.
// Returns ``(word index of that record, ops queued)``.
py::tuple queue_records(py::tuple chain, py::list words, int64_t p, int64_t end, py::list hts, py::dict resolved,
                        int64_t device, int64_t free_kind) {
  static PyObject* s_tm = interned("tm");
  static PyObject* s_native = interned("native");
  static PyObject* s_op = interned("op");
  static PyObject* s_devices = interned("devices");
  static PyObject* s_n_slots = interned("n_slots");
  static PyObject* s_dense = interned("dense");
  static PyObject* s_n_out = interned("n_out");
  ChainRefs c = refs_of(chain);
  PyObject* w_list = words.ptr();
  if (end > PyList_GET_SIZE(w_list) || p < 0) throw py::index_error("hit records past the hit frame");
  auto word = [&](int64_t at) -> int64_t {
    int64_t v = PyLong_AsLongLong(PyList_GET_ITEM(w_list, at));
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    return v;
  };
  py::int_ dev(device);
  int64_t queued = 0;
  while (p < end) {
    int64_t w = word(p);
    if ((w & 3) == free_kind) {
      int64_t q = p + 1 + (w >> 2);
      if (q > end) throw py::index_error("a free record past its hit run");
      py::list ids;
      for (int64_t k = p + 1; k < q; ++k) ids.append(py::handle(PyList_GET_ITEM(w_list, k)));
      if (PyList_GET_SIZE(c.ops.ptr()) > 0) {
        chain_free(c, ids.ptr());
      } else {
        for (int64_t k = p + 1; k < q; ++k) drop_blob(c.blobs, PyList_GET_ITEM(w_list, k));
      }
      p = q;
      continue;
    }
    PyObject* ht = PyList_GetItem(hts.ptr(), static_cast<Py_ssize_t>(w >> 2));  // borrowed; checked index
    if (ht == nullptr) throw py::error_already_set();
    int64_t n_slots = attr(ht, s_n_slots).cast<int64_t>();
    int64_t q = p + 3 + n_slots;
    if (q > end) throw py::index_error("a hit record past its hit run");
    int here = PySequence_Contains(attr(ht, s_devices).ptr(), dev.ptr());
    if (here < 0) throw py::error_already_set();
    if (!here) {
      p = q;
      continue;
    }
    PyObject* call = PyDict_GetItemWithError(resolved.ptr(), attr(ht, s_tm).ptr());  // borrowed
    if (call == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      break;
    }
    if (call == Py_None) break;
    py::object native = attr(call, s_native);
    if (native.cast<int64_t>() < 0) break;
    bool dense = attr(ht, s_dense).cast<bool>();
    py::list ins;
    for (int64_t k = p + 3; k < q; ++k) {
      PyObject* i = PyList_GET_ITEM(w_list, k);
      if (!dense && word(k) < 0) continue;  // an absent slot
      ins.append(py::handle(i));
    }
    int64_t first = word(p + 2);
    int64_t n_out = attr(ht, s_n_out).cast<int64_t>();
    py::list outs;
    for (int64_t o = 0; o < n_out; ++o) outs.append(py::int_(first + o));
    if (!chain_add(c, native.ptr(), attr(ht, s_op).ptr(), ins.ptr(), outs.ptr(), Py_None)) break;
    ++queued;
    p = q;
  }
  return py::make_tuple(p, queued);
}

std::string name_of(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_calls.at(static_cast<size_t>(handle)).name;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("resolve", &resolve);
  m.def("run_chain", &run_chain);
  m.def("name_of", &name_of);
  m.def("release", &release);
  m.def("live", &live);
  m.def("add", &add);
  m.def("queue_runs", &queue_runs);
  m.def("free", &free_ids);
  m.def("queue_records", &queue_records);
  m.def("encode_hits", &encode_hits);
  m.def("take_peak", []() { return py::make_tuple(g_peak.exchange(0), g_end.exchange(0)); });
}
