/* kvport._memops's kernels for x86-64 with AVX-512 F and BW (xxh3's AVX-512 path). */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,avx512f,avx512bw")
#define XXH_VECTOR 3 /* XXH_AVX512 */
#define KV_NT_STORES 1
#define KV_KERNEL(name) name##_avx512
#include "_memops_kernels.h"
#else
typedef int kv_no_avx512; /* not x86-64: this set is not built (ISO C wants something here) */
#endif
