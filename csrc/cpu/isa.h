// Run-time choice of the CPU kernel variant (see kernel.h).
#pragma once

#include <string>

namespace pyengine::cpu {

struct KernelTable;

// The table matching at::get_cpu_capability() (which honours ATEN_CPU_CAPABILITY=avx2|default).
const KernelTable& selected_kernels();
std::string selected_isa();

// Whether the update runs its software-prefetching loops (KernelTable::update_prefetch; Note [Prefetching the
// streams] in kernel_isa.cpp): PYENGINE_CPU_PREFETCH=0|1 when set, else on for Intel CPUs. Decided once per process,
// at the first call; set_prefetch_streams (for A/B benchmarks and tests) overrides it for the process and returns the
// previous setting. The results are the same either way.
bool prefetch_streams();
bool set_prefetch_streams(bool on);

// Whether the CPU ops run on the calling thread only (no OpenMP region) on this thread; returns the previous value.
// Per thread, with no effect on torch's thread settings: see Note [Host threads beside CPU workers] in
// pyengine/workers.py for why the engine's host thread wants this while CPU workers compute.
bool set_serial_on_this_thread(bool serial);

}  // namespace pyengine::cpu
