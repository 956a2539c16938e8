// The "testdev" device: a PyTorch out-of-tree PrivateUse1 backend whose memory is not the host's
// as far as torch is concerned. Bytes live in host RAM (there is no hardware), but every tensor carries
// device type PrivateUse1 (renamed to "testdev" from Python), so the dispatcher, device checks, copies,
// pinning and process groups treat it as they treat a GPU.
//
// What it provides:
//   * an allocator (per-device byte counters and peaks, used by memory_allocated());
//   * a device guard (thread-local current device and current stream per device);
//   * streams and events: kernels run synchronously on the calling thread, so any stream order is
//     already satisfied; events record a steady-clock time so elapsed_time() is real;
//   * host<->device copies (_copy_from / _copy_from_and_resize) for any strides;
//   * the views torch needs a backend to implement (as_strided, view, _reshape_alias, unfold, set_);
//   * every other operator through at::native::cpu_fallback, after a device check that raises as CUDA
//     does when a non-scalar CPU tensor (or another testdev index) is mixed in;
//   * a count of device scalars read on the host (the host synchronizations of a GPU);
//   * PrivateUse1 hooks: pinned host memory (a real allocator that remembers its ranges, so
//     is_pinned() is true only for memory it handed out), device count, current device.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/extension.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

namespace testdev {

constexpr int kMaxDevices = 16;
using c10::DeviceType;

int device_count_value() {
  static const int n = [] {
    const char* env = std::getenv("DSCORE_TESTDEV_COUNT");
    int v = env ? std::atoi(env) : 8;
    return v < 1 ? 1 : (v > kMaxDevices ? kMaxDevices : v);
  }();
  return n;
}

thread_local c10::DeviceIndex tl_device = 0;
// current stream id per device, per thread (as CUDA's current stream is per thread)
thread_local std::array<c10::StreamId, kMaxDevices> tl_stream{};
std::atomic<c10::StreamId> next_stream_id{1};

// ------------------------------------------------------------------------- allocator (device memory)
struct Counters {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
};
std::array<Counters, kMaxDevices> counters;
std::mutex owner_mu;
std::map<void*, std::pair<size_t, c10::DeviceIndex>> owners;  // ptr -> (bytes, device)

void device_delete(void* ptr) {
  if (!ptr) return;
  size_t bytes = 0;
  c10::DeviceIndex dev = 0;
  {
    std::lock_guard<std::mutex> g(owner_mu);
    auto it = owners.find(ptr);
    if (it != owners.end()) {
      bytes = it->second.first;
      dev = it->second.second;
      owners.erase(it);
    }
  }
  counters[dev].allocated.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  c10::free_cpu(ptr);
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex dev = tl_device;
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (data) {
      {
        std::lock_guard<std::mutex> g(owner_mu);
        owners[data] = {nbytes, dev};
      }
      int64_t now = counters[dev].allocated.fetch_add(static_cast<int64_t>(nbytes)) + static_cast<int64_t>(nbytes);
      int64_t prev = counters[dev].peak.load();
      while (now > prev && !counters[dev].peak.compare_exchange_weak(prev, now)) {
      }
    }
    return {data, data, &device_delete, c10::Device(DeviceType::PrivateUse1, dev)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &device_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};
DeviceAllocator device_allocator;
REGISTER_ALLOCATOR(DeviceType::PrivateUse1, &device_allocator);

// ------------------------------------------------------------------------- pinned host memory
std::mutex pinned_mu;
std::map<uintptr_t, size_t> pinned;  // start -> bytes

void pinned_delete(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> g(pinned_mu);
    pinned.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (data) {
      std::lock_guard<std::mutex> g(pinned_mu);
      pinned[reinterpret_cast<uintptr_t>(data)] = nbytes;
    }
    return {data, data, &pinned_delete, c10::Device(DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};
PinnedAllocator pinned_allocator;

bool is_pinned_ptr(const void* data) {
  auto p = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> g(pinned_mu);
  auto it = pinned.upper_bound(p);
  if (it == pinned.begin()) return false;
  --it;
  return p >= it->first && p < it->first + it->second;
}

// ------------------------------------------------------------------------- events
struct Event {
  std::chrono::steady_clock::time_point when;
  bool recorded = false;
};

// ------------------------------------------------------------------------- device guard
struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  static constexpr DeviceType static_type = DeviceType::PrivateUse1;
  GuardImpl() = default;
  explicit GuardImpl(DeviceType t) { TORCH_INTERNAL_ASSERT(t == static_type); }
  DeviceType type() const override { return static_type; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(static_type, tl_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == static_type, "testdev guard got device ", d);
    if (d.has_index()) {
      TORCH_CHECK(d.index() >= 0 && d.index() < device_count_value(), "testdev: device index ", int(d.index()),
                  " is out of range; ", device_count_value(), " device(s) exist (DSCORE_TESTDEV_COUNT)");
      tl_device = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) tl_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    auto idx = d.has_index() ? d.index() : tl_device;
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(static_type, idx), tl_stream[idx]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(static_type, d.has_index() ? d.index() : tl_device));
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    auto idx = d.has_index() ? d.index() : tl_device;
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(static_type, idx), next_stream_id.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/) const override {
    return getNewStream(d, 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto idx = s.device_index();
    auto old = c10::Stream(c10::Stream::UNSAFE, s.device(), tl_stream[idx]);
    tl_stream[idx] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return static_cast<c10::DeviceIndex>(device_count_value()); }
  // Work is executed synchronously when it is issued, so a stream is always idle and an event is
  // complete as soon as it is recorded: waits are satisfied by construction.
  void record(void** event, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) *event = new Event();
    auto* e = static_cast<Event*>(*event);
    e->when = std::chrono::steady_clock::now();
    e->recorded = true;
  }
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<Event*>(event);
  }
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const c10::DeviceIndex /*device_index*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const c10::Stream& /*stream*/) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a && b && a->recorded && b->recorded, "testdev: both events must be recorded before elapsed_time()");
    return std::chrono::duration<double, std::milli>(b->when - a->when).count();
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ------------------------------------------------------------------------- hooks
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*device_index*/) const override {
    // operators run through the CPU fallback, which draws from the CPU generator: one stream of
    // random numbers, shared with the host (documented in the Python module)
    return at::detail::getDefaultCPUGenerator();
  }
  at::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::mutex> g(owner_mu);
    auto it = owners.find(data);
    return c10::Device(DeviceType::PrivateUse1, it == owners.end() ? tl_device : it->second.second);
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(device_count_value()); }
  void setCurrentDevice(c10::DeviceIndex d) const override { GuardImpl().setDevice(c10::Device(DeviceType::PrivateUse1, d)); }
  c10::DeviceIndex getCurrentDevice() const override { return tl_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = tl_device;
    setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    c10::DataPtr fresh = device_allocator.allocate(newsize);
    size_t keep = std::min(newsize, impl->nbytes());
    if (keep) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

void register_hooks() {
  static bool done = false;
  if (!done) {
    static Hooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
    done = true;
  }
}

// ------------------------------------------------------------------------- kernels
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                               std::optional<at::Device> device, std::optional<bool> pin_memory,
                               std::optional<at::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard guard(device);
  constexpr c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, &device_allocator, ks, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device, std::optional<bool> pin_memory) {
  c10::OptionalDeviceGuard guard(device);
  constexpr c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, &device_allocator, ks, c10::dtype_or_default(dtype));
}

// A CPU tensor aliasing the same bytes (the device's memory is host RAM underneath): copies of any
// strides and dtypes then reduce to CPU copy_.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().is_cpu()) return t;
  auto opts = t.options().device(c10::kCPU);
  if (t.numel() == 0) return at::empty(t.sizes(), opts);
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), opts);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.is_cpu() || self.device().type() == DeviceType::PrivateUse1, "testdev copy from ", self.device());
  TORCH_CHECK(dst.is_cpu() || dst.device().type() == DeviceType::PrivateUse1, "testdev copy to ", dst.device());
  TORCH_CHECK(self.sizes() == dst.sizes(), "testdev copy: sizes differ ", self.sizes(), " vs ", dst.sizes());
  if (dst.numel() == 0) return dst;
  host_alias(dst).copy_(host_alias(self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage src) {
  int64_t new_size = static_cast<int64_t>(src.nbytes() / self.dtype().itemsize());
  return at::native::set_storage_cpu_(self, src, 0, {new_size}, {});
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage src, int64_t offset, c10::IntArrayRef size,
                                      c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, src, offset, size, stride);
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, &device_allocator, true);
  return at::native::set_storage_cpu_(self, storage, 0, {0}, {});
}

// Reading a device scalar on the host (.item(), float(t), bool(t)) is a device->host synchronization on a
// GPU; counted so tests can assert a code path has none.
std::atomic<int64_t> scalar_reads{0};

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  scalar_reads.fetch_add(1, std::memory_order_relaxed);
  return at::_local_scalar_dense(host_alias(self));
}

// ------------------------------------------------------------------------- fallback with device checks
bool allows_host_indices(const c10::OperatorName& name) {
  // CUDA accepts CPU index tensors for advanced indexing (they are moved to the device)
  const std::string& n = name.name;
  return n == "aten::index" || n == "aten::index_put_" || n == "aten::index_put" || n == "aten::_index_put_impl_";
}

void check_devices(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto n = schema.arguments().size();
  auto args = torch::jit::last(stack, n);
  std::optional<c10::Device> dev;
  std::optional<c10::Device> host;
  std::string host_arg;
  auto visit = [&](const at::Tensor& t, const std::string& arg) {
    if (!t.defined()) return;
    if (t.device().type() == DeviceType::PrivateUse1) {
      if (dev && *dev != t.device()) {
        TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                    *dev, " and ", t.device(), "! (when checking argument ", arg, " of ", schema.name(), ")");
      }
      dev = t.device();
    } else if (t.is_cpu() && t.dim() > 0 && !host) {
      host = t.device();
      host_arg = arg;
    }
  };
  for (size_t i = 0; i < n; ++i) {
    const auto& iv = args[i];
    const auto& arg = schema.arguments()[i].name();
    if (iv.isTensor()) {
      visit(iv.toTensor(), arg);
    } else if (iv.isTensorList()) {
      for (const auto& t : iv.toTensorList()) visit(t, arg);
    } else if (iv.isList()) {
      for (const auto& e : iv.toListRef()) {
        if (e.isTensor()) visit(e.toTensor(), arg);
      }
    }
  }
  if (dev && host && !allows_host_indices(schema.operator_name())) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", *dev,
                " and cpu! (when checking argument ", host_arg, " of ", schema.name(), ")");
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  check_devices(op, stack);
  at::native::cpu_fallback(op, stack);
}

// ------------------------------------------------------------------------- Python-facing helpers
int64_t memory_allocated(int64_t device) {
  TORCH_CHECK(device >= 0 && device < device_count_value(), "testdev: no device ", device);
  return counters[device].allocated.load();
}
int64_t max_memory_allocated(int64_t device) {
  TORCH_CHECK(device >= 0 && device < device_count_value(), "testdev: no device ", device);
  return std::max(counters[device].peak.load(), counters[device].allocated.load());
}
void reset_peak_memory_stats(int64_t device) {
  TORCH_CHECK(device >= 0 && device < device_count_value(), "testdev: no device ", device);
  counters[device].peak.store(counters[device].allocated.load());
}
int64_t device_count() { return device_count_value(); }
int64_t host_scalar_reads() { return scalar_reads.load(); }
int64_t current_device() { return tl_device; }
void set_device(int64_t device) { GuardImpl().setDevice(c10::Device(DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device))); }
int64_t current_stream_id(int64_t device) { return tl_stream[device]; }
bool is_pinned(const at::Tensor& t) { return t.is_cpu() && t.numel() > 0 && is_pinned_ptr(t.data_ptr()); }

}  // namespace testdev

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", testdev::empty_memory_format);
  m.impl("empty_strided", testdev::empty_strided);
  m.impl("_copy_from", testdev::copy_from);
  m.impl("_copy_from_and_resize", testdev::copy_from_and_resize);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("resize_", at::native::resize_);
  m.impl("set_.source_Storage", testdev::set_source_storage);
  m.impl("set_.source_Storage_storage_offset", testdev::set_source_storage_offset);
  m.impl("set_", testdev::set_empty);
  m.impl("_local_scalar_dense", testdev::local_scalar_dense);
  // ops with a CompositeExplicitAutograd kernel would run that generic decomposition on an out-of-tree
  // device instead of the backend fallback; route them to the CPU kernels so the device computes exactly
  // what the host computes
  m.impl("native_layer_norm", torch::CppFunction::makeFromBoxedFunction<&testdev::fallback>());
  m.impl("native_layer_norm_backward", torch::CppFunction::makeFromBoxedFunction<&testdev::fallback>());
  m.impl("native_group_norm", torch::CppFunction::makeFromBoxedFunction<&testdev::fallback>());
  m.impl("native_group_norm_backward", torch::CppFunction::makeFromBoxedFunction<&testdev::fallback>());
  // CompositeImplicitAutograd with CPU/CUDA kernels: SiLU's backward formula differs from the CPU kernel in
  // the last bit (Llama-style MLPs: the AutoTP / Ulysses cells of the test-device matrix)
  m.impl("silu_backward", torch::CppFunction::makeFromBoxedFunction<&testdev::fallback>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&testdev::fallback>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_hooks", &testdev::register_hooks, "install the PrivateUse1 hooks (pinned memory, device count)");
  m.def("device_count", &testdev::device_count);
  m.def("current_device", &testdev::current_device);
  m.def("set_device", &testdev::set_device);
  m.def("current_stream_id", &testdev::current_stream_id);
  m.def("memory_allocated", &testdev::memory_allocated);
  m.def("max_memory_allocated", &testdev::max_memory_allocated);
  m.def("reset_peak_memory_stats", &testdev::reset_peak_memory_stats);
  m.def("is_pinned", &testdev::is_pinned);
  m.def("host_scalar_reads", &testdev::host_scalar_reads, "device scalars read on the host so far (host syncs)");
}
