/* A libcuda.so.1 stand-in for machines without a driver: mooncake.pg links these driver entry
 * points; each reports CUDA_ERROR_NO_DEVICE (100) so the library loads and finds no GPU. */
#include <stddef.h>
#define NO_DEVICE 100
#define STUB(name) int name(void) { return NO_DEVICE; }
STUB(cuInit)
STUB(cuCtxGetDevice)
STUB(cuCtxSetCurrent)
STUB(cuDeviceGet)
STUB(cuDeviceGetAttribute)
STUB(cuDevicePrimaryCtxRelease_v2)
STUB(cuDevicePrimaryCtxRetain)
STUB(cuMemAddressFree)
STUB(cuMemAddressReserve)
STUB(cuMemCreate)
STUB(cuMemExportToShareableHandle)
STUB(cuMemGetAddressRange_v2)
STUB(cuMemGetAllocationGranularity)
STUB(cuMemGetHandleForAddressRange)
STUB(cuMemImportFromShareableHandle)
STUB(cuMemMap)
STUB(cuMemRelease)
STUB(cuMemSetAccess)
STUB(cuMemUnmap)
STUB(cuPointerGetAttribute)
STUB(cuPointerSetAttribute)
STUB(cuDeviceGetCount)
int cuDriverGetVersion(int *v) { if (v) *v = 0; return 0; }
int cuGetErrorString(int e, const char **s) { (void)e; if (s) *s = "no CUDA device (stub driver)"; return 0; }
int cuGetErrorName(int e, const char **s) { (void)e; if (s) *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
