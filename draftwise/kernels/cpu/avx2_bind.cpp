#define KERNEL_ISA "avx2"
#include "bindings.h"
