// Build-time shim (helixserve's own code, not part of FlashMLA). build.sh puts shim/ first on the include
// path, so FlashMLA's `#include "utils.h"` lands here: this includes FlashMLA's csrc/utils.h unchanged
// (include_next: the next directory on the path), then redefines its host-side error macros to throw
// std::runtime_error instead of calling exit(1). capi.cu catches the exception and returns an error code
// (message: flashmla_last_error()), so a failed launch does not kill the Python process. Device-side
// asserts (trap) are unchanged.
#pragma once

#include_next "utils.h"

#include <stdexcept>
#include <string>

#undef CHECK_CUDA
#define CHECK_CUDA(call)                                                                              \
    do {                                                                                              \
        cudaError_t status_ = call;                                                                   \
        if (status_ != cudaSuccess) {                                                                 \
            throw std::runtime_error(std::string("CUDA error (") + __FILE__ + ":" +                  \
                                     std::to_string(__LINE__) + "): " + cudaGetErrorString(status_)); \
        }                                                                                             \
    } while (0)

#undef FLASH_ASSERT
#define FLASH_ASSERT(cond)                                                                            \
    do {                                                                                              \
        if (not(cond)) {                                                                              \
            throw std::runtime_error(std::string("Assertion failed (") + __FILE__ + ":" +            \
                                     std::to_string(__LINE__) + "): " #cond);                        \
        }                                                                                             \
    } while (0)
