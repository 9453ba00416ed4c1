/* kvport._memops's kernels for x86-64 with AVX2 (xxh3's AVX2 path): e.g. AMD EPYC Rome and Milan. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define XXH_VECTOR 2 /* XXH_AVX2 */
#define KV_NT_STORES 1
#define KV_KERNEL(name) name##_avx2
#include "_memops_kernels.h"
#else
typedef int kv_no_avx2; /* not x86-64: this set is not built (ISO C wants something here) */
#endif
