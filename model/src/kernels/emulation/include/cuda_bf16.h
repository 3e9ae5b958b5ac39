// What our kernels include of CUDA, on the CPU: everything is in cuda_cpu.h.
#pragma once
#include "cuda_cpu.h"
