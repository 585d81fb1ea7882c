// What the stand-in device's two translation units share (standin.cc: guard, hooks, ops;
// memory.cc: allocators).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace capstan_standin {

constexpr int kMaxDevices = 16;

c10::DeviceIndex device_count();            // CAPSTAN_STANDIN_DEVICES, read once
extern thread_local c10::DeviceIndex current_device;
void check_index(c10::DeviceIndex d);       // raises for an index past device_count()

c10::Allocator* device_alloc();             // the caching device allocator (registered for PrivateUse1)
at::Allocator* host_alloc();                // the caching pinned host allocator
bool host_owns(const void* p);              // whether `p` points into a pinned block

}  // namespace capstan_standin
