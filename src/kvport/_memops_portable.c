/* kvport._memops's portable kernels: no intrinsics of kvport's own (memcpy; xxh3 picks its path
 * from the compiler's baseline: SSE2 on x86-64, NEON on aarch64, scalar elsewhere). */
#define KV_KERNEL(name) name##_portable
#include "_memops_kernels.h"
