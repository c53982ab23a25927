/* Fused CPU kernels for the DIVISION packed format (docs/ARCHITECTURE.md), and Q-bit packing.
 *
 * The torch reference (freqact/kernels/reference.py) is the specification; these functions give
 * the same bytes for the same uniforms (tests/kernels/test_cpu_division.py), with one difference
 * allowed: block sums are added in another order, so on general float32 data a block mean may
 * differ from the reference's in its last float32 bits (and, rarely, its bf16 rounding); where a
 * block's sum cancels (values of +-3e38 beside small ones) the difference is that of the
 * cancellation, up to the small values' whole sum (measured: 0.150 here, 0.100 in the reference).
 *
 * Layout: `maps` activation maps of D x H x W float32 elements each, contiguous and in logical
 * order (1D maps are 1 x 1 x L, 2D maps 1 x H x W). Blocks are bd x bh x bw with bd = min(B, D)
 * etc.; edge blocks average what they cover. All sizes come from Python (format.Geometry, checked
 * there against the buffers): this file derives none. lfc == NULL means no block means (the
 * `quant` ablation: the codes quantise x itself). One OpenMP thread team of `threads` splits the
 * maps (or sequences) in contiguous static shares, roughly as torch's own parallel loops split
 * a tensor: each thread then mostly reads what its core's caches hold from the op that wrote x,
 * and writes the decode's output where the backward op's same thread reads it. Shares dealt one
 * at a time, dynamically, moved every cache line between the cores (the measurements are in
 * docs/ARCHITECTURE.md, "engine/", the token layouts' fused kernels); the price is that a
 * thread the scheduler leaves behind holds up its fixed share (the DCT kernels share their work
 * out dynamically for that reason).
 * Overflow of finite values follows the edge rule of format.py (saturation).
 *
 * Encode per map, the data staying in cache between its passes:
 *   1. per block row, block sums (its rows read in memory order and added column-wise, 0 + row 0
 *      + row 1 + ..., then each block's columns in order) -> lfc = bf16(sum / count), rounded to
 *      nearest even (as torch's .to(bfloat16)), and h = x - float(lfc) for its rows while they
 *      are in L1;
 *   2. the min and max of h (a NaN anywhere makes both NaN; a zero min or max is +0, whatever
 *      the scan order: min + 0.0f, as the reference);
 *   3. lo = bf16 rounded down from min, step = bf16 rounded up from (max - lo) / (2^Q - 1),
 *      codes = clamp(floor(u + (h - lo) / step), 0, 2^Q - 1) (step 0 divides by 1), packed
 *      8 / Q per byte, code i at bit (i % (8 / Q)) * Q of byte i / (8 / Q); the next map's input
 *      is prefetched a cache line per step of this loop.
 * Maps of at most SMALL_MAP elements (4 x 4, 8 x 8, 16 x 16) that draw their own noise go 16 at
 * a time, one per lane of a transposed panel, through the same operations per lane
 * (encode_small_maps, on the token layouts' quantize_lanes).
 * u comes from `noise` when given, else from a counter-based generator drawn in registers inside
 * the quantise loop: quant map m (of at most 2^32 elements) has two 32-bit keys from
 * SplitMix64's draw (Steele, Lea and Flood 2014) at state seed + (m + 1) * golden gamma, its
 * low half (add) and its high half with the lowest bit set (mul, odd), and its element t takes
 * the top 24 bits of lowbias32((t * mul + add) mod 2^32) (Wellons' integer hash), times 2^-24;
 * so the bytes depend on the seed alone, not on the thread count, and a map's uniforms on its
 * index alone. Each map hashes its own arithmetic progression (an odd mul: distinct inputs within
 * a map), so two maps share no runs of inputs; with one step for all maps they would be windows
 * of one sequence (65,536 maps of 256 elements: 271 pairs sharing runs of up to 256 inputs,
 * test_maps_draw_from_unrelated_runs_of_the_stream).
 *
 * Decoded NaNs: which of two NaNs an addition returns (its sign and payload) follows the operand
 * order the compiler picks, so it is not specified (a NaN map decodes to NaN all the same).
 *
 * Built with -ffp-contract=off and without -ffast-math: every float operation rounds as the
 * reference's torch operations do. Loops are written so that the compiler vectorises them (flat
 * loops over a map) or with GCC/Clang vector types in lane groups of GL (16 with AVX-512, 8
 * without: HALVES16 below): min/max lanes, a group of codes per quantise, pack, unpack and
 * dequantise step, a group of mask bits per step, a group of uniforms at a time,
 * 8 token blocks' means, 16 token quant maps and 16 small maps in lanes (a group at a time), 16
 * token columns per decode step; not with intrinsics (but the 8-lane min and max with AVX2,
 * instructions that are the select they replace): the file builds for any CPU, as scalar code
 * without vector units. Each vector step does per lane the float operations of the scalar code
 * in its order (the same bytes). The token layouts' `chan` maps drawing their own noise make
 * their residual a strip of 16 columns at a time, its ranges on the way (quantize_strips).
 */
#include <float.h>
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h> /* the 8-lane min and max (less8, greater8, imin8) */
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t size[3];      /* D, H, W */
    int64_t blk[3];       /* block extent per dim */
    int64_t nb[3];        /* blocks per dim */
    int64_t numel;        /* D * H * W */
    int64_t nblocks;      /* nb[0] * nb[1] * nb[2] */
    int64_t code_bytes;   /* bytes of one map's packed codes */
    int64_t *row_blocks;  /* per row (d, h): index of its block row, (d / bd) * nb[1] + h / bh */
    float *counts;        /* per block: the number of elements it covers */
} geometry;

static void free_geometry(geometry *g) {
    free(g->row_blocks);
    free(g->counts);
}

/* The geometry that Python computed once (freqact/kernels/format.py, `cpu._geometry_args`):
 * maps, D, H, W, block extents bd, bh, bw, block counts nbd, nbh, nbw, bytes of one map's codes. */
enum { G_MAPS, G_D, G_H, G_W, G_BD, G_BH, G_BW, G_NBD, G_NBH, G_NBW, G_CODE_BYTES, G_LEN };

/* The elements of block b: [lo[k], hi[k]) per dim k (D, H, W), edge blocks cut at the map's
 * end. */
static void block_bounds(const geometry *g, int64_t b, int64_t lo[3], int64_t hi[3]) {
    for (int k = 2; k >= 0; k--) {
        lo[k] = (b % g->nb[k]) * g->blk[k];
        hi[k] = lo[k] + g->blk[k] < g->size[k] ? lo[k] + g->blk[k] : g->size[k];
        b /= g->nb[k];
    }
}

/* Fills g and its tables from the geometry array; returns 0, or -1 (tables freed) if they could
 * not be allocated. */
static int make_geometry(geometry *g, const int64_t *geom) {
    for (int k = 0; k < 3; k++) {
        g->size[k] = geom[G_D + k];
        g->blk[k] = geom[G_BD + k];
        g->nb[k] = geom[G_NBD + k];
    }
    const int64_t d = g->size[0], h = g->size[1];
    g->numel = d * h * g->size[2];
    g->nblocks = g->nb[0] * g->nb[1] * g->nb[2];
    g->code_bytes = geom[G_CODE_BYTES];
    g->row_blocks = malloc((size_t)(d * h) * sizeof(int64_t));
    g->counts = malloc((size_t)g->nblocks * sizeof(float));
    if (!g->row_blocks || !g->counts) {
        free_geometry(g);
        return -1;
    }
    for (int64_t r = 0; r < d * h; r++)
        g->row_blocks[r] = (r / h / g->blk[0]) * g->nb[1] + (r % h) / g->blk[1];
    for (int64_t b = 0; b < g->nblocks; b++) {
        /* (float)(cd * ch * cw) as the reference's float32 product of the three extents. */
        int64_t lo[3], hi[3];
        block_bounds(g, b, lo, hi);
        float count = 1.0f;
        for (int k = 2; k >= 0; k--) count *= (float)(hi[k] - lo[k]);
        g->counts[b] = count;
    }
    return 0;
}

/* --- bfloat16, bit for bit as c10::BFloat16 ------------------------------------------------- */

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define BF16_MAX_BITS 0x7F7Fu

/* Nearest even; a finite f that would round to infinity saturates at the largest finite bf16
 * (format.bf16_nearest). */
static inline uint16_t bf16_nearest(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    if ((r & 0x7FFF) == 0x7F80 && isfinite(f)) r = (uint16_t)((r & 0x8000) | BF16_MAX_BITS);
    return r;
}

/* Rounded toward +inf (up) or -inf on the bit patterns, the algorithm of format.bf16_directed:
 * truncation rounds toward zero; one unit more in the magnitude when bits were dropped and f is
 * on the far side of zero. A finite f saturates at the largest finite bf16; NaN gives 0x7FC0. */
static inline uint16_t bf16_directed(float f, int up) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    uint16_t kept = (uint16_t)(u >> 16);
    if ((u & 0xFFFFu) && (up ? f > 0.0f : f < 0.0f)) kept++;
    if ((kept & 0x7FFF) == 0x7F80 && isfinite(f)) kept--;
    return kept;
}

static inline uint16_t bf16_down(float v) { return bf16_directed(v, 0); }

static inline uint16_t bf16_up(float v) { return bf16_directed(v, 1); }

/* --- vectors: GCC/Clang vector types, plain scalar code on a CPU without vector units ------- */

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
/* 16 lanes for the quantise loop (one step over a 16-token map) */
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x4 __attribute__((vector_size(4)));
typedef uint8_t u8x2 __attribute__((vector_size(2)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef uint64_t u64x2 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* Lane-wise `mask ? a : b` (mask lanes all ones or all zeros, as vector comparisons give), for 8
 * lanes (select) and 16 (select16). */
#define DEFINE_SELECT(name, f32xn, i32xn)                        \
    static inline f32xn name(i32xn mask, f32xn a, f32xn b) { \
        i32xn ai, bi;                                        \
        memcpy(&ai, &a, sizeof ai);                          \
        memcpy(&bi, &b, sizeof bi);                          \
        const i32xn r = (mask & ai) | (~mask & bi);          \
        f32xn out;                                           \
        memcpy(&out, &r, sizeof out);                        \
        return out;                                          \
    }
DEFINE_SELECT(select, f32x8, i32x8)
DEFINE_SELECT(select16, f32x16, i32x16)

/* Without AVX-512, GCC 12 keeps a 16-lane (64-byte) vector in memory and does its comparisons,
 * lane loops and narrowing element by element (scalar code: the kernels ran 1.6 to 7.5 times
 * slower on an AVX2 Zen 3, docs/ARCHITECTURE.md "Lane groups"). There (HALVES16) the kernels work in groups of 8 lanes instead of 16
 * (GL below); with AVX-512 in groups of 16. The same bytes either way. */
#if defined(FREQACT_HALVES16) /* -DFREQACT_HALVES16=0 or 1: the tests build the other path too */
#define HALVES16 FREQACT_HALVES16
#elif defined(__AVX512F__)
#define HALVES16 0
#else
#define HALVES16 1
#endif

/* Whether this build works in groups of 8 lanes (for the tests and benchmarks). */
int freqact_vector_halves(void) { return HALVES16; }

typedef union {
    i32x16 v;
    i32x8 h[2];
} i32x16_halves;

/* Lane-wise a < b ? a : b and a > b ? a : b (for floats: exactly this, NaN and -0/+0
 * included). On 16 lanes written per lane, so that the compiler sees the comparison and emits
 * one vminps/vmaxps (vpminsd for int32) where a select on a mask costs a compare and a blend
 * (GCC 12 leaves such a lane loop scalar against a constant vector: for running minima/maxima
 * only). On 8 lanes with AVX2 the instructions themselves: vminps a, b is a < b ? a : b and
 * vmaxps a, b is a > b ? a : b by definition (the second operand where a lane is unordered or
 * both are zeros), where GCC 12 gave the select below, a compare and a blend (lanes_range ran
 * two of each per vector and spilled its accumulators); without AVX2 that select, which GCC 12
 * keeps in vectors where it left the lane loop scalar inside the callers' loops. */
#if defined(__AVX2__)
static inline f32x8 less8(f32x8 a, f32x8 b) {
    return (f32x8)_mm256_min_ps((__m256)a, (__m256)b);
}
static inline f32x8 greater8(f32x8 a, f32x8 b) {
    return (f32x8)_mm256_max_ps((__m256)a, (__m256)b);
}
static inline i32x8 imin8(i32x8 a, i32x8 b) {
    return (i32x8)_mm256_min_epi32((__m256i)a, (__m256i)b);
}
#else
#define DEFINE_EXTREME(name, vec8, op)                                              \
    static inline vec8 name(vec8 a, vec8 b) {                                       \
        i32x8 m = a op b, ai, bi;                                                   \
        memcpy(&ai, &a, sizeof ai);                                                 \
        memcpy(&bi, &b, sizeof bi);                                                 \
        ai = (m & ai) | (~m & bi);                                                  \
        memcpy(&a, &ai, sizeof a);                                                  \
        return a;                                                                   \
    }
DEFINE_EXTREME(less8, f32x8, <)
DEFINE_EXTREME(greater8, f32x8, >)
DEFINE_EXTREME(imin8, i32x8, <)
#endif

#define DEFINE_EXTREME16(name, vec, op)                                             \
    static inline vec name(vec a, vec b) {                                          \
        vec r;                                                                      \
        for (int l = 0; l < 16; l++) r[l] = a[l] op b[l] ? a[l] : b[l];             \
        return r;                                                                   \
    }
DEFINE_EXTREME16(less16, f32x16, <)
DEFINE_EXTREME16(greater16, f32x16, >)
DEFINE_EXTREME16(imin16, i32x16, <)

/* v as 8 lanes */
static inline f32x8 splat8(float v) { return (f32x8){v, v, v, v, v, v, v, v}; }

/* v as 16 lanes */
static inline f32x16 splat16(float v) {
    return (f32x16){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v};
}

/* Lane-wise isfinite: exponent bits not all ones. */
static inline i32x8 finite8(f32x8 v) {
    i32x8 b;
    memcpy(&b, &v, sizeof b);
    return (b & 0x7F800000) != 0x7F800000;
}

/* The same on 16 lanes: on the halves path per half (the token decode's columns are 16 lanes
 * there too). */
static inline i32x16 finite16(f32x16 v) {
    if (!HALVES16) {
        i32x16 b;
        memcpy(&b, &v, sizeof b);
        return (b & 0x7F800000) != 0x7F800000;
    }
    f32x8 h[2];
    i32x16_halves r;
    memcpy(h, &v, sizeof h);
    for (int half = 0; half < 2; half++) r.h[half] = finite8(h[half]);
    return r.v;
}

/* Floats from bf16 bit patterns in int32 lanes. */
#define DEFINE_BF16_TO_FLOAT(name, fvec, ivec)                                      \
    static inline fvec name(ivec b) {                                               \
        const ivec bits = b << 16;                                                  \
        fvec f;                                                                     \
        memcpy(&f, &bits, sizeof f);                                                \
        return f;                                                                   \
    }
DEFINE_BF16_TO_FLOAT(bf16_to_float16, f32x16, i32x16)

/* Whether a lane of the mask m is set (8 or 16 lanes): halves OR-ed together. */
static inline int any8(i32x8 a) {
    a |= __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
    a |= __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1);
    return (a[0] | a[1]) != 0;
}

static inline int any16(i32x16 m) {
    const i32x16_halves x = {m};
    return any8(x.h[0] | x.h[1]);
}

/* The lane group of the token kernels (quantize_lanes' maps, token_residual's features): 16
 * lanes in 16-lane registers, or on the halves path (HALVES16) 8 lanes in 8-lane registers; the
 * same operations per lane.
 * Either width is native, so a group's comparisons are the plain operators. gf32/gi32/gu32:
 * float/int32/uint32 lanes of a group. */
#if HALVES16
enum { GL = 8 };
typedef f32x8 gf32;
typedef i32x8 gi32;
typedef u32x8 gu32;
typedef u16x8 gu16;
#else
enum { GL = 16 };
typedef f32x16 gf32;
typedef i32x16 gi32;
typedef u32x16 gu32;
typedef u16x16 gu16;
#endif

#if HALVES16
#define finite_g finite8
DEFINE_BF16_TO_FLOAT(bf16_to_float_g, f32x8, i32x8)
#define select_g select
#define quantize_g quantize8
#define any_g any8
#define splat_g splat8
#define less_g less8
#define greater_g greater8
#define extreme_g extreme8
#define pack_g pack8
#else
#define finite_g finite16
#define bf16_to_float_g bf16_to_float16
#define select_g select16
#define quantize_g quantize16
#define any_g any16
#define splat_g splat16
#define less_g less16
#define greater_g greater16
#define extreme_g extreme16
#define pack_g pack16
#endif

/* --- noise ---------------------------------------------------------------------------------- */

#define GOLDEN_GAMMA 0x9E3779B97F4A7C15ull

/* SplitMix64's output for state z (Steele, Lea and Flood 2014): its finaliser. */
static inline uint64_t splitmix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Map m's two noise keys from SplitMix64's draw at state seed + (m + 1) * golden gamma: its low
 * 32 bits (add) and its high 32 bits with the lowest set (mul, odd). */
typedef struct {
    uint32_t add, mul;
} map_key;

static inline map_key key_of(uint64_t seed, uint64_t map) {
    const uint64_t r = splitmix64(seed + (map + 1u) * GOLDEN_GAMMA);
    return (map_key){(uint32_t)r, (uint32_t)(r >> 32) | 1u};
}

/* Wellons' lowbias32 integer hash (its 2022 constants), a bijection of 32-bit words; lane-wise
 * for a group. Its multiplies are 32-bit: one instruction per lane group on AVX2, which has no
 * 64-bit lane multiply (GCC builds each of SplitMix64's from three 32-bit ones, shifts and
 * adds). */
#define DEFINE_MIX32(name, vec)                                                     \
    static inline vec name(vec x) {                                                 \
        x ^= x >> 16;                                                               \
        x *= 0x21F0AAADu;                                                           \
        x ^= x >> 15;                                                               \
        x *= 0x735A2D97u;                                                           \
        return x ^ (x >> 15);                                                       \
    }
DEFINE_MIX32(mix_g, gu32)

/* The uniforms of hash inputs x (t * mul + add mod 2^32 of element t), lane-wise: the top 24
 * bits of mix(x), times 2^-24 (< 2^24: exact as int32 and as float). */
static inline gf32 uniforms_at(gu32 x) {
    const gu32 bits = mix_g(x) >> 8;
    return __builtin_convertvector((gi32)bits, gf32) * 0x1p-24f;
}

/* The noise of one map drawn in registers, GL uniforms per `next_uniforms` from its element 0
 * on (no buffer: the encode's maps read theirs once, in the quantise loop): x holds the hash
 * inputs of the next GL elements, each step adds GL * mul. */
typedef struct {
    gu32 x;
    uint32_t advance;
} map_noise;

static inline map_noise noise_of(uint64_t seed, uint64_t map) {
    const map_key k = key_of(seed, map);
    map_noise s = {{0}, (uint32_t)GL * k.mul};
    for (int l = 0; l < GL; l++) s.x[l] = (uint32_t)l * k.mul + k.add;
    return s;
}

static inline gf32 next_uniforms(map_noise *s) {
    const gf32 v = uniforms_at(s->x);
    s->x += s->advance;
    return v;
}

/* --- encode: block means and residual ----------------------------------------------------- */

/* The edge rule of format.block_means: a block sum that overflowed is redone on the values scaled
 * by 2^-64 (exact) when every value of the block is finite. */
static float scaled_block_mean(const geometry *g, const float *x, const int64_t lo[3],
                               const int64_t hi[3], float sum, float count) {
    const int64_t H = g->size[1], W = g->size[2];
    float s = 0.0f;
    for (int64_t d = lo[0]; d < hi[0]; d++)
        for (int64_t h = lo[1]; h < hi[1]; h++)
            for (int64_t w = lo[2]; w < hi[2]; w++) {
                const float v = x[(d * H + h) * W + w];
                if (!isfinite(v)) return sum / count;
                s += v * 0x1p-64f;
            }
    return s / count / 0x1p-64f;
}

/* x - m, saturated at +-FLT_MAX where that overflows for a finite x (the edge rule). */
static inline float residual_at(float x, float m) {
    const float r = x - m;
    const int fix = (fabsf(r) == INFINITY) & (fabsf(x) < INFINITY);
    return fix ? copysignf(FLT_MAX, r) : r;
}

/* out[k * n + i] = residual_at(x[k * n + i], m[i]) for `rows` rows k of n elements against one
 * row m; out is not x. The plain differences first, GL at a time, summing r - r in lanes (0 while
 * every r is finite, NaN once one is not, and NaN stays): only a call that met an infinite or
 * NaN difference is redone with the rule (whose selects cost twice the difference itself). */
static void residual_rows(const float *x, const float *m, int64_t n, int64_t rows, float *out) {
    gf32 nonfinite = {0};
    int bad = 0;
    for (int64_t k = 0; k < rows; k++) {
        const float *xk = x + k * n;
        float *ok = out + k * n;
        int64_t i = 0;
        for (; i + GL <= n; i += GL) {
            gf32 a, b;
            memcpy(&a, xk + i, sizeof a);
            memcpy(&b, m + i, sizeof b);
            const gf32 r = a - b;
            nonfinite += r - r;
            memcpy(ok + i, &r, sizeof r);
        }
        for (; i < n; i++) {
            ok[i] = xk[i] - m[i];
            bad |= !isfinite(ok[i]);
        }
    }
    if (!(bad | any_g(nonfinite != nonfinite))) return;
    for (int64_t k = 0; k < rows; k++)
        for (int64_t i = 0; i < n; i++) out[k * n + i] = residual_at(x[k * n + i], m[i]);
}

/* row[w] = the value of w's block for the W columns of a row, from its block row's nb[2]
 * values v. */
static void spread_row(const geometry *g, const float *v, float *row) {
    const int64_t W = g->size[2], bw = g->blk[2];
    for (int64_t j = 0; j < g->nb[2]; j++) {
        const int64_t w1 = (j + 1) * bw < W ? (j + 1) * bw : W;
        for (int64_t w = j * bw; w < w1; w++) row[w] = v[j];
    }
}

/* Block means of map x into lfc (bf16) and its residual x - float(lfc), saturated (residual_rows),
 * into h, one block row at a time while its rows are in L1: the rows are read in memory order
 * (a cold map streams in) and added column-wise into colsum (colsum[w] = 0 + x[row 0][w] +
 * x[row 1][w] + ...), then each block adds its columns in order (0 + colsum[w0] + ...).
 * colsum: scratch of W floats; row: of blk[1] * W; means: of nb[2]. */
static void block_residual(const geometry *g, const float *x, float *colsum, float *row,
                           float *means, uint16_t *lfc, float *h) {
    const int64_t H = g->size[1], W = g->size[2], bw = g->blk[2], nbw = g->nb[2];
    for (int64_t db = 0; db < g->nb[0]; db++) {
        const int64_t d0 = db * g->blk[0], d1 = d0 + g->blk[0] < g->size[0] ? d0 + g->blk[0]
                                                                             : g->size[0];
        for (int64_t hb = 0; hb < g->nb[1]; hb++) {
            const int64_t h0 = hb * g->blk[1], h1 = h0 + g->blk[1] < H ? h0 + g->blk[1] : H;
            for (int64_t w = 0; w < W; w++) colsum[w] = 0.0f;
            for (int64_t d = d0; d < d1; d++)
                for (int64_t r = d * H + h0; r < d * H + h1; r++) {
                    const float *xr = x + r * W;
                    for (int64_t w = 0; w < W; w++) colsum[w] += xr[w];
                }
            const int64_t first = (db * g->nb[1] + hb) * nbw;
            for (int64_t j = 0; j < nbw; j++) {
                const int64_t b = first + j, w0 = j * bw, w1 = w0 + bw < W ? w0 + bw : W;
                float sum = 0.0f;
                for (int64_t c = w0; c < w1; c++) sum += colsum[c];
                float mean = sum / g->counts[b];
                if (!isfinite(sum)) {
                    const int64_t lo[3] = {d0, h0, w0}, hi[3] = {d1, h1, w1};
                    mean = scaled_block_mean(g, x, lo, hi, sum, g->counts[b]);
                }
                lfc[b] = bf16_nearest(mean);
                means[j] = bf16_to_float(lfc[b]);
            }
            /* the block row's rows of one d are contiguous: one residual_rows call for them
             * (a 4 x 4 map in one vector step, not four scalar rows) */
            spread_row(g, means, row);
            for (int64_t r = 1; r < h1 - h0; r++) memcpy(row + r * W, row, (size_t)W * sizeof *row);
            for (int64_t d = d0; d < d1; d++)
                residual_rows(x + (d * H + h0) * W, row, (h1 - h0) * W, 1, h + (d * H + h0) * W);
        }
    }
}

/* out[i] = x[i] + (value of i's block) (decode's base), per row against its block row's values
 * spread over its W columns (rebuilt when the block row changes; row: scratch of W). out may be
 * x. Returns whether a value of out is not finite. */
static int add_block_values(const geometry *g, const float *x, const float *values, float *row,
                            float *out) {
    const int64_t W = g->size[2], rows = g->size[0] * g->size[1];
    int64_t current = -1;
    int bad = 0;
    gi32 finite = ~(gi32){0}; /* all lanes true */
    for (int64_t r = 0; r < rows; r++) {
        if (g->row_blocks[r] != current) {
            current = g->row_blocks[r];
            spread_row(g, values + current * g->nb[2], row);
        }
        const float *xr = x + r * W;
        float *o = out + r * W;
        int64_t w = 0;
        for (; w + GL <= W; w += GL) { /* finiteness in lanes, reduced once per map */
            gf32 a, b;
            memcpy(&a, xr + w, sizeof a);
            memcpy(&b, row + w, sizeof b);
            a += b;
            finite &= finite_g(a);
            memcpy(o + w, &a, sizeof a);
        }
        for (; w < W; w++) {
            o[w] = xr[w] + row[w];
            bad |= !isfinite(o[w]);
        }
    }
    return bad | any_g(~finite);
}

/* CALL(b) with b the constant equal to bits (1, 2, 4, else 8), so that an always_inline kernel
 * called there unrolls and vectorises for that width. */
#define AT_CONSTANT_BITS(bits, CALL)  \
    switch (bits) {                   \
        case 1: CALL(1); break;       \
        case 2: CALL(2); break;       \
        case 4: CALL(4); break;       \
        default: CALL(8);             \
    }

/* --- packing: code i of a row at bit (i % (8 / bits)) * bits of byte i / (8 / bits) ----------- */

/* always_inline with a constant `bits`: the loops unroll and vectorise per width. */
static inline __attribute__((always_inline)) void pack_fixed(const uint8_t *q, int64_t count,
                                                             uint8_t *out, const int bits) {
    const int per_byte = 8 / bits;
    const int64_t whole = count / per_byte;
    for (int64_t j = 0; j < whole; j++) {
        unsigned acc = 0;
        for (int k = 0; k < per_byte; k++) acc |= (unsigned)q[j * per_byte + k] << (k * bits);
        out[j] = (uint8_t)acc;
    }
    if (whole * per_byte < count) {
        unsigned acc = 0;
        for (int k = 0; whole * per_byte + k < count; k++)
            acc |= (unsigned)q[whole * per_byte + k] << (k * bits);
        out[whole] = (uint8_t)acc;
    }
}

static inline __attribute__((always_inline)) void unpack_fixed(const uint8_t *packed,
                                                               int64_t count, uint8_t *q,
                                                               const int bits) {
    const int per_byte = 8 / bits;
    const unsigned mask = (1u << bits) - 1u;
    const int64_t whole = count / per_byte;
    for (int64_t j = 0; j < whole; j++)
        for (int k = 0; k < per_byte; k++)
            q[j * per_byte + k] = (uint8_t)((packed[j] >> (k * bits)) & mask);
    for (int64_t i = whole * per_byte; i < count; i++)
        q[i] = (uint8_t)((packed[whole] >> ((i - whole * per_byte) * bits)) & mask);
}

static void pack_row(const uint8_t *q, int64_t count, uint8_t *out, int bits) {
    switch (bits) {
        case 1: pack_fixed(q, count, out, 1); break;
        case 2: pack_fixed(q, count, out, 2); break;
        case 4: pack_fixed(q, count, out, 4); break;
        default: memcpy(out, q, (size_t)count);
    }
}

static void unpack_row(const uint8_t *packed, int64_t count, uint8_t *q, int bits) {
    switch (bits) {
        case 1: unpack_fixed(packed, count, q, 1); break;
        case 2: unpack_fixed(packed, count, q, 2); break;
        case 4: unpack_fixed(packed, count, q, 4); break;
        default: memcpy(q, packed, (size_t)count);
    }
}

/* 16 codes (< 2^bits, one per lane) packed into their 2 * bits bytes at out: each lane shifted to
 * its place in its byte and narrowed to a byte, then the 8 / bits bytes of each packed byte OR-ed
 * within the word that holds them (the OR of all of a word's bytes: the same on any byte order),
 * its low byte kept. A lane shuffle tree did this on the vector permute port that the noise and
 * the division also need. always_inline with a constant `bits`. */
static inline __attribute__((always_inline)) void pack16(i32x16 c, uint8_t *out, const int bits) {
    const int per_byte = 8 / bits;
    i32x16 shift;
    for (int l = 0; l < 16; l++) shift[l] = (l % per_byte) * bits;
    const u8x16 b = __builtin_convertvector(c << shift, u8x16);
    if (bits == 8) {
        memcpy(out, &b, sizeof b);
    } else if (bits == 4) {
        u16x8 w;
        memcpy(&w, &b, sizeof w);
        const u8x8 r = __builtin_convertvector(w | w >> 8, u8x8);
        memcpy(out, &r, sizeof r);
    } else if (bits == 2) {
        u32x4 w;
        memcpy(&w, &b, sizeof w);
        const u8x4 r = __builtin_convertvector(w | w >> 8 | w >> 16 | w >> 24, u8x4);
        memcpy(out, &r, sizeof r);
    } else {
        u64x2 w;
        memcpy(&w, &b, sizeof w);
        w |= w >> 8 | w >> 16 | w >> 24;
        const u8x2 r = __builtin_convertvector(w | w >> 32, u8x2);
        memcpy(out, &r, sizeof r);
    }
}

/* 8 codes packed into their `bits` bytes at out (the halves path's groups): each lane shifted
 * to its place in its byte, the 8 / bits lanes of each byte OR-ed together by lane shuffles, and
 * the bytes taken from their lanes (AVX2 has no narrowing of 32-bit lanes to bytes: GCC 12
 * narrows pack16's way lane by lane). always_inline with a constant `bits`. */
static inline __attribute__((always_inline)) void pack8(i32x8 c, uint8_t *out, const int bits) {
    const int per_byte = 8 / bits;
    i32x8 shift;
    for (int l = 0; l < 8; l++) shift[l] = (l % per_byte) * bits;
    i32x8 v = c << shift;
    if (per_byte >= 2) v |= __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    if (per_byte >= 4) v |= __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    if (per_byte == 8) v |= __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    for (int b = 0; b < bits; b++) out[b] = (uint8_t)v[b * per_byte];
}

/* The little-endian 32-bit word of the bytes p[0 .. 3] (on any host). */
static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Inverse of pack16: the 16 codes of the 2 * bits bytes at p, one per lane: code l is bits
 * l * bits .. of the bytes read as a little-endian number, taken from the 32-bit word that holds
 * it. always_inline with a constant `bits`. */
static inline __attribute__((always_inline)) i32x16 unpack16(const uint8_t *p, const int bits) {
    if (bits == 8) {
        u8x16 b;
        memcpy(&b, p, sizeof b);
        return __builtin_convertvector(b, i32x16);
    }
    const uint32_t w0 = bits == 1 ? (uint32_t)p[0] | (uint32_t)p[1] << 8 : le32(p);
    const u32x16 zero = {0};
    u32x16 w = zero + w0; /* broadcast (a lane-by-lane build is slow) */
    if (bits == 4) {
        const u32x16 low = {~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u};
        w = (w & low) | ((zero + le32(p + 4)) & ~low);
    }
    u32x16 shift;
    for (int l = 0; l < 16; l++) shift[l] = (uint32_t)(l * bits % 32);
    return (i32x16)((w >> shift) & ((1u << bits) - 1u));
}

/* Inverse of pack8: the 8 codes of the `bits` bytes at p, one per lane (as unpack16: code l is
 * bits l * bits .. of the bytes read as a little-endian number). always_inline with a constant
 * `bits`. */
static inline __attribute__((always_inline)) i32x8 unpack8(const uint8_t *p, const int bits) {
    if (bits == 8) {
        u8x8 b;
        memcpy(&b, p, sizeof b);
        return __builtin_convertvector(b, i32x8);
    }
    const uint32_t w0 = bits == 4 ? le32(p) : bits == 2 ? (uint32_t)p[0] | (uint32_t)p[1] << 8
                                                        : p[0];
    const u32x8 w = (u32x8){0} + w0; /* broadcast (a lane-by-lane build is slow) */
    u32x8 shift;
    for (int l = 0; l < 8; l++) shift[l] = (uint32_t)(l * bits);
    return (i32x8)((w >> shift) & ((1u << bits) - 1u));
}

#if HALVES16
#define unpack_g unpack8
#else
#define unpack_g unpack16
#endif

/* --- encode: quantise one map --------------------------------------------------------------- */

static inline uint8_t quantize(float h, float u, float lo, float divisor, float qmax) {
    float t = u + (h - lo) / divisor;
    t = t > 0.0f ? t : 0.0f; /* NaN -> 0 */
    t = t < qmax ? t : qmax;
    return (uint8_t)(int)t; /* t >= 0: truncation is the floor */
}

/* The codes of 16 (8) residuals h with their uniforms u, lane-wise `quantize`. The lower clamp
 * is t > 0 ? t : 0 (NaN and -0 become +0): one vmaxps on 8 lanes (greater8), a select on 16.
 * The upper clamp is an integer min of the bit patterns: after the lower clamp each lane is +0,
 * positive or +inf, whose patterns order as their values (one vpminsd, where GCC 12 gives a
 * float min against the constant qmax as a compare and two operations, or as scalar code
 * through less16). */
#define DEFINE_QUANTIZE(name, fvec, ivec, floor0, imin)                             \
    static inline ivec name(fvec h, fvec u, fvec vlo, fvec vdiv, fvec vmax) {       \
        const fvec zero = {0};                                                      \
        fvec t = floor0(u + (h - vlo) / vdiv, zero);                                \
        ivec tb, mb;                                                                \
        memcpy(&tb, &t, sizeof tb);                                                 \
        memcpy(&mb, &vmax, sizeof mb);                                              \
        tb = imin(tb, mb);                                                          \
        memcpy(&t, &tb, sizeof t);                                                  \
        return __builtin_convertvector(t, ivec);                                    \
    }
static inline f32x16 above16(f32x16 t, f32x16 zero) { return select16(t > zero, t, zero); }
DEFINE_QUANTIZE(quantize16, f32x16, i32x16, above16, imin16)
DEFINE_QUANTIZE(quantize8, f32x8, i32x8, greater8, imin8)

/* The codes of h[i] (i < n) packed into `codes`: a group of GL lanes at a time (`quantize16`
 * or `quantize8`, the float operations of `quantize`, so the same codes) packed in registers
 * (`pack16`, `pack8`), the rest one by one through the byte packing. The uniforms come from u,
 * or when u is NULL from gen, GL per step in registers. ahead: NULL, or the next map's n floats,
 * asked for one cache line per 16 floats (the hardware's stream prefetcher stops at each 4 KiB
 * page, so the first rows of each page, a whole 32 x 32 map, would otherwise arrive at memory
 * latency in the next map's first pass; here the loads overlap this loop's arithmetic).
 * always_inline with a constant `bits` (quantize_pack). Written with vector types because the
 * compiler leaves the plain loop scalar for the short maps of the token layouts (16 tokens). */
static inline __attribute__((always_inline)) void quantize_pack_fixed(
        int64_t n, const float *h, const float *u, map_noise *gen, const float *ahead, float lo,
        float divisor, float qmax, uint8_t *codes, const int bits) {
    const gf32 vlo = splat_g(lo), vdiv = splat_g(divisor), vmax = splat_g(qmax);
    int64_t i = 0;
    for (; i + GL <= n; i += GL) {
        if (ahead && i % 16 == 0) __builtin_prefetch(ahead + i);
        gf32 hv, uv;
        memcpy(&hv, h + i, sizeof hv);
        if (u) memcpy(&uv, u + i, sizeof uv);
        else uv = next_uniforms(gen);
        pack_g(quantize_g(hv, uv, vlo, vdiv, vmax), codes + i * bits / 8, bits);
    }
    if (i == n) return;
    float drawn[GL];
    if (!u) {
        const gf32 uv = next_uniforms(gen);
        memcpy(drawn, &uv, sizeof uv);
    }
    const float *ut = u ? u + i : drawn;
    uint8_t q[16]; /* GL <= 16 codes are whole bytes at every bits: the tail starts on a byte */
    for (int64_t k = 0; i + k < n; k++) q[k] = quantize(h[i + k], ut[k], lo, divisor, qmax);
    pack_row(q, n - i, codes + i * bits / 8, bits);
}

/* u: the map's uniforms, or NULL to draw them from the stream of seed for map `map` (the map's
 * noise state a local, whose address no other path takes: it stays in registers). */
static void quantize_pack(int64_t n, int bits, const float *h, const float *u, uint64_t seed,
                          uint64_t map, const float *ahead, float lo, float divisor, float qmax,
                          uint8_t *codes) {
    map_noise s = {0};
    if (!u) s = noise_of(seed, map);
#define QUANTIZE_AT(b)                                                                         \
    (u ? quantize_pack_fixed(n, h, u, NULL, ahead, lo, divisor, qmax, codes, b)                \
       : quantize_pack_fixed(n, h, NULL, &s, ahead, lo, divisor, qmax, codes, b))
    AT_CONSTANT_BITS(bits, QUANTIZE_AT);
#undef QUANTIZE_AT
}

/* The smallest (largest with `max`) of 8 (16) lanes, in any order: halves folded together. */
static inline float extreme8(f32x8 a, int max) {
    for (int width = 4; width >= 1; width /= 2) {
        const f32x8 b = width == 4 ? __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3)
                        : width == 2 ? __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1)
                                     : __builtin_shufflevector(a, a, 1, 0, 1, 0, 1, 0, 1, 0);
        a = select(max ? b > a : b < a, b, a);
    }
    return a[0];
}

static inline float extreme16(f32x16 v, int max) {
    const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const f32x8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return extreme8(select(max ? b > a : b < a, b, a), max);
}

/* The min and max of the map's n elements (NaN for both when it holds a NaN, as torch.aminmax),
 * zeros as +0 (min + 0.0f: -0 + 0 = +0), so the order of the scan does not matter: a group of
 * GL lanes in two independent chains, reduced in any order. */
static void map_range(int64_t n, const float *h, float *mn_out, float *mx_out) {
    gf32 mn0 = splat_g(INFINITY), mn1 = mn0, mx0 = splat_g(-INFINITY), mx1 = mx0, a, b;
    gi32 nan = {0};
    int64_t i = 0;
    for (; i + 2 * GL <= n; i += 2 * GL) {
        memcpy(&a, h + i, sizeof a);
        memcpy(&b, h + i + GL, sizeof b);
        mn0 = less_g(a, mn0);
        mn1 = less_g(b, mn1);
        mx0 = greater_g(a, mx0);
        mx1 = greater_g(b, mx1);
        nan |= (a != a) | (b != b);
    }
    if (i + GL <= n) {
        memcpy(&a, h + i, sizeof a);
        mn0 = less_g(a, mn0);
        mx0 = greater_g(a, mx0);
        nan |= a != a;
        i += GL;
    }
    float lo = extreme_g(less_g(mn1, mn0), 0);
    float hi = extreme_g(greater_g(mx1, mx0), 1);
    int any_nan = any_g(nan);
    for (; i < n; i++) {
        lo = h[i] < lo ? h[i] : lo;
        hi = h[i] > hi ? h[i] : hi;
        any_nan |= h[i] != h[i];
    }
    *mn_out = any_nan ? NAN : lo + 0.0f;
    *mx_out = any_nan ? NAN : hi + 0.0f;
}

/* h: the residual of map `map` (n elements); its uniforms: noise + map * n (noise: the whole
 * tensor's), or when noise is NULL drawn from seed; ahead: NULL or the next map's input,
 * prefetched (quantize_pack_fixed). */
static void quantize_map_with(int64_t n, int bits, const float *h, const float *noise,
                              uint64_t seed, uint64_t map, const float *ahead,
                              uint16_t *lo_out, uint16_t *step_out, uint8_t *codes) {
    float mn, mx;
    map_range(n, h, &mn, &mx);
    const float qmax = (float)((1 << bits) - 1);
    const uint16_t lo = bf16_down(mn);
    const float lo_f = bf16_to_float(lo);
    /* A span that overflows float32 in a finite map: max / qmax - lo / qmax (the edge rule). */
    const float span = mx - lo_f;
    const int over = isinf(span) && isfinite(mx) && isfinite(lo_f);
    const uint16_t step = bf16_up(over ? mx / qmax - lo_f / qmax : span / qmax);
    const float step_f = bf16_to_float(step);
    *lo_out = lo;
    *step_out = step;
    quantize_pack(n, bits, h, noise ? noise + map * n : NULL, seed, map, ahead, lo_f,
                  step_f == 0.0f ? 1.0f : step_f, qmax, codes);
}

/* The most elements of a map that encode_small_maps takes (a 16 x 16 map). */
#define SMALL_MAP 256

static void encode_small_maps(const geometry *g, int64_t m0, int bits, const float *x,
                              uint64_t seed, uint16_t *lfc, uint16_t *lo, uint16_t *step,
                              uint8_t *codes, float *scratch);

/* Encode the maps of x (float32, contiguous) described by geom (G_LEN values). lfc: bf16
 * (maps, nblocks), or NULL for the quant form (codes of x itself); lo, step: bf16 (maps,);
 * codes: uint8 (maps, code bytes); noise: float32 like x, or NULL to draw from the seed.
 * Returns 0, or -1 if scratch memory ran out. */
int freqact_division_encode(const int64_t *geom, int bits, const float *x, const float *noise,
                            uint64_t seed, uint16_t *lfc, uint16_t *lo, uint16_t *step,
                            uint8_t *codes, int threads) {
    geometry g;
    if (make_geometry(&g, geom) != 0) return -1;
    const int64_t maps = geom[G_MAPS], W = g.size[2];
    const int block = lfc != NULL;
    /* work units: groups of 16 small maps (encode_small_maps), then single maps */
    const int64_t groups = !noise && g.numel <= SMALL_MAP ? maps / 16 : 0;
    const int64_t units = groups + maps - 16 * groups;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* colsum (W), row (blk[1] * W), means (nb[2]) in one allocation; the residual */
        float *rows = block ? malloc((size_t)((1 + g.blk[1]) * W + g.nb[2]) * sizeof(float))
                            : NULL;
        float *residual = block ? malloc((size_t)g.numel * sizeof(float)) : NULL;
        float *lanes = groups ? malloc(4 * 16 * SMALL_MAP * sizeof(float)) : NULL;
        if ((block && (!rows || !residual)) || (groups && !lanes)) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t unit = 0; unit < units; unit++) {
                if (unit < groups) {
                    encode_small_maps(&g, 16 * unit, bits, x, seed, lfc, lo, step, codes,
                                      lanes);
                    continue;
                }
                const int64_t m = 16 * groups + unit - groups;
                const float *xm = x + m * g.numel;
                if (block)
                    block_residual(&g, xm, rows, rows + W, rows + (1 + g.blk[1]) * W,
                                   lfc + m * g.nblocks, residual);
                quantize_map_with(g.numel, bits, block ? residual : xm, noise, seed,
                                  (uint64_t)m, m + 1 < maps ? xm + g.numel : NULL,
                                  lo + m, step + m, codes + m * g.code_bytes);
            }
        }
        free(rows);
        free(residual);
        free(lanes);
    }
    free_geometry(&g);
    return failed ? -1 : 0;
}

/* --- decode --------------------------------------------------------------------------------- */

/* out[i] = q[i] * step (+ lo with `with_lo`) for the n codes packed at `codes`, q[i] as float:
 * GL codes at a time unpacked in registers (`unpack16`, `unpack8`), the rest one by one. Returns
 * whether a value is not finite. always_inline with constant `bits` and `with_lo`. */
static inline __attribute__((always_inline)) int dequantize_fixed(
        const uint8_t *codes, int64_t n, float lo_f, float step_f, float *out, const int bits,
        const int with_lo) {
    const gf32 vstep = splat_g(step_f), vlo = splat_g(lo_f);
    gi32 finite = ~(gi32){0}; /* all lanes true */
    int64_t i = 0;
    for (; i + GL <= n; i += GL) {
        gf32 v = __builtin_convertvector(unpack_g(codes + i * bits / 8, bits), gf32) * vstep;
        if (with_lo) v += vlo;
        finite &= finite_g(v);
        memcpy(out + i, &v, sizeof v);
    }
    int bad = any_g(~finite);
    const int per_byte = 8 / bits;
    for (; i < n; i++) {
        const float q = (float)((codes[i / per_byte] >> (i % per_byte * bits)) & ((1 << bits) - 1));
        out[i] = with_lo ? q * step_f + lo_f : q * step_f;
        bad |= !isfinite(out[i]);
    }
    return bad;
}

/* dequantize_fixed with a run-time `bits` and `with_lo`. */
static int dequantize_codes(const uint8_t *codes, int64_t n, int bits, float lo_f, float step_f,
                            int with_lo, float *out) {
    int bad;
#define DEQUANTIZE_AT(b)                                                                       \
    bad = with_lo ? dequantize_fixed(codes, n, lo_f, step_f, out, b, 1)                        \
                  : dequantize_fixed(codes, n, lo_f, step_f, out, b, 0)
    AT_CONSTANT_BITS(bits, DEQUANTIZE_AT);
#undef DEQUANTIZE_AT
    return bad;
}

/* The decode's edge rule for one value h whose quarter-scale sum (the same sum with every term
 * divided by 4) is `quarter`: where h overflowed while quarter is finite, quarter times 4,
 * saturated at +-FLT_MAX; else h. */
static inline float at_quarter_scale(float h, float quarter) {
    if (isfinite(h) || !isfinite(quarter)) return h;
    const float v = quarter * 4.0f;
    return isfinite(v) ? v : (v > 0 ? FLT_MAX : -FLT_MAX);
}

/* The decode's edge rule for one map whose sums did not all stay finite: where the sum is not
 * finite but q * (step / 4) + (lfc / 4 + lo / 4) is, out = that times 4, saturated at +-FLT_MAX
 * (at_quarter_scale). base, scaled, row: the decode's scratch (overwritten). */
static void redo_at_quarter_scale(const geometry *g, const uint16_t *lfc, float lo_f, float step_f,
                               const uint8_t *q, float *base, float *scaled, float *row,
                               float *out) {
    for (int64_t b = 0; b < g->nblocks; b++)
        base[b] = lfc ? bf16_to_float(lfc[b]) * 0.25f + lo_f * 0.25f : lo_f * 0.25f;
    for (int64_t i = 0; i < g->numel; i++) scaled[i] = (float)q[i] * (step_f * 0.25f);
    add_block_values(g, scaled, base, row, scaled);
    for (int64_t i = 0; i < g->numel; i++) out[i] = at_quarter_scale(out[i], scaled[i]);
}

static inline float positive_or_zero(unsigned bit, float v, float tiny) {
    return bit ? (v < tiny ? tiny : v) : 0.0f;
}

static inline unsigned bit_at(const uint8_t *bits, int64_t g) { return (bits[g >> 3] >> (g & 7)) & 1; }

/* A ReLU output's 1-bit mask on its decoded map of n elements (element first + i of the tensor
 * at bit (first + i) % 8 of byte (first + i) / 8): out = the value clamped up to `tiny` (NaN
 * kept) where the bit is set, exactly 0 elsewhere. */
static void apply_positive(const uint8_t *positive, int64_t first, int64_t n, float tiny,
                           float *out) {
    int64_t i = 0;
    for (; i < n && ((first + i) & 7); i++)  /* up to a byte boundary */
        out[i] = positive_or_zero(bit_at(positive, first + i), out[i], tiny);
    /* then a group's GL elements (whole bytes) at a time, in lanes (a branch per element on a
     * random mask mispredicts half the time: 3 ns per element) */
    const gf32 tinies = splat_g(tiny), zeros = {0};
    for (; i + GL <= n; i += GL) {
        gf32 v;
        memcpy(&v, out + i, sizeof v);
        v = select_g(v < tinies, tinies, v); /* NaN compares false: kept */
        v = select_g(unpack_g(positive + ((first + i) >> 3), 1) != 0, v, zeros);
        memcpy(out + i, &v, sizeof v);
    }
    for (; i < n; i++) out[i] = positive_or_zero(bit_at(positive, first + i), out[i], tiny);
}

/* out = q * step + (float(lfc) + lo) per element, float32 (maps, numel), for the maps that geom
 * describes; lfc NULL: the quant form. A map of one block (and every quant map) is one pass
 * (dequantize_codes with lo = its base); others dequantize into out, then add their blocks'
 * bases row by row in L1. A sum that overflows float32 while its quarter-scale sum
 * q * (step / 4) + base / 4 is finite becomes that sum times 4, saturated at +-FLT_MAX (the edge
 * rule of the reference). positive: NULL, or a ReLU output's mask (`apply_positive`, in the
 * same pass). Returns 0, or -1 if scratch memory ran out. */
int freqact_division_decode(const int64_t *geom, int bits, const uint16_t *lfc,
                            const uint16_t *lo, const uint16_t *step, const uint8_t *codes,
                            const uint8_t *positive, float tiny, float *out, int threads) {
    geometry g;
    if (make_geometry(&g, geom) != 0) return -1;
    const int64_t maps = geom[G_MAPS];
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *base = malloc((size_t)g.nblocks * sizeof(float));
        float *row = malloc((size_t)g.size[2] * sizeof(float));
        uint8_t *q = malloc((size_t)g.numel); /* q, scaled: the edge rule's scratch */
        float *scaled = malloc((size_t)g.numel * sizeof(float));
        if (!base || !row || !q || !scaled) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < maps; m++) {
                const float lo_f = bf16_to_float(lo[m]), step_f = bf16_to_float(step[m]);
                for (int64_t b = 0; b < g.nblocks; b++)
                    base[b] = lfc ? bf16_to_float(lfc[m * g.nblocks + b]) + lo_f : lo_f;
                const uint8_t *cm = codes + m * g.code_bytes;
                float *o = out + m * g.numel;
                int overflow;
                if (g.nblocks == 1) {
                    overflow = dequantize_codes(cm, g.numel, bits, base[0], step_f, 1, o);
                } else {
                    dequantize_codes(cm, g.numel, bits, 0.0f, step_f, 0, o);
                    overflow = add_block_values(&g, o, base, row, o);
                }
                if (overflow) {
                    unpack_row(cm, g.numel, q, bits);
                    redo_at_quarter_scale(&g, lfc ? lfc + m * g.nblocks : NULL, lo_f, step_f, q,
                                          base, scaled, row, o);
                }
                if (positive) apply_positive(positive, m * g.numel, g.numel, tiny, o);
            }
        }
        free(base);
        free(q);
        free(scaled);
        free(row);
    }
    free_geometry(&g);
    return failed ? -1 : 0;
}

/* --- packing of whole tensors --------------------------------------------------------------- */

/* Rows are cut into chunks of CHUNK codes (a multiple of 8, so chunks start on whole bytes) that
 * threads share, so that one long row (a flattened 1-bit mask) is packed in parallel too. */
#define CHUNK 65536

/* codes (rows, count) uint8 < 2^bits -> out (rows, ceil(count * bits / 8)). */
void freqact_pack_codes(int64_t rows, int64_t count, int bits, const uint8_t *codes, uint8_t *out,
                        int threads) {
    const int64_t row_bytes = (count * bits + 7) / 8, chunks = (count + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < rows * chunks; t++) {
        const int64_t r = t / chunks, first = (t % chunks) * CHUNK;
        const int64_t n = count - first < CHUNK ? count - first : CHUNK;
        pack_row(codes + r * count + first, n, out + r * row_bytes + first * bits / 8, bits);
    }
}

/* Inverse of freqact_pack_codes: packed (rows, ceil(count * bits / 8)) -> out (rows, count). */
void freqact_unpack_codes(int64_t rows, int64_t count, int bits, const uint8_t *packed,
                          uint8_t *out, int threads) {
    const int64_t row_bytes = (count * bits + 7) / 8, chunks = (count + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < rows * chunks; t++) {
        const int64_t r = t / chunks, first = (t % chunks) * CHUNK;
        const int64_t n = count - first < CHUNK ? count - first : CHUNK;
        unpack_row(packed + r * row_bytes + first * bits / 8, n, out + r * count + first, bits);
    }
}

/* --- 1-bit masks of float tensors ------------------------------------------------------------ */

/* Elements per task (a multiple of 16: each task's lane steps start on a whole byte). */
#define MASK_CHUNK 4096

/* The mask bits of a group's GL floats at p, one per lane (1 or 0): lower < p[l] (and
 * p[l] < upper when bounded); NaN gives 0. */
static inline gi32 mask_g(const float *p, gf32 lower, int bounded, gf32 upper) {
    gf32 v;
    memcpy(&v, p, sizeof v);
    const gi32 bit = v > lower;
    return (bounded ? bit & (v < upper) : bit) & 1;
}

/* Bit i (bit i % 8 of byte i / 8) = lower < x[i] (and x[i] < upper when bounded), n elements:
 * GL compares in lanes packed in registers per step (pack16, pack8); the last count % GL of the
 * tensor through a NaN-padded copy (NaN sets no bit, so the last byte's unused bits stay 0). */
void freqact_pack_mask(int64_t n, const float *x, float lower, int bounded, float upper,
                       uint8_t *out, int threads) {
    const int64_t chunks = (n + MASK_CHUNK - 1) / MASK_CHUNK;
    const gf32 lo_g = splat_g(lower), up_g = splat_g(upper);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t first = c * MASK_CHUNK, count = n - first < MASK_CHUNK ? n - first : MASK_CHUNK;
        const float *xc = x + first;
        uint8_t *oc = out + first / 8;
        int64_t i = 0;
        for (; i + GL <= count; i += GL) pack_g(mask_g(xc + i, lo_g, bounded, up_g), oc + i / 8, 1);
        if (i < count) {
            float pad[GL];
            uint8_t bytes[GL / 8];
            for (int k = 0; k < GL; k++) pad[k] = i + k < count ? xc[i + k] : NAN;
            pack_g(mask_g(pad, lo_g, bounded, up_g), bytes, 1);
            memcpy(oc + i / 8, bytes, (size_t)(count - i + 7) / 8);
        }
    }
}

/* out[i] = bit i ? on : off, float32, n elements: GL bits unpacked in registers per step
 * (unpack16, unpack8). */
void freqact_unpack_mask(int64_t n, const uint8_t *packed, float off, float on, float *out,
                         int threads) {
    const int64_t chunks = (n + MASK_CHUNK - 1) / MASK_CHUNK;
    const gf32 on_g = splat_g(on), off_g = splat_g(off);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t first = c * MASK_CHUNK, count = n - first < MASK_CHUNK ? n - first : MASK_CHUNK;
        const uint8_t *pc = packed + first / 8;
        float *oc = out + first;
        int64_t i = 0;
        for (; i + GL <= count; i += GL) {
            const gf32 v = select_g(unpack_g(pc + i / 8, 1) != 0, on_g, off_g);
            memcpy(oc + i, &v, sizeof v);
        }
        for (; i < count; i++) oc[i] = bit_at(pc, i) ? on : off;
    }
}


/* --- token layouts (freqact/engine/layouts.py) ------------------------------------------------
 *
 * One sequence m of a token tensor is a panel of H x W tokens (H = 1 for sequences) of F
 * features, read through strides (any layout, no copy in Python). Its block means cover bh x bw
 * tokens x bf features (`feat` 1 x 1 x 8, `tile` 1 x 8 x 8, `tok64` 1 x 64 x 1, `grid64`
 * 8 x 8 x 1; edge blocks cover what is left) and block (i, j, k) is stored at lfc[m * nblocks +
 * i * lh + j * lw + k * lf], the order of the block view the torch path encodes. The residual
 * x - mean (saturated as in encode) is then quantised per token row (stats 0, `tok`: maps of F
 * elements, map index m * T + t) or per feature column (stats 1, `chan`: maps of T = H * W
 * elements, map index m * F + f), the quant view whose element g draws uniform g (noise[g], or
 * the stream above: element g % n of map g / n, n the map length). Per sequence, in cache: gather
 * (a panel that is not contiguous), block sums, residual, then the quant maps 16 at a time, one
 * per lane (quantize_lanes: `chan` maps down 16 columns of the residual in place, `tok` maps
 * from a 16-row strip transposed): min/max, lo/step, uniforms and quantise + pack in registers,
 * nothing per map reduced across lanes and no uniforms stored; the maps left over (maps % 16)
 * and every map of a call with given noise one by one as in the map kernels (quantize_map_with).
 * Decode: mean + (q * step + lo) with the quant decode's edge rule, into a float32 (H * W, F)
 * panel per sequence at out + m * out_stride: `chan` maps 16 columns at a time straight from
 * their code words into the panel (dequantize_columns), the rest map by map; no transpose and no
 * separate mean pass. At most one OpenMP thread per sequence. */

enum { T_M, T_H, T_W, T_F, T_BH, T_BW, T_BF, T_NBH, T_NBW, T_NBF, T_LH, T_LW, T_LF, T_STATS,
       T_CODE_BYTES, T_SM, T_MI, T_SMI, T_SH, T_SW, T_SF, T_OUT_STRIDE, T_LEN };

/* Where sequence m of the encode's input x starts: the sequences are T_M / T_MI groups (stride
 * T_SM) of T_MI sequences each (stride T_SMI), as attention's (N, heads, T, d) views of a qkv
 * projection hold them (N * heads sequences read in place, whose strides no single one gives). */
static inline int64_t sequence_offset(const int64_t *g, int64_t m) {
    return m / g[T_MI] * g[T_SM] + m % g[T_MI] * g[T_SMI];
}

/* The OpenMP team for M sequences: no more threads than sequences (an idle thread's wake-up
 * and join cost a small call more than its share), at least one. */
static inline int team(int64_t M, int threads) {
    return M < threads ? (M > 0 ? (int)M : 1) : threads;
}

/* p[(h * W + w) * F + f] = x[h * sh + w * sw + f * sf] for one sequence. */
static void gather_panel(const int64_t *g, const float *x, float *p) {
    const int64_t H = g[T_H], W = g[T_W], F = g[T_F];
    const int64_t sh = g[T_SH], sw = g[T_SW], sf = g[T_SF];
    for (int64_t h = 0; h < H; h++) {
        if (sf == 1) {
            for (int64_t w = 0; w < W; w++) memcpy(p + (h * W + w) * F, x + h * sh + w * sw,
                                                   (size_t)F * sizeof(float));
        } else {
            for (int64_t f = 0; f < F; f++)
                for (int64_t w = 0; w < W; w++) p[(h * W + w) * F + f] = x[h * sh + w * sw + f * sf];
        }
    }
}

/* The 8 x 8 floats of rows r transposed into columns c, in registers: interleave pairs of rows,
 * then pairs of pairs, then the two halves. */
static inline void transpose8_regs(const f32x8 r[8], f32x8 c[8]) {
    f32x8 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4)
        for (int k = 0; k < 2; k++) {
            u[i + 2 * k] = __builtin_shufflevector(t[i + k], t[i + k + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[i + 2 * k + 1] = __builtin_shufflevector(t[i + k], t[i + k + 2], 2, 3, 10, 11, 6, 7,
                                                       14, 15);
        }
    for (int k = 0; k < 4; k++) {
        c[k] = __builtin_shufflevector(u[k], u[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        c[k + 4] = __builtin_shufflevector(u[k], u[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* The 8 x 8 floats at src (row stride ss) transposed to dst (row stride ds), in registers. */
static inline void transpose8(const float *src, int64_t ss, float *dst, int64_t ds) {
    f32x8 r[8], c[8];
    for (int i = 0; i < 8; i++) memcpy(&r[i], src + i * ss, sizeof r[i]);
    transpose8_regs(r, c);
    for (int k = 0; k < 8; k++) memcpy(dst + k * ds, &c[k], sizeof c[k]);
}

/* dst (cols, rows) = src (rows, cols; rows `stride` floats apart) transposed: 8 x 8 tiles in
 * registers, the edges by element. */
static void transpose(const float *src, int64_t rows, int64_t cols, int64_t stride, float *dst) {
    const int64_t rows8 = rows - rows % 8, cols8 = cols - cols % 8;
    for (int64_t r = 0; r < rows8; r += 8)
        for (int64_t c = 0; c < cols8; c += 8)
            transpose8(src + r * stride + c, stride, dst + c * rows + r, rows);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = r < rows8 ? cols8 : 0; c < cols; c++) dst[c * rows + r] = src[r * stride + c];
}

/* The block rows of a panel: blocks (i, j, .) cover tokens h in [h0, h1), w in [w0, w1). */
typedef struct {
    int64_t i, j, h0, h1, w0, w1;
} block_row;

static block_row block_row_at(const int64_t *g, int64_t i, int64_t j) {
    block_row r = {i, j, i * g[T_BH], (i + 1) * g[T_BH], j * g[T_BW], (j + 1) * g[T_BW]};
    if (r.h1 > g[T_H]) r.h1 = g[T_H];
    if (r.w1 > g[T_W]) r.w1 = g[T_W];
    return r;
}

/* row[f] = the float value of f's block mean in block row r (lfc of one sequence). */
static void mean_row(const int64_t *g, const uint16_t *lfc, block_row r, float *row) {
    const int64_t F = g[T_F], bf = g[T_BF];
    const uint16_t *base = lfc + r.i * g[T_LH] + r.j * g[T_LW];
    if (bf == 1) {
        for (int64_t f = 0; f < F; f++) row[f] = bf16_to_float(base[f * g[T_LF]]);
        return;
    }
    /* 16 floats (two blocks) per store: residual_rows reads the row 16 floats at a time right
     * after, and a load that spans two stores waits until they reach the cache (the store
     * forwarding fails; for blocks of one token, in every row). 8 contiguous blocks' means
     * from one load, then blocks in pairs, then one by one. */
    int64_t k = 0;
    if (bf == 8 && g[T_LF] == 1)
        for (; (k + 8) * 8 <= F; k += 8) {
            u16x8 b;
            memcpy(&b, base + k, sizeof b);
            const i32x8 bits = __builtin_convertvector(b, i32x8) << 16;
            f32x8 v;
            memcpy(&v, &bits, sizeof v);
            const f32x16 out[4] = {
                __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                __builtin_shufflevector(v, v, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
                __builtin_shufflevector(v, v, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5),
                __builtin_shufflevector(v, v, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7)};
            memcpy(row + k * 8, out, sizeof out);
        }
    if (bf == 8)
        for (; (k + 2) * 8 <= F; k += 2) {
            const float a = bf16_to_float(base[k * g[T_LF]]);
            const float b = bf16_to_float(base[(k + 1) * g[T_LF]]);
            const f32x16 v = {a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b};
            memcpy(row + k * 8, &v, sizeof v);
        }
    for (; k < g[T_NBF]; k++) {
        const float v = bf16_to_float(base[k * g[T_LF]]);
        const int64_t f0 = k * bf, n = f0 + bf <= F ? bf : F - f0;
        if (n == 8) {
            const f32x8 splat = {v, v, v, v, v, v, v, v};
            memcpy(row + f0, &splat, sizeof splat);
        } else {
            for (int64_t e = 0; e < n; e++) row[f0 + e] = v;
        }
    }
}

/* The 2^-64-scaled sum of the edge rule for one block (k: its feature block), or sum / count
 * when a value of the block is not finite. */
static float scaled_panel_mean(const int64_t *g, const float *p, block_row r, int64_t k,
                               float sum, float count) {
    const int64_t W = g[T_W], F = g[T_F], f0 = k * g[T_BF];
    const int64_t f1 = f0 + g[T_BF] < F ? f0 + g[T_BF] : F;
    float s = 0.0f;
    for (int64_t h = r.h0; h < r.h1; h++)
        for (int64_t w = r.w0; w < r.w1; w++)
            for (int64_t f = f0; f < f1; f++) {
                const float v = p[(h * W + w) * F + f];
                if (!isfinite(v)) return sum / count;
                s += v * 0x1p-64f;
            }
    return s / count / 0x1p-64f;
}

/* bf16 of f rounded to nearest even, lane-wise: bf16_nearest on 8 lanes. */
static inline i32x8 bf16_nearest8(f32x8 f) {
    u32x8 u;
    memcpy(&u, &f, sizeof u);
    i32x8 r = (i32x8)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    const i32x8 finite = ((i32x8)u & 0x7F800000) != 0x7F800000;
    const i32x8 saturate = ((r & 0x7FFF) == 0x7F80) & finite;
    r = (saturate & ((r & 0x8000) | (int32_t)BF16_MAX_BITS)) | (~saturate & r);
    const i32x8 nan = f != f;
    return (nan & 0x7FC0) | (~nan & r);
}

/* The sums 0 + s[8 l] + s[8 l + 1] + ... + s[8 l + 7] of 8 groups l of 8 floats at s, added in
 * this order (as the scalar loop adds them), 8 groups in lanes through a transpose. */
static inline f32x8 group_sums8(const float *s) {
    f32x8 r[8], c[8];
    for (int i = 0; i < 8; i++) memcpy(&r[i], s + 8 * i, sizeof r[i]);
    transpose8_regs(r, c);
    f32x8 sum = {0};
    for (int e = 0; e < 8; e++) sum += c[e];
    return sum;
}

/* lfc index of block (i, j, k) of a sequence */
static inline int64_t lfc_index(const int64_t *g, int64_t i, int64_t j, int64_t k) {
    return i * g[T_LH] + j * g[T_LW] + k * g[T_LF];
}

/* The lfc of 8 blocks from their sums (8 lanes) over count elements each: the division and
 * rounding lane-wise, a block whose sum is not finite by the edge rule. Block l is (r, k0 + l),
 * or with `per_token` (blocks of one token, nbf per token) the block g0 + l of the panel. */
static void store_means8(const int64_t *g, const float *src, block_row r, int64_t k0,
                         int per_token, f32x8 sum, float count, uint16_t *lfc) {
    const f32x8 counts = {count, count, count, count, count, count, count, count};
    const i32x8 bf16 = bf16_nearest8(sum / counts);
    i32x8 bits;
    memcpy(&bits, &sum, sizeof bits);
    const i32x8 finite = (bits & 0x7F800000) != 0x7F800000;
    const int all_finite = !any8(~finite);
    /* the common case: finite sums, stored contiguously (lanes extracted one by one are slow) */
    const int64_t first = per_token ? k0 : lfc_index(g, r.i, r.j, k0);
    const int contiguous = per_token ? g[T_H] == 1 && g[T_LW] == g[T_NBF] && g[T_LF] == 1
                                     : g[T_LF] == 1;
    if (all_finite && contiguous) {
        const u16x8 v = __builtin_convertvector(bf16, u16x8);
        memcpy(lfc + first, &v, sizeof v);
        return;
    }
    for (int l = 0; l < 8; l++) {
        int64_t k = k0 + l;
        if (per_token) {
            const int64_t t = k / g[T_NBF];
            r = block_row_at(g, t / g[T_W], t % g[T_W]);
            k %= g[T_NBF];
        }
        uint16_t v = (uint16_t)bf16[l];
        if (!isfinite(sum[l])) v = bf16_nearest(scaled_panel_mean(g, src, r, k, sum[l], count));
        lfc[lfc_index(g, r.i, r.j, k)] = v;
    }
}

/* The lfc of a panel whose blocks are one token by 8 features (F a multiple of 8): its
 * T * F / 8 blocks are consecutive groups of 8 floats, 8 of them at a time in lanes (a block row
 * alone has too few when F < 64); the last ones by row_means' scalar loop (returns how many
 * whole tokens were done). */
static int64_t token_means(const int64_t *g, const float *src, uint16_t *lfc) {
    const int64_t T = g[T_H] * g[T_W], nbf = g[T_NBF];
    const block_row unused = {0, 0, 0, 0, 0, 0};
    int64_t b = 0;
    for (; b + 8 <= T * nbf; b += 8)
        store_means8(g, src, unused, b, 1, group_sums8(src + b * 8), 8.0f, lfc);
    return b / nbf;
}

/* The lfc of block row r from its sums over its tokens (F floats; tokens of them): 8 blocks at
 * a time in lanes when a block is one feature or 8 of them (F a multiple of 8), else one by
 * one. */
static void row_means(const int64_t *g, const float *src, block_row r, const float *sums,
                      float tokens, uint16_t *lfc) {
    const int64_t F = g[T_F], bf = g[T_BF], nbf = g[T_NBF];
    int64_t k = 0;
    if (bf == 1 || (bf == 8 && F % 8 == 0))
        for (; k + 8 <= nbf; k += 8) {
            f32x8 sum = {0};
            if (bf == 1) {
                f32x8 v;
                memcpy(&v, sums + k, sizeof v);
                sum += v; /* 0 + v, as the scalar loop (-0 becomes +0) */
            } else {
                sum = group_sums8(sums + k * 8);
            }
            store_means8(g, src, r, k, 0, sum, tokens * (float)bf, lfc);
        }
    for (; k < nbf; k++) {
        const int64_t f0 = k * bf, f1 = f0 + bf < F ? f0 + bf : F;
        float sum = 0.0f;
        for (int64_t f = f0; f < f1; f++) sum += sums[f];
        const float count = tokens * (float)(f1 - f0);
        const float mean = isfinite(sum) ? sum / count : scaled_panel_mean(g, src, r, k, sum, count);
        lfc[lfc_index(g, r.i, r.j, k)] = bf16_nearest(mean);
    }
}

/* acc[f] for the `vecs` vectors of 16 features at f: 0 + x[f] of the tokens of block row r in
 * order (h, w), in registers, a lane group per register. always_inline with a constant `vecs`. */
static inline __attribute__((always_inline)) void sum_vectors(const int64_t *g, const float *src,
                                                              block_row r, int64_t f,
                                                              float *acc, const int vecs) {
    const int64_t W = g[T_W], F = g[T_F];
    const int groups = vecs * 16 / GL;
    gf32 sum[64 / GL] = {{0}}, v;
    for (int64_t h = r.h0; h < r.h1; h++)
        for (int64_t w = r.w0; w < r.w1; w++) {
            const float *x = src + (h * W + w) * F + f;
            for (int k = 0; k < groups; k++) {
                memcpy(&v, x + GL * k, sizeof v);
                sum[k] += v;
            }
        }
    for (int k = 0; k < groups; k++) memcpy(acc + f + GL * k, &sum[k], sizeof sum[k]);
}

/* acc[f] = 0 + x[f] of the tokens of block row r in order (h, w): 64 features at a time in
 * 64 / GL registers (independent additions: one running sum waits on its previous add), then 16,
 * then one by one. Added into acc in memory, each token cost a load and a store more per vector. */
static void block_row_sums(const int64_t *g, const float *src, block_row r, float *acc) {
    const int64_t W = g[T_W], F = g[T_F];
    int64_t f = 0;
    for (; f + 64 <= F; f += 64) sum_vectors(g, src, r, f, acc, 4);
    for (; f + 16 <= F; f += 16) sum_vectors(g, src, r, f, acc, 1);
    for (; f < F; f++) {
        float sum = 0.0f;
        for (int64_t h = r.h0; h < r.h1; h++)
            for (int64_t w = r.w0; w < r.w1; w++) sum += src[(h * W + w) * F + f];
        acc[f] = sum;
    }
}

/* Whether the panel's blocks are one token by 8 features with F a multiple of 16 (the `feat`
 * blocks of 32 or 64 features): their means go a group of GL features (one or two blocks) at a
 * time, spread in registers (means_g), where a mean row per token cost more than its use. */
static inline int token_pairs(const int64_t *g) {
    return g[T_BH] * g[T_BW] == 1 && g[T_BF] == 8 && g[T_F] % 16 == 0;
}

/* The lfc of token t's blocks (token_pairs), lf apart. */
static inline const uint16_t *token_lfc(const int64_t *g, const uint16_t *lfc, int64_t t) {
    return lfc + lfc_index(g, t / g[T_W], t % g[T_W], 0);
}

/* The means of features f .. f + GL - 1 (blocks f / 8 ..) from a token's lfc. */
static inline gf32 means_g(const uint16_t *means, int64_t f, int64_t lf) {
    const float a = bf16_to_float(means[f / 8 * lf]);
#if HALVES16
    return splat8(a);
#else
    const float b = bf16_to_float(means[(f / 8 + 1) * lf]);
    return (f32x16){a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b};
#endif
}

/* The residual of a token_pairs panel, its lfc known, checked as residual_rows checks it. */
static void token_residual(const int64_t *g, const float *src, const uint16_t *lfc, float *p) {
    const int64_t T = g[T_H] * g[T_W], F = g[T_F], lf = g[T_LF];
    gf32 nonfinite = {0};
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *means = token_lfc(g, lfc, t);
        for (int64_t f = 0; f < F; f += GL) {
            gf32 x;
            memcpy(&x, src + t * F + f, sizeof x);
            const gf32 r = x - means_g(means, f, lf);
            nonfinite += r - r;
            memcpy(p + t * F + f, &r, sizeof r);
        }
    }
    if (!any_g(nonfinite != nonfinite)) return;
    for (int64_t t = 0; t < T; t++)
        for (int64_t f = 0; f < F; f += GL) {
            const gf32 mean = means_g(token_lfc(g, lfc, t), f, lf);
            for (int l = 0; l < GL; l++)
                p[t * F + f + l] = residual_at(src[t * F + f + l], mean[l]);
        }
}

/* Block means of the panel src ((H * W, F), contiguous) into lfc and its residual into p (not
 * src), or without p the means alone. acc, row: scratch of F floats. */
static void panel_residual(const int64_t *g, const float *src, float *p, uint16_t *lfc,
                           float *acc, float *row) {
    const int64_t W = g[T_W], F = g[T_F];
    /* blocks of one token x 8 features: their means first, for the whole panel */
    const int64_t done = g[T_BH] * g[T_BW] == 1 && g[T_BF] == 8 && F % 8 == 0
                         ? token_means(g, src, lfc) : 0;
    if (token_pairs(g)) {
        for (int64_t t = done; t < g[T_H] * W; t++)
            row_means(g, src, block_row_at(g, t / W, t % W), src + t * F, 1.0f, lfc);
        if (p) token_residual(g, src, lfc, p);
        return;
    }
    for (int64_t i = 0; i < g[T_NBH]; i++)
        for (int64_t j = 0; j < g[T_NBW]; j++) {
            const block_row r = block_row_at(g, i, j);
            const float tokens = (float)((r.h1 - r.h0) * (r.w1 - r.w0));
            /* acc[f] = the block row's sum over its tokens (the token itself for one token) */
            const float *sums = tokens == 1.0f ? src + (r.h0 * W + r.w0) * F : acc;
            if (sums == acc) block_row_sums(g, src, r, acc);
            if (r.h0 * W + r.w0 >= done) row_means(g, src, r, sums, tokens, lfc);
            if (!p) continue;
            mean_row(g, lfc, r, row);
            /* the block row's tokens of one h are contiguous */
            for (int64_t h = r.h0; h < r.h1; h++)
                residual_rows(src + (h * W + r.w0) * F, row, F, r.w1 - r.w0,
                              p + (h * W + r.w0) * F);
        }
}

/* --- quant maps 16 at a time: one map per lane ----------------------------------------------
 *
 * Without given noise, the quant maps of a panel go 16 at a time in lanes: `chan` maps read
 * down 16 columns of the residual panel in place, `tok` maps (token rows) from a 16-row strip
 * transposed to 16 columns; the rest (maps % 16) one by one by quantize_map_with. No per-map
 * reductions and no uniforms written to memory; a group of GL maps in registers at a time (two
 * groups of 8 on the halves path). Per lane these are quantize_map_with's float operations (the
 * same bytes): min/max in PHASES accumulators (element e of the first n - n % PHASES in phase
 * e % PHASES, independent chains), reduced, then the tail elements, zeros as +0; the uniforms
 * are those of the map's elements in the stream, drawn per lane. */

/* bf16_directed on a group (bit patterns in int32 lanes). */
static inline gi32 bf16_directed_g(gf32 f, int up) {
    gu32 u;
    memcpy(&u, &f, sizeof u);
    gi32 kept = (gi32)(u >> 16);
    const gf32 zero = {0};
    const gi32 dropped = (gi32)(u & 0xFFFFu) != 0;
    kept -= dropped & (up ? f > zero : f < zero); /* a true lane is -1 */
    kept += ((kept & 0x7FFF) == 0x7F80) & finite_g(f);
    const gi32 nan = f != f;
    return (nan & 0x7FC0) | (~nan & kept);
}

/* min and max of a group's maps of n elements in lanes (element e of all GL at p + e * stride),
 * NaN where a map has one, zeros as +0 (as map_range: any order of the scan gives these bytes).
 * The phases are unrolled so that their accumulators stay in registers (indexed by e % PHASES
 * they were kept on the stack: a store and a reload per element): 8 phases of 16 lanes in
 * AVX-512's 32 registers, 4 phases of 8 lanes in AVX2's 16. */
enum { PHASES = GL == 16 ? 8 : 4 };

static void lanes_range(const float *p, int64_t n, int64_t stride, gf32 *mn_out, gf32 *mx_out) {
    gf32 mn[PHASES], mx[PHASES], v;
    gi32 nan = {0};
    for (int k = 0; k < PHASES; k++) mn[k] = splat_g(INFINITY), mx[k] = splat_g(-INFINITY);
    const int64_t whole = n - n % PHASES;
    for (int64_t t = 0; t < whole; t += PHASES)
#pragma GCC unroll 8
        for (int k = 0; k < PHASES; k++) {
            memcpy(&v, p + (t + k) * stride, sizeof v);
            mn[k] = less_g(v, mn[k]);
            mx[k] = greater_g(v, mx[k]);
            nan |= v != v;
        }
    for (int step = 1; step < PHASES; step *= 2) /* phases k and k + step into k */
        for (int k = 0; k < PHASES; k += 2 * step) {
            mn[k] = less_g(mn[k + step], mn[k]);
            mx[k] = greater_g(mx[k + step], mx[k]);
        }
    for (int64_t t = whole; t < n; t++) {
        memcpy(&v, p + t * stride, sizeof v);
        mn[0] = less_g(v, mn[0]);
        mx[0] = greater_g(v, mx[0]);
        nan |= v != v;
    }
    *mn_out = select_g(nan, splat_g(NAN), mn[0] + 0.0f);
    *mx_out = select_g(nan, splat_g(NAN), mx[0] + 0.0f);
}

/* The 4-byte word w of codes at out (its first n <= 4 bytes), little-endian. */
static inline void store_word(uint32_t w, uint8_t *out, int64_t n) {
    for (int64_t b = 0; b < n; b++) out[b] = (uint8_t)(w >> (8 * b));
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LITTLE_ENDIAN_HOST 0
#else
#define LITTLE_ENDIAN_HOST 1
#endif

/* The codes of `count` consecutive elements (p, p + stride, ...; count <= 32 / bits) of a
 * group's GL maps in lanes, packed into one word per lane, their uniforms drawn from x (which
 * steps on by mul per element). always_inline with constant `bits` (and `count` for whole
 * words). */
static inline __attribute__((always_inline)) gu32 quantize_word(
        const float *p, int64_t stride, gu32 *x, gu32 mul, gf32 lo_f, gf32 div, gf32 qmax,
        int count, const int bits) {
    gu32 word = {0};
#pragma GCC unroll 16
    for (int k = 0; k < count; k++) {
        gf32 h;
        memcpy(&h, p + k * stride, sizeof h);
        word |= (gu32)quantize_g(h, uniforms_at(*x), lo_f, div, qmax) << (uint32_t)(k * bits);
        *x += mul;
    }
    return word;
}

/* quantize_lanes for one group of GL maps whose min and max (lanes_range's) are mn and mx,
 * with a constant `bits`, always_inline: the shifts of the packing are constants. */
static inline __attribute__((always_inline)) void quantize_group(
        int64_t map0, int64_t n, int64_t cb, const float *p, int64_t stride, gf32 mn, gf32 mx,
        uint64_t seed, uint16_t *lo, uint16_t *step, uint8_t *codes, const int bits) {
    const gf32 qmax = (gf32){0} + (float)((1 << bits) - 1), zero = {0};
    const gi32 lo_b = bf16_directed_g(mn, 0);
    const gf32 lo_f = bf16_to_float_g(lo_b), span = mx - lo_f;
    /* the edge rule: a span that overflows in a finite map */
    const gi32 over = ~finite_g(span) & (span == span) & finite_g(mx) & finite_g(lo_f);
    const gi32 step_b = bf16_directed_g(select_g(over, mx / qmax - lo_f / qmax, span / qmax), 1);
    const gf32 step_f = bf16_to_float_g(step_b);
    const gf32 div = select_g(step_f == zero, (gf32){0} + 1.0f, step_f);
    const gu16 lo16 = __builtin_convertvector(lo_b, gu16);
    const gu16 step16 = __builtin_convertvector(step_b, gu16);
    memcpy(lo + map0, &lo16, sizeof lo16);
    memcpy(step + map0, &step16, sizeof step16);
    /* lane l is map map0 + l: x the hash input of its element t (from add, steps of mul) */
    gu32 x, mul;
    for (int l = 0; l < GL; l++) {
        const map_key k = key_of(seed, (uint64_t)(map0 + l));
        x[l] = k.add;
        mul[l] = k.mul;
    }
    /* whole words (no bound to check per element), then the last one */
    const int per_word = 32 / bits;
    const int64_t whole = n - n % per_word;
    for (int64_t w0 = 0; w0 < whole; w0 += per_word) {
        const gu32 word = quantize_word(p + w0 * stride, stride, &x, mul, lo_f, div, qmax,
                                        per_word, bits);
        uint8_t *out = codes + map0 * cb + w0 / per_word * 4;
        for (int l = 0; l < GL; l++) store_word(word[l], out + l * cb, 4); /* one store */
    }
    if (whole == n) return;
    const gu32 word = quantize_word(p + whole * stride, stride, &x, mul, lo_f, div, qmax,
                                    (int)(n - whole), bits);
    const int64_t at = whole / per_word * 4, last = cb - at < 4 ? cb - at : 4;
    for (int l = 0; l < GL; l++) store_word(word[l], codes + map0 * cb + at + l * cb, last);
}

/* quantize_group with `bits` a constant. */
static void quantize_ranged(int64_t map0, int64_t n, int64_t cb, int bits, const float *p,
                            int64_t stride, gf32 mn, gf32 mx, uint64_t seed, uint16_t *lo,
                            uint16_t *step, uint8_t *codes) {
#define GROUP_AT(b) quantize_group(map0, n, cb, p, stride, mn, mx, seed, lo, step, codes, b)
    AT_CONSTANT_BITS(bits, GROUP_AT);
#undef GROUP_AT
}

/* Quantise and pack the 16 quant maps map0 + lane of n elements each (element e of all 16 at
 * p + e * stride; cb code bytes per map), a group of GL maps at a time. */
static void quantize_lanes(int64_t map0, int64_t n, int64_t cb, int bits, const float *p,
                           int64_t stride, uint64_t seed, uint16_t *lo, uint16_t *step,
                           uint8_t *codes) {
    for (int g0 = 0; g0 < 16; g0 += GL) {
        gf32 mn, mx;
        lanes_range(p + g0, n, stride, &mn, &mx);
        quantize_ranged(map0 + g0, n, cb, bits, p + g0, stride, mn, mx, seed, lo, step, codes);
    }
}

/* --- chan panels 16 columns at a time: the residual and the quantisation fused ---------------
 *
 * Where quantize_panel reads the chan maps of a residual panel that panel_residual wrote whole
 * (to L2 beyond a few tokens), then reads each strip of 16 columns twice (lanes_range, then the
 * quantisation), quantize_strips makes one strip's residual at a time into T x 16 floats that
 * stay in L1, its maps' ranges on the way: the same floats, so the same bytes. */

/* Whether sequence panels of geometry g are encoded by strips: chan maps drawn from the seed
 * (no given noise), whole strips of 16 columns, blocks of several tokens (a strip pays for its
 * means per block row: with one token per row the `feat` blocks ran 1.1 times slower). */
static inline int by_strips(const int64_t *g, const float *noise) {
    return g[T_STATS] == 1 && !noise && g[T_F] % 16 == 0 && g[T_BH] * g[T_BW] > 1;
}

/* The lfc offsets (within a block row) of the blocks of features c .. c + 15 into at. Returns
 * whether each group of GL features lies in one block (then block_means_g splats one mean). */
static int strip_offsets(const int64_t *g, int64_t c, int64_t at[16]) {
    const int64_t bf = g[T_BF];
    for (int l = 0; l < 16; l++)
        at[l] = (bf % GL == 0 ? (c + l / GL * GL) / bf : (c + l) / bf) * g[T_LF];
    return bf % GL == 0;
}

/* The block means of a group of GL features: lfc row `base` (the block row's), offsets `at`
 * of the group's lanes (strip_offsets), one splat when `whole`, else lane by lane. */
static inline gf32 block_means_g(const uint16_t *base, const int64_t *at, int whole) {
    if (whole) return splat_g(bf16_to_float(base[at[0]]));
    gf32 v;
    for (int l = 0; l < GL; l++) v[l] = bf16_to_float(base[at[l]]);
    return v;
}

enum { STRIP_GROUPS = 16 / GL };

/* s (T rows of 16 floats) = the residual of columns c .. c + 15 of panel src (its lfc known),
 * x - mean, and the min and max of each group of maps over it (+0 for zeros). Returns 1, with
 * s and the ranges incomplete, when a residual is not finite. */
static int strip_residual(const int64_t *g, const float *src, const uint16_t *lfc, int64_t c,
                          float *s, gf32 *mn, gf32 *mx) {
    const int64_t W = g[T_W], F = g[T_F];
    int64_t at[16];
    const int whole = strip_offsets(g, c, at);
    gf32 lo[STRIP_GROUPS], hi[STRIP_GROUPS], mean[STRIP_GROUPS], v, nonfinite = {0};
    for (int k = 0; k < STRIP_GROUPS; k++) lo[k] = splat_g(INFINITY), hi[k] = splat_g(-INFINITY);
    for (int64_t i = 0; i < g[T_NBH]; i++)
        for (int64_t j = 0; j < g[T_NBW]; j++) {
            const block_row r = block_row_at(g, i, j);
            const uint16_t *base = lfc + lfc_index(g, i, j, 0);
            for (int k = 0; k < STRIP_GROUPS; k++)
                mean[k] = block_means_g(base, at + k * GL, whole);
            for (int64_t h = r.h0; h < r.h1; h++)
                for (int64_t t = h * W + r.w0; t < h * W + r.w1; t++)
                    for (int k = 0; k < STRIP_GROUPS; k++) {
                        memcpy(&v, src + t * F + c + k * GL, sizeof v);
                        v -= mean[k];
                        nonfinite += v - v;
                        memcpy(s + t * 16 + k * GL, &v, sizeof v);
                        lo[k] = less_g(v, lo[k]);
                        hi[k] = greater_g(v, hi[k]);
                    }
        }
    if (any_g(nonfinite != nonfinite)) return 1;
    for (int k = 0; k < STRIP_GROUPS; k++) mn[k] = lo[k] + 0.0f, mx[k] = hi[k] + 0.0f;
    return 0;
}

/* quantize_panel's chan maps of sequence m with panel_residual's residual fused in (by_strips;
 * the panel's lfc known): a strip at a time through s (T x 16 floats of scratch). Returns 1 at
 * the first strip with a residual that is not finite (the edge rule's case, rare: the caller
 * encodes the panel the other way, which gives every map the same bytes again), else 0. */
static int quantize_strips(const int64_t *g, int64_t m, int bits, const float *src,
                           const uint16_t *lfc, float *s, uint64_t seed, uint16_t *lo,
                           uint16_t *step, uint8_t *codes) {
    const int64_t T = g[T_H] * g[T_W], F = g[T_F], cb = g[T_CODE_BYTES];
    for (int64_t c = 0; c < F; c += 16) {
        gf32 mn[STRIP_GROUPS], mx[STRIP_GROUPS];
        if (strip_residual(g, src, lfc, c, s, mn, mx)) return 1;
        for (int k = 0; k < STRIP_GROUPS; k++)
            quantize_ranged(m * F + c + k * GL, T, cb, bits, s + k * GL, 16, mn[k], mx[k], seed,
                            lo, step, codes);
    }
    return 0;
}

/* Quantise the residual panel p of sequence m: one map per token row (tok) or per feature
 * column (chan). Without given noise 16 maps at a time in lanes (quantize_lanes; tok rows
 * through a transposed 16-row strip in ht), the rest one by one (chan: the remaining columns
 * transposed into ht) as the map encode quantises its maps (quantize_map_with: their uniforms
 * given, or drawn in registers). ht: scratch of T * F floats. */
static void quantize_panel(const int64_t *g, int64_t m, int bits, const float *p, float *ht,
                           const float *noise, uint64_t seed, uint16_t *lo, uint16_t *step,
                           uint8_t *codes) {
    const int64_t T = g[T_H] * g[T_W], F = g[T_F], cb = g[T_CODE_BYTES];
    const int chan = g[T_STATS] == 1;
    const int64_t maps = chan ? F : T, n = chan ? T : F;
    const int64_t lanes = noise ? 0 : maps - maps % 16; /* maps quantised in lanes */
    for (int64_t r = 0; r < lanes; r += 16) {
        if (!chan) transpose(p + r * F, 16, F, F, ht);
        quantize_lanes(m * maps + r, n, cb, bits, chan ? p + r : ht, chan ? F : 16, seed, lo,
                       step, codes);
    }
    if (lanes == maps) return;
    if (chan) transpose(p + lanes, T, F - lanes, F, ht);
    const float *h = chan ? ht : p + lanes * F; /* the remaining maps, one after the other */
    for (int64_t r = lanes; r < maps; r++) {
        const int64_t map = m * maps + r;
        quantize_map_with(n, bits, h + (r - lanes) * n, noise, seed, (uint64_t)map, NULL,
                          lo + map, step + map, codes + map * cb);
    }
}

/* Encode a token tensor x (float32: sequence m at sequence_offset, its tokens and features at
 * strides T_SH..T_SF) described by geom (T_LEN values) into lfc (bf16, M x nblocks), lo, step
 * (bf16, one per quant map) and codes (uint8, code bytes per quant map); noise: float32 in the
 * quant view's order, or NULL to draw from the seed. Returns 0, or -1 if scratch memory ran out. */
int freqact_token_encode(const int64_t *geom, int bits, const float *x, const float *noise,
                         uint64_t seed, uint16_t *lfc, uint16_t *lo, uint16_t *step,
                         uint8_t *codes, int threads) {
    const int64_t M = geom[T_M], T = geom[T_H] * geom[T_W], F = geom[T_F];
    const int64_t nblocks = geom[T_NBH] * geom[T_NBW] * geom[T_NBF];
    const int dense = geom[T_SF] == 1 && (T == 1 || geom[T_SW] == F)
                      && (geom[T_H] == 1 || geom[T_SH] == geom[T_W] * F);
    const int strips = by_strips(geom, noise);
    int failed = 0;
#pragma omp parallel num_threads(team(M, threads)) reduction(| : failed)
    {
        float *p = malloc((size_t)(T * F) * sizeof(float));
        float *ht = malloc((size_t)(T * F) * sizeof(float));
        float *acc = malloc((size_t)F * sizeof(float));
        float *row = malloc((size_t)F * sizeof(float));
        if (!p || !ht || !acc || !row) {
            failed = 1;
        } else {
#pragma omp for schedule(static)  /* contiguous shares: see the header */
            for (int64_t m = 0; m < M; m++) {
                const float *src = ht;  /* a contiguous panel is read in place */
                if (dense) src = x + sequence_offset(geom, m);
                else gather_panel(geom, x + sequence_offset(geom, m), ht); /* free until quantize */
                uint16_t *means = lfc + m * nblocks;
                if (strips) panel_residual(geom, src, NULL, means, acc, row); /* the means */
                if (!strips
                    || quantize_strips(geom, m, bits, src, means, p, seed, lo, step, codes)) {
                    panel_residual(geom, src, p, means, acc, row);
                    quantize_panel(geom, m, bits, p, ht, noise, seed, lo, step, codes);
                }
            }
        }
        free(p);
        free(ht);
        free(acc);
        free(row);
    }
    return failed ? -1 : 0;
}

/* The quant decode's edge rule for one value h = q * step + lo: at_quarter_scale with the
 * quarter-scale sum q * (step / 4) + lo / 4. */
static inline float quarter_rule(float h, float q, float lo_f, float step_f) {
    return at_quarter_scale(h, q * (step_f * 0.25f) + lo_f * 0.25f);
}

/* out[i] = q[i] * step + lo for the n codes packed at `codes`, with the edge rule (quarter_rule).
 * q: scratch of n bytes (used on overflow only). */
static void dequantize_row(const uint8_t *codes, int64_t n, int bits, float lo_f, float step_f,
                           uint8_t *q, float *out) {
    if (!dequantize_codes(codes, n, bits, lo_f, step_f, 1, out)) return;
    unpack_row(codes, n, q, bits);
    for (int64_t i = 0; i < n; i++) out[i] = quarter_rule(out[i], (float)q[i], lo_f, step_f);
}

/* The first n <= 4 bytes at p as a little-endian word (n = 4: one load). */
static inline uint32_t load_word(const uint8_t *p, int64_t n) {
    if (n == 4) return le32(p);
    uint32_t w = 0;
    for (int64_t b = 0; b < n; b++) w |= (uint32_t)p[b] << (8 * b);
    return w;
}

/* How decode_word treats q * step + lo: known finite in every lane (nothing to check), checked
 * (its lanes' finiteness returned), or with the quarter-scale edge rule applied lane by lane. */
enum { H_FINITE, H_CHECK, H_FIX };

/* Tokens w0 .. w0 + per_word - 1 (those below T) of the 16 chan maps at columns c, their codes
 * in lanes of `word`: out row t, columns c.. = (mean of t's block row) + (q * step + lo), per
 * `rule`. Returns the lanes' finiteness of q * step + lo (all true unless H_CHECK found a value
 * that is not). always_inline with constant `bits` and `rule`. */
static inline __attribute__((always_inline)) i32x16 decode_word(
        const int64_t *g, int64_t w0, int64_t c, u32x16 word, f32x16 lo_f, f32x16 step_f,
        const float *means, const int64_t *block_of, float *o, const int bits, const int rule) {
    const int64_t T = g[T_H] * g[T_W], F = g[T_F];
    const int per_word = 32 / bits;
    i32x16 finite = ~(i32x16){0}; /* all lanes true */
#pragma GCC unroll 32
    for (int k = 0; k < per_word; k++) {
        const int64_t t = w0 + k;
        if (t >= T) break;
        const f32x16 q = __builtin_convertvector((i32x16)((word >> (uint32_t)(k * bits))
                                                          & ((1u << bits) - 1u)), f32x16);
        f32x16 h = q * step_f + lo_f;
        if (rule == H_FIX) {
            for (int l = 0; l < 16; l++) h[l] = quarter_rule(h[l], q[l], lo_f[l], step_f[l]);
        } else if (rule == H_CHECK) {
            finite &= finite16(h);
        }
        f32x16 mean;
        memcpy(&mean, means + block_of[t] * F + c, sizeof mean);
        const f32x16 v = mean + h;
        memcpy(o + t * F + c, &v, sizeof v);
    }
    return finite;
}

/* Words 4 k0 .. 4 k0 + 3 of 16 rows of codes (row l at p + l * cb, its 16 bytes from p + 16 k0
 * on) in lanes: w[k][l] = word 4 k0 + k of row l, as little-endian numbers (little-endian hosts
 * only). 16 vector loads of 16 bytes and shuffles: filled word by word through 16 scalar stores
 * and one vector load, each word cost a failed store forwarding (the stores not yet in L1). */
static inline void load_words4(const uint8_t *p, int64_t cb, u32x16 w[4]) {
    u32x4 r[16];
    for (int l = 0; l < 16; l++) memcpy(&r[l], p + l * cb, sizeof r[l]);
    u32x16 rows[4]; /* rows[i]: rows 4 i .. 4 i + 3, 4 words each */
    for (int i = 0; i < 4; i++) {
        const u32x8 a = __builtin_shufflevector(r[4 * i], r[4 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7);
        const u32x8 b = __builtin_shufflevector(r[4 * i + 2], r[4 * i + 3], 0, 1, 2, 3, 4, 5, 6,
                                                7);
        rows[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                          15);
    }
    /* half[k / 2][..]: words k (first 8 lanes) and k + 1 (last 8) of rows 0..7 (h = 0) or
     * 8..15 (h = 1); then the halves joined */
    for (int k = 0; k < 4; k += 2) {
        u32x16 half[2];
        for (int h = 0; h < 2; h++)
            half[h] = k == 0 ? __builtin_shufflevector(rows[2 * h], rows[2 * h + 1], 0, 4, 8, 12,
                                                       16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29)
                             : __builtin_shufflevector(rows[2 * h], rows[2 * h + 1], 2, 6, 10, 14,
                                                       18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27,
                                                       31);
        w[k] = __builtin_shufflevector(half[0], half[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                       20, 21, 22, 23);
        w[k + 1] = __builtin_shufflevector(half[0], half[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                           26, 27, 28, 29, 30, 31);
    }
}

/* Decode word w0 / per_word of the 16 maps (`decode_word`): when every lane's q * step + lo is
 * known finite in one pass, else checked and, where a lane is not, redone with the edge rule. */
static inline __attribute__((always_inline)) void decode_word_ruled(
        const int64_t *g, int64_t w0, int64_t c, u32x16 word, f32x16 lo_f, f32x16 step_f,
        int finite, const float *means, const int64_t *block_of, float *o, const int bits) {
    if (finite) {
        decode_word(g, w0, c, word, lo_f, step_f, means, block_of, o, bits, H_FINITE);
        return;
    }
    const i32x16 ok = decode_word(g, w0, c, word, lo_f, step_f, means, block_of, o, bits,
                                  H_CHECK);
    if (any16(~ok)) decode_word(g, w0, c, word, lo_f, step_f, means, block_of, o, bits, H_FIX);
}

/* The 16 chan maps of sequence m at columns c decoded straight into the output panel o: per
 * lane a 32-bit word of codes, per token one vector of 16 columns (no row decode, transpose and
 * mean pass; the same float operations per element). means: the sequence's mean rows (F floats
 * per block row), block_of: each token's block row. always_inline with a constant `bits`. */
static inline __attribute__((always_inline)) void dequantize_columns_fixed(
        const int64_t *g, int64_t m, int64_t c, const uint16_t *lo, const uint16_t *step,
        const uint8_t *codes, const float *means, const int64_t *block_of, float *o,
        const int bits) {
    const int64_t T = g[T_H] * g[T_W], F = g[T_F], cb = g[T_CODE_BYTES], map0 = m * F + c;
    u16x16 lo16, step16;
    memcpy(&lo16, lo + map0, sizeof lo16);
    memcpy(&step16, step + map0, sizeof step16);
    const f32x16 lo_f = bf16_to_float16(__builtin_convertvector(lo16, i32x16));
    const f32x16 step_f = bf16_to_float16(__builtin_convertvector(step16, i32x16));
    /* q * step + lo is monotonic in q (each rounding is), so it is finite for every code when
     * it is for q = 0 and q = 2^bits - 1: then no lane needs a check per token */
    const f32x16 qmax = splat16((float)((1 << bits) - 1));
    const int finite = !any16(~(finite16(lo_f + splat16(0.0f) * step_f)
                                & finite16(qmax * step_f + lo_f)));
    const uint8_t *cm = codes + map0 * cb;
    const int per_word = 32 / bits;
    int64_t w0 = 0;
    /* 4 words at a time from whole 16-byte groups of the rows, then the rest word by word */
    for (; LITTLE_ENDIAN_HOST && w0 / per_word * 4 + 16 <= cb; w0 += 4 * per_word) {
        u32x16 words[4];
        load_words4(cm + w0 / per_word * 4, cb, words);
        for (int k = 0; k < 4; k++)
            decode_word_ruled(g, w0 + k * per_word, c, words[k], lo_f, step_f, finite, means,
                              block_of, o, bits);
    }
    for (; w0 < T; w0 += per_word) {
        const int64_t at = w0 / per_word * 4, n = cb - at < 4 ? cb - at : 4;
        u32x16 word;
        for (int l = 0; l < 16; l++) word[l] = load_word(cm + l * cb + at, n);
        decode_word_ruled(g, w0, c, word, lo_f, step_f, finite, means, block_of, o, bits);
    }
}

static void dequantize_columns(const int64_t *g, int64_t m, int64_t c, int bits,
                               const uint16_t *lo, const uint16_t *step, const uint8_t *codes,
                               const float *means, const int64_t *block_of, float *o) {
#define DECODE_AT(b) dequantize_columns_fixed(g, m, c, lo, step, codes, means, block_of, o, b)
    AT_CONSTANT_BITS(bits, DECODE_AT);
#undef DECODE_AT
}

/* Inverse of freqact_token_encode into float32 panels (H * W, F), one per sequence at
 * out + m * T_OUT_STRIDE: upsample(lfc) + (q * step + lo). Per sequence the mean rows of its
 * block rows first; `chan` maps then go 16 at a time down the columns (dequantize_columns), the
 * other maps (tok rows, the last F % 16 chan columns) one by one through a row decode, the mean
 * added as each is written. Returns 0, or -1 without memory. */
int freqact_token_decode(const int64_t *geom, int bits, const uint16_t *lfc, const uint16_t *lo,
                         const uint16_t *step, const uint8_t *codes, float *out, int threads) {
    const int64_t M = geom[T_M], W = geom[T_W], T = geom[T_H] * W, F = geom[T_F];
    const int64_t nbw = geom[T_NBW], rows = geom[T_NBH] * nbw, cb = geom[T_CODE_BYTES];
    const int64_t nblocks = rows * geom[T_NBF];
    const int chan = geom[T_STATS] == 1;
    const int64_t maps = chan ? F : T, n = chan ? T : F;
    const int64_t lanes = chan ? F - F % 16 : 0; /* maps decoded in lanes */
    int64_t *block_of = malloc((size_t)T * sizeof(int64_t));
    if (!block_of) return -1;
    for (int64_t t = 0; t < T; t++) block_of[t] = t / W / geom[T_BH] * nbw + t % W / geom[T_BW];
    int failed = 0;
#pragma omp parallel num_threads(team(M, threads)) reduction(| : failed)
    {
        float *means = malloc((size_t)(rows * F) * sizeof(float));
        float *h = malloc((size_t)n * sizeof(float)); /* one map's q * step + lo */
        uint8_t *q = malloc((size_t)n);
        if (!means || !h || !q) {
            failed = 1;
        } else {
#pragma omp for schedule(static)  /* contiguous shares: see the header */
            for (int64_t m = 0; m < M; m++) {
                if (token_pairs(geom)) { /* one mean row per token, in one loop */
                    for (int64_t t = 0; t < T; t++)
                        for (int64_t f = 0; f < F; f += GL) {
                            const gf32 v = means_g(token_lfc(geom, lfc + m * nblocks, t), f,
                                                   geom[T_LF]);
                            memcpy(means + t * F + f, &v, sizeof v);
                        }
                } else {
                    for (int64_t i = 0; i < geom[T_NBH]; i++)
                        for (int64_t j = 0; j < nbw; j++)
                            mean_row(geom, lfc + m * nblocks, block_row_at(geom, i, j),
                                     means + (i * nbw + j) * F);
                }
                float *o = out + m * geom[T_OUT_STRIDE];
                for (int64_t c = 0; c < lanes; c += 16)
                    dequantize_columns(geom, m, c, bits, lo, step, codes, means, block_of, o);
                for (int64_t r = lanes; r < maps; r++) {
                    const int64_t map = m * maps + r;
                    dequantize_row(codes + map * cb, n, bits, bf16_to_float(lo[map]),
                                   bf16_to_float(step[map]), q, h);
                    if (chan) {
                        for (int64_t t = 0; t < T; t++)
                            o[t * F + r] = means[block_of[t] * F + r] + h[t];
                    } else {
                        const float *mean = means + block_of[r] * F;
                        for (int64_t f = 0; f < F; f++) o[r * F + f] = mean[f] + h[f];
                    }
                }
            }
        }
        free(means);
        free(h);
        free(q);
    }
    free(block_of);
    return failed ? -1 : 0;
}

/* --- flat tokens ------------------------------------------------------------------------------
 * Whether a norm input holds a token whose own spread is below its quantisation step
 * (`moments.NormLayout`; `reference.token_flat` is the specification): token r (of M x T, at
 * (r / T) * sm + (r % T) * st, its F features sf apart) is flat when max - min < float(step[r])
 * in float32, and never when it holds a NaN (torch's amax - amin is then NaN, which compares
 * false). Infinities compare as torch's: all +inf gives inf - inf = NaN, not flat. */

/* min and max of a token's F values (NaNs left out; *nan says whether there was one). */
static void token_range(const float *p, int64_t F, int64_t sf, float *mn_out, float *mx_out,
                        int *nan_out) {
    float mn = INFINITY, mx = -INFINITY;
    int nan = 0;
    int64_t f = 0;
    if (sf == 1 && F >= 8) {
        f32x8 lo = splat8(INFINITY), hi = splat8(-INFINITY), v;
        i32x8 bad = {0};
        for (; f + 8 <= F; f += 8) {
            memcpy(&v, p + f, sizeof v);
            lo = less8(v, lo); /* a NaN v keeps lo: NaNs are counted apart */
            hi = greater8(v, hi);
            bad |= v != v;
        }
        nan = any8(bad);
        for (int l = 0; l < 8; l++) {
            mn = lo[l] < mn ? lo[l] : mn;
            mx = hi[l] > mx ? hi[l] : mx;
        }
    }
    for (; f < F; f++) {
        const float v = p[f * sf];
        nan |= v != v;
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    *mn_out = mn, *mx_out = mx, *nan_out = nan;
}

/* geom: M, T, F, sm, st, sf (checked in Python: every token read lies in x). Returns 1 when some
 * token is flat, else 0. */
int freqact_token_flat(const int64_t *geom, const float *x, const uint16_t *step, int threads) {
    const int64_t M = geom[0], T = geom[1], F = geom[2], sm = geom[3], st = geom[4], sf = geom[5];
    int flat = 0;
    /* a thread per 2^15 values at most: a smaller share costs its wake-up more than its work */
#pragma omp parallel for collapse(2) schedule(static) \
    num_threads(team(M * T * F >> 15, threads)) reduction(| : flat)
    for (int64_t m = 0; m < M; m++)
        for (int64_t t = 0; t < T; t++) {
            float mn, mx;
            int nan;
            token_range(x + m * sm + t * st, F, sf, &mn, &mx, &nan);
            flat |= !nan && mx - mn < bf16_to_float(step[m * T + t]);
        }
    return flat;
}


/* --- small maps 16 at a time (the map encode, on the token layouts' column kernels) -----------
 *
 * A map of few elements (4 x 4, 8 x 8, 16 x 16) spends much of a per-map encode in loop and
 * call overhead and in long dependent chains of float operations. 16 such maps drawing their
 * own noise are transposed into an n x 16 panel, one map per lane, for their block sums and
 * residual in lanes and then quantize_lanes: 16 maps of n elements at a stride of 16 floats,
 * lane l being the encode's map m0 + l, drawing the uniforms of the map's elements in the
 * stream. Per lane these are the per-map path's float operations in its order (the same bytes;
 * a zero min or max is +0 in both). */

/* Encode maps m0 .. m0 + 15 of x, each of n <= SMALL_MAP elements. scratch: 4 * 16 * SMALL_MAP
 * floats (the panel, its residual, the block means in lanes, a row of them spread). */
static void encode_small_maps(const geometry *g, int64_t m0, int bits, const float *x,
                              uint64_t seed, uint16_t *lfc, uint16_t *lo, uint16_t *step,
                              uint8_t *codes, float *scratch) {
    float *xt = scratch, *ht = xt + 16 * SMALL_MAP, *means = ht + 16 * SMALL_MAP;
    float *mrow = means + 16 * SMALL_MAP;
    const int64_t n = g->numel, H = g->size[1], W = g->size[2], bw = g->blk[2];
    const float *xm = x + m0 * n;
    transpose(xm, 16, n, n, xt);
    const float *h = xt;
    if (lfc) {
        /* block_residual's sums per block: per column 0 + its rows in order, then 0 + the
         * columns */
        for (int64_t b = 0; b < g->nblocks; b++) {
            int64_t lo3[3], hi3[3];
            block_bounds(g, b, lo3, hi3);
            f32x16 sum = {0};
            for (int64_t w = lo3[2]; w < hi3[2]; w++) {
                f32x16 col = {0};
                for (int64_t d = lo3[0]; d < hi3[0]; d++)
                    for (int64_t r = d * H + lo3[1]; r < d * H + hi3[1]; r++) {
                        f32x16 v;
                        memcpy(&v, xt + (r * W + w) * 16, sizeof v);
                        col += v;
                    }
                sum += col;
            }
            for (int l = 0; l < 16; l++) {
                float mean = sum[l] / g->counts[b];
                if (!isfinite(sum[l]))
                    mean = scaled_block_mean(g, xm + l * n, lo3, hi3, sum[l], g->counts[b]);
                const uint16_t v = bf16_nearest(mean);
                lfc[(m0 + l) * g->nblocks + b] = v;
                means[b * 16 + l] = bf16_to_float(v);
            }
        }
        /* per row, its 16 lanes' block means spread over its W columns (rebuilt when the block
         * row changes), then one residual_rows call over the row's W x 16 floats */
        for (int64_t r = 0, current = -1; r < n / W; r++) {
            if (g->row_blocks[r] != current) {
                current = g->row_blocks[r];
                for (int64_t w = 0; w < W; w++)
                    memcpy(mrow + w * 16, means + (current * g->nb[2] + w / bw) * 16,
                           16 * sizeof(float));
            }
            residual_rows(xt + r * W * 16, mrow, W * 16, 1, ht + r * W * 16);
        }
        h = ht;
    }
    quantize_lanes(m0, n, g->code_bytes, bits, h, 16, seed, lo, step, codes);
}
