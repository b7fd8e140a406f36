// Text of the error codes the launchers return.
#include <cuda_runtime.h>

#include "launchers.h"

namespace astrai {

const char* error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace astrai
