/* Fused CPU kernels for the orthonormal DCT-II of activation maps (freqact/dct.py is the
 * specification: the same transform as scipy.fft.dctn(type=2, norm="ortho") over the last two
 * dims; tests/test_dct.py checks these kernels against it and against scipy in float64).
 *
 * Layout: `maps` float32 maps of h x w elements each, contiguous (a 1D transform is h = 1).
 * One OpenMP team of `threads` splits the maps; each map is transformed while it is in cache,
 * with per-thread scratch, so no activation-sized temporary exists.
 *
 * The basis D[k][i] = c_k cos(pi (2i + 1) k / (2n)) (c_0 = sqrt(1/n), c_k = sqrt(2/n)) is built in
 * double once per call and rounded to float. Its rows are even or odd about the centre,
 * D[k][n - 1 - i] = (-1)^k D[k][i], so a length-n transform is two half-size products:
 * even k from u_i = x_i + x_{n-1-i}, odd k from v_i = x_i - x_{n-1-i} (i < n / 2; for odd n the
 * middle element joins u alone, as D[odd k][middle] = 0). That halves the multiply-adds; it is
 * used along columns, and along rows of at least FULL_ROWS (shorter rows take the plain product,
 * which is faster there: see FULL_ROWS).
 *
 * Loops are axpy-shaped (a row of the output accumulates scalar x row), so the compiler vectorises
 * them without reassociating sums; FMA contraction is allowed (the result is not bit-matched to
 * torch, only checked to float32 accuracy). Every function returns 0, or -1 when the per-thread
 * scratch could not be allocated (nothing is written then that the caller may read); the corner
 * and high-pass jobs return 1 when the output is complete but a corner coefficient is not finite.
 */
#define _GNU_SOURCE /* MADV_HUGEPAGE under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h> /* non-temporal stores: `store_result` */
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

static const double PI = 3.14159265358979323846;

/* Accumulators are fixed-width blocks of LANES floats, which the compiler keeps in one vector
 * register (AVX-512) or two (AVX2) over a whole dot-product loop. Tables are stored with rows
 * padded by zeros to a multiple of LANES, so a block may read past the last real column. */
#define LANES 16

static int64_t padded(int64_t m) { return (m + LANES - 1) / LANES * LANES; }

typedef struct {
    int64_t n, ne, no; /* length, even rows ceil(n / 2), odd rows floor(n / 2) */
    int64_t pe, po;    /* padded row strides of the even / odd tables */
    float *fe_t;       /* [j * pe + q] = D[2q][j], j < ne: forward along a row */
    float *fo_t;       /* [j * po + q] = D[2q + 1][j], j < no */
    float *ie;         /* [q * pe + i] = D[2q][i]: along columns, and the inverse */
    float *io;         /* [q * po + i] = D[2q + 1][i] */
    float *full_t;     /* [j * padded(n) + k] = D[k][j]: forward along rows (n < FULL_ROWS) */
    float *full;       /* [k * padded(n) + i] = D[k][i]: inverse along rows (n < FULL_ROWS) */
} half_plan;

/* Along rows, the even/odd split halves the multiply-adds but leaves the even and odd outputs
 * interleaved; the interleave is a vector shuffle per LANES outputs (`interleave`). Rows shorter
 * than FULL_ROWS = 2 LANES would feed products of less than a vector and take the plain n x n
 * product, outputs in order. Along columns the split needs no shuffle: there each product row is
 * a whole row of the map. */
#define FULL_ROWS (2 * LANES)

static double basis(int64_t k, int64_t i, int64_t n) {
    const double c = k == 0 ? sqrt(1.0 / (double)n) : sqrt(2.0 / (double)n);
    return c * cos(PI * (double)(2 * i + 1) * (double)k / (2.0 * (double)n));
}

static void free_plan(half_plan *p) {
    free(p->fe_t);
    free(p->fo_t);
    free(p->ie);
    free(p->io);
    free(p->full_t);
    free(p->full);
}

static float *leading_rows(int64_t m, int64_t n, int transposed);

static int make_plan(half_plan *p, int64_t n) {
    p->full_t = p->full = NULL;
    p->n = n;
    p->ne = (n + 1) / 2;
    p->no = n / 2;
    p->pe = padded(p->ne);
    p->po = padded(p->no);
    const size_t e = (size_t)(p->ne * p->pe) + 1, o = (size_t)(p->no * p->po) + 1;
    p->fe_t = calloc(e, sizeof(float));
    p->ie = calloc(e, sizeof(float));
    p->fo_t = calloc(o, sizeof(float));
    p->io = calloc(o, sizeof(float));
    if (n < FULL_ROWS) {
        p->full_t = leading_rows(n, n, 1);
        p->full = leading_rows(n, n, 0);
    }
    if (!p->fe_t || !p->ie || !p->fo_t || !p->io || (n < FULL_ROWS && (!p->full_t || !p->full))) {
        free_plan(p);
        return -1;
    }
    for (int64_t q = 0; q < p->ne; q++)
        for (int64_t i = 0; i < p->ne; i++)
            p->ie[q * p->pe + i] = p->fe_t[i * p->pe + q] = (float)basis(2 * q, i, n);
    for (int64_t q = 0; q < p->no; q++)
        for (int64_t i = 0; i < p->no; i++)
            p->io[q * p->po + i] = p->fo_t[i * p->po + q] = (float)basis(2 * q + 1, i, n);
    return 0;
}

/* Leading rows of D (rows k < m, columns i < n), zero-padded rows: [k * padded(n) + i] = D[k][i],
 * or transposed, [i * padded(m) + k]. */
static float *leading_rows(int64_t m, int64_t n, int transposed) {
    const int64_t rows = transposed ? n : m, stride = padded(transposed ? m : n);
    float *d = calloc((size_t)(rows * stride), sizeof(float));
    if (d)
        for (int64_t k = 0; k < m; k++)
            for (int64_t i = 0; i < n; i++)
                d[transposed ? i * stride + k : k * stride + i] = (float)basis(k, i, n);
    return d;
}

/* GROUP independent accumulators per loop hide the latency of the multiply-adds. They are GCC /
 * Clang vector types (not intrinsics: any CPU; AVX2 splits one into two registers), so they stay
 * in registers; vload/vstore are unaligned accesses. */
#define GROUP 4
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_u __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline vec vload(const float *p) { return *(const vec_u *)p; }
static inline void vstore(float *p, vec v) { *(vec_u *)p = v; }

/* The first `count` (<= LANES) lanes of v to p. */
static inline void vstore_part(float *p, vec v, int64_t count) {
    if (count == LANES) {
        vstore(p, v);
    } else {
        float lanes[LANES];
        vstore(lanes, v);
        memcpy(p, lanes, (size_t)count * sizeof(float));
    }
}

/* The blocks below keep `rows` (1 to GROUP; a constant where inlined) output rows of LANES
 * columns in registers, each as two partial sums (the even and the odd terms), so that even a
 * single row keeps two independent multiply-add chains in flight (one chain waits on the
 * multiply-add latency: the corner transforms' 7-row products were latency-bound). */

/* out_r[0:count] = sum_j s_r[j] * mat[j * stride + 0:count] for r < rows, s_r = s + r * s_stride,
 * out_r = out + r * out_stride: rows of scalars against shared vector rows (both products below:
 * a vector times a table, and a table times a block of map rows). */
static inline __attribute__((always_inline)) void
block_product(const float *restrict s, int64_t s_stride, const int rows, int64_t len,
              const float *restrict mat, int64_t stride, int64_t count, float *restrict out,
              int64_t out_stride) {
    vec even[GROUP], odd[GROUP];
    for (int r = 0; r < rows; r++)
        even[r] = odd[r] = (vec){0};
    int64_t j = 0;
    for (; j + 1 < len; j += 2) {
        const vec m0 = vload(mat + j * stride), m1 = vload(mat + (j + 1) * stride);
        for (int r = 0; r < rows; r++) {
            even[r] += s[r * s_stride + j] * m0;
            odd[r] += s[r * s_stride + j + 1] * m1;
        }
    }
    if (j < len) {
        const vec m0 = vload(mat + j * stride);
        for (int r = 0; r < rows; r++)
            even[r] += s[r * s_stride + j] * m0;
    }
    for (int r = 0; r < rows; r++)
        vstore_part(out + r * out_stride, even[r] + odd[r], count);
}

/* block_product for rows in 1..GROUP, each count compiled with its own registers (inlined: a
 * call per block costs the small corner products a third of their time). */
static inline __attribute__((always_inline)) void product_of_rows(const float *restrict s, int64_t s_stride, int64_t rows, int64_t len,
                            const float *restrict mat, int64_t stride, int64_t count,
                            float *restrict out, int64_t out_stride) {
    if (rows == 4)
        block_product(s, s_stride, 4, len, mat, stride, count, out, out_stride);
    else if (rows == 3)
        block_product(s, s_stride, 3, len, mat, stride, count, out, out_stride);
    else if (rows == 2)
        block_product(s, s_stride, 2, len, mat, stride, count, out, out_stride);
    else
        block_product(s, s_stride, 1, len, mat, stride, count, out, out_stride);
}

/* out_r[0:m] = sum_j s_r[j] * mat[j * padded(m) + 0:m] (j < len) for every r < rows (any count),
 * s_r = s + r * s_stride, out_r = out + r * out_stride. */
static void vec_mat_rows(const float *restrict s, int64_t s_stride, int64_t rows, int64_t len,
                         const float *restrict mat, int64_t m, float *restrict out,
                         int64_t out_stride) {
    const int64_t stride = padded(m);
    for (int64_t r0 = 0; r0 < rows; r0 += GROUP) {
        const int64_t n = rows - r0 < GROUP ? rows - r0 : GROUP;
        const float *sr = s + r0 * s_stride;
        float *o = out + r0 * out_stride;
        for (int64_t q0 = 0; q0 < m; q0 += LANES) {
            const int64_t count = m - q0 < LANES ? m - q0 : LANES;
            product_of_rows(sr, s_stride, n, len, mat + q0, stride, count, o + q0, out_stride);
        }
    }
}

/* Columns [c0, cols) of one output row, scalar (for tails of X taller than PANEL_ROWS). */
static void row_tail(const float *restrict a, int64_t len, const float *restrict x,
                     int64_t x_stride, int64_t c0, int64_t cols, float *restrict y) {
    for (int64_t c = c0; c < cols; c++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < len; i++)
            sum += a[i] * x[i * x_stride + c];
        y[c] = sum;
    }
}

/* Tails of fewer than LANES columns (all of an 8 x 8 map's) are copied into a zero-padded panel
 * of whole vectors (a vector load from X itself could read past its last row), when X has at
 * most PANEL_ROWS rows: vector products there instead of scalar loops (8 x 8 synthesis 10.4 ->
 * 7.2 ms per 98,304 maps, one thread). */
#define PANEL_ROWS 64

/* Y[k, :cols] = sum_i a[k * lda + i] * X[i, :cols] for k < m; X rows x_stride apart, Y rows
 * y_stride apart. */
static void mat_rows(const float *restrict a, int64_t lda, int64_t m, int64_t len,
                     const float *restrict x, int64_t x_stride, int64_t cols, float *restrict y,
                     int64_t y_stride) {
    const int64_t full = cols / LANES * LANES, tail = cols - full;
    /* worth the copy from a group of output rows on (the corners' 2-row products stay scalar) */
    const int paneled = tail > 0 && len <= PANEL_ROWS && m >= GROUP;
    float panel[PANEL_ROWS * LANES];
    if (paneled)
        for (int64_t i = 0; i < len; i++)
            for (int64_t c = 0; c < LANES; c++)
                panel[i * LANES + c] = c < tail ? x[i * x_stride + full + c] : 0.0f;
    for (int64_t k = 0; k < m; k += GROUP) {
        const int64_t n = m - k < GROUP ? m - k : GROUP;
        const float *ak = a + k * lda;
        float *yk = y + k * y_stride;
        for (int64_t c = 0; c < full; c += LANES)
            product_of_rows(ak, lda, n, len, x + c, x_stride, LANES, yk + c, y_stride);
        if (paneled)
            product_of_rows(ak, lda, n, len, panel, LANES, tail, yk + full, y_stride);
        else
            for (int64_t r = 0; r < n && tail; r++)
                row_tail(ak + r * lda, len, x, x_stride, full, cols, yk + r * y_stride);
    }
}

/* Interleaving LANES / 2 even and LANES / 2 odd values (the low halves of e and o) into LANES
 * outputs e0 o0 e1 o1 ..., and back (the even and the odd lanes of two vectors), as vector
 * shuffles: a scalar scatter here cost more than the half of the products it saves. */
typedef int32_t lane_index __attribute__((vector_size(LANES * sizeof(int32_t))));
_Static_assert(LANES == 16, "the shuffle masks below are written for 16 lanes");
static const lane_index INTERLEAVE = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
static const lane_index EVEN_LANES = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const lane_index ODD_LANES = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

/* t[2q] = e[q], t[2q + 1] = o[q] for 2q, 2q + 1 < n; e and o readable LANES past n / 2. */
static void interleave(const float *restrict e, const float *restrict o, int64_t n,
                       float *restrict t) {
    for (int64_t c = 0; c < n; c += LANES) {
        const vec out = __builtin_shuffle(vload(e + c / 2), vload(o + c / 2), INTERLEAVE);
        vstore_part(t + c, out, n - c < LANES ? n - c : LANES);
    }
}

/* e[q] = y[2q], o[q] = y[2q + 1]: y readable up to 2 LANES past its n values, e and o LANES. */
static void deinterleave(const float *restrict y, int64_t n, float *restrict e,
                         float *restrict o) {
    for (int64_t c = 0; c < n; c += 2 * LANES) {
        const vec lo = vload(y + c), hi = vload(y + c + LANES);
        vstore(e + c / 2, __builtin_shuffle(lo, hi, EVEN_LANES));
        vstore(o + c / 2, __builtin_shuffle(lo, hi, ODD_LANES));
    }
}

/* Scratch of the row passes, per thread: u, v, e, o of GROUP rows each, padded. */
static size_t row_scratch_floats(int64_t n) { return (size_t)(4 * (GROUP * n + 2 * LANES)); }

/* Forward along `rows` (1 to GROUP) rows of length p->n: t[r] = D x[r]. */
static inline __attribute__((always_inline)) void
rows_forward_group(const half_plan *p, const float *restrict x, int rows, float *restrict t,
                   float *restrict scratch) {
    const int64_t n = p->n, ne = p->ne, no = p->no, part = GROUP * n + 2 * LANES;
    float *u = scratch, *v = scratch + part, *e = scratch + 2 * part, *o = scratch + 3 * part;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        for (int64_t j = 0; j < no; j++) {
            u[r * n + j] = xr[j] + xr[n - 1 - j];
            v[r * n + j] = xr[j] - xr[n - 1 - j];
        }
        if (n & 1)
            u[r * n + no] = xr[no];
    }
    vec_mat_rows(u, n, rows, ne, p->fe_t, ne, e, n);
    vec_mat_rows(v, n, rows, no, p->fo_t, no, o, n);
    for (int r = 0; r < rows; r++)
        interleave(e + r * n, o + r * n, n, t + r * n);
}

/* Forward along the columns of an (n x cols) block: y = D t. scratch: n * cols floats. */
static void cols_forward(const half_plan *p, const float *restrict t, int64_t cols,
                         float *restrict y, float *restrict scratch) {
    const int64_t n = p->n, ne = p->ne, no = p->no;
    float *u = scratch, *v = scratch + ne * cols;
    for (int64_t i = 0; i < no; i++)
        for (int64_t c = 0; c < cols; c++) {
            u[i * cols + c] = t[i * cols + c] + t[(n - 1 - i) * cols + c];
            v[i * cols + c] = t[i * cols + c] - t[(n - 1 - i) * cols + c];
        }
    if (n & 1)
        memcpy(u + no * cols, t + no * cols, (size_t)cols * sizeof(float));
    mat_rows(p->ie, p->pe, ne, ne, u, cols, cols, y, 2 * cols);        /* rows 0, 2, 4, ... */
    mat_rows(p->io, p->po, no, no, v, cols, cols, y + cols, 2 * cols); /* rows 1, 3, ... */
}

/* Inverse along `rows` (1 to GROUP) rows: x[r] = D^T y[r]; y readable 2 LANES past its rows. */
static inline __attribute__((always_inline)) void
rows_inverse_group(const half_plan *p, const float *restrict y, int rows, float *restrict x,
                   float *restrict scratch) {
    const int64_t n = p->n, ne = p->ne, no = p->no, part = GROUP * n + 2 * LANES;
    float *se = scratch, *so = scratch + part, *e = scratch + 2 * part, *o = scratch + 3 * part;
    for (int r = 0; r < rows; r++)
        deinterleave(y + r * n, n, se + r * n, so + r * n);
    vec_mat_rows(se, n, rows, ne, p->ie, ne, e, n);
    vec_mat_rows(so, n, rows, no, p->io, no, o, n);
    for (int r = 0; r < rows; r++) {
        float *xr = x + r * n;
        for (int64_t i = 0; i < no; i++) {
            xr[i] = e[r * n + i] + o[r * n + i];
            xr[n - 1 - i] = e[r * n + i] - o[r * n + i];
        }
        if (n & 1)
            xr[no] = e[r * n + no];
    }
}

/* Along `rows` rows of length p->n: out[r] = D in[r] (forward) or D^T in[r] (inverse). */
static void rows_pass(const half_plan *p, const float *restrict in, int64_t rows,
                      float *restrict out, float *restrict scratch, int inverse) {
    const int64_t n = p->n;
    const float *full = inverse ? p->full : p->full_t;
    if (full) {
        vec_mat_rows(in, n, rows, n, full, n, out, n);
        return;
    }
    for (int64_t r = 0; r < rows; r += GROUP) {
        const int count = rows - r < GROUP ? (int)(rows - r) : GROUP;
        if (inverse)
            rows_inverse_group(p, in + r * n, count, out + r * n, scratch);
        else
            rows_forward_group(p, in + r * n, count, out + r * n, scratch);
    }
}

/* Inverse along the columns of an (n x cols) block: x = D^T y. scratch: n * cols floats. */
static void cols_inverse(const half_plan *p, const float *restrict y, int64_t cols,
                         float *restrict x, float *restrict scratch) {
    const int64_t n = p->n, ne = p->ne, no = p->no;
    float *e = scratch, *o = scratch + ne * cols;
    /* e[i] = sum_q D[2q][i] y[2q] = sum_q fe_t[i][q] y[2q]; the same for the odd rows. */
    mat_rows(p->fe_t, p->pe, ne, ne, y, 2 * cols, cols, e, cols);
    mat_rows(p->fo_t, p->po, no, no, y + cols, 2 * cols, cols, o, cols);
    for (int64_t i = 0; i < no; i++)
        for (int64_t c = 0; c < cols; c++) {
            x[i * cols + c] = e[i * cols + c] + o[i * cols + c];
            x[(n - 1 - i) * cols + c] = e[i * cols + c] - o[i * cols + c];
        }
    if (n & 1)
        memcpy(x + no * cols, e + no * cols, (size_t)cols * sizeof(float));
}

/* Full 2D transform of one map (forward: rows then columns; inverse: columns then rows). */
static void map_transform(const half_plan *ph, const half_plan *pw, const float *src, float *dst,
                          int inverse, float *tmp, float *scratch) {
    const int64_t h = ph->n, w = pw->n;
    if (inverse) {
        cols_inverse(ph, src, w, tmp, scratch);
        rows_pass(pw, tmp, h, dst, scratch, 1);
    } else {
        rows_pass(pw, src, h, tmp, scratch, 0);
        cols_forward(ph, tmp, w, dst, scratch);
    }
}

static int make_plans(half_plan *ph, half_plan *pw, int64_t h, int64_t w) {
    if (make_plan(ph, h))
        return -1;
    if (make_plan(pw, w)) {
        free_plan(ph);
        return -1;
    }
    return 0;
}

/* Per-thread scratch of a full transform: the intermediate map (padded: the inverse row pass
 * reads 2 LANES past it), then the butterfly buffers of the column and the row passes. */
static size_t tmp_floats(int64_t h, int64_t w) { return (size_t)(h * w + 2 * LANES); }
static size_t scratch_floats(int64_t h, int64_t w) {
    const size_t cols = (size_t)(h * w), rows = row_scratch_floats(w);
    return tmp_floats(h, w) + (cols > rows ? cols : rows);
}

/* Outputs of STREAM_BYTES and more (the full transforms, and the high-pass part, which is read
 * again only in backward) are written past the caches with non-temporal stores: ordinary stores
 * would first read every line of them (write-allocate) and evict the working set for data that
 * is not read soon, or would not fit in the cache with its input anyway. A map is computed into
 * per-thread scratch (in L1 up to 32 x 32 maps) and then streamed out (`store_result`); each
 * thread calls stream_fence() before its writes are read. (128, 64, 32, 32) at two threads, call
 * after call: 9.3 -> 7.1 ms, best of 15, on a loaded machine, in a one-off ctypes A/B of the two
 * builds; `python -m benchmarks.dct_bench` times the result beside scipy. */
#define STREAM_BYTES ((int64_t)8 << 20)

/* y[0:n] = a[0:n] - b[0:n] (b NULL: y = a). stream: plain stores up to y's first vector-aligned
 * float, then streamed whole vectors, then a plain tail; else plain stores throughout. */
static void store_result(const float *restrict a, const float *restrict b, int64_t n,
                         float *restrict y, int stream) {
    int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX__)
#if defined(__AVX512F__)
    const int64_t width = 16;
#else
    const int64_t width = 8;
#endif
    if (stream) {
        for (; i < n && ((uintptr_t)(y + i) & (uintptr_t)(width * 4 - 1)); i++)
            y[i] = b ? a[i] - b[i] : a[i];
        for (; i + width <= n; i += width) {
#if defined(__AVX512F__)
            const __m512 v = _mm512_loadu_ps(a + i);
            _mm512_stream_ps(y + i, b ? _mm512_sub_ps(v, _mm512_loadu_ps(b + i)) : v);
#else
            const __m256 v = _mm256_loadu_ps(a + i);
            _mm256_stream_ps(y + i, b ? _mm256_sub_ps(v, _mm256_loadu_ps(b + i)) : v);
#endif
        }
    }
#else
    (void)stream;
#endif
    for (; i < n; i++)
        y[i] = b ? a[i] - b[i] : a[i];
}

/* Orders this thread's non-temporal stores before what follows (a no-op without them). */
static void stream_fence(void) {
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence();
#endif
}

/* A large output buffer is usually fresh from mmap, and faulting it in 4 KiB pages, one trap per
 * page, costs more than the transform itself. So before it is written, transparent huge pages are
 * asked for on its 2 MiB-aligned interior (`advise_huge`, before the team starts, so that the
 * advice precedes every fault), and the team populates (faults in) the buffer in 2 MiB chunks, one
 * madvise call each (MADV_POPULATE_WRITE, Linux 5.14; whole huge pages per call: two threads
 * faulting one contend for it), taken dynamically and with no barrier after them (`prefault`): a
 * thread the scheduler left behind on shared cores holds up neither the populating nor the
 * transform, which starts as soon as its thread runs out of chunks (a page written before its
 * chunk is populated faults in as it would have without). The transform loops end without a
 * barrier too (nowait: what follows them is per thread), so the end of the team is the one wait
 * (docs/ARCHITECTURE.md gives the A/B against barriers after a static share). Advice only: where
 * THP is off, the kernel is older, or the pages are already there, nothing changes but the time. */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#if defined(__linux__) && defined(MADV_HUGEPAGE)
#define HUGE_PAGE ((uintptr_t)2 << 20)

/* Whether an output of `bytes` is advised and populated: from 4 huge pages on. */
static int populated(int64_t bytes) { return bytes >= (int64_t)(4 * HUGE_PAGE); }
#endif

/* Asks for huge pages on the 2 MiB-aligned interior of p[0:bytes]; before the team starts. */
static void advise_huge(void *p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t start = ((uintptr_t)p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    const uintptr_t end = ((uintptr_t)p + (uintptr_t)bytes) & ~(HUGE_PAGE - 1);
    if (populated(bytes) && end > start)
        madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* Populates p[0:bytes] in 2 MiB chunks shared out dynamically; called by every thread of the team,
 * which it does not hold up (nowait). */
static void prefault(void *p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (!populated(bytes))
        return;
    const uintptr_t page = 4096;
    const uintptr_t first = (uintptr_t)p & ~(page - 1);
    const uintptr_t last = ((uintptr_t)p + (uintptr_t)bytes + page - 1) & ~(page - 1);
    const uintptr_t base = first & ~(HUGE_PAGE - 1);
    const int64_t chunks = (int64_t)((last - base + HUGE_PAGE - 1) / HUGE_PAGE);
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < chunks; c++) {
        const uintptr_t lo = base + (uintptr_t)c * HUGE_PAGE, hi = lo + HUGE_PAGE;
        const uintptr_t a = lo < first ? first : lo, b = hi < last ? hi : last;
        madvise((void *)a, b - a, MADV_POPULATE_WRITE);
    }
#else
    (void)p;
    (void)bytes;
#endif
}

int freqact_dct(int64_t maps, int64_t h, int64_t w, const float *src, float *dst, int inverse,
                int threads) {
    half_plan ph, pw;
    if (make_plans(&ph, &pw, h, w))
        return -1;
    int failed = 0;
    const int64_t bytes = maps * h * w * (int64_t)sizeof(float);
    advise_huge(dst, bytes);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        prefault(dst, bytes);
        const int stream = bytes >= STREAM_BYTES;
        const size_t map = stream ? (size_t)(h * w) : 0; /* the map before it is streamed */
        float *tmp = malloc((scratch_floats(h, w) + map) * sizeof(float));
        failed = tmp == NULL;
#pragma omp for schedule(dynamic, 8) nowait
        for (int64_t m = 0; m < maps; m++)
            if (tmp) {
                float *out = stream ? tmp + scratch_floats(h, w) : dst + m * h * w;
                map_transform(&ph, &pw, src + m * h * w, out, inverse, tmp, tmp + tmp_floats(h, w));
                if (stream)
                    store_result(out, NULL, h * w, dst + m * h * w, 1);
            }
        stream_fence();
        free(tmp);
    }
    free_plan(&ph);
    free_plan(&pw);
    return failed ? -1 : 0;
}

/* The leading-row tables of the corner transforms of (h, w) maps with a wh x ww window. */
typedef struct {
    int64_t h, w, wh, ww;
    float *dh;   /* [k * padded(h) + i] = D_h[k][i], k < wh */
    float *dw_t; /* [j * padded(ww) + k] = D_w[k][j], k < ww */
    float *dh_t; /* [i * padded(wh) + k] = D_h[k][i] */
    float *dw;   /* [k * padded(w) + j] = D_w[k][j] */
} corner_plan;

static void free_corner_plan(corner_plan *p) {
    free(p->dh);
    free(p->dw_t);
    free(p->dh_t);
    free(p->dw);
}

/* The tables the transforms need (forward: dh, dw_t; synthesis: dh_t, dw); -1 when out of memory. */
static int make_corner_plan(corner_plan *p, int64_t h, int64_t w, int64_t wh, int64_t ww,
                            int forward, int synthesis) {
    *p = (corner_plan){h, w, wh, ww, NULL, NULL, NULL, NULL};
    if (forward) {
        p->dh = leading_rows(wh, h, 0);
        p->dw_t = leading_rows(ww, w, 1);
    }
    if (synthesis) {
        p->dh_t = leading_rows(wh, h, 1);
        p->dw = leading_rows(ww, w, 0);
    }
    if ((forward && (!p->dh || !p->dw_t)) || (synthesis && (!p->dh_t || !p->dw))) {
        free_corner_plan(p);
        return -1;
    }
    return 0;
}

/* corner (wh, ww) = the top-left DCT coefficients of one (h, w) map: columns first (only wh
 * output rows), then the wh rows against D_w[:ww]^T. s: wh * w floats of scratch. */
static void map_corner(const corner_plan *p, const float *restrict x, float *restrict s,
                       float *restrict corner) {
    const int64_t h = p->h, w = p->w, wh = p->wh, ww = p->ww;
    mat_rows(p->dh, padded(h), wh, h, x, w, w, s, w);
    vec_mat_rows(s, w, wh, w, p->dw_t, ww, corner, ww);
}

/* out (h, w) = the inverse DCT of one (wh, ww) corner, zeros elsewhere: rows first
 * (r = C D_w[:ww], wh x w), then out = D_h[:wh]^T r. r: wh * w floats of scratch. */
static void map_synthesis(const corner_plan *p, const float *restrict corner, float *restrict r,
                          float *restrict out) {
    const int64_t h = p->h, w = p->w, wh = p->wh, ww = p->ww;
    vec_mat_rows(corner, ww, wh, ww, p->dw, w, r, w);
    mat_rows(p->dh_t, padded(wh), h, wh, r, w, w, out, w);
}

/* Narrow maps: rows of w in {2, 4, 8}, so that a vector holds R = LANES / w whole rows (h a
 * multiple of R, h <= NARROW_ROWS). The products above take such rows as a tail narrower than a
 * vector, and pay per row and per call what dominates these maps (an 8 x 8 map's high-pass part
 * took about 150 ns at one thread in a ctypes timing of the kernels, for some 40 vector
 * multiply-adds; 8,192 such maps 1.2 -> 0.41 ms with this path). Here a map is G = h / R
 * vectors and every pass is made of whole vectors:
 *   columns   T_a = sum_i D_h[a][i] X_i (a < wh): per vector of X, one multiply-add with the
 *             vector of D_h[a][the row of each lane] (`col`), then the R row slots of T_a are
 *             summed by a butterfly of lane shuffles, which leaves T_a in every slot;
 *   corner    C[a][b] = sum_j T_a[j] D_w[b][j] (b < ww): T_a's lanes times `row_t`;
 *   rows      S_a = sum_b C[a][b] D_w[b], D_w[b] repeated in every slot (`row`);
 *   synthesis L = sum_a D_h[a][the row of each lane] S_a, vector by vector, with `col` again.
 * HIGHPASS runs the corner then the synthesis, the same arithmetic as CORNER then SYNTHESIS, so
 * the same bytes. Maps of 16 or 32 columns gained nothing this way (measured at
 * 16 x 16 and 32 x 32: equal and slower), so they keep the products above. */
#define NARROW_ROWS 64

static int narrow(int64_t h, int64_t w) {
    return (w == 2 || w == 4 || w == 8) && h % (LANES / w) == 0 && h <= NARROW_ROWS;
}

typedef struct {
    int64_t h, w, wh, ww, groups; /* groups: G, the vectors of a map */
    float *col;   /* [(a * groups + g) * LANES + l] = D_h[a][g R + l / w] */
    float *row_t; /* [j * LANES + b] = D_w[b][j] for b < ww, zero beyond */
    float *row;   /* [b * LANES + l] = D_w[b][l mod w] */
} narrow_plan;

static void free_narrow_plan(narrow_plan *p) {
    free(p->col);
    free(p->row_t);
    free(p->row);
}

/* The tables of `narrow` maps with a wh x ww window; -1 when out of memory. */
static int make_narrow_plan(narrow_plan *p, int64_t h, int64_t w, int64_t wh, int64_t ww) {
    const int64_t slots = LANES / w;
    *p = (narrow_plan){h, w, wh, ww, h / slots, NULL, NULL, NULL};
    p->col = malloc((size_t)(wh * p->groups * LANES) * sizeof(float));
    p->row_t = calloc((size_t)(w * LANES), sizeof(float));
    p->row = malloc((size_t)(ww * LANES) * sizeof(float));
    if (!p->col || !p->row_t || !p->row) {
        free_narrow_plan(p);
        return -1;
    }
    for (int64_t a = 0; a < wh; a++)
        for (int64_t i = 0; i < h; i++) { /* row i: slot i mod R of vector i / R */
            const float d = (float)basis(a, i, h);
            float *lanes = p->col + (a * p->groups + i / slots) * LANES + i % slots * w;
            for (int64_t j = 0; j < w; j++)
                lanes[j] = d;
        }
    for (int64_t j = 0; j < w; j++)
        for (int64_t b = 0; b < ww; b++)
            p->row_t[j * LANES + b] = (float)basis(b, j, w);
    for (int64_t b = 0; b < ww; b++)
        for (int64_t l = 0; l < LANES; l++)
            p->row[b * LANES + l] = (float)basis(b, l % w, w);
    return 0;
}

/* Per-thread scratch of a narrow map: T (then S) and the corner rows, wh vectors each. */
static size_t narrow_scratch_floats(int64_t wh) { return (size_t)(2 * wh * LANES); }

/* Lane l ^ 2^k for k = 1, 2, 3 (XOR_LANES[k - 1]; w >= 2, so never k = 0): the butterfly steps
 * that sum the row slots of a vector. */
static const lane_index XOR_LANES[3] = {
    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
    {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
    {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}};

/* t[a * LANES + 0:LANES] = T_a in every slot, a0 <= a < a0 + rows (1 to GROUP, a constant where
 * inlined): the column pass of one map x. */
static inline __attribute__((always_inline)) void
narrow_columns_block(const narrow_plan *p, const float *restrict x, int64_t a0, const int rows,
                     float *restrict t) {
    vec acc[GROUP];
    for (int r = 0; r < rows; r++)
        acc[r] = (vec){0};
    for (int64_t g = 0; g < p->groups; g++) {
        const vec xv = vload(x + g * LANES);
        for (int r = 0; r < rows; r++)
            acc[r] += vload(p->col + ((a0 + r) * p->groups + g) * LANES) * xv;
    }
    for (int r = 0; r < rows; r++) {
        for (int k = 1; k < 4; k++) /* slots are w lanes wide: partners 2^k >= w lanes apart */
            if ((1 << k) >= p->w)
                acc[r] += __builtin_shuffle(acc[r], XOR_LANES[k - 1]);
        vstore(t + (a0 + r) * LANES, acc[r]);
    }
}

/* corner (wh, ww) = the top-left DCT coefficients of one narrow map x. s: narrow scratch. */
static void narrow_corner(const narrow_plan *p, const float *restrict x, float *restrict s,
                          float *restrict corner) {
    const int64_t wh = p->wh, ww = p->ww;
    float *t = s, *corner_rows = s + wh * LANES;
    for (int64_t a0 = 0; a0 < wh; a0 += GROUP) {
        const int64_t rows = wh - a0 < GROUP ? wh - a0 : GROUP;
        if (rows == 4)
            narrow_columns_block(p, x, a0, 4, t);
        else if (rows == 3)
            narrow_columns_block(p, x, a0, 3, t);
        else if (rows == 2)
            narrow_columns_block(p, x, a0, 2, t);
        else
            narrow_columns_block(p, x, a0, 1, t);
        product_of_rows(t + a0 * LANES, LANES, rows, p->w, p->row_t, LANES, LANES,
                        corner_rows + a0 * LANES, LANES);
    }
    for (int64_t a = 0; a < wh; a++)
        memcpy(corner + a * ww, corner_rows + a * LANES, (size_t)ww * sizeof(float));
}

/* Vectors g0 <= g < g0 + count (1 to GROUP, a constant where inlined) of the synthesis from S:
 * out_g = L_g. */
static inline __attribute__((always_inline)) void
narrow_synthesis_block(const narrow_plan *p, const float *restrict s, int64_t g0, const int count,
                       float *restrict out) {
    vec even[GROUP], odd[GROUP];
    for (int k = 0; k < count; k++)
        even[k] = odd[k] = (vec){0};
    int64_t a = 0;
    for (; a + 1 < p->wh; a += 2) {
        const vec s0 = vload(s + a * LANES), s1 = vload(s + (a + 1) * LANES);
        for (int k = 0; k < count; k++) {
            even[k] += vload(p->col + (a * p->groups + g0 + k) * LANES) * s0;
            odd[k] += vload(p->col + ((a + 1) * p->groups + g0 + k) * LANES) * s1;
        }
    }
    if (a < p->wh) {
        const vec s0 = vload(s + a * LANES);
        for (int k = 0; k < count; k++)
            even[k] += vload(p->col + (a * p->groups + g0 + k) * LANES) * s0;
    }
    for (int k = 0; k < count; k++)
        vstore(out + (g0 + k) * LANES, even[k] + odd[k]);
}

/* out (h, w) = the inverse DCT of one (wh, ww) corner (zeros elsewhere). s: narrow scratch. */
static void narrow_synthesis(const narrow_plan *p, const float *restrict corner, float *restrict s,
                             float *restrict out) {
    const int64_t wh = p->wh, ww = p->ww;
    for (int64_t a0 = 0; a0 < wh; a0 += GROUP)
        product_of_rows(corner + a0 * ww, ww, wh - a0 < GROUP ? wh - a0 : GROUP, ww, p->row,
                        LANES, LANES, s + a0 * LANES, LANES);
    int64_t g0 = 0;
    for (; g0 + GROUP <= p->groups; g0 += GROUP)
        narrow_synthesis_block(p, s, g0, GROUP, out);
    for (; g0 < p->groups; g0++)
        narrow_synthesis_block(p, s, g0, 1, out);
}

/* Whether every one of n floats is finite. */
static int all_finite(const float *x, int64_t n) {
    int finite = 1;
    for (int64_t i = 0; i < n; i++)
        finite &= isfinite(x[i]) != 0;
    return finite;
}

/* What `corner_maps` computes per map. */
enum corner_job { CORNER, SYNTHESIS, HIGHPASS };

/* One corner job over `maps` maps, in cache per map, OpenMP over maps:
 * CORNER: src (maps, h, w) -> dst (maps, wh, ww), the top-left DCT coefficients;
 * SYNTHESIS: src (maps, wh, ww) -> dst (maps, h, w), the inverse DCT of the corner (zeros
 * elsewhere); HIGHPASS: src (maps, h, w) -> dst (maps, h, w), each map minus the inverse DCT of
 * its own corner (the low-pass part is synthesised into a per-thread scratch map, in cache, and
 * x minus it stored to dst: streamed, see STREAM_BYTES, since it is read only in backward).
 * Returns 0; -1 when out of memory; 1 when dst is complete but a corner coefficient was not
 * finite (CORNER, HIGHPASS: the caller's edge rule needs to know). */
static int corner_maps(enum corner_job job, int64_t maps, int64_t h, int64_t w, int64_t wh,
                       int64_t ww, const float *src, float *dst, int threads) {
    const int is_narrow = narrow(h, w);
    corner_plan p;
    narrow_plan np;
    if (is_narrow ? make_narrow_plan(&np, h, w, wh, ww)
                  : make_corner_plan(&p, h, w, wh, ww, job != SYNTHESIS, job != CORNER))
        return -1;
    const int64_t corner = wh * ww, in = job == SYNTHESIS ? corner : h * w;
    const int64_t out = job == CORNER ? corner : h * w;
    const size_t low_size = job == HIGHPASS ? (size_t)(h * w) : 0; /* the low-pass map */
    const size_t scratch_size = low_size + (size_t)corner +
                                (is_narrow ? narrow_scratch_floats(wh) : (size_t)(wh * w));
    const int64_t bytes = maps * out * (int64_t)sizeof(float);
    const int stream = bytes >= STREAM_BYTES;
    int failed = 0, overflow = 0;
    advise_huge(dst, bytes);
#pragma omp parallel num_threads(threads) reduction(| : failed, overflow)
    {
        prefault(dst, bytes);
        float *scratch = malloc(scratch_size * sizeof(float));
        failed = scratch == NULL;
#pragma omp for schedule(dynamic, 8) nowait
        for (int64_t m = 0; m < maps; m++) {
            if (!scratch)
                continue;
            const float *x = src + m * in;
            float *y = dst + m * out, *low = scratch + corner, *r = low + low_size;
            float *coeffs = job == CORNER ? y : scratch; /* where the corner is computed */
            float *synthesis = job == HIGHPASS ? low : y;
            const float *c = job == SYNTHESIS ? x : coeffs;
            if (job != SYNTHESIS) {
                if (is_narrow)
                    narrow_corner(&np, x, r, coeffs);
                else
                    map_corner(&p, x, r, coeffs);
                overflow |= !all_finite(coeffs, corner);
            }
            if (job != CORNER) {
                if (is_narrow)
                    narrow_synthesis(&np, c, r, synthesis);
                else
                    map_synthesis(&p, c, r, synthesis);
            }
            if (job == HIGHPASS)
                store_result(x, low, h * w, y, stream);
        }
        stream_fence();
        free(scratch);
    }
    if (is_narrow)
        free_narrow_plan(&np);
    else
        free_corner_plan(&p);
    return failed ? -1 : overflow ? 1 : 0;
}

int freqact_dct_corner(int64_t maps, int64_t h, int64_t w, int64_t wh, int64_t ww,
                       const float *src, float *dst, int threads) {
    return corner_maps(CORNER, maps, h, w, wh, ww, src, dst, threads);
}

int freqact_idct_corner(int64_t maps, int64_t h, int64_t w, int64_t wh, int64_t ww,
                        const float *src, float *dst, int threads) {
    return corner_maps(SYNTHESIS, maps, h, w, wh, ww, src, dst, threads);
}

int freqact_highpass(int64_t maps, int64_t h, int64_t w, int64_t wh, int64_t ww,
                     const float *src, float *dst, int threads) {
    return corner_maps(HIGHPASS, maps, h, w, wh, ww, src, dst, threads);
}

/* Per map: low[m] = sum of X^2 over the top-left wh x ww coefficients, high[m] = over the rest
 * (X = the map's DCT, squares summed in double). */
int freqact_band_energy(int64_t maps, int64_t h, int64_t w, int64_t wh, int64_t ww,
                        const float *src, double *low, double *high, int threads) {
    half_plan ph, pw;
    if (make_plans(&ph, &pw, h, w))
        return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *tmp = malloc((scratch_floats(h, w) + (size_t)(h * w)) * sizeof(float));
        failed = tmp == NULL;
#pragma omp for schedule(dynamic, 8) nowait
        for (int64_t m = 0; m < maps; m++)
            if (tmp) {
                float *coeffs = tmp + scratch_floats(h, w);
                map_transform(&ph, &pw, src + m * h * w, coeffs, 0, tmp, tmp + tmp_floats(h, w));
                double lo = 0.0, hi = 0.0;
                for (int64_t k = 0; k < h; k++)
                    for (int64_t j = 0; j < w; j++) {
                        const double c = coeffs[k * w + j];
                        if (k < wh && j < ww)
                            lo += c * c;
                        else
                            hi += c * c;
                    }
                low[m] = lo;
                high[m] = hi;
            }
        free(tmp);
    }
    free_plan(&ph);
    free_plan(&pw);
    return failed ? -1 : 0;
}
