/* A stand-in libcuda.so.1 whose cuInit fails with CUDA_ERROR_UNKNOWN: the
 * CUDA runtime then answers cudaGetDeviceCount with cudaErrorUnknown, a
 * start-up error that is neither "no device" nor "no driver". ctest
 * cuda_startup_error_fails runs test_cuda against it (LD_LIBRARY_PATH) and
 * requires a failure naming the error, not a skip. The runtime looks every
 * driver entry point up through cuGetProcAddress; each one but cuInit,
 * cuDriverGetVersion and cuGetProcAddress itself fails the same way. */
#include <string.h>

typedef int CUresult;
enum { kCudaErrorUnknown = 999 };

static CUresult fail_call(void) { return kCudaErrorUnknown; }

CUresult cuInit(unsigned flags) {
  (void)flags;
  return kCudaErrorUnknown;
}

CUresult cuDriverGetVersion(int* version) {
  *version = 13000; /* new enough for the toolkit: the failure is cuInit's */
  return 0;
}

CUresult cuGetProcAddress(const char* symbol, void** fn, int version, unsigned long long flags);

CUresult cuGetProcAddress_v2(const char* symbol, void** fn, int version, unsigned long long flags,
                             int* status) {
  (void)flags;
  if (status) *status = 0;
  if (!strcmp(symbol, "cuInit")) *fn = (void*)cuInit;
  else if (!strcmp(symbol, "cuDriverGetVersion")) *fn = (void*)cuDriverGetVersion;
  else if (!strcmp(symbol, "cuGetProcAddress"))  /* 12000 on: the _v2 signature */
    *fn = version >= 12000 ? (void*)cuGetProcAddress_v2 : (void*)cuGetProcAddress;
  else *fn = (void*)fail_call;
  return 0;
}

CUresult cuGetProcAddress(const char* symbol, void** fn, int version, unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, fn, version, flags, 0);
}
