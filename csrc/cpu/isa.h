// Run-time choice of the CPU kernel variant (see kernel.h).
#pragma once

#include <string>

namespace pyengine::cpu {

struct KernelTable;

// The table matching at::get_cpu_capability() (which honours ATEN_CPU_CAPABILITY=avx2|default).
const KernelTable& selected_kernels();
std::string selected_isa();

}  // namespace pyengine::cpu
