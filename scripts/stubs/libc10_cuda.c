/* A libc10_cuda.so stand-in: mooncake.pg's torch extension links these c10::cuda symbols
 * (Itanium-mangled names are plain C identifiers) but only calls them for CUDA tensors.
 * On a CPU-only machine a call means a CUDA path was taken by mistake: say so and abort. */
#include <stdio.h>
#include <stdlib.h>
static void no_cuda(const char *what) {
  fprintf(stderr, "sglang-elastic-ep stub libc10_cuda: %s called without CUDA\n", what);
  abort();
}
void _ZN3c104cuda14current_deviceEv(void) { no_cuda("c10::cuda::current_device"); }
void _ZN3c104cuda17hasPrimaryContextEa(void) { no_cuda("c10::cuda::hasPrimaryContext"); }
void _ZN3c104cuda20getCurrentCUDAStreamEa(void) { no_cuda("c10::cuda::getCurrentCUDAStream"); }
void _ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb(void) { no_cuda("c10_cuda_check"); }
void _ZNK3c104cuda10CUDAStream11synchronizeEv(void) { no_cuda("CUDAStream::synchronize"); }
void _ZNK3c104cuda10CUDAStream6streamEv(void) { no_cuda("CUDAStream::stream"); }
