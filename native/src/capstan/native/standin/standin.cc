// A second device for the CPU test suite: PyTorch's PrivateUse1 backend,
// renamed "standin" by capstan.native.standin, backed by host memory.
//
// Why: with the CPU standing in for the GPU, a missing `.to(device)` or a CPU
// tensor mixed into device work passes every CPU test and fails on the first
// GPU. Tensors on this device report their own type and index, and an op that
// mixes them with a CPU tensor (other than a 0-dim scalar or an index list, as
// CUDA allows) raises CUDA's kind of error. It has what the GPU code asks of a
// device: streams and events (ordering is immediate: every op runs on the host
// when called), a caching device allocator with allocated/reserved statistics
// and an out-of-memory error at a configurable capacity, pinned host memory
// through a caching host allocator rounded to powers of two (as CUDA's is),
// and the device-generic APIs (torch.accelerator, torch.Stream/torch.Event,
// memory statistics) on top of them.
//
// Ops: the few that define a tensor's memory (empty, views, copies, resize,
// set_) are registered directly; every other op reaches one boxed fallback
// that checks devices, runs the CPU kernel on aliases of the same host bytes
// (no copy: an in-place op writes the device tensor's memory), and moves fresh
// results onto the device through the device allocator, so the statistics
// count them. Compiled and loaded at run time by capstan.native.standin (links
// against the installed torch; no torch headers in libcapstan).
//
// Environment: CAPSTAN_STANDIN_DEVICES (devices, default 2),
// CAPSTAN_STANDIN_MEMORY (bytes per device, default 64 GiB).

// This file: the device guard (streams, events), the hooks torch asks of an accelerator, and the ops;
// memory.cc: the allocators.

#include "standin.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace capstan_standin {

// ---- device guard: current device, streams and events -------------------------------------------
// Every op runs on the host when it is called, so a stream is only an id and an event is complete
// as soon as it is recorded; elapsed time is measured between records.
thread_local c10::StreamId current_stream[kMaxDevices] = {};
std::atomic<c10::StreamId> next_stream{1};

// Late events (capstan_standin_set_event_lag, tests only): an event recorded while the lag is n answers
// "not done" to its first n queries, as a GPU's copy still in flight would, until synchronized. The data
// is in place at once all the same, so what this finds is code that reads a buffer before the event
// that guards it says done, or trusts one query: orders a GPU shows and an always-done stand-in hides.
// CAPSTAN_STANDIN_EVENT_LAG=n sets it from the start in every process (a launch's ranks too).
std::atomic<int> event_lag{[] {
  const char* v = std::getenv("CAPSTAN_STANDIN_EVENT_LAG");
  return v == nullptr ? 0 : std::max(0, std::atoi(v));
}()};

struct Event {
  std::chrono::steady_clock::time_point at;
  int lag = 0;  // queries left that answer "not done"
};

struct StandinGuardImpl final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kType, current_device}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "standin guard given a ", d, " device");
    if (d.has_index()) {
      check_index(d.index());
      current_device = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    const auto i = d.has_index() ? d.index() : current_device;
    return c10::Stream(c10::Stream::UNSAFE, {kType, i}, current_stream[i]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, {kType, d.has_index() ? d.index() : current_device}, 0);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, {kType, d.has_index() ? d.index() : current_device},
                       next_stream.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high) const override {
    return getNewStream(d, high ? -1 : 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const auto i = s.device_index();
    check_index(i);
    const c10::Stream old = getStream(s.device());
    current_stream[i] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new Event{};
    static_cast<Event*>(*event)->at = std::chrono::steady_clock::now();
    static_cast<Event*>(*event)->lag = event_lag.load();
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    if (e != nullptr && e->lag > 0) {
      --e->lag;
      return false;
    }
    return true;
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) static_cast<Event*>(event)->lag = 0;
  }
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "standin: both events must be recorded before elapsed_time");
    const auto dt = static_cast<Event*>(end)->at - static_cast<Event*>(start)->at;
    return std::chrono::duration<double, std::milli>(dt).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, StandinGuardImpl);

// ---- hooks: what torch asks of an accelerator ----------------------------------------------------
struct StandinHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_index(d);
    current_device = d;
  }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    const auto old = current_device;
    setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  bool isPinnedPtr(const void* p) const override { return host_owns(p); }
  at::Allocator* getPinnedMemoryAllocator() const override { return host_alloc(); }
  // Random numbers come from the CPU generator: the stand-in draws what the CPU draws, so a run on it
  // matches the CPU run, dropout included.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  at::Device getDeviceFromPtr(void*) const override { return {c10::DeviceType::PrivateUse1, current_device}; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new StandinHooks()); }
};
RegisterHooks register_hooks;

// ---- kernels that define memory -------------------------------------------------------------------
constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

c10::Device target(std::optional<c10::Device> d) {
  c10::Device dev = d.value_or(c10::Device(c10::DeviceType::PrivateUse1, current_device));
  TORCH_CHECK(dev.is_privateuseone(), "standin kernel asked for a ", dev, " tensor");
  if (!dev.has_index()) dev = c10::Device(c10::DeviceType::PrivateUse1, current_device);
  return dev;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> fmt) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "standin tensors are strided only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only CPU tensors can be pinned");
  const c10::DeviceGuard guard(target(device));
  return at::detail::empty_generic(size, device_alloc(), kKeys, c10::dtype_or_default(dtype), fmt);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "standin tensors are strided only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only CPU tensors can be pinned");
  const c10::DeviceGuard guard(target(device));
  return at::detail::empty_strided_generic(size, stride, device_alloc(), kKeys, c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> fmt) {
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, size, fmt);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

// A CPU tensor over the same host bytes as `t` (a device tensor): no copy, so a kernel writing it writes
// the device tensor. Its storage does not own the bytes and may be resized by an out= kernel, which then
// moves it to new CPU memory; the fallback sees that and moves the result back (`write_back`).
at::Tensor cpu_alias(const at::Tensor& t) {
  const c10::Storage& st = t.storage();
  void* base = st.mutable_data();
  c10::DataPtr ptr(base, base, &c10::detail::deleteNothing, c10::Device(c10::DeviceType::CPU));
  auto impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), st.nbytes(),
                                                    std::move(ptr), c10::GetCPUAllocator(), /*resizable=*/true);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(impl)),
                                                            c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) out._set_conj(true);
  if (t.is_neg()) out._set_neg(true);
  return out;
}

// Host synchronizations a CUDA program would make here: a device->host copy that is blocking or lands in
// pageable memory, a host->device copy that is blocking or reads pageable memory, and `.item()`. Counted so
// tests can hold the hot path to the syncs it needs (capstan.native.standin.host_syncs).
std::atomic<int64_t> host_syncs{0};

// CAPSTAN_STANDIN_SYNC_TRAP=N: the N-th sync raises, so its Python traceback shows where it is.
void count_sync() {
  static const long long trap = [] {
    const char* v = std::getenv("CAPSTAN_STANDIN_SYNC_TRAP");
    return v == nullptr ? 0LL : std::atoll(v);
  }();
  const int64_t n = ++host_syncs;
  TORCH_CHECK(trap <= 0 || n != trap, "standin: host sync number ", n, " (CAPSTAN_STANDIN_SYNC_TRAP)");
}

bool host_pinned(const at::Tensor& t) { return t.data_ptr() != nullptr && host_owns(t.data_ptr()); }

// The bytes of `src` into `dst` (either may be a device tensor): the copy itself, also used inside the
// fallback, where it stands for no operation of the program's.
void copy_bytes(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  at::Tensor s = src.is_privateuseone() ? cpu_alias(src) : src;
  at::Tensor d = dst.is_privateuseone() ? cpu_alias(dst) : dst;
  TORCH_CHECK(s.is_cpu() && d.is_cpu(), "standin copy between ", src.device(), " and ", dst.device());
  at::native::copy_(d, s, non_blocking);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (self.is_privateuseone() && dst.is_cpu() && (!non_blocking || !host_pinned(dst))) count_sync();
  if (self.is_cpu() && dst.is_privateuseone() && (!non_blocking || !host_pinned(self))) count_sync();
  copy_bytes(self, dst, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  count_sync();
  return at::native::_local_scalar_dense_cpu(cpu_alias(self));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) { return at::native::set_tensor_(self, source); }
at::Tensor& set_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, source); }
at::Tensor& set_storage_offset(at::Tensor& self, at::Storage source, int64_t offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  return at::cpu::set_(self, source, offset, size, stride);
}

void record_stream(at::Tensor&, c10::Stream) {}

// `param.data = t` between a CPU and a device tensor is allowed for CUDA (both "dense" backends); torch's
// list of dense backends leaves PrivateUse1 out, so say the same here for CPU and stand-in tensors.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::Layout::Strided && (t.is_cpu() || t.is_privateuseone());
  };
  return dense(self) && dense(from);
}

// ---- every other op: device checks, then the CPU kernel on aliases ---------------------------------
bool allows_cpu_indices(const c10::OperatorName& op) {
  // CUDA takes CPU index tensors for advanced indexing (x_cuda[idx_cpu]).
  return op.name == "aten::index" || op.name == "aten::index_put_" || op.name == "aten::_index_put_impl_" ||
         op.name == "aten::index_put";
}

struct DeviceCheck {
  const c10::FunctionSchema& schema;
  std::optional<c10::Device> device;  // the device tensors' device
  void see(const at::Tensor& t, const c10::Argument& arg) {
    if (!t.defined() || !t.is_privateuseone()) return;
    if (!device) {
      device = t.device();
    } else if (*device != t.device()) {
      fail(arg, t.device());
    }
  }
  [[noreturn]] void fail(const c10::Argument& arg, c10::Device other) const {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but got ", arg.name(), " is on ", other,
                ", different from other tensors on ", *device, " (when checking argument in method ",
                schema.operator_name(), ")");
    std::abort();
  }
  void check_cpu(const at::Tensor& t, const c10::Argument& arg) const {
    if (t.defined() && t.is_cpu() && t.dim() > 0 && device) fail(arg, t.device());
  }
};

at::Tensor to_device(const at::Tensor& cpu, c10::Device device) {
  const c10::DeviceGuard guard(device);
  at::Tensor out = at::detail::empty_strided_generic(cpu.sizes(), cpu.strides(), device_alloc(), kKeys,
                                                     cpu.scalar_type());
  copy_bytes(cpu, out, false);
  return out;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t n = args.size();
  const size_t begin = stack->size() - n;
  DeviceCheck check{schema, std::nullopt};

  // 1. Which device, and is anything on another one? (Every tensor argument, in lists too; CPU index
  //    tensors pass where CUDA takes them.)
  auto each_tensor = [&](const c10::IValue& v, bool optional_lists, auto&& fn) {
    if (v.isTensor()) {
      fn(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) fn(t);
    } else if (v.isOptionalTensorList() && optional_lists) {
      for (const auto& t : v.toOptionalTensorVector()) if (t) fn(*t);
    }
  };
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = (*stack)[begin + i];
    each_tensor(v, true, [&](const at::Tensor& t) { check.see(t, args[i]); });
    if (v.isDevice() && v.toDevice().is_privateuseone() && !check.device) check.device = target(v.toDevice());
  }
  const bool cpu_indices = allows_cpu_indices(schema.operator_name());
  for (size_t i = 0; i < n; ++i) {
    each_tensor((*stack)[begin + i], !cpu_indices, [&](const at::Tensor& t) { check.check_cpu(t, args[i]); });
  }
  TORCH_CHECK(check.device.has_value(), "standin fallback for ", schema.operator_name(), " found no standin tensor");
  const c10::DeviceGuard guard(*check.device);

  // 2. Device tensors become CPU aliases of the same bytes; a device argument becomes the CPU.
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (device tensor, its alias) of mutable arguments
  std::vector<at::Tensor> aliases;
  auto alias = [&](const at::Tensor& t, const c10::Argument& arg) -> at::Tensor {
    if (!t.defined() || !t.is_privateuseone()) return t;
    at::Tensor a = cpu_alias(t);
    aliases.push_back(a);
    if (arg.alias_info() != nullptr && arg.alias_info()->isWrite()) written.emplace_back(t, a);
    return a;
  };
  std::vector<at::Tensor> originals(n);
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[begin + i];
    if (v.isTensor()) {
      originals[i] = v.toTensor();
      v = alias(originals[i], args[i]);
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> ts;
      for (const at::Tensor& t : v.toTensorVector()) ts.push_back(alias(t, args[i]));
      v = c10::IValue(c10::List<at::Tensor>(ts));
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> ts;
      for (const auto& t : v.toOptionalTensorVector()) ts.push_back(t ? std::optional<at::Tensor>(alias(*t, args[i])) : t);
      v = c10::IValue(ts);
    } else if (v.isDevice() && v.toDevice().is_privateuseone()) {
      v = c10::IValue(c10::Device(c10::DeviceType::CPU));
    }
  }

  // 3. The CPU kernel.
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  // 4. A mutable argument the kernel resized (moved to new CPU memory, or re-shaped) takes the new shape
  //    and bytes on the device.
  for (auto& [dev, a] : written) {
    const bool moved = a.storage().data() != dev.storage().data();
    const bool reshaped = a.sizes() != dev.sizes() || a.strides() != dev.strides() ||
                          a.storage_offset() != dev.storage_offset();
    if (!moved && !reshaped) continue;
    auto* impl = dev.unsafeGetTensorImpl();
    if (moved) {
      c10::Storage st(c10::Storage::use_byte_size_t(), a.storage().nbytes(), device_alloc(), true);
      std::memcpy(st.mutable_data(), a.storage().data(), a.storage().nbytes());
      impl->set_storage_keep_dtype(st);
    }
    impl->set_sizes_and_strides(a.sizes(), a.strides(), a.storage_offset());
  }

  // 5. Results: a mutable alias is the device argument itself; a fresh CPU tensor moves to the device.
  const auto& rets = schema.returns();
  const size_t r_begin = stack->size() - rets.size();
  auto give = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || !t.is_cpu()) return t;
    for (const auto& [dev, a] : written) {
      if (t.unsafeGetTensorImpl() == a.unsafeGetTensorImpl()) return dev;
    }
    for (size_t i = 0; i < aliases.size(); ++i) {
      // A result viewing an argument's bytes (an op returning its input): the same view on the device.
      if (t.storage().data() == aliases[i].storage().data() && t.storage().data() != nullptr) {
        for (const at::Tensor& o : originals) {
          if (o.defined() && o.is_privateuseone() && o.storage().data() == t.storage().data()) {
            return at::native::as_strided_tensorimpl(o, t.sizes(), t.strides(), t.storage_offset());
          }
        }
      }
    }
    return to_device(t, *check.device);
  };
  for (size_t i = 0; i < rets.size(); ++i) {
    c10::IValue& v = (*stack)[r_begin + i];
    if (v.isTensor()) {
      v = c10::IValue(give(v.toTensor()));
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> ts;
      for (const at::Tensor& t : v.toTensorVector()) ts.push_back(give(t));
      v = c10::IValue(c10::List<at::Tensor>(ts));
    }
  }
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(as_strided));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("_reshape_alias", TORCH_FN(reshape_alias));
  m.impl("view", TORCH_FN(view));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  m.impl("set_.source_Storage", TORCH_FN(set_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  m.impl("record_stream", TORCH_FN(record_stream));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
}

// Ops with a generic (CompositeExplicitAutograd) kernel beside the CPU one would take the generic kernel here
// and round differently from the CPU; sent to the fallback they run the CPU kernel, so a run on the stand-in
// is the CPU run bit for bit.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* op : {"native_layer_norm", "native_layer_norm_backward"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

// Autocast: CUDA's policy (the same op lists, lower precision for matmuls and convolutions, fp32 for the
// ops that need its range), so `torch.autocast("standin", torch.bfloat16)` casts what it casts on a GPU.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define STANDIN_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define STANDIN_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_LOWER_PRECISION_FP(STANDIN_LOWER)
  AT_FORALL_FP32(STANDIN_FP32)
#undef STANDIN_LOWER
#undef STANDIN_FP32
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

}  // namespace capstan_standin

// ---- a flat C ABI for what Python reads without going through torch ------------------------------
extern "C" {

__attribute__((visibility("default"))) int capstan_standin_abi_version() { return 2; }

__attribute__((visibility("default"))) void capstan_standin_set_event_lag(int queries) {
  capstan_standin::event_lag.store(queries < 0 ? 0 : queries);
}

__attribute__((visibility("default"))) int64_t capstan_standin_host_syncs() {
  return capstan_standin::host_syncs.load();
}

__attribute__((visibility("default"))) int capstan_standin_device_count() {
  return capstan_standin::device_count();
}

}  // extern "C"
