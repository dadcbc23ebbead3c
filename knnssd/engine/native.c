/* Small CPU kernels for the decode step (``native.py`` builds and loads them).

   Every kernel computes each row alone, with one fixed loop over its n values, so a row's result
   never depends on how many rows the call has: row-invariant by construction. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16 /* partial sums per row: a fixed order, wide enough for the compiler to vectorise */

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's BFloat16 */
    uint32_t u;
    if (isnan(f)) return 0x7FC0;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* RMSNorm of one row as F.rms_norm computes it: x / sqrt(mean(x^2) + eps) * w, in fp32, then
   rounded once to the output type. */
#define RMS_NORM(NAME, T, LOAD, STORE)                                                             \
    void NAME(const T *x, const float *w, T *out, int64_t rows, int64_t n, float eps) {           \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *xr = x + r * n;                                                               \
            T *o = out + r * n;                                                                    \
            float acc[LANES] = {0};                                                                \
            int64_t j = 0;                                                                         \
            for (; j + LANES <= n; j += LANES)                                                     \
                for (int l = 0; l < LANES; l++) {                                                  \
                    float v = LOAD(xr[j + l]);                                                     \
                    acc[l] += v * v;                                                               \
                }                                                                                  \
            for (int l = 0; j < n; j++, l++) {                                                     \
                float v = LOAD(xr[j]);                                                             \
                acc[l] += v * v;                                                                   \
            }                                                                                      \
            float s = 0.0f;                                                                        \
            for (int l = 0; l < LANES; l++) s += acc[l];                                           \
            float inv = 1.0f / sqrtf(s / (float)n + eps);                                          \
            for (j = 0; j < n; j++) o[j] = STORE(LOAD(xr[j]) * inv * w[j]);                        \
        }                                                                                          \
    }

#define SAME(v) (v)
RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
RMS_NORM(rms_norm_f32, float, SAME, SAME)

/* RoPE of T rows of heads x D values, x's rows ``stride`` apart (the q and k heads of a QKV row),
   into out (T, heads, D): x * cos + roll(x, d / 2) * sin over the first d values (sin signed for
   the rotation), the rest copied; each product and the sum rounded to the type, as torch's ops do. */
#define ROPE_HALF(FROM, SHIFT, LOAD, STORE) /* j pairs with j + SHIFT; no branch, so it vectorises */   \
    for (int64_t j = FROM; j < FROM + half; j++)                                                   \
        o[j] = STORE(LOAD(STORE(LOAD(xr[j]) * LOAD(c[j]))) + LOAD(STORE(LOAD(xr[j + SHIFT]) * LOAD(s[j]))));

#define ROPE(NAME, T, LOAD, STORE)                                                                 \
    void NAME(const T *x, int64_t stride, const T *cos, const T *sin, T *out, int64_t rows,          \
              int64_t heads, int64_t D, int64_t d) {                                               \
        int64_t half = d / 2;                                                                      \
        for (int64_t t = 0; t < rows; t++) {                                                       \
            const T *c = cos + t * d, *s = sin + t * d;                                            \
            for (int64_t h = 0; h < heads; h++) {                                                  \
                const T *xr = x + t * stride + h * D;                                              \
                T *o = out + (t * heads + h) * D;                                                  \
                ROPE_HALF(0, half, LOAD, STORE)                                                    \
                ROPE_HALF(half, -half, LOAD, STORE)                                                \
                for (int64_t j = d; j < D; j++) o[j] = xr[j];                                      \
            }                                                                                      \
        }                                                                                          \
    }

ROPE(rope_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
ROPE(rope_f32, float, SAME, SAME)

/* exp(x) for the softmax, x <= 0: Cephes' expf (x = n ln2 + r, a degree-7 polynomial in r, 2^n put
   into the exponent bits), within about an ulp of expf; 0 below -87 (where expf is denormal or
   0). No branch and no libm call, so the loops over keys vectorise. */
static inline float softmax_exp(float x) {
    float c = x < -87.0f ? -87.0f : x;
    float n = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return x < -87.0f ? 0.0f : p * two_n;
}

/* The sum of LANES partial sums in a fixed tree (halves added pairwise), so it vectorises. */
static inline float sum_lanes(float *acc) {
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* The arguments of one attention call (``attention_bf16``/``attention_f32``), shared by its work
   items: row r's query heads at q + r * q_stride (each D values, heads D apart); K and V share
   their layout: slot s, KV head g, position j at s * slot_stride + g * head_stride + j * D. */
#define ATTENTION_ARGS(T)                                                                          \
    struct {                                                                                       \
        const T *q, *k, *v;                                                                        \
        T *out;                                                                                    \
        const int64_t *slots, *pos;                                                                \
        int64_t q_stride, slot_stride, L, head_stride, H, KV, D, window;                           \
        float scale;                                                                               \
    }
typedef uint16_t bf16_t; /* the element types, by the kernels' suffixes */
typedef float f32_t;
typedef ATTENTION_ARGS(bf16_t) args_bf16;
typedef ATTENTION_ARGS(f32_t) args_f32;

/* Attention of one work item, query row r and KV head g, alone: the row at position pos[r] of cache
   slot slots[r] reads keys lo..pos[r] of that slot (lo = pos[r] - window + 1 for a sliding window,
   else 0) and nothing else: scores q.k * scale in fp32 (fixed lanes), softmax (max, exp, sum in
   fixed lanes), then the sum of p_j v_j over the keys in order, divided by the sum and rounded once
   to T. The G = H / KV query heads of KV head g (heads g G .. g G + G - 1) are computed together,
   each key and value read once for them. An item's result depends on nothing but its own query,
   position and keys: invariant to the call's rows, their order, the cache's key length and which
   thread computes it.
   ``scratch``: (2 G + 1) D + G L floats (L: the positions a slot holds; no row reads more). */
#define ATTENTION(NAME, T, LOAD, STORE)                                                            \
    static void NAME(const args_##T *a, int64_t r, int64_t g, float *scratch) {                    \
        int64_t G = a->H / a->KV, D = a->D, L = a->L;                                              \
        float *qf = scratch, *kf = qf + G * D, *o = kf + D, *p = o + G * D;                        \
        int64_t end = a->pos[r] + 1, lo = a->window > 0 && end > a->window ? end - a->window : 0;  \
        int64_t n = end - lo;                                                                      \
        const T##_t *kg = a->k + a->slots[r] * a->slot_stride + g * a->head_stride + lo * D;       \
        const T##_t *vg = a->v + a->slots[r] * a->slot_stride + g * a->head_stride + lo * D;       \
        for (int64_t i = 0; i < G * D; i++) qf[i] = LOAD(a->q[r * a->q_stride + g * G * D + i]);   \
        for (int64_t j = 0; j < n; j++) {                                                          \
            for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kg[j * D + d]);                           \
            for (int64_t h = 0; h < G; h++) {                                                      \
                const float *qh = qf + h * D;                                                      \
                float acc[LANES] = {0};                                                            \
                int64_t d = 0;                                                                     \
                for (; d + LANES <= D; d += LANES)                                                 \
                    for (int l = 0; l < LANES; l++) acc[l] += qh[d + l] * kf[d + l];               \
                for (int l = 0; d < D; d++, l++) acc[l] += qh[d] * kf[d];                          \
                p[h * L + j] = sum_lanes(acc) * a->scale;                                          \
            }                                                                                      \
        }                                                                                          \
        for (int64_t h = 0; h < G; h++) {                                                          \
            float *ph = p + h * L, m = -INFINITY, sums[LANES] = {0};                               \
            for (int64_t j = 0; j < n; j++) m = ph[j] > m ? ph[j] : m;                             \
            int64_t j = 0;                                                                         \
            for (; j + LANES <= n; j += LANES)                                                     \
                for (int l = 0; l < LANES; l++) {                                                  \
                    ph[j + l] = softmax_exp(ph[j + l] - m);                                        \
                    sums[l] += ph[j + l];                                                          \
                }                                                                                  \
            for (int l = 0; j < n; j++, l++) {                                                     \
                ph[j] = softmax_exp(ph[j] - m);                                                    \
                sums[l] += ph[j];                                                                  \
            }                                                                                      \
            float inv = 1.0f / sum_lanes(sums);                                                    \
            for (j = 0; j < n; j++) ph[j] *= inv;                                                  \
        }                                                                                          \
        for (int64_t i = 0; i < G * D; i++) o[i] = 0.0f;                                           \
        for (int64_t j = 0; j < n; j++) {                                                          \
            for (int64_t d = 0; d < D; d++) kf[d] = LOAD(vg[j * D + d]);                           \
            for (int64_t h = 0; h < G; h++) {                                                      \
                float pj = p[h * L + j];                                                           \
                for (int64_t d = 0; d < D; d++) o[h * D + d] += pj * kf[d];                        \
            }                                                                                      \
        }                                                                                          \
        T##_t *dst = a->out + r * a->H * D + g * G * D;                                            \
        for (int64_t i = 0; i < G * D; i++) dst[i] = STORE(o[i]);                                  \
    }

ATTENTION(attention_any_bf16, bf16, bf16_to_f32, f32_to_bf16)
ATTENTION(attention_any_f32, f32, SAME, SAME)

/* The same attention in SIMD registers of W lanes (AVX-512: 16, AVX2 with FMA: 8), where the compiler
   targets them and D is a multiple of W: a key's D values as D / W vectors, its G dot products by
   fused multiply-adds, each summed across lanes in a fixed order; the softmax W scores at a time (the
   last n % W one by one); p_j v_j by fused multiply-adds into G D / W vectors. A fixed sequence of
   operations per row, so as row-invariant as the portable form, which it does not match bit for bit.
   ``scratch``: G L + 16 floats. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#if defined(__AVX512F__)
#define W 16
typedef __m512 vf;
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#define VOP(op) _mm512_##op
#define vsum _mm512_reduce_add_ps
#define vmaxall _mm512_reduce_max_ps
static inline vf vfloor(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf vexp2n(vf n) { /* 2^n for integral n in [-126, 127] */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vf vzero_below(vf y, vf x, float lo) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ), y);
}
#else
#define W 8
typedef __m256 vf;
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#define VOP(op) _mm256_##op
static inline float vsum(vf a) { /* halves, then pairs, then the last two */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vmaxall(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vfloor(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf vexp2n(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vzero_below(vf y, vf x, float lo) { return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GE_OQ)); }
#endif
/* the operations both widths name alike (_mm512_add_ps, _mm256_add_ps, ...) */
#define vload_f32 VOP(loadu_ps)
#define vstore VOP(storeu_ps)
#define vset1 VOP(set1_ps)
#define vzero VOP(setzero_ps)
#define vadd VOP(add_ps)
#define vsub VOP(sub_ps)
#define vmul VOP(mul_ps)
#define vmax VOP(max_ps)
#define vfma VOP(fmadd_ps)

static inline vf vexp(vf x) { /* softmax_exp on W lanes */
    vf c = vmax(x, vset1(-87.0f));
    vf n = vfloor(vadd(vmul(c, vset1(1.44269504088896341f)), vset1(0.5f)));
    vf r = vsub(c, vmul(n, vset1(0.693359375f)));
    r = vsub(r, vmul(n, vset1(-2.12194440e-4f)));
    vf p = vset1(1.9875691500e-4f);
    p = vadd(vmul(p, r), vset1(1.3981999507e-3f));
    p = vadd(vmul(p, r), vset1(8.3334519073e-3f));
    p = vadd(vmul(p, r), vset1(4.1665795894e-2f));
    p = vadd(vmul(p, r), vset1(1.6666665459e-1f));
    p = vadd(vmul(p, r), vset1(5.0000001201e-1f));
    p = vadd(vadd(vmul(vmul(p, r), r), r), vset1(1.0f));
    return vzero_below(vmul(p, vexp2n(n)), x, -87.0f);
}

#define MAXG 16
#define MAXC (256 / W)
#define ATTENTION_SIMD(NAME, T, LOADV, STORE)                                                      \
    static void NAME(const args_##T *a, int64_t r, int64_t g, float *scratch) {                    \
        int64_t G = a->H / a->KV, D = a->D, L = a->L, nc = D / W;                                  \
        float *p = scratch, *o = scratch + G * L;                                                  \
        int64_t end = a->pos[r] + 1, lo = a->window > 0 && end > a->window ? end - a->window : 0;  \
        int64_t n = end - lo, body = n / W * W;                                                    \
        const T##_t *kg = a->k + a->slots[r] * a->slot_stride + g * a->head_stride + lo * D;       \
        const T##_t *vg = a->v + a->slots[r] * a->slot_stride + g * a->head_stride + lo * D;       \
        const T##_t *qg = a->q + r * a->q_stride + g * G * D;                                      \
        vf qv[MAXG * MAXC], kv[MAXC];                                                              \
        for (int64_t i = 0; i < G * nc; i++) qv[i] = LOADV(qg + W * i);                            \
        for (int64_t j = 0; j < n; j++) {                                                          \
            for (int64_t c = 0; c < nc; c++) kv[c] = LOADV(kg + j * D + W * c);                    \
            for (int64_t h = 0; h < G; h++) {                                                      \
                vf acc = vmul(qv[h * nc], kv[0]);                                                  \
                for (int64_t c = 1; c < nc; c++) acc = vfma(qv[h * nc + c], kv[c], acc);           \
                p[h * L + j] = vsum(acc) * a->scale;                                               \
            }                                                                                      \
        }                                                                                          \
        for (int64_t h = 0; h < G; h++) {                                                          \
            float *ph = p + h * L, m = -INFINITY, tail = 0.0f;                                     \
            vf mx = vset1(-INFINITY), sums = vzero();                                              \
            for (int64_t j = 0; j < body; j += W) mx = vmax(mx, vload_f32(ph + j));                \
            if (body) m = vmaxall(mx);                                                             \
            for (int64_t j = body; j < n; j++) m = ph[j] > m ? ph[j] : m;                          \
            for (int64_t j = 0; j < body; j += W) {                                                \
                vf e = vexp(vsub(vload_f32(ph + j), vset1(m)));                                    \
                vstore(ph + j, e);                                                                 \
                sums = vadd(sums, e);                                                              \
            }                                                                                      \
            for (int64_t j = body; j < n; j++) {                                                   \
                ph[j] = softmax_exp(ph[j] - m);                                                    \
                tail += ph[j];                                                                     \
            }                                                                                      \
            float inv = 1.0f / (vsum(sums) + tail);                                                \
            for (int64_t j = 0; j < body; j += W) vstore(ph + j, vmul(vload_f32(ph + j), vset1(inv))); \
            for (int64_t j = body; j < n; j++) ph[j] *= inv;                                       \
        }                                                                                          \
        vf ov[MAXG * MAXC];                                                                        \
        for (int64_t i = 0; i < G * nc; i++) ov[i] = vzero();                                      \
        for (int64_t j = 0; j < n; j++) {                                                          \
            for (int64_t c = 0; c < nc; c++) kv[c] = LOADV(vg + j * D + W * c);                    \
            for (int64_t h = 0; h < G; h++) {                                                      \
                vf pj = vset1(p[h * L + j]);                                                       \
                for (int64_t c = 0; c < nc; c++) ov[h * nc + c] = vfma(pj, kv[c], ov[h * nc + c]); \
            }                                                                                      \
        }                                                                                          \
        T##_t *dst = a->out + r * a->H * D + g * G * D;                                            \
        for (int64_t i = 0; i < G * nc; i++) {                                                     \
            vstore(o, ov[i]);                                                                      \
            for (int l = 0; l < W; l++) dst[W * i + l] = STORE(o[l]);                              \
        }                                                                                          \
    }

ATTENTION_SIMD(attention_simd_bf16, bf16, vload_bf16, f32_to_bf16)
ATTENTION_SIMD(attention_simd_f32, f32, vload_f32, SAME)
#define HAVE_SIMD 1
#endif

/* Exported: the SIMD form where it is compiled and the shapes suit it, else the portable one (one
   choice per model, never per call), over the call's rows x KV heads work items, shared out among
   ``threads`` OpenMP threads (built with OpenMP: torch's own runtime, so the same thread pool as its
   ops) with ``per`` floats of ``scratch`` each: (2 G + 1) D + G L + 16. The cache holds ``slots_n``
   slots of L positions; a row outside them returns -1 before anything is computed. */
#define ATTENTION_ENTRY(NAME)                                                                      \
    int64_t attention_##NAME(const NAME##_t *q, int64_t q_stride, const NAME##_t *k, const NAME##_t *v, \
                             int64_t slots_n, int64_t slot_stride, int64_t L, int64_t head_stride,  \
                             const int64_t *slots, const int64_t *pos, NAME##_t *out, int64_t rows, \
                             int64_t H, int64_t KV, int64_t D, int64_t window, float scale,         \
                             float *scratch, int64_t per, int64_t threads) {                        \
        if (KV <= 0 || H % KV || threads < 1) return -1;                                           \
        for (int64_t r = 0; r < rows; r++)                                                         \
            if (pos[r] < 0 || pos[r] >= L || slots[r] < 0 || slots[r] >= slots_n) return -1;        \
        if (rows <= 0) return 0;                                                                   \
        args_##NAME a = {q, k, v, out, slots, pos, q_stride, slot_stride, L, head_stride, H, KV, D, window, scale}; \
        void (*item)(const args_##NAME *, int64_t, int64_t, float *) = attention_any_##NAME;       \
        FAST_##NAME                                                                                \
        int64_t items = rows * KV;                                                                 \
        PARALLEL_FOR(threads, items)                                                               \
        for (int64_t i = 0; i < items; i++) item(&a, i / KV, i % KV, scratch + per * THREAD);      \
        return 0;                                                                                  \
    }

#if defined(_OPENMP)
#include <omp.h>
#define PRAGMA(x) _Pragma(#x)
#define PARALLEL_FOR(threads, items) PRAGMA(omp parallel for schedule(dynamic, 1) num_threads(threads < items ? threads : items))
#define THREAD omp_get_thread_num()
#else
#define PARALLEL_FOR(threads, items)
#define THREAD 0
#endif
#if defined(HAVE_SIMD)
#define FAST(NAME)                                                                                 \
    if (D % W == 0 && D / W <= MAXC && H / KV <= MAXG) item = attention_simd_##NAME;
#else
#define FAST(NAME)
#endif
#define FAST_bf16 FAST(bf16)
#define FAST_f32 FAST(f32)
ATTENTION_ENTRY(bf16)
ATTENTION_ENTRY(f32)

/* y = x W^T (+ b) for bf16 rows x (M, K), each K values contiguous and rows x_stride apart, into out
   (M, N), with W (N, K) prepacked (``native.Linear``) as N / 16 blocks of 16 output columns, each
   block K / 2 pairs of 16 columns x 2 inputs: one AVX-512 vector per pair of inputs, which vdpbf16ps
   multiplies with a row's two inputs (broadcast) and adds into 16 fp32 sums. Each output is summed
   over its inputs in one fixed order, pair by pair from the first, in one fp32 lane, then the bias
   (fp32) is added and the sum rounded once to bf16: a row's outputs do not depend on the call's
   rows, on how they are tiled, nor on which thread computes them. Tiles of up to LIN_MR rows x
   LIN_NR blocks keep their sums in registers; the threads take equal runs of column blocks (the
   weights stream from memory once per call). Returns -1, computing nothing, where the library is
   built without avx512_bf16 or the shapes do not fit (N % 16, K % 2).

   ``linear_int8_bf16``: the same with int8 weights in the same layout (a draft's weight-only int8
   copy, ``stack.Int8Linear``), each output column's sum multiplied by its fp32 scale before the
   bias: an int8 weight is a bf16 exactly (|q| <= 127), so a vector of 32 is widened to fp32 and
   narrowed to bf16 without rounding, and the products are the bf16 kernel's. Half the bytes to read
   where a one-row draft step is bound by memory. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define LIN_MR 6
#define LIN_NR 4
static inline __attribute__((always_inline)) __m512bh linear_weights(const void *wp, int64_t at, int int8) {
    if (!int8) return (__m512bh)_mm512_loadu_si512((const uint16_t *)wp + at);
    __m256i q = _mm256_loadu_si256((const __m256i *)((const int8_t *)wp + at));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* One tile: up to LIN_MR rows x LIN_NR blocks of 16 columns, summed over the first ``pairs`` pairs of
   inputs (the blocks ``stride`` pairs apart in ``wp``).
   ``kind``: LIN_BF16 and LIN_INT8 round each sum (scaled per column for int8, plus the bias) to bf16 into
   ``out``; LIN_SCORES (``causal_bf16``'s q.k) stores each sum times ``fscale`` in fp32 into ``fout``. */
enum { LIN_BF16, LIN_INT8, LIN_SCORES };
static inline __attribute__((always_inline)) void linear_tile(const uint16_t *x, int64_t xs, const void *wp,
        int64_t pairs, int64_t stride, const float *scale, const float *bias, uint16_t *out, float *fout,
        float fscale, int64_t os, int mr, int nr, int kind) {
    int int8 = kind == LIN_INT8;
    __m512 acc[LIN_MR][LIN_NR];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) acc[m][n] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh w[LIN_NR];
        for (int n = 0; n < nr; n++) w[n] = linear_weights(wp, (n * stride + p) * 32, int8);
        for (int m = 0; m < mr; m++) {
            int32_t two;
            memcpy(&two, x + m * xs + 2 * p, sizeof two);
            __m512bh b = (__m512bh)_mm512_set1_epi32(two);
            for (int n = 0; n < nr; n++) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], b, w[n]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) {
            __m512 s = acc[m][n];
            if (kind == LIN_SCORES) {
                _mm512_storeu_ps(fout + m * os + n * 16, _mm512_mul_ps(s, _mm512_set1_ps(fscale)));
                continue;
            }
            if (int8) s = _mm512_mul_ps(s, _mm512_loadu_ps(scale + n * 16));
            if (bias) s = _mm512_add_ps(s, _mm512_loadu_ps(bias + n * 16));
            _mm256_storeu_si256((__m256i *)(out + m * os + n * 16), (__m256i)_mm512_cvtneps_pbh(s));
        }
}

/* Rows 0..M-1 against blocks of columns (nr of them) in tiles of LIN_MR rows: each case a tile shape the
   compiler unrolls with its sums in registers. */
#define LIN_BLOCKS(NAME, KIND)                                                                     \
    static void NAME(const uint16_t *x, int64_t xs, const void *wp, int64_t pairs, int64_t stride, const float *scale, \
                     const float *bias, uint16_t *out, float *fout, float fscale, int64_t os, int64_t M, int nr) { \
        for (int64_t m0 = 0; m0 < M; m0 += LIN_MR) {                                               \
            int mr = M - m0 < LIN_MR ? (int)(M - m0) : LIN_MR;                                     \
            const uint16_t *xm = x + m0 * xs;                                                      \
            uint16_t *om = KIND == LIN_SCORES ? 0 : out + m0 * os;                                 \
            float *fm = KIND == LIN_SCORES ? fout + m0 * os : 0;                                   \
            switch (mr * 8 + nr) {                                                                 \
                LIN_ROWS(1, KIND) LIN_ROWS(2, KIND) LIN_ROWS(3, KIND)                              \
                LIN_ROWS(4, KIND) LIN_ROWS(5, KIND) LIN_ROWS(6, KIND)                              \
            }                                                                                      \
        }                                                                                          \
    }
#define LIN_CASE(a, b, KIND) \
    case a * 8 + b: linear_tile(xm, xs, wp, pairs, stride, scale, bias, om, fm, fscale, os, a, b, KIND); break;
#define LIN_ROWS(a, K) LIN_CASE(a, 1, K) LIN_CASE(a, 2, K) LIN_CASE(a, 3, K) LIN_CASE(a, 4, K)
LIN_BLOCKS(linear_blocks_bf16, LIN_BF16)
LIN_BLOCKS(linear_blocks_int8, LIN_INT8)
LIN_BLOCKS(linear_blocks_scores, LIN_SCORES)

/* Rows 0..M-1 against column blocks b0..b1-1 (``stride`` pairs apart in ``wp``), LIN_NR blocks at a time,
   by ``kind`` (``linear_tile``); ``scale``, ``bias``, ``out`` and ``fout`` start at block 0. */
static void linear_columns(const uint16_t *x, int64_t xs, const void *wp, int64_t pairs, int64_t stride,
                           const float *scale, const float *bias, uint16_t *out, float *fout, float fscale,
                           int64_t os, int64_t M, int64_t b0, int64_t b1, int kind) {
    for (int64_t b = b0; b < b1; b += LIN_NR) {
        int nr = b1 - b < LIN_NR ? (int)(b1 - b) : LIN_NR;
        const void *wb = (const char *)wp + b * stride * 32 * (kind == LIN_INT8 ? 1 : 2);
        const float *bb = bias ? bias + b * 16 : 0;
        if (kind == LIN_INT8)
            linear_blocks_int8(x, xs, wb, pairs, stride, scale + b * 16, bb, out + b * 16, 0, 0, os, M, nr);
        else if (kind == LIN_SCORES)
            linear_blocks_scores(x, xs, wb, pairs, stride, 0, 0, 0, fout + b * 16, fscale, os, M, nr);
        else
            linear_blocks_bf16(x, xs, wb, pairs, stride, 0, bb, out + b * 16, 0, 0, os, M, nr);
    }
}

static int64_t linear_run(const uint16_t *x, int64_t x_stride, const void *wp, int int8, const float *scale,
                          const float *bias, uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    if (N % 16 || K % 2) return -1;
    if (M <= 0) return 0; /* the probe's call: nothing to do */
    int64_t blocks = N / 16, pairs = K / 2;
    if (threads > blocks) threads = blocks;
    if (threads < 1) threads = 1;
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
#endif
    {
#if defined(_OPENMP)
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        int64_t t = 0, T = 1;
#endif
        linear_columns(x, x_stride, wp, pairs, pairs, scale, bias, out, 0, 0, N, M, blocks * t / T,
                       blocks * (t + 1) / T, int8 ? LIN_INT8 : LIN_BF16);
    }
    return 0;
}

int64_t linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *wp, const float *bias, uint16_t *out,
                    int64_t M, int64_t K, int64_t N, int64_t threads) {
    return linear_run(x, x_stride, wp, 0, 0, bias, out, M, K, N, threads);
}

int64_t linear_int8_bf16(const uint16_t *x, int64_t x_stride, const int8_t *wp, const float *scale,
                         const float *bias, uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    return linear_run(x, x_stride, wp, 1, scale, bias, out, M, K, N, threads);
}

/* Causal attention of a prefill in bf16, for one sequence: queries t = 0..T-1 at positions start + t (q's
   rows q_stride apart, head h at h D), keys and values of KV head g at k + g head_stride + j D; query
   t reads keys 0..start + t and nothing else. Per row: the scores q.k by the linear kernel's tiles
   (K packed as its weights, one fixed fp32 order per score) times ``scale``; the softmax over the
   row's keys (max; exp; the sum in 16 lanes by key index from key 0, added in a fixed tree); the
   probabilities rounded to bf16 (as HF's eager attention does), 0 past the row's last key; then
   P @ V by the linear kernel's tiles (V packed as weights, pairs of keys from key 0 in order, the
   zeros adding nothing), rounded once to bf16 into out (T, H D). A row's result depends on nothing
   but its query, its position and its keys: not on T, start, the blocks or the threads, so a prompt
   prefilled in parts (``decode.Reused``) gets the bits of its prefill in one call.

   Work items: a KV head's G query heads for CAUSAL_BQ positions (G CAUSAL_BQ rows), the latest
   (longest) first, shared out among ``threads`` OpenMP threads. Returns -1 where built without
   avx512_bf16, for shapes it does not take (D % 16) or when out of memory; 0 for T = 0. */
#define CAUSAL_BQ 16

static void causal_pack(const uint16_t *k, const uint16_t *v, int64_t D, int64_t end, int64_t kblocks,
                        int64_t kpairs, uint16_t *kp, uint16_t *vp) {
    int64_t dp = D / 2; /* K as the weights of kblocks x 16 columns (keys) by D inputs */
    uint32_t *kp32 = (uint32_t *)kp;
    for (int64_t j = 0; j < kblocks * 16; j++)
        for (int64_t p = 0; p < dp; p++) {
            uint32_t two = 0;
            if (j < end) memcpy(&two, k + j * D + 2 * p, sizeof two);
            kp32[((j / 16) * dp + p) * 16 + j % 16] = two;
        }
    for (int64_t j = 0; j < 2 * kpairs; j++) /* V as the weights of D columns by 2 kpairs inputs (keys) */
        for (int64_t d = 0; d < D; d++)
            vp[(((d / 16) * kpairs + j / 2) * 16 + d % 16) * 2 + j % 2] = j < end ? v[j * D + d] : 0;
}

static inline __mmask16 lanes_below(int64_t n) { /* the first n of 16 lanes (all past 16, none below 1) */
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

static void causal_item(const uint16_t *q, int64_t q_stride, const uint16_t *kp, const uint16_t *vp,
                        int64_t kpairs_all, int64_t start, int64_t T, int64_t H, int64_t G, int64_t D,
                        int64_t g, int64_t qb, float scale, uint16_t *out, uint16_t *qbuf, float *sc, uint16_t *pb) {
    int64_t lo = qb * CAUSAL_BQ, n = T - lo < CAUSAL_BQ ? T - lo : CAUSAL_BQ, rows = G * n;
    int64_t kend = start + lo + n, kblocks = (kend + 15) / 16, sl = kblocks * 16, kpairs = (kend + 1) / 2;
    for (int64_t h = 0; h < G; h++)
        for (int64_t t = 0; t < n; t++)
            memcpy(qbuf + (h * n + t) * D, q + (lo + t) * q_stride + (g * G + h) * D, D * sizeof *qbuf);
    linear_columns(qbuf, D, kp, D / 2, D / 2, 0, 0, 0, sc, scale, sl, rows, 0, kblocks, LIN_SCORES);
    for (int64_t r = 0; r < rows; r++) {
        float *s = sc + r * sl;
        uint16_t *pr = pb + r * sl;
        int64_t nk = start + lo + r % n + 1; /* the row's keys */
        __m512 mx = _mm512_set1_ps(-INFINITY), sums = _mm512_setzero_ps();
        for (int64_t j = 0; j < nk; j += 16) {
            __mmask16 in = lanes_below(nk - j);
            mx = _mm512_mask_max_ps(mx, in, mx, _mm512_loadu_ps(s + j));
        }
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (int64_t j = 0; j < nk; j += 16) {
            __mmask16 in = lanes_below(nk - j);
            __m512 e = _mm512_maskz_mov_ps(in, vexp(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
            _mm512_storeu_ps(s + j, e);
            sums = _mm512_add_ps(sums, e);
        }
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sums));
        for (int64_t j = 0; j < sl; j += 16) {
            __mmask16 in = lanes_below(nk - j);
            __m512 p = _mm512_maskz_mov_ps(in, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
            _mm256_storeu_si256((__m256i *)(pr + j), (__m256i)_mm512_cvtneps_pbh(p));
        }
    }
    for (int64_t h = 0; h < G; h++)
        linear_columns(pb + h * n * sl, sl, vp, kpairs, kpairs_all, 0, 0, out + lo * H * D + (g * G + h) * D, 0, 0,
                       H * D, n, 0, D / 16, LIN_BF16);
}

int64_t causal_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t head_stride,
                    int64_t start, int64_t T, int64_t H, int64_t KV, int64_t D, float scale, uint16_t *out,
                    int64_t threads) {
    if (KV <= 0 || H % KV || D <= 0 || D % 16 || start < 0 || threads < 1) return -1;
    if (T <= 0) return 0; /* the probe's call */
    int64_t G = H / KV, end = start + T, kblocks = (end + 15) / 16, kpairs = (end + 1) / 2;
    int64_t kp_n = kblocks * 16 * D, vp_n = 2 * kpairs * D, nqb = (T + CAUSAL_BQ - 1) / CAUSAL_BQ;
    uint16_t *packed = malloc((kp_n + vp_n) * KV * sizeof *packed);
    if (!packed) return -1;
    for (int64_t g = 0; g < KV; g++)
        causal_pack(k + g * head_stride, v + g * head_stride, D, end, kblocks, kpairs, packed + g * kp_n,
                    packed + KV * kp_n + g * vp_n);
    int64_t items = KV * nqb, rows = G * CAUSAL_BQ, sl = kblocks * 16;
    int64_t per = rows * sl * (sizeof(float) + sizeof(uint16_t)) + rows * D * sizeof(uint16_t); /* bytes a thread */
    char *scratch = malloc((threads < items ? threads : items) * per);
    if (!scratch) {
        free(packed);
        return -1;
    }
    PARALLEL_FOR(threads, items)
    for (int64_t i = 0; i < items; i++) {
        float *sc = (float *)(scratch + THREAD * per);
        uint16_t *pb = (uint16_t *)(sc + rows * sl), *qbuf = pb + rows * sl;
        causal_item(q, q_stride, packed + (i % KV) * kp_n, packed + KV * kp_n + (i % KV) * vp_n, kpairs, start, T,
                    H, G, D, i % KV, nqb - 1 - i / KV, scale, out, qbuf, sc, pb);
    }
    free(scratch);
    free(packed);
    return 0;
}
#else
int64_t linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *wp, const float *bias, uint16_t *out,
                    int64_t M, int64_t K, int64_t N, int64_t threads) {
    return -1;
}

int64_t linear_int8_bf16(const uint16_t *x, int64_t x_stride, const int8_t *wp, const float *scale,
                         const float *bias, uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    return -1;
}
int64_t causal_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t head_stride,
                    int64_t start, int64_t T, int64_t H, int64_t KV, int64_t D, float scale, uint16_t *out,
                    int64_t threads) {
    return -1;
}
#endif

/* Whether the library runs its kernels on OpenMP threads (``native.Linear`` is used only then, or on one
   thread: on one core it would lose to oneDNN's threads). */
int64_t built_with_openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}
