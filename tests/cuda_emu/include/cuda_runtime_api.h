// Stands in for the CUDA runtime header when the kernel sources are compiled
// for the CPU emulation: the few runtime types they name (cudaStream_t, dim3,
// float4, double2) come from cuda_emu.h, which the build force-includes.
#pragma once
#include "../cuda_emu.h"
