// Eager replay of recorded calls: the C side of openkernels.shared.replay (see replay.py).
//
// A Table belongs to one public function. `table.call(args, kwargs)` builds a key from the
// call's arguments (tensors by dtype, device, sizes, strides and 16-byte alignment; None,
// bools, ints, floats, dtypes and tuples of them by value; keyword names by identity) plus
// the CPU thread count and the current CUDA device. On a hit it allocates the recorded
// outputs, fills each recorded launch's argument slots with the pointers of this call's
// tensors and runs the launches: a CPU kernel's packed entry (`int f(const int64_t*)`) or a
// compiled Triton kernel through cuLaunchKernelEx on the current stream. It returns the
// outputs, or MISS (record this call: the second with its key) or SKIP (run the Python path:
// the key's first call, a refused key, or a call that cannot be replayed: autograd, a tensor
// subclass, an argument of another type). No Python runs on a hit.
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

// ---- the CUDA driver entry, found at run time (no CUDA headers or libraries at build time)
struct LaunchConfig {  // CUlaunchConfig's layout
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
  void* stream;
  void* attrs;
  unsigned num_attrs;
};
struct LaunchAttr {  // CUlaunchAttribute: id, padding, a 64-byte value union
  int id;
  char pad[4];
  union {
    char bytes[64];
    int value;
    struct {
      unsigned x, y, z;
    } cluster;
  } v;
};
static_assert(sizeof(LaunchAttr) == 72, "CUlaunchAttribute is 72 bytes");
static_assert(offsetof(LaunchConfig, stream) == 32 && sizeof(LaunchConfig) == 56, "CUlaunchConfig's layout");
constexpr int kAttrCooperative = 2, kAttrClusterDim = 4, kAttrClusterPolicy = 5, kAttrPdl = 6;
using LaunchEx = int (*)(const LaunchConfig*, void*, void**, void**);
using CtxGetCurrent = int (*)(void**);
using CtxSetCurrent = int (*)(void*);
using PrimaryCtxRetain = int (*)(void**, int);
using DeviceGet = int (*)(int*, int);
// cuTensorMapEncodeTiled: (map, dtype, rank, address, dims, byte strides, box, element
// strides, interleave, swizzle, L2 promotion, out-of-bounds fill), enums passed as ints.
using EncodeTiled = int (*)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                            const uint32_t*, int, int, int, int);
LaunchEx launch_ex = nullptr;
EncodeTiled encode_tiled = nullptr;  // null: launches with tensor maps are not recorded
CtxGetCurrent ctx_get_current = nullptr;
CtxSetCurrent ctx_set_current = nullptr;
PrimaryCtxRetain primary_ctx_retain = nullptr;
DeviceGet device_get = nullptr;

bool load_driver() {
  if (launch_ex) return true;
  void* handle = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (!handle) handle = dlopen("libcuda.so.1", RTLD_LAZY);
  if (!handle) return false;
  ctx_get_current = reinterpret_cast<CtxGetCurrent>(dlsym(handle, "cuCtxGetCurrent"));
  ctx_set_current = reinterpret_cast<CtxSetCurrent>(dlsym(handle, "cuCtxSetCurrent"));
  primary_ctx_retain = reinterpret_cast<PrimaryCtxRetain>(dlsym(handle, "cuDevicePrimaryCtxRetain"));
  device_get = reinterpret_cast<DeviceGet>(dlsym(handle, "cuDeviceGet"));
  if (!ctx_get_current || !ctx_set_current || !primary_ctx_retain || !device_get) return false;
  encode_tiled = reinterpret_cast<EncodeTiled>(dlsym(handle, "cuTensorMapEncodeTiled"));
  launch_ex = reinterpret_cast<LaunchEx>(dlsym(handle, "cuLaunchKernelEx"));
  return launch_ex != nullptr;
}

// The driver launches on the calling thread's current context. A thread that has made no
// CUDA runtime call has none (autograd's device thread for GPU 0 never calls cudaSetDevice:
// it is already the runtime's current device), so bind the device's primary context, the
// one the runtime and torch use.
bool ensure_context(c10::DeviceIndex device) {
  void* ctx = nullptr;
  if (ctx_get_current(&ctx) != 0) return false;
  if (ctx) return true;
  int handle = 0;
  return device_get(&handle, device) == 0 && primary_ctx_retain(&ctx, handle) == 0 && ctx_set_current(ctx) == 0;
}

bool allow_cuda = false;  // replay calls with CUDA tensors (set_cuda)

// ---- keys
enum Tag : int64_t { kTensor = 1, kNone, kBool, kInt, kFloat, kDtype, kTuple, kKwarg, kEnd, kStr };

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return h;
  }
};

// Appends `obj` to the key, its tensors to `tensors`; false when it cannot be replayed.
bool add_value(PyObject* obj, std::vector<int64_t>& key, std::vector<const at::Tensor*>& tensors, bool& cuda,
               int depth = 0) {
  if (THPVariable_CheckExact(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided || t.is_conj() || t.is_neg()) return false;
    const auto device = t.device();
    if (device.type() != c10::kCPU && device.type() != c10::kCUDA) return false;
    if (device.type() == c10::kCUDA && !allow_cuda) return false;  // not replayed: fail early
    cuda = cuda || device.type() == c10::kCUDA;
    key.push_back(kTensor);
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(device.type()) * 1024 + device.index());
    key.push_back(t.dim());
    for (int64_t s : t.sizes()) key.push_back(s);
    for (int64_t s : t.strides()) key.push_back(s);
    key.push_back((reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0);
    key.push_back(t.requires_grad() && at::GradMode::is_enabled());  // a call under autograd
    tensors.push_back(&t);
    return true;
  }
  if (obj == Py_None) {
    key.push_back(kNone);
    return true;
  }
  if (PyBool_Check(obj)) {
    key.push_back(kBool);
    key.push_back(obj == Py_True);
    return true;
  }
  if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    key.push_back(kInt);
    key.push_back(v);
    return true;
  }
  if (PyFloat_CheckExact(obj)) {
    double d = PyFloat_AS_DOUBLE(obj);
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    key.push_back(kFloat);
    key.push_back(bits);
    return true;
  }
  if (THPDtype_Check(obj)) {
    key.push_back(kDtype);
    key.push_back(static_cast<int64_t>(reinterpret_cast<THPDtype*>(obj)->scalar_type));
    return true;
  }
  if (PyUnicode_CheckExact(obj)) {  // by identity: the table holds every string its keys name
    key.push_back(kStr);
    key.push_back(reinterpret_cast<int64_t>(obj));
    return true;
  }
  if (PyTuple_CheckExact(obj) && depth < 2) {
    const Py_ssize_t n = PyTuple_GET_SIZE(obj);
    key.push_back(kTuple);
    key.push_back(n);
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!add_value(PyTuple_GET_ITEM(obj, i), key, tensors, cuda, depth + 1)) return false;
    return true;
  }
  return false;
}

// ---- entries
enum SlotKind : int { kConst = 0, kInput = 1, kOutput = 2 };
struct Slot {
  int kind;
  int index;     // input tensor (in key order) or output
  int64_t bits;  // the constant; a tensor map's index in Launch::maps
  int size;      // bytes in a CUDA kernel's parameter (CPU slots are 8); kTensorMapBytes: a
                 // CUtensorMap over that tensor, encoded per call
};
constexpr int kTensorMapBytes = 128, kMaxTensorMaps = 4;
// A host TMA descriptor's encoding but for its address (replay.py, `_tensor_map_slots`):
// driver dtype, rank, swizzle, out-of-bounds fill, dims[rank] (innermost first), byte
// strides[rank - 1], box[rank].
struct TensorMapSpec {
  int dtype = 0, swizzle = 0, fill = 0;
  unsigned rank = 0;
  uint64_t dims[5] = {}, strides[5] = {};
  uint32_t box[5] = {};
};
struct Launch {
  bool cuda;
  void* fn;  // CPU: int (*)(const int64_t*); CUDA: CUfunction
  unsigned grid[3];
  int num_warps, num_ctas, shared, cooperative, pdl;
  std::vector<Slot> slots;
  std::vector<TensorMapSpec> maps;
};
struct Output {
  int alias;  // -1: a new tensor; else this input is returned as is
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  c10::Device device{c10::kCPU};
};
// A CPU call whose body also computes with aten ops replays as a program: every aten op it
// ran (views, allocations and computations), called again through the dispatcher, and its
// kernel launches, in the recorded order, over a table of values (the call's tensors, then
// each op's tensor outputs). See replay.py, `_program`.
struct TensorArg {
  int position;  // in the op's argument stack
  std::vector<int> values;  // one value index; several for a Tensor[] argument
  bool list;
};
struct Step {
  bool aten = true;
  std::optional<c10::OperatorHandle> op;
  std::vector<c10::IValue> args;  // the stack, tensors left as None
  std::vector<TensorArg> tensors;
  std::vector<int> outputs;  // the value index of each returned tensor (-1: not kept)
  size_t launch = 0;         // a launch step: the entry's launch, its slots over values
};

struct GradPlan;
struct Entry {
  std::vector<Output> outputs;  // what the launches use: results and scratch
  std::vector<int> returns;     // the outputs returned, in order (a backward: -1 for no gradient)
  bool tuple = false;           // return a tuple (else the one output)
  bool skip = false;            // recorded as not replayable: the Python path runs
  std::vector<Launch> launches;
  std::shared_ptr<GradPlan> grad;  // a call under autograd: the graph node its results get
  std::vector<Step> program;       // a CPU call with aten computations (empty: none)
  int n_values = 0;                // the program's value table
};

// Allocates an entry's outputs (aliases: the inputs themselves) and runs its launches with
// the GIL released; false when a launch failed.
bool run_entry(const Entry& entry, const std::vector<const at::Tensor*>& inputs, std::vector<at::Tensor>& outputs,
               c10::Device device);

// A program entry's replay over `inputs` into `values`: "" or why it failed (no exception leaves).
std::string run_program(const Entry& entry, const std::vector<const at::Tensor*>& inputs,
                        std::vector<at::Tensor>& values) noexcept;

// ---- autograd: the node a replayed call under autograd gives its results
//
// Recorded from one call of an openkernels autograd.Function (replay.py, `_grad_plan`): which
// results are differentiable, which arguments the gradients flow to, what the forward saves
// (arguments or its own buffers) and the backward as an entry of its own, recorded on the
// saved tensors and a dense gradient per differentiable result. A backward whose gradients
// differ from the recorded ones (missing, other strides or alignment, a double backward)
// calls the Python backward instead (`fallback`), as the Python path would have run it.
// A CPU op whose bodies compute with aten ops has programs for both: the forward's saved
// buffers and results index its value table, the backward is a program of its own.
struct GradMeta {
  bool present = false;  // the recorded backward took a gradient for this result
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat;
  bool aligned = true;
};
struct SavedRef {
  int kind;   // kInput: an argument tensor (key order); kOutput: a forward output buffer
  int index;
  bool output;  // a differentiable result of the node (saved without a reference cycle)
};
struct GradPlan {
  std::vector<char> differentiable;  // per returned result
  std::vector<int> edges;            // argument tensors (key order) the gradients flow to
  std::vector<SavedRef> saved;
  std::vector<GradMeta> grads;  // per returned result
  Entry backward;               // inputs: the saved tensors, then the present gradients
  bool materialize = true;      // the op's backward takes zeros for a missing gradient
  PyObject* fallback = nullptr;  // (saved: tuple, grads: tuple) -> one gradient or None per edge
  std::string name;
  ~GradPlan() {
    if (fallback && Py_IsInitialized()) {
      PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(fallback);
      PyGILState_Release(state);
    }
  }
};

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
// torch holds nodes in std::shared_ptr (up to 2.12) or c10::intrusive_ptr (2.13 on).
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T>
NodePtr make_node(std::shared_ptr<GradPlan> plan, c10::Device device) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) return std::make_shared<T>(std::move(plan), device);
  else return c10::make_intrusive<T>(std::move(plan), device);
}

bool grad_matches(const at::Tensor& g, const GradMeta& m) {
  return g.scalar_type() == m.dtype && g.sizes().equals(m.sizes) && g.strides().equals(m.strides) &&
         ((reinterpret_cast<uintptr_t>(g.data_ptr()) & 15) == 0) == m.aligned;
}

struct ReplayNode : Node {
  ReplayNode(std::shared_ptr<GradPlan> plan, c10::Device device) : plan_(std::move(plan)), device_(device) {}

  std::string name() const override { return plan_->name; }

  void release_variables() override {
    for (SavedVariable& s : saved_) s.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const GradPlan& plan = *plan_;
    std::vector<at::Tensor> inputs;  // the saved tensors, then the present gradients
    inputs.reserve(saved_.size() + grads.size());
    for (const SavedVariable& s : saved_) inputs.push_back(s.unpack(getptr()));  // raises once freed
    const size_t n_saved = inputs.size();
    // A backward that builds a graph (create_graph=True) takes the Python path, whose library
    // op says that double backward is not supported.
    bool recorded = !at::GradMode::is_enabled() && grads.size() == plan.grads.size();
    for (size_t i = 0; recorded && i < grads.size(); ++i) {
      const GradMeta& m = plan.grads[i];
      at::Tensor g = grads[i];
      if (m.present && !g.defined() && zeros_stand_in(plan, m)) {
        g = at::empty_strided(m.sizes, m.strides, at::TensorOptions(m.dtype).device(device_)).zero_();
      } else if (!m.present || !g.defined()) {
        recorded = !m.present && !g.defined();
        continue;
      }
      // The Python path makes a broadcast gradient (`y.sum().backward()`) dense the same way.
      for (int64_t stride : g.strides())
        if (stride == 0) {
          g = g.contiguous();
          break;
        }
      recorded = grad_matches(g, m);
      inputs.push_back(std::move(g));
    }
    if (!recorded) return python_backward(inputs, n_saved, grads);
    std::vector<const at::Tensor*> pointers;
    pointers.reserve(inputs.size());
    for (const at::Tensor& t : inputs) pointers.push_back(&t);
    std::vector<at::Tensor> outputs;
    if (!plan.backward.program.empty()) {
      const std::string failure = run_program(plan.backward, pointers, outputs);
      if (!failure.empty()) throw std::runtime_error(failure);
    } else if (!run_entry(plan.backward, pointers, outputs, device_)) {
      throw std::runtime_error("openkernels replay: a recorded backward launch failed");
    }
    variable_list result(plan.edges.size());
    for (size_t e = 0; e < result.size(); ++e)
      if (plan.backward.returns[e] >= 0) result[e] = outputs[plan.backward.returns[e]];
    return result;
  }

  std::vector<SavedVariable> saved_;

 private:
  // A result whose gradient is missing (`y.sum().backward()` on one of prenorm's two results)
  // gets zeros where the Python path would compute the same: always for an op whose backward
  // materializes missing gradients as zeros itself; for the others (which skip the term) when
  // the zeros are small, where the Python backward costs more than filling and reading them.
  static bool zeros_stand_in(const GradPlan& plan, const GradMeta& m) {
    if (plan.materialize) return true;
    int64_t bytes = c10::elementSize(m.dtype);
    for (int64_t size : m.sizes) bytes *= size;
    return bytes <= (int64_t(4) << 20);
  }

  variable_list python_backward(const std::vector<at::Tensor>& inputs, size_t n_saved, const variable_list& grads) {
    pybind11::gil_scoped_acquire gil;
    PyObject* saved = PyTuple_New(static_cast<Py_ssize_t>(n_saved));
    PyObject* given = saved ? PyTuple_New(static_cast<Py_ssize_t>(grads.size())) : nullptr;
    if (!given) {
      Py_XDECREF(saved);
      throw python_error();
    }
    for (size_t i = 0; i < n_saved; ++i) PyTuple_SET_ITEM(saved, i, THPVariable_Wrap(inputs[i]));
    for (size_t i = 0; i < grads.size(); ++i) {
      PyObject* g = grads[i].defined() ? THPVariable_Wrap(grads[i]) : (Py_INCREF(Py_None), Py_None);
      PyTuple_SET_ITEM(given, i, g);
    }
    PyObject* out = PyObject_CallFunctionObjArgs(plan_->fallback, saved, given, nullptr);
    Py_DECREF(saved);
    Py_DECREF(given);
    if (!out) throw python_error();
    variable_list result(plan_->edges.size());
    const bool ok = PyTuple_Check(out) && PyTuple_GET_SIZE(out) == static_cast<Py_ssize_t>(result.size());
    for (size_t e = 0; ok && e < result.size(); ++e) {
      PyObject* g = PyTuple_GET_ITEM(out, e);
      if (THPVariable_Check(g)) result[e] = THPVariable_Unpack(g);
    }
    Py_DECREF(out);
    if (!ok) throw std::runtime_error("openkernels replay: the Python backward returned a malformed result");
    return result;
  }

  std::shared_ptr<GradPlan> plan_;
  c10::Device device_;
};

// Gives a replayed call's results their graph node (as autograd.Function.apply would have).
void attach_node(const std::shared_ptr<GradPlan>& plan, const std::vector<const at::Tensor*>& inputs,
                 std::vector<at::Tensor>& outputs, const std::vector<int>& returns, c10::Device device) {
  NodePtr node = make_node<ReplayNode>(plan, device);
  torch::autograd::edge_list edges;
  edges.reserve(plan->edges.size());
  for (int i : plan->edges) edges.push_back(torch::autograd::impl::gradient_edge(*inputs[i]));
  node->set_next_edges(std::move(edges));
  for (size_t r = 0; r < returns.size(); ++r) {
    if (plan->differentiable[r]) torch::autograd::set_history(outputs[returns[r]], node);
    else node->add_input_metadata(Node::undefined_input());
  }
  auto* replay_node = static_cast<ReplayNode*>(node.get());
  replay_node->saved_.reserve(plan->saved.size());
  for (const SavedRef& s : plan->saved) {
    const at::Tensor& t = s.kind == kInput ? *inputs[s.index] : outputs[s.index];
    replay_node->saved_.emplace_back(t, s.output);
  }
}

struct TableObject {
  PyObject_HEAD std::unordered_map<std::vector<int64_t>, std::shared_ptr<Entry>, KeyHash>* entries;
  // Keys seen once: a key is recorded on its second call, so one-off shapes (a prefill of
  // each length, a test's shapes) never pay for a recording.
  std::unordered_set<std::vector<int64_t>, KeyHash>* seen;
  std::vector<PyObject*>* names;  // strings held: keyword names and str arguments (keys hold their addresses)
  Py_ssize_t limit;
  long long hits;
};

PyObject* miss_sentinel = nullptr;  // record this call
PyObject* skip_sentinel = nullptr;  // do not record

// The key of a call, or false (not replayable). cuda: a CUDA tensor is among the arguments.
bool build_key(PyObject* args, PyObject* kwargs, std::vector<int64_t>& key,
               std::vector<const at::Tensor*>& tensors, bool& cuda) {
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  key.reserve(64);
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!add_value(PyTuple_GET_ITEM(args, i), key, tensors, cuda)) return false;
  if (kwargs && PyDict_GET_SIZE(kwargs)) {
    PyObject *name, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &name, &value)) {
      key.push_back(kKwarg);
      key.push_back(reinterpret_cast<int64_t>(name));
      if (!add_value(value, key, tensors, cuda)) return false;
    }
  }
  key.push_back(kEnd);
  // Which tensors share an address: a recording passes the first one's pointer for all of
  // them, right only for calls that share the same way.
  for (size_t i = 0; i < tensors.size(); ++i) {
    const void* ptr = tensors[i]->data_ptr();
    int64_t first = -1;
    for (size_t j = 0; j < i && first < 0 && ptr; ++j)
      if (tensors[j]->data_ptr() == ptr) first = static_cast<int64_t>(j);
    key.push_back(first);
  }
  key.push_back(at::get_num_threads());
  if (cuda) {
    // The device and its current stream: a recording may hold per-stream scratch (quant's
    // split-K counters), valid only on the stream it was made for.
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
    const c10::Device device = impl->getDevice();
    key.push_back(device.index());
    key.push_back(impl->getStream(device).id());
  }
  return true;
}

// A call's (args, kwargs) as the methods take them: checks the arguments (a TypeError with
// `usage` when malformed: returns -1), then builds the key (0: the call has none, 1: built).
struct CallKey {
  std::vector<int64_t> key;
  std::vector<const at::Tensor*> tensors;
  bool cuda = false;
};

int call_key(PyObject* const* argv, Py_ssize_t argc, Py_ssize_t expected, const char* usage, CallKey& out) {
  if (argc != expected || !PyTuple_CheckExact(argv[0]) || (argv[1] != Py_None && !PyDict_CheckExact(argv[1]))) {
    PyErr_SetString(PyExc_TypeError, usage);
    return -1;
  }
  return build_key(argv[0], argv[1] == Py_None ? nullptr : argv[1], out.key, out.tensors, out.cuda) ? 1 : 0;
}

bool run_launch(const Launch& launch, const std::vector<const at::Tensor*>& inputs,
                const std::vector<at::Tensor>& outputs, c10::Device device) {
  int64_t values[64];
  void* params[66];
  struct alignas(64) TensorMap {  // CUtensorMap: 128 bytes, 64-byte aligned
    unsigned char bytes[kTensorMapBytes];
  } maps[kMaxTensorMaps];
  const size_t n = launch.slots.size();
  if (n > 64) return false;
  for (size_t i = 0; i < n; ++i) {
    const Slot& s = launch.slots[i];
    if (s.kind == kInput) values[i] = reinterpret_cast<int64_t>(inputs[s.index]->data_ptr());
    else if (s.kind == kOutput) values[i] = reinterpret_cast<int64_t>(outputs[s.index].data_ptr());
    else values[i] = s.bits;
  }
  if (!launch.cuda) return reinterpret_cast<int (*)(const int64_t*)>(launch.fn)(values) == 0;
  // Little-endian: a 4- or 2-byte parameter is the low bytes of its 8-byte slot.
  for (size_t i = 0; i < n; ++i) params[i] = &values[i];
  for (size_t i = 0; i < n; ++i) {  // tensor maps over this call's tensors, as Triton's launcher encodes them
    const Slot& s = launch.slots[i];
    if (s.size != kTensorMapBytes) continue;
    const TensorMapSpec& m = launch.maps[static_cast<size_t>(s.bits)];
    const uint32_t element_strides[5] = {1, 1, 1, 1, 1};
    TensorMap& map = maps[s.bits];
    if (!encode_tiled || encode_tiled(map.bytes, m.dtype, m.rank, reinterpret_cast<void*>(values[i]), m.dims,
                                      m.strides, m.box, element_strides, 0 /* interleave none */, m.swizzle,
                                      2 /* L2 promotion 128B */, m.fill) != 0)
      return false;
    params[i] = map.bytes;
  }
  int64_t scratch = 0;  // global and profile scratch: kernels that need them are not recorded
  params[n] = &scratch;
  params[n + 1] = &scratch;
  auto stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device);
  LaunchAttr attrs[4];
  std::memset(attrs, 0, sizeof attrs);
  unsigned count = 0;
  if (launch.pdl) {
    attrs[count].id = kAttrPdl;
    attrs[count++].v.value = 1;
  }
  if (launch.cooperative) {
    attrs[count].id = kAttrCooperative;
    attrs[count++].v.value = 1;
  }
  if (launch.num_ctas != 1) {
    attrs[count].id = kAttrClusterDim;
    attrs[count++].v.cluster = {static_cast<unsigned>(launch.num_ctas), 1, 1};
    attrs[count].id = kAttrClusterPolicy;
    attrs[count++].v.value = 1;  // CU_CLUSTER_SCHEDULING_POLICY_SPREAD
  }
  LaunchConfig config{launch.grid[0] * static_cast<unsigned>(launch.num_ctas), launch.grid[1], launch.grid[2],
                      32u * static_cast<unsigned>(launch.num_warps), 1, 1, static_cast<unsigned>(launch.shared),
                      stream.native_handle(), attrs, count};
  if (launch.grid[0] * launch.grid[1] * launch.grid[2] == 0) return true;
  return launch_ex(&config, launch.fn, params, nullptr) == 0;
}

bool run_entry(const Entry& entry, const std::vector<const at::Tensor*>& inputs, std::vector<at::Tensor>& outputs,
               c10::Device device) {
  try {  // no exception may leave: the forward calls this with the GIL released
    outputs.reserve(entry.outputs.size());
    for (const Output& out : entry.outputs) {
      if (out.alias >= 0) outputs.push_back(*inputs[out.alias]);
      else
        outputs.push_back(at::empty_strided(out.sizes, out.strides, at::TensorOptions(out.dtype).device(out.device)));
    }
    bool context = false;
    for (const Launch& launch : entry.launches) {
      if (launch.cuda && !context && !(context = ensure_context(device.index()))) return false;
      if (!run_launch(launch, inputs, outputs, device)) return false;
    }
    return true;
  } catch (...) {
    return false;
  }
}

bool run_steps(const Entry& entry, const std::vector<const at::Tensor*>& inputs, std::vector<at::Tensor>& values);

// A program entry's replay; called with the GIL released, as torch's own bindings call ops
// (a dispatch mode that reaches Python takes it again). Fills `values`; returns "" or why it
// failed (no exception may leave).
std::string run_program(const Entry& entry, const std::vector<const at::Tensor*>& inputs,
                        std::vector<at::Tensor>& values) noexcept {
  try {
    // Under autograd the bodies ran inside autograd.Function, with grad mode off: the ops
    // make plain tensors, and the call's node (attach_node) gives the results their graph.
    std::optional<at::NoGradGuard> no_grad;
    if (entry.grad) no_grad.emplace();
    return run_steps(entry, inputs, values) ? "" : "openkernels replay: a recorded launch failed";
  } catch (const std::exception& e) {
    return e.what();
  }
}

bool run_steps(const Entry& entry, const std::vector<const at::Tensor*>& inputs, std::vector<at::Tensor>& values) {
  values.assign(entry.n_values, at::Tensor());
  for (size_t i = 0; i < inputs.size(); ++i) values[i] = *inputs[i];
  const c10::Device cpu(c10::kCPU);
  for (const Step& step : entry.program) {
    if (!step.aten) {
      if (!run_launch(entry.launches[step.launch], inputs, values, cpu)) return false;
      continue;
    }
    torch::jit::Stack stack(step.args);
    for (const TensorArg& t : step.tensors) {
      if (!t.list) {
        stack[t.position] = values[t.values[0]];
        continue;
      }
      c10::List<at::Tensor> list;
      list.reserve(t.values.size());
      for (int v : t.values) list.push_back(values[v]);
      stack[t.position] = std::move(list);
    }
    step.op->callBoxed(&stack);
    for (size_t i = 0; i < step.outputs.size() && i < stack.size(); ++i) {
      if (step.outputs[i] < 0) continue;
      if (!stack[i].isTensor()) throw std::runtime_error("openkernels replay: an aten op returned no tensor");
      values[step.outputs[i]] = stack[i].toTensor();
    }
  }
  return true;
}

// The methods that take a call's (args, kwargs): body(key, keyed) with the call's key (keyed: 1, or 0
// when the call has none), after call_key's checks (their error: nullptr); a C++ exception from
// either becomes a RuntimeError.
template <class Body>
PyObject* with_call_key(PyObject* const* argv, Py_ssize_t argc, const char* usage, Body&& body) {
  try {
    CallKey k;
    const int keyed = call_key(argv, argc, 2, usage, k);
    if (keyed < 0) return nullptr;
    return body(k, keyed);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* table_call(TableObject* self, PyObject* const* argv, Py_ssize_t argc) {
  return with_call_key(argv, argc, "Table.call(args: tuple, kwargs: dict | None)", [&](CallKey& k, int keyed) -> PyObject* {
    if (keyed == 0 || (k.cuda && !allow_cuda)) {
      Py_INCREF(skip_sentinel);
      return skip_sentinel;
    }
    const bool cuda = k.cuda;
    const std::vector<const at::Tensor*>& tensors = k.tensors;
    auto found = self->entries->find(k.key);
    if (found == self->entries->end()) {
      if (self->seen->erase(k.key)) {  // its second call: record it
        Py_INCREF(miss_sentinel);
        return miss_sentinel;
      }
      if (static_cast<Py_ssize_t>(self->seen->size()) >= 16 * self->limit) self->seen->clear();
      self->seen->insert(std::move(k.key));
      Py_INCREF(skip_sentinel);
      return skip_sentinel;
    }
    const std::shared_ptr<Entry> held = found->second;  // alive while the GIL is released
    const Entry& entry = *held;
    if (entry.skip) {
      Py_INCREF(skip_sentinel);
      return skip_sentinel;
    }
    const c10::Device device = cuda ? c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice() : c10::Device(c10::kCPU);
    std::vector<at::Tensor> outputs;
    bool launched = true;
    std::string failure;
    Py_BEGIN_ALLOW_THREADS;  // as ctypes and Triton's launcher do: other threads run meanwhile
    if (!entry.program.empty()) failure = run_program(entry, tensors, outputs);
    else launched = run_entry(entry, tensors, outputs, device);
    Py_END_ALLOW_THREADS;
    if (!launched || !failure.empty()) {
      PyErr_SetString(PyExc_RuntimeError, failure.empty() ? "openkernels replay: a recorded launch failed" : failure.c_str());
      return nullptr;
    }
    if (entry.grad) attach_node(entry.grad, tensors, outputs, entry.returns, device);
    self->hits++;
    if (!entry.tuple && entry.returns.empty()) Py_RETURN_NONE;  // in place: the launches wrote its inputs
    if (!entry.tuple) return THPVariable_Wrap(outputs[entry.returns[0]]);
    PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(entry.returns.size()));
    if (!result) return nullptr;
    for (size_t i = 0; i < entry.returns.size(); ++i)
      PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), THPVariable_Wrap(outputs[entry.returns[i]]));
    return result;
  });
}

PyObject* store(TableObject* self, PyObject* args, PyObject* kwargs, std::vector<int64_t>&& key,
                std::shared_ptr<Entry>&& entry);

void hold(TableObject* self, PyObject* obj) {
  for (PyObject* n : *self->names)
    if (n == obj) return;
  Py_INCREF(obj);
  self->names->push_back(obj);
}

// Holds every string among `obj` (an argument, a tuple of arguments or a dict of keyword
// arguments and their names): keys name strings by address, so none may be freed and reused.
void hold_strings(TableObject* self, PyObject* obj, int depth = 0) {
  if (PyUnicode_CheckExact(obj)) {
    hold(self, obj);
  } else if (PyTuple_CheckExact(obj) && depth < 3) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); ++i) hold_strings(self, PyTuple_GET_ITEM(obj, i), depth + 1);
  } else if (PyDict_CheckExact(obj)) {
    PyObject *name, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(obj, &pos, &name, &value)) {
      hold(self, name);
      hold_strings(self, value, depth + 1);
    }
  }
}

// ---- recording: Table.add(args, kwargs, outputs, returns, is_tuple, launches)
// outputs: [(alias, sizes, strides, dtype, device_type, device_index)]
// launches: [(cuda, fn, (gx, gy, gz), num_warps, num_ctas, shared, cooperative, pdl,
//             [(kind, index, bits, size)])]
bool as_i64(PyObject* obj, int64_t& out) {
  out = PyLong_AsLongLong(obj);
  return !(out == -1 && PyErr_Occurred());
}

bool int_list(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence");
  if (!fast) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  bool ok = true;
  for (Py_ssize_t i = 0; i < n && ok; ++i) {
    int64_t v;
    ok = as_i64(PySequence_Fast_GET_ITEM(fast, i), v);
    out.push_back(v);
  }
  Py_DECREF(fast);
  return ok;
}

// A launch's tensor maps: [(dtype, rank, swizzle, fill, dims..., strides..., box...)], see
// TensorMapSpec. Needs the driver's encoder (a driver without it cannot run such kernels:
// Triton's own launcher encodes with it too).
bool parse_tensor_maps(PyObject* seq, std::vector<TensorMapSpec>& maps) {
  if (!load_driver() || !encode_tiled) return false;
  PyObject* fast = PySequence_Fast(seq, "tensor maps");
  if (!fast) return false;
  bool ok = PySequence_Fast_GET_SIZE(fast) <= kMaxTensorMaps;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); ++i) {
    std::vector<int64_t> v;
    ok = int_list(PySequence_Fast_GET_ITEM(fast, i), v) && v.size() >= 4;
    if (!ok) break;
    const int64_t rank = v[1];
    ok = rank >= 1 && rank <= 5 && v.size() == static_cast<size_t>(4 + 3 * rank - 1);
    if (!ok) break;
    TensorMapSpec m;
    m.dtype = static_cast<int>(v[0]);
    m.rank = static_cast<unsigned>(rank);
    m.swizzle = static_cast<int>(v[2]);
    m.fill = static_cast<int>(v[3]);
    for (int64_t d = 0; d < rank; ++d) m.dims[d] = static_cast<uint64_t>(v[4 + d]);
    for (int64_t d = 0; d + 1 < rank; ++d) m.strides[d] = static_cast<uint64_t>(v[4 + rank + d]);
    for (int64_t d = 0; d < rank; ++d) m.box[d] = static_cast<uint32_t>(v[4 + 2 * rank - 1 + d]);
    maps.push_back(m);
  }
  Py_DECREF(fast);
  return ok;
}

// outputs, returns and launches of an entry whose launches take `n_inputs` input tensors;
// `backward`: returns name one output or -1 (no gradient) per edge.
bool parse_entry(PyObject* outputs, PyObject* returns_seq, PyObject* launches_seq, size_t n_inputs, bool backward,
                 Entry& entry) {
  PyObject* outs = PySequence_Fast(outputs, "outputs");
  if (!outs) return false;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(outs); ++i) {
    PyObject* o = PySequence_Fast_GET_ITEM(outs, i);
    Output out;
    int64_t alias, dtype, dev_type, dev_index;
    ok = PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 6 && as_i64(PyTuple_GET_ITEM(o, 0), alias) &&
         int_list(PyTuple_GET_ITEM(o, 1), out.sizes) && int_list(PyTuple_GET_ITEM(o, 2), out.strides) &&
         as_i64(PyTuple_GET_ITEM(o, 3), dtype) && as_i64(PyTuple_GET_ITEM(o, 4), dev_type) &&
         as_i64(PyTuple_GET_ITEM(o, 5), dev_index);
    if (!ok) break;
    out.alias = static_cast<int>(alias);
    ok = alias < static_cast<int64_t>(n_inputs);
    out.dtype = static_cast<at::ScalarType>(dtype);
    out.device = c10::Device(static_cast<c10::DeviceType>(dev_type), static_cast<c10::DeviceIndex>(dev_index));
    entry.outputs.push_back(std::move(out));
  }
  Py_DECREF(outs);
  std::vector<int64_t> returns;
  ok = ok && int_list(returns_seq, returns) &&
       (backward || (entry.tuple ? !returns.empty() : returns.size() <= 1));
  // A program's returns and launch slots index its value table instead of its outputs.
  const int64_t n_outputs = entry.n_values ? entry.n_values : static_cast<int64_t>(entry.outputs.size());
  for (int64_t r : returns) {
    ok = ok && r >= (backward ? -1 : 0) && r < n_outputs;
    entry.returns.push_back(static_cast<int>(r));
  }
  PyObject* launches = ok ? PySequence_Fast(launches_seq, "launches") : nullptr;
  if (!launches) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Table.add: malformed outputs");
    return false;
  }
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(launches); ++i) {
    PyObject* l = PySequence_Fast_GET_ITEM(launches, i);
    Launch launch{};
    int64_t is_cuda, fn, warps, ctas, shared, coop, pdl;
    std::vector<int64_t> grid;
    const Py_ssize_t parts = PyTuple_Check(l) ? PyTuple_GET_SIZE(l) : 0;  // 10: with tensor maps
    ok = (parts == 9 || parts == 10) && as_i64(PyTuple_GET_ITEM(l, 0), is_cuda) &&
         as_i64(PyTuple_GET_ITEM(l, 1), fn) && int_list(PyTuple_GET_ITEM(l, 2), grid) && grid.size() == 3 &&
         as_i64(PyTuple_GET_ITEM(l, 3), warps) && as_i64(PyTuple_GET_ITEM(l, 4), ctas) &&
         as_i64(PyTuple_GET_ITEM(l, 5), shared) && as_i64(PyTuple_GET_ITEM(l, 6), coop) &&
         as_i64(PyTuple_GET_ITEM(l, 7), pdl);
    if (!ok) break;
    launch.cuda = is_cuda != 0;
    launch.fn = reinterpret_cast<void*>(fn);
    for (int d = 0; d < 3; ++d) launch.grid[d] = static_cast<unsigned>(grid[d]);
    launch.num_warps = static_cast<int>(warps);
    launch.num_ctas = static_cast<int>(ctas);
    launch.shared = static_cast<int>(shared);
    launch.cooperative = static_cast<int>(coop);
    launch.pdl = static_cast<int>(pdl);
    if (parts == 10) ok = parse_tensor_maps(PyTuple_GET_ITEM(l, 9), launch.maps);
    if (!ok) break;
    PyObject* slots = PySequence_Fast(PyTuple_GET_ITEM(l, 8), "slots");
    if (!slots) {
      ok = false;
      break;
    }
    for (Py_ssize_t j = 0; ok && j < PySequence_Fast_GET_SIZE(slots); ++j) {
      std::vector<int64_t> s;
      ok = int_list(PySequence_Fast_GET_ITEM(slots, j), s) && s.size() == 4;
      if (!ok) break;
      const int64_t bound = s[0] == kInput ? static_cast<int64_t>(n_inputs)
                            : s[0] == kOutput ? n_outputs
                                              : 1;
      ok = s[0] >= kConst && s[0] <= kOutput && (s[0] == kConst || (s[1] >= 0 && s[1] < bound));
      if (s[3] == kTensorMapBytes)  // a map over an input or output, one of this launch's specs
        ok = ok && launch.cuda && s[0] != kConst && s[2] >= 0 && s[2] < static_cast<int64_t>(launch.maps.size());
      launch.slots.push_back(Slot{static_cast<int>(s[0]), static_cast<int>(s[1]), s[2], static_cast<int>(s[3])});
    }
    Py_DECREF(slots);
    ok = ok && launch.slots.size() <= 64;
    entry.launches.push_back(std::move(launch));
  }
  Py_DECREF(launches);
  if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Table.add: malformed launches");
  return ok;
}

bool parse_program(PyObject* steps_seq, Entry& entry);

// grad: (name, differentiable, edges, saved, grads, backward outputs, backward returns,
//        backward launches, fallback, backward program or None, materialize) as replay.py's
//        `_grad_plan` makes it.
//   saved: [(kind, index, is_output)] (a program forward's kOutput: a value index);
//   grads: [(present, sizes, strides, dtype, aligned)]
std::shared_ptr<GradPlan> parse_grad(PyObject* grad, size_t n_inputs, const Entry& forward) {
  auto plan = std::make_shared<GradPlan>();
  if (!PyTuple_Check(grad) || PyTuple_GET_SIZE(grad) != 11 || !PyUnicode_Check(PyTuple_GET_ITEM(grad, 0)) ||
      !PyCallable_Check(PyTuple_GET_ITEM(grad, 8))) {
    PyErr_SetString(PyExc_ValueError, "Table.add: malformed grad plan");
    return nullptr;
  }
  plan->name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(grad, 0));
  std::vector<int64_t> flags, edges;
  bool ok = int_list(PyTuple_GET_ITEM(grad, 1), flags) && flags.size() == forward.returns.size() &&
            int_list(PyTuple_GET_ITEM(grad, 2), edges);
  for (int64_t f : flags) plan->differentiable.push_back(f != 0);
  for (int64_t e : edges) {
    ok = ok && e >= 0 && e < static_cast<int64_t>(n_inputs);
    plan->edges.push_back(static_cast<int>(e));
  }
  PyObject* saved = ok ? PySequence_Fast(PyTuple_GET_ITEM(grad, 3), "saved") : nullptr;
  for (Py_ssize_t i = 0; saved && ok && i < PySequence_Fast_GET_SIZE(saved); ++i) {
    std::vector<int64_t> s;
    ok = int_list(PySequence_Fast_GET_ITEM(saved, i), s) && s.size() == 3 && (s[0] == kInput || s[0] == kOutput) &&
         s[1] >= 0 &&
         s[1] < static_cast<int64_t>(s[0] == kInput ? n_inputs
                                     : forward.n_values ? static_cast<size_t>(forward.n_values)
                                                        : forward.outputs.size());
    if (ok) plan->saved.push_back(SavedRef{static_cast<int>(s[0]), static_cast<int>(s[1]), s[2] != 0});
  }
  Py_XDECREF(saved);
  PyObject* grads = ok && saved ? PySequence_Fast(PyTuple_GET_ITEM(grad, 4), "grads") : nullptr;
  size_t present = 0;
  for (Py_ssize_t i = 0; grads && ok && i < PySequence_Fast_GET_SIZE(grads); ++i) {
    PyObject* g = PySequence_Fast_GET_ITEM(grads, i);
    GradMeta m;
    int64_t is_present, dtype, aligned;
    ok = PyTuple_Check(g) && PyTuple_GET_SIZE(g) == 5 && as_i64(PyTuple_GET_ITEM(g, 0), is_present) &&
         int_list(PyTuple_GET_ITEM(g, 1), m.sizes) && int_list(PyTuple_GET_ITEM(g, 2), m.strides) &&
         as_i64(PyTuple_GET_ITEM(g, 3), dtype) && as_i64(PyTuple_GET_ITEM(g, 4), aligned);
    m.present = is_present != 0;
    m.dtype = static_cast<at::ScalarType>(dtype);
    m.aligned = aligned != 0;
    present += m.present;
    plan->grads.push_back(std::move(m));
  }
  Py_XDECREF(grads);
  ok = ok && grads && plan->grads.size() == forward.returns.size();
  // A backward program's launches and returns index its value table (the inputs first).
  PyObject* program = PyTuple_GET_ITEM(grad, 9);
  size_t n_slots = plan->saved.size() + present;
  if (ok && program != Py_None) {
    int64_t n_values = 0;
    ok = PyTuple_Check(program) && PyTuple_GET_SIZE(program) == 2 && as_i64(PyTuple_GET_ITEM(program, 0), n_values) &&
         n_values >= static_cast<int64_t>(n_slots);
    plan->backward.n_values = static_cast<int>(n_values);
    n_slots = static_cast<size_t>(n_values);
  }
  ok = ok && parse_entry(PyTuple_GET_ITEM(grad, 5), PyTuple_GET_ITEM(grad, 6), PyTuple_GET_ITEM(grad, 7),
                         n_slots, true, plan->backward) &&
       plan->backward.returns.size() == plan->edges.size();
  ok = ok && (program == Py_None || parse_program(PyTuple_GET_ITEM(program, 1), plan->backward));
  if (!ok) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Table.add: malformed grad plan");
    return nullptr;
  }
  plan->materialize = PyObject_IsTrue(PyTuple_GET_ITEM(grad, 10)) == 1;
  plan->fallback = PyTuple_GET_ITEM(grad, 8);
  Py_INCREF(plan->fallback);
  return plan;
}

// program: (n_values, steps); steps: [("aten", "ns::name", "overload", args, outputs) or
// ("launch", launch index)], args: [("t", value), ("tl", [values]) or ("o", a Python value)]
// in schema order, outputs: one value index (or -1) per returned tensor.
bool parse_program(PyObject* steps_seq, Entry& entry) {
  PyObject* steps = PySequence_Fast(steps_seq, "program steps");
  if (!steps) return false;
  bool ok = true;
  try {
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(steps); ++i) {
      PyObject* s = PySequence_Fast_GET_ITEM(steps, i);
      ok = PyTuple_Check(s) && PyTuple_GET_SIZE(s) >= 2 && PyUnicode_Check(PyTuple_GET_ITEM(s, 0));
      if (!ok) break;
      Step step;
      if (std::strcmp(PyUnicode_AsUTF8(PyTuple_GET_ITEM(s, 0)), "launch") == 0) {
        int64_t index;
        ok = as_i64(PyTuple_GET_ITEM(s, 1), index) && index >= 0 && index < static_cast<int64_t>(entry.launches.size());
        step.aten = false;
        step.launch = static_cast<size_t>(index);
        entry.program.push_back(std::move(step));
        continue;
      }
      ok = PyTuple_GET_SIZE(s) == 5 && PyUnicode_Check(PyTuple_GET_ITEM(s, 1)) && PyUnicode_Check(PyTuple_GET_ITEM(s, 2));
      if (!ok) break;
      step.op = c10::Dispatcher::singleton().findSchemaOrThrow(PyUnicode_AsUTF8(PyTuple_GET_ITEM(s, 1)),
                                                               PyUnicode_AsUTF8(PyTuple_GET_ITEM(s, 2)));
      const auto& arguments = step.op->schema().arguments();
      PyObject* args = PySequence_Fast(PyTuple_GET_ITEM(s, 3), "aten arguments");
      if (!args) return false;
      ok = PySequence_Fast_GET_SIZE(args) == static_cast<Py_ssize_t>(arguments.size());
      for (Py_ssize_t a = 0; ok && a < PySequence_Fast_GET_SIZE(args); ++a) {
        PyObject* arg = PySequence_Fast_GET_ITEM(args, a);
        ok = PyTuple_Check(arg) && PyTuple_GET_SIZE(arg) == 2 && PyUnicode_Check(PyTuple_GET_ITEM(arg, 0));
        if (!ok) break;
        const std::string kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(arg, 0));
        if (kind == "o") {
          step.args.push_back(torch::jit::toIValue(PyTuple_GET_ITEM(arg, 1), arguments[a].type()));
          continue;
        }
        if (kind == "n") {  // a Python number passed for a tensor, as torch's own binding wraps it
          PyObject* number = PyTuple_GET_ITEM(arg, 1);
          const at::Scalar scalar = PyBool_Check(number) ? at::Scalar(number == Py_True)
                                    : PyFloat_Check(number) ? at::Scalar(PyFloat_AsDouble(number))
                                                            : at::Scalar(static_cast<int64_t>(PyLong_AsLongLong(number)));
          at::Tensor wrapped = c10::scalar_to_tensor(scalar);
          wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
          step.args.emplace_back(std::move(wrapped));
          continue;
        }
        TensorArg t{static_cast<int>(a), {}, kind == "tl"};
        if (t.list) {
          std::vector<int64_t> values;
          ok = int_list(PyTuple_GET_ITEM(arg, 1), values);
          for (int64_t v : values) t.values.push_back(static_cast<int>(v));
        } else {
          int64_t v;
          ok = kind == "t" && as_i64(PyTuple_GET_ITEM(arg, 1), v);
          t.values.push_back(static_cast<int>(v));
        }
        for (int v : t.values) ok = ok && v >= 0 && v < entry.n_values;
        step.args.emplace_back();
        step.tensors.push_back(std::move(t));
      }
      Py_DECREF(args);
      std::vector<int64_t> outputs;
      ok = ok && int_list(PyTuple_GET_ITEM(s, 4), outputs);
      for (int64_t o : outputs) {
        ok = ok && o >= -1 && o < entry.n_values;
        step.outputs.push_back(static_cast<int>(o));
      }
      entry.program.push_back(std::move(step));
    }
  } catch (const std::exception& e) {
    Py_DECREF(steps);
    PyErr_SetString(PyExc_ValueError, (std::string("Table.add: program: ") + e.what()).c_str());
    return false;
  }
  Py_DECREF(steps);
  if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Table.add: malformed program");
  return ok;
}

PyObject* table_add(TableObject* self, PyObject* const* argv, Py_ssize_t argc) {
  try {
    const char* usage = "Table.add(args, kwargs, outputs, returns, is_tuple, launches, grad=None, program=None)";
    CallKey k;
    const int keyed = call_key(argv, argc >= 7 ? 6 : argc, 6, usage, k);
    if (keyed < 0 || argc > 8) {
      if (keyed >= 0) PyErr_SetString(PyExc_TypeError, usage);
      return nullptr;
    }
    if (keyed == 0 || (k.cuda && !load_driver())) Py_RETURN_FALSE;
    auto entry = std::make_shared<Entry>();
    entry->tuple = PyObject_IsTrue(argv[4]) == 1;
    PyObject* program = argc == 8 && argv[7] != Py_None ? argv[7] : nullptr;
    // A program's launches and returns index its value table, given with the program.
    size_t n_slots = k.tensors.size();
    if (program) {
      int64_t n_values = 0;
      if (!PyTuple_Check(program) || PyTuple_GET_SIZE(program) != 2 || !as_i64(PyTuple_GET_ITEM(program, 0), n_values) ||
          n_values < static_cast<int64_t>(k.tensors.size())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Table.add: malformed program");
        return nullptr;
      }
      entry->n_values = static_cast<int>(n_values);
      n_slots = static_cast<size_t>(n_values);
    }
    if (!parse_entry(argv[2], argv[3], argv[5], n_slots, false, *entry)) return nullptr;
    if (argc >= 7 && argv[6] != Py_None) {
      entry->grad = parse_grad(argv[6], k.tensors.size(), *entry);
      if (!entry->grad) return nullptr;
    }
    if (program && !parse_program(PyTuple_GET_ITEM(program, 1), *entry)) return nullptr;
    return store(self, argv[0], argv[1], std::move(k.key), std::move(entry));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* table_refuse(TableObject* self, PyObject* const* argv, Py_ssize_t argc) {
  // Table.refuse(args, kwargs): calls with this key take the Python path from now on.
  return with_call_key(argv, argc, "Table.refuse(args, kwargs)", [&](CallKey& k, int keyed) -> PyObject* {
    if (keyed == 0) Py_RETURN_FALSE;
    auto entry = std::make_shared<Entry>();
    entry->skip = true;
    return store(self, argv[0], argv[1], std::move(k.key), std::move(entry));
  });
}

PyObject* store(TableObject* self, PyObject* args, PyObject* kwargs, std::vector<int64_t>&& key,
                std::shared_ptr<Entry>&& entry) {
    if (static_cast<Py_ssize_t>(self->entries->size()) >= self->limit) self->entries->clear();
    hold_strings(self, args);
    if (kwargs != Py_None) hold_strings(self, kwargs);
    (*self->entries)[std::move(key)] = std::move(entry);
    Py_RETURN_TRUE;
}

PyObject* table_kind(TableObject* self, PyObject* const* argv, Py_ssize_t argc) {
  // Table.kind(args, kwargs): "program", "launches", "refused", or None (no entry): tests.
  return with_call_key(argv, argc, "Table.kind(args, kwargs)", [&](CallKey& k, int keyed) -> PyObject* {
    auto found = keyed ? self->entries->find(k.key) : self->entries->end();
    if (found == self->entries->end()) Py_RETURN_NONE;
    const Entry& entry = *found->second;
    return PyUnicode_FromString(entry.skip ? "refused" : entry.program.empty() ? "launches" : "program");
  });
}

PyObject* table_clear(TableObject* self, PyObject*) {
  self->entries->clear();
  self->seen->clear();
  Py_RETURN_NONE;
}

PyObject* table_len(TableObject* self, PyObject*) { return PyLong_FromSsize_t(self->entries->size()); }

PyObject* table_hits(TableObject* self, PyObject*) { return PyLong_FromLongLong(self->hits); }

PyObject* table_new(PyTypeObject* type, PyObject* args, PyObject*) {
  Py_ssize_t limit = 1024;
  if (!PyArg_ParseTuple(args, "|n", &limit)) return nullptr;
  auto* self = reinterpret_cast<TableObject*>(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  self->entries = new std::unordered_map<std::vector<int64_t>, std::shared_ptr<Entry>, KeyHash>();
  self->seen = new std::unordered_set<std::vector<int64_t>, KeyHash>();
  self->names = new std::vector<PyObject*>();
  self->limit = limit;
  self->hits = 0;
  return reinterpret_cast<PyObject*>(self);
}

void table_dealloc(TableObject* self) {
  delete self->entries;
  delete self->seen;
  for (PyObject* name : *self->names) Py_DECREF(name);
  delete self->names;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMethodDef table_methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_call)), METH_FASTCALL,
     "call(args, kwargs): the outputs, MISS (record this call: its key's second) or SKIP"},
    {"add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_add)), METH_FASTCALL,
     "add(args, kwargs, outputs, returns, is_tuple, launches): record a call; False when it has no key"},
    {"refuse", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_refuse)), METH_FASTCALL,
     "refuse(args, kwargs): calls with this key are not replayed"},
    {"kind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_kind)), METH_FASTCALL,
     "kind(args, kwargs): the entry of a call's key: 'program', 'launches', 'refused' or None"},
    {"clear", reinterpret_cast<PyCFunction>(table_clear), METH_NOARGS, "forget every entry"},
    {"size", reinterpret_cast<PyCFunction>(table_len), METH_NOARGS, "number of entries"},
    {"hits", reinterpret_cast<PyCFunction>(table_hits), METH_NOARGS, "calls replayed so far"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject table_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* key_of(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  // The key of a call as a tuple of ints, or None (tests).
  return with_call_key(argv, argc, "key(args, kwargs)", [&](CallKey& k, int keyed) -> PyObject* {
    if (keyed == 0) Py_RETURN_NONE;
    const std::vector<int64_t>& key = k.key;
    PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(key.size()));
    for (size_t i = 0; i < key.size(); ++i) PyTuple_SET_ITEM(out, i, PyLong_FromLongLong(key[i]));
    return out;
  });
}

PyObject* set_cuda(PyObject*, PyObject* flag) {
  allow_cuda = PyObject_IsTrue(flag) == 1;
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"set_cuda", set_cuda, METH_O, "set_cuda(flag): replay calls with CUDA tensors"},
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(key_of)), METH_FASTCALL,
     "key(args, kwargs): a call's key (None: not replayable)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "openkernels_replay", "eager replay of recorded calls", -1,
                          module_methods};

}  // namespace

PyMODINIT_FUNC PyInit_openkernels_replay() {
  table_type.tp_name = "openkernels_replay.Table";
  table_type.tp_basicsize = sizeof(TableObject);
  table_type.tp_flags = Py_TPFLAGS_DEFAULT;
  table_type.tp_new = table_new;
  table_type.tp_dealloc = reinterpret_cast<destructor>(table_dealloc);
  table_type.tp_methods = table_methods;
  if (PyType_Ready(&table_type) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (!m) return nullptr;
  miss_sentinel = PyUnicode_InternFromString("MISS");
  skip_sentinel = PyUnicode_InternFromString("SKIP");
  Py_INCREF(&table_type);
  PyModule_AddObject(m, "Table", reinterpret_cast<PyObject*>(&table_type));
  Py_INCREF(miss_sentinel);
  PyModule_AddObject(m, "MISS", miss_sentinel);
  Py_INCREF(skip_sentinel);
  PyModule_AddObject(m, "SKIP", skip_sentinel);
  return m;
}
