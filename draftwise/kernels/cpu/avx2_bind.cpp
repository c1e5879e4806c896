#ifdef DRAFTWISE_AVX_VNNI
#define KERNEL_ISA "avx_vnni"
#else
#define KERNEL_ISA "avx2"
#endif
#include "bindings.h"
