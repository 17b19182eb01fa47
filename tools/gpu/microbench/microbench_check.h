#pragma once
// CK(expr): a microbench's CUDA / cuBLASLt / driver call must return 0, else the program prints what failed and
// exits. The microbenches are standalone timing probes, so they stop at the first error instead of throwing.
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                              \
  do {                                                                                     \
    auto e_ = (x);                                                                         \
    if (e_ != 0) {                                                                         \
      std::printf("FAIL: error %d (%s) at %s:%d\n", int(e_), #x, __FILE__, __LINE__);      \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)
