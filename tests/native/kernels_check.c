/* The portable kernels of kvport._memops on their own (no Python): built for another CPU (aarch64)
 * and run under qemu-user by tests/test_memops.py. For each size, the bytes are
 * b[i] = (131 i + 7 (i >> 8) + 17) mod 256; prints "size hash copy_hash copied_equal" per line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "_memops.h"

KV_DECLARE(portable)

int main(void) {
    static const size_t sizes[] = {0, 1, 63, 64, 65, 4096, 16384, 16391, 65536, 100003, 1 << 20};
    static char bounce[KV_PIECE];
    size_t most = 1 << 20;
    unsigned char *src = malloc(most), *dst = malloc(most + 13);
    if (src == NULL || dst == NULL) return 2;
    for (size_t i = 0; i < most; i++) src[i] = (unsigned char)(131 * i + 7 * (i >> 8) + 17);
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t n = sizes[s];
        memset(dst, 0, most + 13);
        uint64_t h = hash_one_portable(src, n);
        uint64_t c = copy_hash_portable((char *)dst + 13, (const char *)src, n, bounce); /* misaligned */
        store_fence_portable();
        printf("%zu %016llx %016llx %d\n", n, (unsigned long long)h, (unsigned long long)c,
               memcmp(dst + 13, src, n) == 0);
    }
    free(src);
    free(dst);
    return 0;
}
