#define KERNEL_ISA "avx512"
#include "bindings.h"
