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
 *
 * The kernels exist once per instruction set, and the widest this CPU runs is used: avx512 (xxh3's
 * AVX-512 path), avx2 (its AVX2 path; e.g. AMD EPYC Rome and Milan), both with 256-bit
 * non-temporal stores, and portable (memcpy, xxh3 on the compiler's baseline: SSE2, NEON on
 * aarch64, scalar). ``path()`` names the one in use, ``paths()`` those that run here, ``use(name)``
 * picks another (the tests check that every one gives the same bytes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "_memops.h"

#define MAX_THREADS 8
#define GROUP 4096 /* buffers held at once (bounds the Py_buffer array) */

/* The kernels, one set per instruction set (_memops_kernels.h, compiled by _memops_avx512.c,
 * _memops_avx2.c and _memops_portable.c); PyInit picks the widest this CPU runs, ``use`` another. */
KV_DECLARE(portable)
#if defined(__x86_64__) && defined(__GNUC__)
#define KV_X86 1
KV_DECLARE(avx2)
KV_DECLARE(avx512)
#endif

typedef struct {
    const char *name;
    uint64_t (*copy_hash)(char *dst, const char *src, size_t n, char *bounce);
    uint64_t (*hash_one)(const void *p, size_t n);
    void (*store_fence)(void);
} kernels_t;

static const kernels_t KERNELS[] = {
#ifdef KV_X86
    {"avx512", copy_hash_avx512, hash_one_avx512, store_fence_avx512},
    {"avx2", copy_hash_avx2, hash_one_avx2, store_fence_avx2},
#endif
    {"portable", copy_hash_portable, hash_one_portable, store_fence_portable},
};
#define N_KERNELS ((int)(sizeof(KERNELS) / sizeof(KERNELS[0])))

static int runs_here(const kernels_t *k) {
#ifdef KV_X86
    if (strcmp(k->name, "avx512") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (strcmp(k->name, "avx2") == 0) return __builtin_cpu_supports("avx2");
#endif
    return strcmp(k->name, "portable") == 0;
}

static const kernels_t *K = &KERNELS[N_KERNELS - 1]; /* in use: the widest at import, or ``use``'s */
static const kernels_t *kernels(void) { return __atomic_load_n(&K, __ATOMIC_ACQUIRE); }

static uint64_t le64(const unsigned char *p) { /* the wire's u64: little-endian */
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static void put_le64(unsigned char *p, uint64_t v) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
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
    const kernels_t *k; /* the kernels of the whole job */
} job_t;

static void run_job(job_t *j) {
    char bounce[KV_PIECE] __attribute__((aligned(64)));
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->n) break;
        Py_ssize_t k = j->base + i;
        uint64_t h = j->k->copy_hash((char *)j->dst[i].buf, j->src + le64(j->off + 8 * k), (size_t)j->dst[i].len, bounce);
        j->bad[k] = h != le64(j->want + 8 * k);
    }
    j->k->store_fence();
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
        job_t job = {views, (const char *)src.buf, off.buf, want.buf, m, base, bad, 0, 0, 0, kernels()};
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
        const kernels_t *k = kernels();
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < m; i++) {
            put_le64((unsigned char *)out.buf + 8 * (base + i), k->hash_one(views[i].buf, (size_t)views[i].len));
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
        put_le64((unsigned char *)out.buf + 8 * i, at);
        put_le64((unsigned char *)out.buf + 8 * (n + i), len);
        PyBuffer_Release(&v);
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *path(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(kernels()->name);
}

static PyObject *paths(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    PyObject *out = PyList_New(0);
    for (int i = 0; out != NULL && i < N_KERNELS; i++) {
        if (!runs_here(&KERNELS[i])) continue;
        PyObject *v = PyUnicode_FromString(KERNELS[i].name);
        if (v == NULL || PyList_Append(out, v) < 0) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

static PyObject *use(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (int i = 0; i < N_KERNELS; i++) {
        if (strcmp(KERNELS[i].name, name) != 0) continue;
        if (!runs_here(&KERNELS[i])) {
            PyErr_Format(PyExc_ValueError, "the %s kernels do not run on this CPU", name);
            return NULL;
        }
        __atomic_store_n(&K, &KERNELS[i], __ATOMIC_RELEASE); /* a copy already running keeps its own */
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_ValueError, "no kernels named %s in this build", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"path", path, METH_NOARGS, "path() -> the kernels in use: avx512, avx2 or portable."},
    {"paths", paths, METH_NOARGS, "paths() -> the kernels this build has that run on this CPU, widest first."},
    {"use", use, METH_VARARGS, "use(name): use these kernels from now on (ValueError when they cannot run here)."},
    {"spans", spans, METH_VARARGS, "spans(bufs, out): each buffer's address (u64 LE) at [8i], its length at [8(n+i)]."},
    {"copy_verify", copy_verify, METH_VARARGS,
     "copy_verify(dsts, src, offsets, want, threads) -> bad indexes: copy src[offsets[i]:] into each dst "
     "(non-temporal stores), hashing exactly the bytes written (xxh3-64), compared with want[i]."},
    {"xxh3_many", xxh3_many, METH_VARARGS, "xxh3_many(bufs, out): xxh3-64 of each buffer into out, u64 LE."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_memops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__memops(void) {
#ifdef KV_X86
    __builtin_cpu_init();
#endif
    for (int i = 0; i < N_KERNELS; i++) {
        if (runs_here(&KERNELS[i])) {
            K = &KERNELS[i];
            break;
        }
    }
    pthread_atfork(NULL, NULL, pool_after_fork_child);
    return PyModule_Create(&module);
}
