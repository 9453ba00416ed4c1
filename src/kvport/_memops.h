/* What kvport._memops (the module, _memops.c) and its kernels (_memops_kernels.h, compiled once per
 * instruction set by _memops_avx512.c, _memops_avx2.c and _memops_portable.c) agree on. */
#ifndef KVPORT_MEMOPS_H
#define KVPORT_MEMOPS_H
#include <stddef.h>
#include <stdint.h>

#define KV_PIECE (16 * 1024) /* copy_hash hashes, then stores, this many bytes at a time (its bounce buffer) */
#define KV_PAGE 4096

#define KV_DECLARE(sfx)                                                           \
    uint64_t copy_hash_##sfx(char *dst, const char *src, size_t n, char *bounce); \
    uint64_t hash_one_##sfx(const void *p, size_t n);                             \
    void store_fence_##sfx(void);

#endif
