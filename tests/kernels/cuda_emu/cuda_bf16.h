// the CPU stand-in (cuda_runtime.h of this folder) defines the half-precision types and intrinsics too
#pragma once
#include "cuda_runtime.h"
