/* The kernels of kvport._memops, compiled once per instruction set. A file that includes this
 * first names its set: the target pragma, XXH_VECTOR (xxh3's own path), KV_KERNEL(name) (the
 * suffix its functions get) and, on x86-64, KV_NT_STORES (256-bit non-temporal stores). Without
 * KV_NT_STORES the copy is memcpy: the portable path, for any CPU GCC or Clang builds for.
 *
 *   uint64_t KV_KERNEL(copy_hash)(dst, src, n, bounce)   dst[:n] = src[:n]; xxh3-64 of what was written
 *   uint64_t KV_KERNEL(hash_one)(p, n)                   xxh3-64 of p[:n]
 *   void     KV_KERNEL(store_fence)(void)                stores visible to other threads before return
 */
#include <string.h>

#include "_memops.h"
#define XXH_INLINE_ALL
#include <xxhash.h>

#ifdef KV_NT_STORES
#include <immintrin.h>

/* dst aligned to 64 bytes first; then 4 pages at a time, interleaved, so four read streams are in
 * flight (a single stream of non-temporal stores runs at ~0.75 of glibc's large memcpy here). */
static void nt_copy(char *dst, const char *src, size_t n) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t quads = n / (4 * KV_PAGE), i, p;
    for (size_t q = 0; q < quads; q++) {
        const char *s = src + q * 4 * KV_PAGE;
        char *d = dst + q * 4 * KV_PAGE;
        for (i = 0; i < KV_PAGE; i += 64) {
            for (p = 0; p < 4; p++) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(s + p * KV_PAGE + i));
                __m256i b = _mm256_loadu_si256((const __m256i *)(s + p * KV_PAGE + i + 32));
                _mm256_stream_si256((__m256i *)(d + p * KV_PAGE + i), a);
                _mm256_stream_si256((__m256i *)(d + p * KV_PAGE + i + 32), b);
            }
        }
    }
    size_t done = quads * 4 * KV_PAGE, body = (n - done) & ~(size_t)63;
    for (i = done; i < done + body; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
    }
    memcpy(dst + done + body, src + done + body, n - done - body);
}

static void fence(void) { _mm_sfence(); } /* non-temporal stores are weakly ordered */
#else
static void nt_copy(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
static void fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif

uint64_t KV_KERNEL(copy_hash)(char *dst, const char *src, size_t n, char *bounce) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (size_t o = 0; o < n; o += KV_PIECE) {
        size_t m = n - o < KV_PIECE ? n - o : KV_PIECE;
        memcpy(bounce, src + o, m);
        XXH3_64bits_update(&st, bounce, m);
        nt_copy(dst + o, bounce, m);
    }
    return XXH3_64bits_digest(&st);
}

uint64_t KV_KERNEL(hash_one)(const void *p, size_t n) { return XXH3_64bits(p, n); }

void KV_KERNEL(store_fence)(void) { fence(); }
