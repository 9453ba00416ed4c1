/* kvport._memops: the native memory kernels of kvport's hot paths (optional; kvport.memops falls
 * back to numpy + python-xxhash with identical results when this module is not built).
 *
 *   xxh3_many(bufs, out)                     out[8i:8i+8] = xxh3_64(bufs[i]) as u64 LE
 *   spans(bufs, out)                         out = addresses (u64 LE) of bufs, then their lengths
 *   copy_verify(dsts, src, offsets, want, threads) -> list of bad indexes
 *       dsts[i][:] = src[offsets[i] : offsets[i] + len(dsts[i])], and i is bad when
 *       xxh3_64 of the copied bytes != want[i]
 *
 * copy_verify is the receive side of a same-host transfer out of registered memory, measured
 * against one memcpy of the same bytes (kvport bench transfer). Per 16 KiB piece:
 *
 *     src (RAM) --memcpy--> bounce (L1) --xxh3--> digest
 *                           bounce (L1) --non-temporal stores, 4 KiB pages interleaved--> dst
 *
 * so what is hashed is exactly what is written (the producer may race us; a racing write cannot
 * slip between the hash and the copy), the destination is never read for ownership, and RAM sees
 * one read and one write per byte, as in memcpy. Chunks are split over ``threads`` threads; the GIL
 * is released while bytes move. Every length and offset is checked before anything is copied.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if !defined(__x86_64__) || !defined(__GNUC__)
#error "kvport._memops needs x86-64 and GCC/Clang (kvport.memops falls back to numpy + xxhash)"
#endif

/* Everything below the pragma is compiled for AVX2 + AVX-512 (xxh3 takes its AVX-512 path);
 * PyInit refuses to load on a CPU without them, and kvport.memops then uses its fallbacks. */
#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512bw")
#include <immintrin.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#define PIECE (16 * 1024)
#define PAGE 4096
#define MAX_THREADS 8
#define GROUP 4096 /* buffers held at once (bounds the Py_buffer array) */

/* dst aligned to 64 bytes first; then 4 pages at a time, interleaved, so four read streams are in
 * flight (a single stream of non-temporal stores runs at ~0.75 of glibc's large memcpy here). */
static void nt_copy(char *dst, const char *src, size_t n) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t quads = n / (4 * PAGE), i, p;
    for (size_t q = 0; q < quads; q++) {
        const char *s = src + q * 4 * PAGE;
        char *d = dst + q * 4 * PAGE;
        for (i = 0; i < PAGE; i += 64) {
            for (p = 0; p < 4; p++) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(s + p * PAGE + i));
                __m256i b = _mm256_loadu_si256((const __m256i *)(s + p * PAGE + i + 32));
                _mm256_stream_si256((__m256i *)(d + p * PAGE + i), a);
                _mm256_stream_si256((__m256i *)(d + p * PAGE + i + 32), b);
            }
        }
    }
    size_t done = quads * 4 * PAGE, body = (n - done) & ~(size_t)63;
    for (i = done; i < done + body; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
    }
    memcpy(dst + done + body, src + done + body, n - done - body);
}

static uint64_t copy_hash(char *dst, const char *src, size_t n, char *bounce) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (size_t o = 0; o < n; o += PIECE) {
        size_t m = n - o < PIECE ? n - o : PIECE;
        memcpy(bounce, src + o, m);
        XXH3_64bits_update(&st, bounce, m);
        nt_copy(dst + o, bounce, m);
    }
    return XXH3_64bits_digest(&st);
}

static uint64_t hash_one(const void *p, size_t n) { return XXH3_64bits(p, n); }
static void store_fence(void) { _mm_sfence(); } /* non-temporal stores visible before we return */
#pragma GCC pop_options

static uint64_t le64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* x86-64 is little-endian */
}

/* A copy job shared by the calling thread and the pool's workers: each takes the next chunk from an
 * atomic counter, so a worker that wakes up late (both cores busy) only means the caller copies more
 * of the chunks itself; the caller never waits for a worker that has not joined the job. */
typedef struct {
    Py_buffer *dst;
    const char *src;
    const unsigned char *off, *want;
    Py_ssize_t n, base;
    unsigned char *bad;
    Py_ssize_t next; /* atomic: the next chunk to take */
    int active;      /* workers inside the job (under pool.mu) */
    int closed;      /* no worker may join any more (under pool.mu) */
} job_t;

static void run_job(job_t *j) {
    char bounce[PIECE] __attribute__((aligned(64)));
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->n) break;
        Py_ssize_t k = j->base + i;
        uint64_t h = copy_hash((char *)j->dst[i].buf, j->src + le64(j->off + 8 * k), (size_t)j->dst[i].len, bounce);
        j->bad[k] = h != le64(j->want + 8 * k);
    }
    store_fence();
}

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    job_t *job;
    unsigned long gen;
    int workers;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0};

static void *worker(void *arg) {
    (void)arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.job == NULL || pool.gen == seen) pthread_cond_wait(&pool.work, &pool.mu);
        job_t *j = pool.job;
        seen = pool.gen;
        if (j->closed) continue;
        j->active++;
        pthread_mutex_unlock(&pool.mu);
        run_job(j);
        pthread_mutex_lock(&pool.mu);
        if (--j->active == 0) pthread_cond_broadcast(&pool.done);
    }
    return NULL;
}

static void pool_after_fork_child(void) { /* a forked child has none of the parent's threads */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.job = NULL;
    pool.workers = 0;
}

/* Run ``j`` on the calling thread plus up to ``helpers`` pool workers (started on first use). */
static void run_shared(job_t *j, int helpers) {
    pthread_mutex_lock(&pool.mu);
    while (pool.workers < helpers) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, NULL) != 0) break;
        pthread_detach(t);
        pool.workers++;
    }
    if (helpers > 0 && pool.workers > 0) {
        pool.job = j;
        pool.gen++;
        pthread_cond_broadcast(&pool.work);
    }
    pthread_mutex_unlock(&pool.mu);
    run_job(j);
    pthread_mutex_lock(&pool.mu);
    j->closed = 1;
    if (pool.job == j) pool.job = NULL;
    while (j->active > 0) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
}

static void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

static PyObject *copy_verify(PyObject *self, PyObject *args) {
    PyObject *dsts, *seq;
    Py_buffer src, off, want;
    int threads;
    if (!PyArg_ParseTuple(args, "Oy*y*y*i", &dsts, &src, &off, &want, &threads)) return NULL;
    PyObject *result = NULL;
    unsigned char *bad = NULL;
    Py_buffer *views = NULL;
    seq = PySequence_Fast(dsts, "dsts must be a sequence of writable buffers");
    if (seq == NULL) goto out;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (off.len != 8 * n || want.len != 8 * n) {
        PyErr_Format(PyExc_ValueError, "%zd buffers need %zd bytes of offsets and of digests", n, 8 * n);
        goto out;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    bad = PyMem_Calloc(n ? n : 1, 1);
    views = PyMem_Calloc(n < GROUP ? (n ? n : 1) : GROUP, sizeof(Py_buffer));
    if (bad == NULL || views == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t base = 0; base < n; base += GROUP) {
        Py_ssize_t m = n - base < GROUP ? n - base : GROUP, got = 0;
        for (; got < m; got++) {
            PyObject *o = PySequence_Fast_GET_ITEM(seq, base + got);
            if (PyObject_GetBuffer(o, &views[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) break;
            uint64_t start = le64((const unsigned char *)off.buf + 8 * (base + got));
            if (start > (uint64_t)src.len || (uint64_t)views[got].len > (uint64_t)src.len - start) {
                PyErr_Format(PyExc_ValueError, "chunk %zd: [%llu, +%zd) is outside the %zd-byte source",
                             base + got, (unsigned long long)start, views[got].len, src.len);
                PyBuffer_Release(&views[got]);
                break;
            }
        }
        if (got < m) {
            release_all(views, got);
            goto out;
        }
        job_t job = {views, (const char *)src.buf, off.buf, want.buf, m, base, bad, 0, 0, 0};
        Py_BEGIN_ALLOW_THREADS
        run_shared(&job, threads - 1);
        Py_END_ALLOW_THREADS
        release_all(views, m);
    }
    result = PyList_New(0);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        if (!bad[i]) continue;
        PyObject *v = PyLong_FromSsize_t(i);
        if (v == NULL || PyList_Append(result, v) < 0) Py_CLEAR(result);
        Py_XDECREF(v);
    }
out:
    PyMem_Free(views);
    PyMem_Free(bad);
    Py_XDECREF(seq);
    PyBuffer_Release(&src);
    PyBuffer_Release(&off);
    PyBuffer_Release(&want);
    return result;
}

/* The (bufs, out) arguments of xxh3_many and spans: bufs as a fast sequence (returned; NULL on
 * error, with ``out`` released) and ``out`` a writable buffer of exactly ``per`` bytes a buffer. */
static PyObject *bufs_and_out(PyObject *args, Py_ssize_t per, Py_buffer *out, Py_ssize_t *n) {
    PyObject *bufs;
    if (!PyArg_ParseTuple(args, "Ow*", &bufs, out)) return NULL;
    PyObject *seq = PySequence_Fast(bufs, "bufs must be a sequence of buffers");
    if (seq != NULL && out->len != per * PySequence_Fast_GET_SIZE(seq)) {
        PyErr_Format(PyExc_ValueError, "%zd buffers need an output of %zd bytes, got %zd",
                     PySequence_Fast_GET_SIZE(seq), per * PySequence_Fast_GET_SIZE(seq), out->len);
        Py_CLEAR(seq);
    }
    if (seq == NULL) {
        PyBuffer_Release(out);
        return NULL;
    }
    *n = PySequence_Fast_GET_SIZE(seq);
    return seq;
}

static PyObject *xxh3_many(PyObject *self, PyObject *args) {
    Py_buffer out;
    Py_ssize_t n;
    PyObject *seq = bufs_and_out(args, 8, &out, &n);
    if (seq == NULL) return NULL;
    PyObject *result = NULL;
    Py_buffer *views = PyMem_Calloc(n < GROUP ? (n ? n : 1) : GROUP, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t base = 0; base < n; base += GROUP) {
        Py_ssize_t m = n - base < GROUP ? n - base : GROUP, got = 0;
        for (; got < m; got++)
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, base + got), &views[got], PyBUF_C_CONTIGUOUS) < 0) break;
        if (got < m) {
            release_all(views, got);
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < m; i++) {
            uint64_t h = hash_one(views[i].buf, (size_t)views[i].len);
            memcpy((char *)out.buf + 8 * (base + i), &h, 8);
        }
        Py_END_ALLOW_THREADS
        release_all(views, m);
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyMem_Free(views);
    Py_XDECREF(seq);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *spans(PyObject *self, PyObject *args) {
    Py_buffer out;
    Py_ssize_t n;
    PyObject *seq = bufs_and_out(args, 16, &out, &n);
    if (seq == NULL) return NULL;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer v;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &v, PyBUF_C_CONTIGUOUS) < 0) goto done;
        uint64_t at = (uint64_t)(uintptr_t)v.buf, len = (uint64_t)v.len;
        memcpy((char *)out.buf + 8 * i, &at, 8);
        memcpy((char *)out.buf + 8 * (n + i), &len, 8);
        PyBuffer_Release(&v);
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"spans", spans, METH_VARARGS, "spans(bufs, out): each buffer's address (u64 LE) at [8i], its length at [8(n+i)]."},
    {"copy_verify", copy_verify, METH_VARARGS,
     "copy_verify(dsts, src, offsets, want, threads) -> bad indexes: copy src[offsets[i]:] into each dst "
     "(non-temporal stores), hashing exactly the bytes written (xxh3-64), compared with want[i]."},
    {"xxh3_many", xxh3_many, METH_VARARGS, "xxh3_many(bufs, out): xxh3-64 of each buffer into out, u64 LE."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_memops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__memops(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) {
        PyErr_SetString(PyExc_ImportError, "kvport._memops needs AVX2 and AVX-512 (F, BW)");
        return NULL;
    }
    pthread_atfork(NULL, NULL, pool_after_fork_child);
    return PyModule_Create(&module);
}
