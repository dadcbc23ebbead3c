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
        const int64_t *kstart, *kmap; /* a token tree's key map (``key_map_fits``), or NULL */     \
        int64_t kmap_w;                                                                            \
    }
typedef uint16_t bf16_t; /* the element types, by the kernels' suffixes */
typedef float f32_t;
typedef ATTENTION_ARGS(bf16_t) args_bf16;
typedef ATTENTION_ARGS(f32_t) args_f32;
#define TREE_KEYS 16    /* a token tree's mapped keys a row, at most (``key_map_fits``) */
#define TREE_GATHER 32  /* keys an item copies for a tree's row: up to 15 before the first mapped one (the step
                           form's block), and up to TREE_KEYS mapped */

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
   last n % W one by one); p_j v_j by fused multiply-adds into G D / W vectors, over the keys in order.
   A fixed sequence of operations per row, so as row-invariant as the portable form, which it does not
   match bit for bit. ``scratch``: G L + 16 floats, and 2 TREE_GATHER D more for a token tree's row
   (``kmap``), whose path's keys and values past its chain's are gathered there in order, the sums then
   running over them as over the cache: the row's bits are its chain row's.

   Each score and each output vector is one chain of fused multiply-adds, and a chain waits for the one
   before it (4-5 cycles): the loops run QK_KEYS keys' chains side by side for one query head, and
   P @ V up to PV_CHUNKS output vectors' chains of one head side by side over the keys, so that the
   chains keep the FMA units busy and stay in registers. Which chains run together changes no
   operation of any chain: the bits are those of one key, one head, one vector at a time. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || defined(__aarch64__)
#if defined(__aarch64__)
#include <arm_neon.h>
#else
#include <immintrin.h>
#endif
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
static inline vf vselect_neg(vf x, vf neg, vf other) { /* x < 0 ? neg : other, lane by lane */
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), other, neg);
}
static inline vf vround_bf16(vf f) { /* f32_to_bf16, kept as fp32: nearest even, NaN -> 0x7FC0 */
    __m512i u = _mm512_castps_si512(f);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(r);
}
static inline void vstore_bf16(uint16_t *p, vf rounded) { /* the top halves of vround_bf16's values */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
static inline vf vload_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(__aarch64__)
#define W 4
typedef float32x4_t vf;
static inline vf vload_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
static inline float vsum(vf a) { return vaddvq_f32(a); }
static inline float vmaxall(vf a) { return vmaxvq_f32(a); }
static inline vf vfloor(vf x) { return vrndmq_f32(x); }
static inline vf vexp2n(vf n) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
}
static inline vf vzero_below(vf y, vf x, float lo) {
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(y), vcgeq_f32(x, vdupq_n_f32(lo))));
}
static inline vf vselect_neg(vf x, vf neg, vf other) { return vbslq_f32(vcltq_f32(x, vdupq_n_f32(0.0f)), neg, other); }
static inline vf vround_bf16(vf f) {
    uint32x4_t u = vreinterpretq_u32_f32(f);
    uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7FFF), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1))));
    r = vandq_u32(r, vdupq_n_u32(0xFFFF0000u));
    r = vbslq_u32(vceqq_f32(f, f), r, vdupq_n_u32(0x7FC00000)); /* f != f: NaN */
    return vreinterpretq_f32_u32(r);
}
static inline void vstore_bf16(uint16_t *p, vf rounded) { vst1_u16(p, vshrn_n_u32(vreinterpretq_u32_f32(rounded), 16)); }
static inline vf vload_f16(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline vf vload_f32(const float *p) { return vld1q_f32(p); }
static inline void vstore(float *p, vf a) { vst1q_f32(p, a); }
static inline vf vset1(float a) { return vdupq_n_f32(a); }
static inline vf vzero(void) { return vdupq_n_f32(0.0f); }
static inline vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vsub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vmax(vf a, vf b) { return vmaxq_f32(a, b); }
static inline vf vdiv(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); } /* a b + c, one rounding */
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
static inline vf vselect_neg(vf x, vf neg, vf other) {
    return _mm256_blendv_ps(other, neg, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
static inline vf vround_bf16(vf f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    return _mm256_castsi256_ps(r);
}
static inline void vstore_bf16(uint16_t *p, vf rounded) {
    __m256i r = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
static inline vf vload_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif
#if !defined(__aarch64__)
/* the operations both x86 widths name alike (_mm512_add_ps, _mm256_add_ps, ...) */
#define vload_f32 VOP(loadu_ps)
#define vstore VOP(storeu_ps)
#define vset1 VOP(set1_ps)
#define vzero VOP(setzero_ps)
#define vadd VOP(add_ps)
#define vsub VOP(sub_ps)
#define vmul VOP(mul_ps)
#define vmax VOP(max_ps)
#define vdiv VOP(div_ps)
#define vfma VOP(fmadd_ps)
#endif

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
#define QK_KEYS 8
#define PV_CHUNKS 8
/* ``qk_T``: the scores of query head qh (nc vectors) against ``keys`` (a constant where inlined) keys
   from k (D apart) into p: each key's product with the head's first vector, then a fused
   multiply-add per further vector, summed across lanes (``vsum``) and scaled.
   ``pv_T``: ``chunks`` output vectors of one head (v and dst start at the first of them): the sum over
   the n keys, in order, of p_j times value j's vector (fused multiply-adds from 0), rounded to T. */
#define SIMD_PRODUCTS(T, LOADV, STORE)                                                             \
    static inline __attribute__((always_inline)) void qk_##T(const vf *qh, const T##_t *k, int64_t D, \
                                                             int64_t nc, int keys, float scale, float *p) { \
        vf acc[QK_KEYS];                                                                           \
        for (int i = 0; i < keys; i++) acc[i] = vmul(qh[0], LOADV(k + i * D));                     \
        for (int64_t c = 1; c < nc; c++)                                                           \
            for (int i = 0; i < keys; i++) acc[i] = vfma(qh[c], LOADV(k + i * D + W * c), acc[i]); \
        for (int i = 0; i < keys; i++) p[i] = vsum(acc[i]) * scale;                                \
    }                                                                                              \
    static inline __attribute__((always_inline)) void pv_##T(const float *ph, const T##_t *v, const T##_t *v2, \
                                                             int64_t split, int64_t D, int64_t n, int chunks, \
                                                             float *o, T##_t *dst) { \
        vf acc[PV_CHUNKS];                                                                         \
        for (int i = 0; i < chunks; i++) acc[i] = vzero();                                         \
        for (int64_t j = 0; j < split; j++) {                                                      \
            vf pj = vset1(ph[j]);                                                                  \
            for (int i = 0; i < chunks; i++) acc[i] = vfma(pj, LOADV(v + j * D + W * i), acc[i]);  \
        }                                                                                          \
        for (int64_t j = split; j < n; j++) { /* a token tree's gathered values (``split`` < n) */ \
            vf pj = vset1(ph[j]);                                                                  \
            for (int i = 0; i < chunks; i++) acc[i] = vfma(pj, LOADV(v2 + (j - split) * D + W * i), acc[i]); \
        }                                                                                          \
        for (int i = 0; i < chunks; i++) {                                                         \
            vstore(o, acc[i]);                                                                     \
            for (int l = 0; l < W; l++) dst[W * i + l] = STORE(o[l]);                              \
        }                                                                                          \
    }
#define ATTENTION_SIMD(NAME, T, LOADV, STORE)                                                      \
    static void NAME(const args_##T *a, int64_t r, int64_t g, float *scratch) {                    \
        int64_t G = a->H / a->KV, D = a->D, L = a->L, nc = D / W;                                  \
        float *p = scratch, *o = scratch + G * L;                                                  \
        int64_t end = a->pos[r] + 1, lo = a->window > 0 && end > a->window ? end - a->window : 0;  \
        int64_t n = end - lo, body = n / W * W;                                                    \
        const T##_t *kb = a->k + a->slots[r] * a->slot_stride + g * a->head_stride;                \
        const T##_t *vb = a->v + a->slots[r] * a->slot_stride + g * a->head_stride;                \
        const T##_t *kg = kb + lo * D, *vg = vb + lo * D, *kg2 = kg, *vg2 = vg;                    \
        int64_t split = n; /* keys 0..split-1 read where they are, the rest from kg2, vg2 */        \
        if (a->kmap && a->kstart[r] < end) { /* a token tree's row: its path's keys, gathered */   \
            int64_t ks = a->kstart[r];                                                             \
            T##_t *kt = (T##_t *)(o + 16), *vt = kt + TREE_GATHER * D;                             \
            split = ks > lo ? ks - lo : 0;                                                         \
            for (int64_t j = split; j < n; j++) {                                                  \
                int64_t at = a->kmap[r * a->kmap_w + lo + j - ks];                                 \
                memcpy(kt + (j - split) * D, kb + at * D, D * sizeof *kt);                         \
                memcpy(vt + (j - split) * D, vb + at * D, D * sizeof *vt);                         \
            }                                                                                      \
            kg2 = kt, vg2 = vt;                                                                    \
        }                                                                                          \
        const T##_t *qg = a->q + r * a->q_stride + g * G * D;                                      \
        vf qv[MAXG * MAXC];                                                                        \
        for (int64_t i = 0; i < G * nc; i++) qv[i] = LOADV(qg + W * i);                            \
        for (int64_t h = 0; h < G; h++) { /* each key's score alone: how keys are grouped changes no bit */ \
            int64_t j = 0;                                                                         \
            for (; j + QK_KEYS <= split; j += QK_KEYS)                                             \
                qk_##T(qv + h * nc, kg + j * D, D, nc, QK_KEYS, a->scale, p + h * L + j);          \
            for (; j < split; j++) qk_##T(qv + h * nc, kg + j * D, D, nc, 1, a->scale, p + h * L + j); \
            for (; j < n; j++) qk_##T(qv + h * nc, kg2 + (j - split) * D, D, nc, 1, a->scale, p + h * L + j); \
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
        T##_t *dst = a->out + r * a->H * D + g * G * D;                                            \
        for (int64_t h = 0; h < G; h++) {                                                          \
            int64_t c = 0;                                                                         \
            for (; c + PV_CHUNKS <= nc; c += PV_CHUNKS)                                            \
                pv_##T(p + h * L, vg + W * c, vg2 + W * c, split, D, n, PV_CHUNKS, o, dst + h * D + W * c); \
            for (; c + 4 <= nc; c += 4)                                                            \
                pv_##T(p + h * L, vg + W * c, vg2 + W * c, split, D, n, 4, o, dst + h * D + W * c); \
            for (; c < nc; c++) pv_##T(p + h * L, vg + W * c, vg2 + W * c, split, D, n, 1, o, dst + h * D + W * c); \
        }                                                                                          \
    }

SIMD_PRODUCTS(bf16, vload_bf16, f32_to_bf16)
SIMD_PRODUCTS(f32, vload_f32, SAME)
ATTENTION_SIMD(attention_simd_bf16, bf16, vload_bf16, f32_to_bf16)
ATTENTION_SIMD(attention_simd_f32, f32, vload_f32, SAME)
#define HAVE_SIMD 1
#endif

/* Exported: in bf16 where the library has avx512_bf16 and D % 32 == 0, the step form (the prefill's
   arithmetic); else the SIMD form where it is compiled and the shapes suit it; else the portable one (one
   choice per model, never per call), over the call's rows x KV heads work items, shared out among
   ``threads`` OpenMP threads (built with OpenMP: torch's own runtime, so the same thread pool as its
   ops) with ``per`` floats of ``scratch`` each (``attention_scratch``). The cache holds ``slots_n``
   slots of L positions; a row outside them returns -1 before anything is computed. */
#define ATTENTION_ENTRY(NAME)                                                                      \
    static int64_t attention_run_##NAME(const NAME##_t *q, int64_t q_stride, const NAME##_t *k, const NAME##_t *v, \
                             int64_t slots_n, int64_t slot_stride, int64_t L, int64_t head_stride,  \
                             const int64_t *slots, const int64_t *pos, NAME##_t *out, int64_t rows, \
                             int64_t H, int64_t KV, int64_t D, int64_t window, float scale,         \
                             float *scratch, int64_t per, int64_t threads, const int64_t *kstart,   \
                             const int64_t *kmap, int64_t kmap_w) {                                 \
        if (KV <= 0 || H % KV || threads < 1) return -1;                                           \
        for (int64_t r = 0; r < rows; r++)                                                         \
            if (pos[r] < 0 || pos[r] >= L || slots[r] < 0 || slots[r] >= slots_n) return -1;        \
        if (rows <= 0) return 0;                                                                   \
        args_##NAME a = {q, k, v, out, slots, pos, q_stride, slot_stride, L, head_stride, H, KV, D, window, scale, \
                         kstart, kmap, kmap_w};                                                    \
        void (*item)(const args_##NAME *, int64_t, int64_t, float *) = attention_any_##NAME;       \
        int mapped = 0; /* whether the item reads a key map */                                     \
        FAST_##NAME                                                                                \
        if (kmap && (!mapped || !key_map_fits(kstart, kmap, kmap_w, pos, rows, L))) return -1;     \
        int64_t items = rows * KV;                                                                 \
        PARALLEL_FOR(threads, items)                                                               \
        for (int64_t i = 0; i < items; i++) item(&a, i / KV, i % KV, scratch + per * THREAD);      \
        return 0;                                                                                  \
    }                                                                                              \
    int64_t attention_##NAME(const NAME##_t *q, int64_t q_stride, const NAME##_t *k, const NAME##_t *v, \
                             int64_t slots_n, int64_t slot_stride, int64_t L, int64_t head_stride,  \
                             const int64_t *slots, const int64_t *pos, NAME##_t *out, int64_t rows, \
                             int64_t H, int64_t KV, int64_t D, int64_t window, float scale,         \
                             float *scratch, int64_t per, int64_t threads) {                        \
        return attention_run_##NAME(q, q_stride, k, v, slots_n, slot_stride, L, head_stride, slots, pos, out, rows, \
                                    H, KV, D, window, scale, scratch, per, threads, NULL, NULL, 0); \
    }

/* A token tree's key map (``layers_bf16``): row r reads the key of position p >= kstart[r] at cache place
   kmap[r kmap_w + p - kstart[r]] of its slot, and the keys below kstart[r] where they are; kstart[r] > pos[r]
   maps nothing. At most TREE_KEYS mapped keys a row, each place inside the slot (TREE_KEYS and
   TREE_GATHER are defined above the attention items, which read them). */
static int key_map_fits(const int64_t *kstart, const int64_t *kmap, int64_t kmap_w, const int64_t *pos, int64_t rows,
                        int64_t L) {
    if (kmap_w < 1 || kmap_w > TREE_KEYS) return 0;
    for (int64_t r = 0; r < rows; r++) {
        if (kstart[r] < 0) return 0;
        for (int64_t p = kstart[r]; p <= pos[r]; p++) {
            if (p - kstart[r] >= kmap_w) return 0;
            int64_t at = kmap[r * kmap_w + p - kstart[r]];
            if (at < 0 || at >= L) return 0;
        }
    }
    return 1;
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

/* Runs CALL on each of up to ``threads`` OpenMP threads (``threads``: a variable, clamped to 1..blocks) with its
   share b0..b1 of ``blocks`` column blocks, contiguous and in order: a column's sum is one thread's alone. */
#if defined(_OPENMP)
#define SHARE_COLUMNS(threads, blocks, CALL)                                                       \
    do {                                                                                           \
        if (threads > blocks) threads = blocks;                                                    \
        if (threads < 1) threads = 1;                                                              \
        _Pragma("omp parallel num_threads(threads)") {                                             \
            int64_t t_ = omp_get_thread_num(), T_ = omp_get_num_threads();                         \
            int64_t b0 = blocks * t_ / T_, b1 = blocks * (t_ + 1) / T_;                            \
            CALL;                                                                                  \
        }                                                                                          \
    } while (0)
#else
#define SHARE_COLUMNS(threads, blocks, CALL)                                                       \
    do {                                                                                           \
        int64_t b0 = 0, b1 = blocks;                                                               \
        CALL;                                                                                      \
    } while (0)
#endif

#if defined(HAVE_SIMD)
#define ALWAYS static inline __attribute__((always_inline))

/* The rows a pass over a thread's columns takes at once, a multiple of ``rows``: as many as keep their inputs
   (``bytes`` a row) within half of a 512 KiB L2 cache. A prefill's 256 rows of inputs pass through every column
   block; from L3 they bounded its speed (and shared it with the machine's other programs). */
static int64_t row_chunk(int64_t bytes, int rows) {
    int64_t n = (256 << 10) / bytes / rows * rows;
    return n < rows ? rows : n;
}

/* AMX's tiles (Sapphire Rapids and later), where the compiler targets them and Linux lets this process use them:
   ``amx_ready`` asks once a process (arch_prctl), so that every call of the process takes one form. */
#if defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_TILES 1
#define AMX_REQ_PERM 0x1023 /* arch_prctl ARCH_REQ_XCOMP_PERM */
#define AMX_TILE_DATA 18    /* XFEATURE_XTILEDATA */
static int amx_state = -1;  /* unknown, no, yes */
static int amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, AMX_REQ_PERM, AMX_TILE_DATA) == 0;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* The calling thread's tiles: sums tmm0..3 (``rows`` x 64 bytes), inputs tmm4 (``rows`` x ``a_bytes``), weights
   tmm5, tmm6 (``b_rows`` x 64 bytes). */
static void amx_tiles(int rows, int a_bytes, int b_rows) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++)
        c.rows[t] = t < 5 ? rows : b_rows, c.colsb[t] = t == 4 ? a_bytes : 64;
    /* the stores must land before the config is read: GCC 12 dropped them for ggml's config on the stack, and
       the first tile instruction then raised SIGILL (llama.cpp PR 26954) */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
#endif

/* The 4-bit and 8-bit blocks, on every vector instruction set: the rows' inputs quantized per block of 32, as
   llama.cpp quantizes activations for these blocks (Q8_0: d = max |x| / 127, q = x / d rounded to the nearest,
   ties away from zero), then each block's sum of q_w q_x in integers, exact whatever the instructions
   (``vpmaddubsw``, ``sdot``, ...) or their grouping. Per row and column, over the blocks in order:
   acc = (d_w d_x) sum + acc, then for 4-bit acc = m_w (d_x sum of q_x) + acc, each product of two scales
   rounded once, in fp32; + bias, rounded to bf16. Every instruction set gives a row the same bits (the integers
   are exact and the fp32 operations the same, column by column), row-invariant by construction; the
   activations' 8 bits are the precision's own. avx512_bf16 runs them too: its own form (bf16 activations on
   ``vdpbf16ps``) was 1.3-1.8x slower at every row count on a Zen 4 (docs/benchmarks.md, 2026-12-06), and so a
   GGUF now gives the same bits on every CPU. (``vpdpbusd``, where VNNI is, summed the same integers no faster.)

   Packed (``native.Linear.q4`` / ``q8``) so that a vector's lanes are columns, each lane 4 inputs wide (what
   ``vpmaddubsw`` + ``vpmaddwd`` and ``sdot`` sum into a 32-bit lane): per 16 columns and block, 4-bit: 4 groups
   x 16 columns x 4 bytes, byte i of group g holding input 8 g + i in its low nibble and 8 g + 4 + i in its high
   one; 8-bit: 8 groups x 16 columns x 4 int8 (inputs 4 g + i); the scales apart, per 16 columns and block: the
   16 fp16 d, then (4-bit) the 16 m. A tile keeps a group of columns' weights and scales in registers and takes
   its rows in turn. */
#define QMR 4 /* rows a tile takes */

/* One block of 32 inputs in 8 bits: amax = max |x| (NaN ignored), d = amax / 127, q = x (1 / d) rounded to the
   nearest, ties away from zero (``roundf``'s rule, kept by truncating and adding the sign where the rest is at
   least a half), within -127..127; returns sum q. ``out``: the 32 q in order (ARM64), or each group of 4 broadcast
   to a vector of 8 (x86: 8 x 32 bytes, what ``vpmaddubsw`` reads from memory). The same bits on either. */
#if defined(__aarch64__)
#define QXB 32 /* bytes a quantized block takes */
static int32_t quant_block(const uint16_t *x, float *d, int8_t *out) {
    float32x4_t v[8], amax = vdupq_n_f32(0.0f);
    for (int i = 0; i < 8; i++) v[i] = vload_bf16(x + 4 * i), amax = vmaxnmq_f32(amax, vabsq_f32(v[i]));
    float db = vmaxvq_f32(amax) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    int32x4_t sum = vdupq_n_s32(0);
    int16x4_t h[8];
    for (int i = 0; i < 8; i++) {
        float32x4_t s = vmulq_f32(v[i], vdupq_n_f32(id)), t = vrndq_f32(s);
        uint32x4_t up = vcgeq_f32(vabsq_f32(vsubq_f32(s, t)), vdupq_n_f32(0.5f));
        float32x4_t one = vbslq_f32(vdupq_n_u32(0x80000000u), s, vdupq_n_f32(1.0f)); /* 1 with s's sign */
        t = vaddq_f32(t, vreinterpretq_f32_u32(vandq_u32(up, vreinterpretq_u32_f32(one))));
        int32x4_t q = vcvtq_s32_f32(vmaxq_f32(vminq_f32(t, vdupq_n_f32(127.0f)), vdupq_n_f32(-127.0f)));
        sum = vaddq_s32(sum, q);
        h[i] = vmovn_s32(q);
    }
    for (int i = 0; i < 4; i++) vst1_s8(out + 8 * i, vmovn_s16(vcombine_s16(h[2 * i], h[2 * i + 1])));
    *d = db;
    return vaddvq_s32(sum);
}
#else
#define QXB 256
static int32_t quant_block(const uint16_t *x, float *d, int8_t *out) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) { /* max(|v|, amax): a NaN lane keeps amax */
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + 8 * i))), 16));
        amax = _mm256_max_ps(_mm256_and_ps(v[i], absmask), amax);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float db = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256 s = _mm256_mul_ps(v[i], _mm256_set1_ps(id)), t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __m256 up = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(s, t), absmask), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
        __m256 one = _mm256_or_ps(_mm256_andnot_ps(absmask, s), _mm256_set1_ps(1.0f)); /* 1 with s's sign */
        t = _mm256_add_ps(t, _mm256_and_ps(up, one));
        q[i] = _mm256_cvttps_epi32(_mm256_max_ps(_mm256_min_ps(t, _mm256_set1_ps(127.0f)), _mm256_set1_ps(-127.0f)));
        sum = _mm256_add_epi32(sum, q[i]);
    }
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* groups of 4 in order */
    for (int g = 0; g < 8; g++)
        _mm256_storeu_si256((__m256i *)(out + 32 * g), _mm256_permutevar8x32_epi32(bytes, _mm256_set1_epi32(g)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    *d = db;
    return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
}
#endif

/* The rows' inputs in 8-bit blocks (``quant_block``), in a buffer of the calling thread's (as ``wide_rows``): M
   rows of K / 32 blocks of QXB bytes, then d_x and d_x sum(q_x) (M x K / 32 fp32 each). NULL: out of memory. */
static int8_t *quant_rows(const uint16_t *x, int64_t xs, int64_t M, int64_t K, float **dx, float **dsx) {
    static _Thread_local char *buf;
    static _Thread_local int64_t cap;
    int64_t kb = K / 32, need = M * kb * QXB + 2 * M * kb * (int64_t)sizeof(float);
    if (need > cap) {
        free(buf);
        buf = malloc(need);
        cap = buf ? need : 0;
        if (!buf) return NULL;
    }
    int8_t *q = (int8_t *)buf;
    float *d = (float *)(buf + M * kb * QXB), *ds = d + M * kb;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < kb; b++) {
            int32_t sum = quant_block(x + m * xs + b * 32, d + m * kb + b, q + (m * kb + b) * QXB);
            ds[m * kb + b] = d[m * kb + b] * (float)sum;
        }
    *dx = d, *dsx = ds;
    return q;
}

/* QC columns' block sums (int32, a lane a column) of one row: ``qcols4`` over the weights of a group of QC columns
   (``w``: group g at w + g QSTRIDE bytes) against the row's block of 32 inputs. ``qfloat``: the fp32 update of
   those columns' totals. */
#if defined(__aarch64__)
#define QC 4
typedef int32x4_t qi;
typedef float32x4_t qf;
#define QSTRIDE 64 /* bytes between a group's 16 columns and the next group's */
/* x0, x1: the block's inputs 0..15 and 16..31 */
#if defined(__ARM_FEATURE_DOTPROD)
#define QDOT(acc, w, x, lane) vdotq_laneq_s32(acc, w, x, lane)
#else
#define QDOT(acc, w, x, lane) vpadalq_s16(acc, q_pairs(w, vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x), lane))))
static inline int16x8_t q_pairs(int8x16_t w, int8x16_t x4) { /* |2 x 128 x 127| fits a 16-bit lane */
    int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x4)), hi = vmull_high_s8(w, x4);
    return vpaddq_s16(lo, hi);
}
#endif
ALWAYS qi qcols4(const uint8_t *w, int bits, int8x16_t x0, int8x16_t x1) {
    qi acc = vdupq_n_s32(0);
    if (bits == 4) {
#define Q4G(g, X, L0, L1)                                                                          \
    {                                                                                              \
        uint8x16_t v = vld1q_u8(w + g * QSTRIDE);                                                  \
        acc = QDOT(acc, vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))), X, L0);                  \
        acc = QDOT(acc, vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), X, L1);                             \
    }
        Q4G(0, x0, 0, 1) Q4G(1, x0, 2, 3) Q4G(2, x1, 0, 1) Q4G(3, x1, 2, 3)
#undef Q4G
    } else {
#define Q8G(g, X, L) acc = QDOT(acc, vld1q_s8((const int8_t *)w + g * QSTRIDE), X, L);
        Q8G(0, x0, 0) Q8G(1, x0, 1) Q8G(2, x0, 2) Q8G(3, x0, 3) Q8G(4, x1, 0) Q8G(5, x1, 1) Q8G(6, x1, 2) Q8G(7, x1, 3)
#undef Q8G
    }
    return acc;
}
typedef struct { int8x16_t x0, x1; } qrow;
ALWAYS qrow qrow_load(const int8_t *xq) { return (qrow){vld1q_s8(xq), vld1q_s8(xq + 16)}; }
ALWAYS qi qcols(const uint8_t *w, int bits, const qrow *r) { return qcols4(w, bits, r->x0, r->x1); }
#define qf_load_f16(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))
#define qf_cvt vcvtq_f32_s32
#define qf_set1 vdupq_n_f32
#define qf_mul vmulq_f32
#define qf_fma(a, b, c) vfmaq_f32(c, a, b)
#define qf_load vld1q_f32
#define qf_store vst1q_f32
ALWAYS void qf_store_bf16(uint16_t *p, qf v) { vstore_bf16(p, vround_bf16(v)); }
#else /* x86: AVX2's 256-bit forms, also where AVX-512 is */
#define QC 8
typedef __m256i qi;
typedef __m256 qf;
#define QSTRIDE 64
typedef struct { const __m256i *x; } qrow; /* a block's 8 groups of 4 inputs, each broadcast (``quant_block``) */
ALWAYS qrow qrow_load(const int8_t *xq) { return (qrow){(const __m256i *)xq}; }
ALWAYS qi qcols(const uint8_t *w, int bits, const qrow *r) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 4) { /* int16 lanes: 8 pairs of 2 x 15 x 127 fit */
        const __m256i low = _mm256_set1_epi8(15);
        __m256i s = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + g * QSTRIDE));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(v, low), _mm256_loadu_si256(r->x + 2 * g)));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                         _mm256_loadu_si256(r->x + 2 * g + 1)));
        }
        return _mm256_madd_epi16(s, ones);
    }
    __m256i acc = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) { /* |w| times x signed as w: pairs of |2 x 128 x 127| fit 16 bits */
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + g * QSTRIDE));
        __m256i x = _mm256_loadu_si256(r->x + g);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v)), ones));
    }
    return acc;
}
#define qf_load_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define qf_cvt _mm256_cvtepi32_ps
#define qf_set1 _mm256_set1_ps
#define qf_mul _mm256_mul_ps
#define qf_fma _mm256_fmadd_ps
#define qf_load _mm256_loadu_ps
#define qf_store _mm256_storeu_ps
ALWAYS void qf_store_bf16(uint16_t *p, qf f) { /* vround_bf16 and vstore_bf16 on 8 lanes */
    __m256i u = _mm256_castps_si256(f);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    r = _mm256_srli_epi32(r, 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

/* The fp32 update of QC columns' totals by one block: acc = (d_w d_x) sum + acc, then (4-bit) m_w (d_x sum q_x) + acc. */
ALWAYS qf qfloat(qf acc, qi sums, qf dw, qf mw, float dx, float dsx, int bits) {
    acc = qf_fma(qf_mul(dw, qf_set1(dx)), qf_cvt(sums), acc);
    return bits == 4 ? qf_fma(mw, qf_set1(dsx), acc) : acc;
}

/* mr rows x one block of 16 columns (16 / QC groups of QC columns), over ``kb`` blocks of inputs. */
ALWAYS void qint_tile(const int8_t *xq, int64_t xk, const float *dx, const float *dsx, int64_t kb, const uint8_t *w8,
                      const uint16_t *dm, const float *bias, uint16_t *out, int64_t os, int mr, int bits) {
    enum { CG = 16 / QC };
    qf total[QMR][CG];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < CG; j++) total[m][j] = qf_set1(0.0f);
    int64_t wb = bits == 4 ? 256 : 512, db = bits == 4 ? 32 : 16; /* bytes of q, fp16 values of d (and m) a block */
    for (int64_t b = 0; b < kb; b++)
        for (int j = 0; j < CG; j++) { /* a group of columns' weights and scales once, the rows in turn */
            const uint16_t *at = dm + b * db + QC * j;
            qf dw = qf_load_f16(at), mw = bits == 4 ? qf_load_f16(at + 16) : qf_set1(0.0f);
            const uint8_t *w = w8 + b * wb + QC * 4 * j;
            for (int m = 0; m < mr; m++) {
                qrow r = qrow_load(xq + m * xk + b * QXB);
                total[m][j] = qfloat(total[m][j], qcols(w, bits, &r), dw, mw, dx[m * kb + b], dsx[m * kb + b], bits);
            }
        }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < CG; j++) {
            qf t = total[m][j];
            if (bias) t = qf_fma(qf_set1(1.0f), qf_load(bias + QC * j), t); /* t + bias, exactly as an add */
            qf_store_bf16(out + m * os + QC * j, t);
        }
}

/* ``qint_tile`` on AVX-512 VNNI, 16 columns a vector: a group of 4 inputs x 16 columns is one ``vpdpbusd`` (unsigned
   weights, signed inputs; 8-bit weights as |w| against the inputs negated where w < 0), the same integer sums, then
   ``qfloat``'s operations on 16 lanes: the same bits. Taken where the tiles are (Sapphire Rapids and later), whose
   one-row calls ran the 256-bit form at a third of the bytes a second a bf16 row streamed (docs/benchmarks.md,
   2026-12-08); not where only VNNI is, as on a Zen 4, whose 256-bit ``vpdpbusd`` was no faster (2026-12-06). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(HAVE_AMX_TILES)
#define HAVE_QVNNI 1
ALWAYS void qvnni_tile(const int8_t *xq, int64_t xk, const float *dx, const float *dsx, int64_t kb, const uint8_t *w8,
                       const uint16_t *dm, const float *bias, uint16_t *out, int64_t os, int mr, int bits) {
    __m512 total[QMR];
    for (int m = 0; m < mr; m++) total[m] = _mm512_setzero_ps();
    int64_t wb = bits == 4 ? 256 : 512, db = bits == 4 ? 32 : 16;
    const __m512i low = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
    for (int64_t b = 0; b < kb; b++) {
        const uint16_t *at = dm + b * db;
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
        __m512 mw = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + 16))) : _mm512_setzero_ps();
        const uint8_t *w = w8 + b * wb;
        __m512i wv[8];
        __mmask64 neg[8];
        if (bits == 4)
            for (int g = 0; g < 4; g++) {
                __m512i v = _mm512_loadu_si512(w + 64 * g);
                wv[2 * g] = _mm512_and_si512(v, low), wv[2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        else
            for (int g = 0; g < 8; g++) {
                __m512i v = _mm512_loadu_si512(w + 64 * g);
                wv[g] = _mm512_abs_epi8(v), neg[g] = _mm512_movepi8_mask(v);
            }
        for (int m = 0; m < mr; m++) {
            const int8_t *xb = xq + m * xk + b * QXB;
            __m512i acc[2] = {zero, zero}; /* two chains of sums: integers, so their order changes nothing */
            for (int g = 0; g < 8; g++) {
                int32_t four;
                memcpy(&four, xb + 32 * g, sizeof four);
                __m512i xv = _mm512_set1_epi32(four);
                if (bits == 8) xv = _mm512_mask_sub_epi8(xv, neg[g], zero, xv);
                acc[g & 1] = _mm512_dpbusd_epi32(acc[g & 1], wv[g], xv);
            }
            __m512i sum = _mm512_add_epi32(acc[0], acc[1]);
            __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[m * kb + b])), _mm512_cvtepi32_ps(sum), total[m]);
            total[m] = bits == 4 ? _mm512_fmadd_ps(mw, _mm512_set1_ps(dsx[m * kb + b]), t) : t;
        }
    }
    for (int m = 0; m < mr; m++) {
        __m512 t = total[m];
        if (bias) t = _mm512_fmadd_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(bias), t); /* t + bias, as an add */
        vstore_bf16(out + m * os, vround_bf16(t));
    }
}
#define QTILE qvnni_tile
#else
#define QTILE qint_tile
#endif

/* Rows 0..M-1 against column blocks b0..b1-1 of 4-bit (``bits`` 4) or 8-bit blocks, in tiles of QMR rows x one
   block of 16 columns (a one-row call streamed faster one block at a time than 2 or 4 side by side). */
static void qint_columns(const int8_t *xq, int64_t K, const float *dx, const float *dsx, const uint8_t *w8,
                         const uint16_t *dm, const float *bias, uint16_t *out, int64_t os, int64_t M, int64_t b0,
                         int64_t b1, int bits) {
    int64_t kb = K / 32, wb = bits == 4 ? 256 : 512, db = bits == 4 ? 32 : 16, chunk = row_chunk(kb * QXB, QMR);
    for (int64_t c0 = 0; c0 < M; c0 += chunk)
    for (int64_t c = b0; c < b1; c++)
        for (int64_t m0 = c0; m0 < M && m0 < c0 + chunk; m0 += QMR) {
            int mr = M - m0 < QMR ? (int)(M - m0) : QMR;
            const int8_t *xm = xq + m0 * kb * QXB;
            const float *dxm = dx + m0 * kb, *dsm = dsx + m0 * kb, *bc = bias ? bias + c * 16 : 0;
            const uint8_t *wc = w8 + c * kb * wb;
            const uint16_t *dc = dm + c * kb * db;
            uint16_t *oc = out + m0 * os + c * 16;
#define QINT(R)                                                                                    \
    case R:                                                                                        \
        if (bits == 4) QTILE(xm, kb * QXB, dxm, dsm, kb, wc, dc, bc, oc, os, R, 4);                \
        else QTILE(xm, kb * QXB, dxm, dsm, kb, wc, dc, bc, oc, os, R, 8);                          \
        break;
            switch (mr) { QINT(1) QINT(2) QINT(3) QINT(4) }
#undef QINT
        }
}

/* The blocks on AMX's int8 tiles, where the CPU has them (``amx_ready``): each block's integer sums by ``tdpbsud``
   (4-bit: signed inputs x unsigned weights) or ``tdpbssd`` (8-bit), exact as the vectors' are, then the same fp32
   update, lane by lane (``qfloat``), and the same rounding; so a row's bits are the vector form's, and a call takes
   either form by its rows alone (``QAMX_ROWS``). B is a block of 32 inputs x 16 columns, the 8 rows of 4 inputs
   that the 8-bit packing already is; the 4-bit one is unpacked first (row 2g: group g's low nibbles, inputs 8g..;
   row 2g+1: its high ones, 8g+4..), once per 4 column blocks for all the rows. A: up to 16 rows' 32 inputs of
   the block, in order (``quant_rows``' bytes regathered). 4 column blocks (tmm0..3) share each A. */
#if defined(HAVE_AMX_TILES) && defined(__AMX_INT8__)
#define HAVE_AMX_INT8 1
#define QAMX_ROWS 4 /* from these rows a call takes the tiles; fewer stream faster on the vectors (the same bits) */

/* ``quant_rows``' bytes (each group of 4 broadcast, ``QXB`` a block) as M rows of kb blocks of 32, in order. */
static int8_t *qamx_plain(const int8_t *xq, int64_t M, int64_t kb) {
    static _Thread_local int8_t *buf;
    static _Thread_local int64_t cap;
    if (M * kb * 32 > cap) {
        free(buf);
        buf = malloc(M * kb * 32);
        cap = buf ? M * kb * 32 : 0;
        if (!buf) return NULL;
    }
    for (int64_t i = 0; i < M * kb; i++)
        for (int g = 0; g < 8; g++) memcpy(buf + i * 32 + 4 * g, xq + i * QXB + 32 * g, 4);
    return buf;
}

static void qamx_columns(const int8_t *xq, const int8_t *xp, int64_t kb, const float *dx, const float *dsx,
                         const uint8_t *w8, const uint16_t *dm, const float *bias, uint16_t *out, int64_t os, int64_t M,
                         int64_t b0, int64_t b1, int bits) {
    static _Thread_local uint8_t *ub; /* 4-bit: 4 column blocks' weights unpacked, 512 bytes a block */
    static _Thread_local int64_t ucap;
    int64_t wb = bits == 4 ? 256 : 512, db = bits == 4 ? 32 : 16, need = 4 * kb * 512;
    if (bits == 4 && need > ucap) {
        free(ub);
        ub = aligned_alloc(64, need);
        ucap = ub ? need : 0;
        if (!ub) { /* out of memory: this thread's columns on the vectors, which give the same bits */
            qint_columns(xq, kb * 32, dx, dsx, w8, dm, bias, out, os, M, b0, b1, bits);
            return;
        }
    }
    float tot[4][16][16] __attribute__((aligned(64)));
    int32_t sums[4][16 * 16] __attribute__((aligned(64)));
    const __m512i low = _mm512_set1_epi8(15);
    int64_t whole = M / 16 * 16;
    for (int part = 0; part < 2; part++) {
        int rows = part ? (int)(M - whole) : 16;
        int64_t r0 = part ? whole : 0, r1 = part ? M : whole;
        if (r1 <= r0) continue;
        amx_tiles(rows, 32, 8);
        for (int64_t c = b0; c < b1; c += 4) {
            int nr = b1 - c < 4 ? (int)(b1 - c) : 4;
            if (bits == 4)
                for (int64_t i = 0; i < nr * kb; i++)
                    for (int g = 0; g < 4; g++) {
                        __m512i v = _mm512_loadu_si512(w8 + c * kb * wb + i * wb + 64 * g);
                        _mm512_store_si512(ub + i * 512 + 128 * g, _mm512_and_si512(v, low));
                        _mm512_store_si512(ub + i * 512 + 128 * g + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                    }
            const uint8_t *wc = bits == 4 ? ub : w8 + c * kb * wb;
            for (int64_t m0 = r0; m0 < r1; m0 += rows) {
                for (int j = 0; j < nr; j++)
                    for (int m = 0; m < rows; m++) _mm512_store_ps(tot[j][m], _mm512_setzero_ps());
                for (int64_t b = 0; b < kb; b++) {
                    _tile_loadd(4, xp + (m0 * kb + b) * 32, kb * 32);
#define QAMX_DOT(J, T)                                                                             \
    if (nr > J) {                                                                                  \
        _tile_zero(J);                                                                             \
        _tile_loadd(T, wc + (J * kb + b) * 512, 64);                                               \
        if (bits == 4) _tile_dpbsud(J, 4, T);                                                      \
        else _tile_dpbssd(J, 4, T);                                                                \
        _tile_stored(J, sums[J], 64);                                                              \
    }
                    QAMX_DOT(0, 5) QAMX_DOT(1, 6) QAMX_DOT(2, 5) QAMX_DOT(3, 6)
#undef QAMX_DOT
                    for (int j = 0; j < nr; j++) {
                        const uint16_t *at = dm + ((c + j) * kb + b) * db;
                        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
                        __m512 mw = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + 16)))
                                              : _mm512_setzero_ps();
                        for (int m = 0; m < rows; m++) { /* qfloat's operations, on 16 lanes */
                            int64_t r = (m0 + m) * kb + b;
                            __m512 t = _mm512_load_ps(tot[j][m]);
                            __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(sums[j] + m * 16));
                            t = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[r])), s, t);
                            if (bits == 4) t = _mm512_fmadd_ps(mw, _mm512_set1_ps(dsx[r]), t);
                            _mm512_store_ps(tot[j][m], t);
                        }
                    }
                }
                for (int j = 0; j < nr; j++)
                    for (int m = 0; m < rows; m++) {
                        __m512 t = _mm512_load_ps(tot[j][m]);
                        if (bias) t = _mm512_fmadd_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(bias + (c + j) * 16), t);
                        vstore_bf16(out + (m0 + m) * os + (c + j) * 16, vround_bf16(t));
                    }
            }
        }
    }
    _tile_release();
}
#endif

/* y = x W^T (+ b) over 4-bit (``bits`` 4: ``dm`` their fp16 d, then m) or 8-bit blocks (``dm``: d), as above. */
static int64_t qint_run(const uint16_t *x, int64_t x_stride, const void *wp, const uint16_t *dm, const float *bias,
                        uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads, int bits) {
    if (N % 16 || K % 32) return -1;
    if (M <= 0) return 0; /* the probe's call: nothing to do */
    int64_t blocks = N / 16;
    float *dx, *dsx;
    const int8_t *xq = quant_rows(x, x_stride, M, K, &dx, &dsx);
    if (!xq) return -1;
#if defined(HAVE_AMX_INT8)
    const int8_t *xp = M >= QAMX_ROWS && amx_ready() ? qamx_plain(xq, M, K / 32) : NULL;
    if (xp) {
        SHARE_COLUMNS(threads, blocks, qamx_columns(xq, xp, K / 32, dx, dsx, wp, dm, bias, out, N, M, b0, b1, bits));
        return 0;
    }
#endif
    SHARE_COLUMNS(threads, blocks, qint_columns(xq, K, dx, dsx, wp, dm, bias, out, N, M, b0, b1, bits));
    return 0;
}

int64_t linear_q4_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *nib, const uint16_t *dm, const float *bias,
                       uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    return qint_run(x, x_stride, nib, dm, bias, out, M, K, N, threads, 4);
}

int64_t linear_q8_bf16(const uint16_t *x, int64_t x_stride, const int8_t *q, const uint16_t *d, const float *bias,
                       uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    return qint_run(x, x_stride, q, d, bias, out, M, K, N, threads, 8);
}
#endif

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
   copy, ``weights.Int8Linear``), each output column's sum multiplied by its fp32 scale before the
   bias: an int8 weight is a bf16 exactly (|q| <= 127), so a vector of 32 is widened to fp32 and
   narrowed to bf16 without rounding, and the products are the bf16 kernel's. Half the bytes to read
   where a one-row draft step is bound by memory. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_LINEAR 1
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

/* AMX (Sapphire Rapids and later): the bf16 linear on tiles, where the CPU has them and Linux lets this process use
   them (``amx_ready``; K % 32). The layout above is already what ``tdpbf16ps`` reads as its B tile: 16 pairs of
   inputs x 16 columns x 2, 1 KiB, for each block of 16 columns and 32 inputs. A tile of up to 16 rows (tmm4) times
   up to 4 such blocks (tmm5, tmm6 in turn) adds into 4 tiles of fp32 sums (tmm0..3), 32 inputs at a time from the
   first; the sums are stored, the bias (fp32) added and each rounded once to bf16. A row's sums are computed
   alone in the tile (its own row of A against B), in the same order whatever the tile's rows, so its outputs do
   not depend on the call's rows nor on the thread: row-invariant by construction. ``tdpbf16ps`` adds each
   product, input by input from the first, into an fp32 sum, which is the wide paths' arithmetic (AVX2, AVX-512F,
   NEON): ``tests/native_check.c`` gets their digest, not ``vdpbf16ps``'s (the tiles flush subnormal values,
   which these weights and activations do not reach). Used for every row count of a linear, so a step, a verify
   pass and a prefill agree. On a 2-core Xeon (model 207) 16 rows cost 1.2-1.5x one row's
   time and 256 rows 7-22x less than the vector form's, whose 16 rows cost 9x its one (docs/benchmarks.md). */
#if defined(HAVE_AMX_TILES) && defined(__AMX_BF16__)
#define HAVE_AMX 1
/* Tiles for ``rows`` rows: sums tmm0..3 and inputs tmm4 of ``rows`` x 64 bytes, weights tmm5, tmm6 of 16 x 64. */
static void amx_configure(int rows) { amx_tiles(rows, 64, 16); }

/* Rows m0..m0+rows-1 (``amx_configure(rows)`` done) against blocks b..b+nr-1 (nr <= 4). */
static inline __attribute__((always_inline)) void amx_tile(const uint16_t *x, int64_t xs, const uint16_t *wp,
        int64_t pairs, const float *bias, uint16_t *out, int64_t os, int rows, int64_t b, int nr) {
    _tile_zero(0);
    if (nr > 1) _tile_zero(1);
    if (nr > 2) _tile_zero(2);
    if (nr > 3) _tile_zero(3);
    const uint16_t *w0 = wp + b * pairs * 32;
    for (int64_t p = 0; p < pairs; p += 16) {
        _tile_loadd(4, x + 2 * p, xs * 2);
        _tile_loadd(5, w0 + p * 32, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nr > 1) { _tile_loadd(6, w0 + (pairs + p) * 32, 64); _tile_dpbf16ps(1, 4, 6); }
        if (nr > 2) { _tile_loadd(5, w0 + (2 * pairs + p) * 32, 64); _tile_dpbf16ps(2, 4, 5); }
        if (nr > 3) { _tile_loadd(6, w0 + (3 * pairs + p) * 32, 64); _tile_dpbf16ps(3, 4, 6); }
    }
    float sums[4][16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, sums[0], 64);
    if (nr > 1) _tile_stored(1, sums[1], 64);
    if (nr > 2) _tile_stored(2, sums[2], 64);
    if (nr > 3) _tile_stored(3, sums[3], 64);
    for (int n = 0; n < nr; n++)
        for (int m = 0; m < rows; m++) {
            __m512 v = _mm512_load_ps(sums[n] + m * 16);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + (b + n) * 16));
            vstore_bf16(out + m * os + (b + n) * 16, vround_bf16(v)); /* the wide paths' rounding, NaN included */
        }
}

/* Rows 0..M-1 against column blocks b0..b1-1: the whole tiles of 16 rows, then the last rows' tile, each pass
   over the blocks 4 at a time with the rows inner, so that a group's weights are read from memory once. */
static void amx_columns(const uint16_t *x, int64_t xs, const uint16_t *wp, int64_t pairs, const float *bias,
                        uint16_t *out, int64_t os, int64_t M, int64_t b0, int64_t b1) {
    int64_t whole = M / 16 * 16;
    for (int part = 0; part < 2; part++) {
        int rows = part ? (int)(M - whole) : 16;
        int64_t r0 = part ? whole : 0, r1 = part ? M : whole;
        if (r1 <= r0) continue;
        amx_configure(rows);
        for (int64_t b = b0; b < b1; b += 4) {
            int nr = b1 - b < 4 ? (int)(b1 - b) : 4;
            for (int64_t m = r0; m < r1; m += rows) amx_tile(x + m * xs, xs, wp, pairs, bias, out + m * os, os, rows, b, nr);
        }
    }
    _tile_release();
}
#endif

static int64_t linear_run(const uint16_t *x, int64_t x_stride, const void *wp, int int8, const float *scale,
                          const float *bias, uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    if (int8 >= 2) return qint_run(x, x_stride, wp, (const uint16_t *)scale, bias, out, M, K, N, threads, int8 == 2 ? 4 : 8);
    if (N % 16 || K % 2) return -1;
    if (M <= 0) return 0; /* the probe's call: nothing to do */
    int64_t blocks = N / 16, pairs = K / 2;
#if defined(HAVE_AMX)
    if (!int8 && K % 32 == 0 && amx_ready()) {
        SHARE_COLUMNS(threads, blocks, amx_columns(x, x_stride, wp, pairs, bias, out, N, M, b0, b1));
        return 0;
    }
#endif
    SHARE_COLUMNS(threads, blocks, linear_columns(x, x_stride, wp, pairs, pairs, scale, bias, out, 0, 0, N, M, b0, b1,
                                                  int8 ? LIN_INT8 : LIN_BF16));
    return 0;
}

static inline void transpose16(__m512i r[16]) { /* 16 vectors of 16 32-bit values: rows become columns */
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Pairs 16 c .. 16 c + 15 of keys 0..15 (D values each, D apart; zeros from key m) as 16 vectors of
   16 keys, a column of the linear kernel's K layout each. */
static inline __attribute__((always_inline)) void keys_transposed(const uint16_t *k, int64_t m, int64_t D,
                                                                  int64_t c, __m512i t[16]) {
    for (int i = 0; i < 16; i++) t[i] = i < m ? _mm512_loadu_si512(k + i * D + 32 * c) : _mm512_setzero_si512();
    transpose16(t);
}

/* Two rows' 32 values a and b as pairs (a_d, b_d) in the linear kernel's input order: d = 0..15 into
   lo, 16..31 into hi. */
static const uint16_t PAIRS_LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static inline __attribute__((always_inline)) void rows_paired(__m512i a, __m512i b, __m512i *lo, __m512i *hi) {
    __m512i at = _mm512_loadu_si512(PAIRS_LO);
    *lo = _mm512_permutex2var_epi16(a, at, b);
    *hi = _mm512_permutex2var_epi16(a, _mm512_add_epi16(at, _mm512_set1_epi16(16)), b);
}

/* Keys and values 0..n-1 (D values each, D apart) packed as the linear kernel's weights, zeros past n:
   K as kblocks blocks of 16 columns (keys) by D inputs (16 keys x 16 pairs at a time by a transpose,
   a last part of D % 32 one by one); V as D / 16 blocks of 16 columns (values) by 2 kpairs inputs
   (keys), kpairs = (n + 1) / 2, the lower key of a pair first (a pair's two rows interleaved). */
static void pack_kv(const uint16_t *k, const uint16_t *v, int64_t D, int64_t n, int64_t kblocks, int64_t kpairs,
                    uint16_t *kp, uint16_t *vp) {
    int64_t dp = D / 2;
    uint32_t *kp32 = (uint32_t *)kp;
    for (int64_t b = 0; b < kblocks; b++) {
        int64_t m = n - 16 * b, p = 0; /* the block's keys below n */
        for (; p + 16 <= dp; p += 16) {
            __m512i t[16];
            keys_transposed(k + 16 * b * D, m, D, p / 16, t);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(kp32 + (b * dp + p + i) * 16, t[i]);
        }
        for (; p < dp; p++)
            for (int64_t i = 0; i < 16; i++) {
                uint32_t two = 0;
                if (i < m) memcpy(&two, k + (16 * b + i) * D + 2 * p, sizeof two);
                kp32[(b * dp + p) * 16 + i] = two;
            }
    }
    for (int64_t p = 0; p < kpairs; p++) {
        const uint16_t *v0 = v + 2 * p * D, *v1 = v0 + D;
        int in1 = 2 * p + 1 < n;
        int64_t d = 0;
        for (; d + 32 <= D; d += 32) {
            __m512i a = _mm512_loadu_si512(v0 + d);
            __m512i b = in1 ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512(), lo, hi;
            rows_paired(a, b, &lo, &hi);
            _mm512_storeu_si512(vp + ((d / 16) * kpairs + p) * 32, lo);
            _mm512_storeu_si512(vp + ((d / 16 + 1) * kpairs + p) * 32, hi);
        }
        for (; d < D; d++) {
            vp[((d / 16) * kpairs + p) * 32 + (d % 16) * 2] = v0[d];
            vp[((d / 16) * kpairs + p) * 32 + (d % 16) * 2 + 1] = in1 ? v1[d] : 0;
        }
    }
}

static inline __mmask16 lanes_below(int64_t n) { /* the first n of 16 lanes (all past 16, none below 1) */
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* The softmax of ``rows`` rows of scores (row i at sc + i sl, sl a multiple of 16), row i over its first
   nk = base + i % per: max; exp; the sum in 16 lanes by key index from key 0, added in a fixed tree;
   the probabilities rounded to bf16 (as HF's eager attention does) into pb (row i at i sl), 0 past nk. */
static void softmax_rows(float *sc, int64_t rows, int64_t per, int64_t base, int64_t sl, uint16_t *pb) {
    for (int64_t r = 0; r < rows; r++) {
        float *s = sc + r * sl;
        uint16_t *pr = pb + r * sl;
        int64_t nk = base + r % per; /* the row's keys */
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
   prefilled in parts (``loop.Reused``) gets the bits of its prefill in one call.

   Work items: a KV head's G query heads for CAUSAL_BQ positions (G CAUSAL_BQ rows), the latest
   (longest) first, shared out among ``threads`` OpenMP threads. Returns -1 where built without
   avx512_bf16, for shapes it does not take (D % 16) or when out of memory; 0 for T = 0. */
#define CAUSAL_BQ 16

static void causal_item(const uint16_t *q, int64_t q_stride, const uint16_t *kp, const uint16_t *vp,
                        int64_t kpairs_all, int64_t start, int64_t T, int64_t H, int64_t G, int64_t D,
                        int64_t g, int64_t qb, float scale, uint16_t *out, uint16_t *qbuf, float *sc, uint16_t *pb) {
    int64_t lo = qb * CAUSAL_BQ, n = T - lo < CAUSAL_BQ ? T - lo : CAUSAL_BQ, rows = G * n;
    int64_t kend = start + lo + n, kblocks = (kend + 15) / 16, sl = kblocks * 16, kpairs = (kend + 1) / 2;
    for (int64_t h = 0; h < G; h++)
        for (int64_t t = 0; t < n; t++)
            memcpy(qbuf + (h * n + t) * D, q + (lo + t) * q_stride + (g * G + h) * D, D * sizeof *qbuf);
    linear_columns(qbuf, D, kp, D / 2, D / 2, 0, 0, 0, sc, scale, sl, rows, 0, kblocks, LIN_SCORES);
    softmax_rows(sc, rows, n, start + lo + 1, sl, pb);
    for (int64_t h = 0; h < G; h++)
        linear_columns(pb + h * n * sl, sl, vp, kpairs, kpairs_all, 0, 0, out + lo * H * D + (g * G + h) * D, 0, 0,
                       H * D, n, 0, D / 16, LIN_BF16);
}

/* The step's attention item (``attention_bf16``: row r, KV head g) in the prefill's arithmetic, reading
   the cache as it is (no packed copy, so its loads stream under the products): the scores of 16 keys
   at a time, their rows transposed in registers (16 pairs of values at a time) into the linear
   kernel's K layout and summed as its tiles sum (pair by pair from the first, one fp32 lane per key),
   times ``scale``; ``softmax_rows``; then P @ V as the tiles sum it (pair of keys by pair from the
   first, a pair's two value rows interleaved in registers), rounded once to bf16. With no window, a
   row's bits are those ``causal_bf16`` gives the same query and keys: where a prefill runs that kernel
   (``native.causal``), a step row is a prefill row.
   Heads in groups of up to STEP_HG, values in groups of 64 (STEP_NB blocks of 16), so the sums stay in
   registers. The keys STEP_AHEAD ahead, and a block's values while its scores run, are prefetched (a
   few percent from memory). Needs D % 32 == 0. ``scratch``: ``step_scratch`` floats.

   A token tree's row (``kmap``: ``key_map_fits``) reads the keys of its own path, which the pass wrote
   at the nodes' places, not at their positions: its keys from the 16-key block that holds the first
   mapped one are copied in order into the scratch (at most TREE_GATHER), and the products run over the
   cache's blocks, then over the copy's. Blocks of 16 keys and pairs of values fall as they fall for a
   chain, so the row's bits are its chain row's. */
#define HAVE_STEP 1
#define STEP_HG 4
#define STEP_NB 4
#define STEP_AHEAD 64 /* keys */
static int64_t step_scratch(int64_t G, int64_t D, int64_t L) { /* scores (fp32), probabilities (bf16), a copy */
    return G * (L + 16) + (G * (L + 16) + 1) / 2 + TREE_GATHER * D;
}

static inline __attribute__((always_inline)) void step_scores(const uint16_t *k, const uint16_t *v, int64_t n,
        int64_t D, const uint16_t *q, float scale, float *sc, int64_t sl, int gh) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        int64_t m = n - j0;
        for (int64_t i = j0 + STEP_AHEAD; i < j0 + STEP_AHEAD + 16 && i < n; i++) /* the keys ahead */
            for (int64_t c = 0; c < D; c += 32) _mm_prefetch((const char *)(k + i * D + c), _MM_HINT_T0);
        if (v) /* the block's values, for P @ V */
            for (int64_t i = j0; i < j0 + 16 && i < n; i++)
                for (int64_t c = 0; c < D; c += 32) _mm_prefetch((const char *)(v + i * D + c), _MM_HINT_T0);
        __m512 acc[STEP_HG];
        for (int h = 0; h < gh; h++) acc[h] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D / 32; c++) {
            __m512i t[16]; /* t[p]: pair 16 c + p of the 16 keys */
            keys_transposed(k + j0 * D, m, D, c, t);
            for (int p = 0; p < 16; p++)
                for (int h = 0; h < gh; h++) {
                    int32_t two;
                    memcpy(&two, q + h * D + 32 * c + 2 * p, sizeof two);
                    acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)_mm512_set1_epi32(two), (__m512bh)t[p]);
                }
        }
        for (int h = 0; h < gh; h++) _mm512_storeu_ps(sc + h * sl + j0, _mm512_mul_ps(acc[h], _mm512_set1_ps(scale)));
    }
}

static inline __attribute__((always_inline)) void step_values(const uint16_t *v, const uint16_t *v2, int64_t split,
        int64_t n, int64_t D, const uint16_t *pb, int64_t sl, uint16_t *out, int gh, int nb) {
    /* values 0..split-1 at v, the rest at v2 (split even: no pair straddles) */
    __m512 acc[STEP_HG][STEP_NB];
    for (int h = 0; h < gh; h++)
        for (int b = 0; b < nb; b++) acc[h][b] = _mm512_setzero_ps();
    for (int64_t p = 0; 2 * p < n; p++) {
        const uint16_t *v0 = 2 * p < split ? v + 2 * p * D : v2 + (2 * p - split) * D, *v1 = v0 + D;
        __m512i w[STEP_NB];
        for (int b = 0; b < nb; b += 2) {
            __m512i a = _mm512_loadu_si512(v0 + 16 * b);
            __m512i c = 2 * p + 1 < n ? _mm512_loadu_si512(v1 + 16 * b) : _mm512_setzero_si512();
            rows_paired(a, c, &w[b], &w[b + 1]);
        }
        for (int h = 0; h < gh; h++) {
            int32_t two;
            memcpy(&two, pb + h * sl + 2 * p, sizeof two);
            __m512bh pp = (__m512bh)_mm512_set1_epi32(two);
            for (int b = 0; b < nb; b++) acc[h][b] = _mm512_dpbf16_ps(acc[h][b], pp, (__m512bh)w[b]);
        }
    }
    for (int h = 0; h < gh; h++)
        for (int b = 0; b < nb; b++)
            _mm256_storeu_si256((__m256i *)(out + h * D + 16 * b), (__m256i)_mm512_cvtneps_pbh(acc[h][b]));
}

static void attention_step_bf16(const args_bf16 *a, int64_t r, int64_t g, float *scratch) {
    int64_t G = a->H / a->KV, D = a->D, L = a->L;
    int64_t end = a->pos[r] + 1, lo = a->window > 0 && end > a->window ? end - a->window : 0, n = end - lo;
    int64_t sl = (n + 15) / 16 * 16;
    float *sc = scratch;
    uint16_t *pb = (uint16_t *)(sc + G * (L + 16));
    const uint16_t *kb = a->k + a->slots[r] * a->slot_stride + g * a->head_stride;
    const uint16_t *vb = a->v + a->slots[r] * a->slot_stride + g * a->head_stride;
    const uint16_t *k = kb + lo * D, *v = vb + lo * D, *k2 = k, *v2 = v;
    int64_t split = n; /* keys 0..split-1 read where they are, the rest from k2, v2 */
    if (a->kmap && a->kstart[r] < end) {
        int64_t ks = a->kstart[r];
        uint16_t *kt = (uint16_t *)(sc + G * (L + 16) + (G * (L + 16) + 1) / 2), *vt = kt + TREE_GATHER * D;
        split = (ks > lo ? ks - lo : 0) / 16 * 16;
        for (int64_t j = split; j < n; j++) {
            int64_t p = lo + j, at = p < ks ? p : a->kmap[r * a->kmap_w + p - ks];
            memcpy(kt + (j - split) * D, kb + at * D, D * sizeof *kt);
            memcpy(vt + (j - split) * D, vb + at * D, D * sizeof *vt);
        }
        k2 = kt, v2 = vt;
    }
    const uint16_t *q = a->q + r * a->q_stride + g * G * D;
    uint16_t *out = a->out + r * a->H * D + g * G * D;
#define STEP_SCORES(GH)                                                                            \
    step_scores(k, h ? 0 : v, split, D, q + h * D, a->scale, sc + h * sl, sl, GH);                 \
    step_scores(k2, h ? 0 : v2, n - split, D, q + h * D, a->scale, sc + h * sl + split, sl, GH)
    for (int64_t h = 0; h < G; h += STEP_HG) {
        int gh = G - h < STEP_HG ? (int)(G - h) : STEP_HG;
        switch (gh) { /* a constant per case: the sums in registers */
            case 1: STEP_SCORES(1); break;
            case 2: STEP_SCORES(2); break;
            case 3: STEP_SCORES(3); break;
            default: STEP_SCORES(4); break;
        }
    }
    softmax_rows(sc, G, 1, n, sl, pb);
    for (int64_t h = 0; h < G; h += STEP_HG) {
        int gh = G - h < STEP_HG ? (int)(G - h) : STEP_HG;
        for (int64_t d = 0; d < D; d += 16 * STEP_NB) {
            int nb = D - d < 16 * STEP_NB ? 2 : STEP_NB; /* D % 32 == 0: 2 or 4 blocks */
            const uint16_t *vd = v + d, *vd2 = v2 + d, *ph = pb + h * sl;
            uint16_t *od = out + h * D + d;
            switch (gh * 8 + nb) {
                case 1 * 8 + 2: step_values(vd, vd2, split, n, D, ph, sl, od, 1, 2); break;
                case 2 * 8 + 2: step_values(vd, vd2, split, n, D, ph, sl, od, 2, 2); break;
                case 3 * 8 + 2: step_values(vd, vd2, split, n, D, ph, sl, od, 3, 2); break;
                case 4 * 8 + 2: step_values(vd, vd2, split, n, D, ph, sl, od, 4, 2); break;
                case 1 * 8 + 4: step_values(vd, vd2, split, n, D, ph, sl, od, 1, 4); break;
                case 2 * 8 + 4: step_values(vd, vd2, split, n, D, ph, sl, od, 2, 4); break;
                case 3 * 8 + 4: step_values(vd, vd2, split, n, D, ph, sl, od, 3, 4); break;
                default: step_values(vd, vd2, split, n, D, ph, sl, od, 4, 4); break;
            }
        }
    }
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
        pack_kv(k + g * head_stride, v + g * head_stride, D, end, kblocks, kpairs, packed + g * kp_n,
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
#elif defined(HAVE_SIMD)
/* The same products where the CPU has no bf16 dot product (AVX2 with FMA, AVX-512F without avx512_bf16,
   ARM64's NEON): the weights in the same packed layouts, widened in registers to fp32 (a bf16 is the top
   half of an fp32, an int8 or a nibble is an fp32 exactly), each output summed by fused multiply-adds,
   input by input from the first (a pair's even input, then its odd one), in one fp32 lane; the rows'
   inputs widened to fp32 once per call. A product of two bf16 values is exact in fp32, so each step
   rounds only the sum. Every output's sequence of operations is the same whatever the tile it falls in,
   the call's rows or the thread, so a row's outputs do not depend on the call: row-invariant by
   construction, as the avx512_bf16 tiles are (whose bits these are not: their products pair inputs
   inside ``vdpbf16ps``). The 4-bit and 8-bit blocks: each block's sum of q x alone, from 0, then
   acc = part d + acc and, for 4-bit, acc = xsum m + acc, the avx512_bf16 kernel's block order.

   Tiles of up to WIDE_MR rows x nb column blocks of 16 (WIDE_CV vectors each) keep their sums in
   registers: nb as wide as the registers allow for the call's rows (``wide_shape``), so a one-row step
   runs enough independent chains to hide the multiply-add's latency, and a prefill's tiles reuse each
   widened weight over their rows. The column blocks are shared out among the threads as above. */
#define HAVE_LINEAR 1
#define WIDE_CV (16 / W) /* vectors per block of 16 columns */
#if defined(__AVX512F__) || defined(__aarch64__)
#define WIDE_MR 4
#define WIDE_ACC 16 /* sums kept in registers (32 vector registers) */
#else
#define WIDE_MR 4
#define WIDE_ACC 8 /* (16 vector registers) */
#endif

/* A pair of inputs of W columns, widened: ``e`` the even input's weights, ``o`` the odd one's. The packed
   pair (``native.Linear._pack``) holds column j's two inputs at 2 j, 2 j + 1: bf16 (p: the W columns'
   2 W values), int8 (the same, a byte each), and 4-bit (p: a block pair's 16 bytes for 16 columns, byte j
   holding column j / 2's inputs in its low nibble and column 8 + j / 2's in its high one; ``c``: which
   W of the 16 columns). */
#if defined(__AVX512F__)
ALWAYS void widen_bf16(const uint16_t *p, vf *e, vf *o) {
    __m512i v = _mm512_loadu_si512(p);
    *e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *o = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
ALWAYS void widen_i8(const int8_t *p, vf *e, vf *o) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    *e = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
    *o = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
}
ALWAYS void widen_q4(const uint8_t *p, int c, vf *e, vf *o) {
    __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i v = _mm512_srlv_epi32(_mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1), /* columns 8..15: high */
                                  _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0));
    __m512i f = _mm512_set1_epi32(15);
    (void)c;
    *e = _mm512_cvtepi32_ps(_mm512_and_si512(v, f));
    *o = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8), f));
}
#elif defined(__aarch64__)
ALWAYS void widen_bf16(const uint16_t *p, vf *e, vf *o) {
    uint32x4_t v = vreinterpretq_u32_u16(vld1q_u16(p));
    *e = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
    *o = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xFFFF0000u)));
}
ALWAYS void widen_i8(const int8_t *p, vf *e, vf *o) {
    int16x8_t w = vmovl_s8(vld1_s8(p));
    *e = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vuzp1q_s16(w, w))));
    *o = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vuzp2q_s16(w, w))));
}
ALWAYS void widen_q4(const uint8_t *p, int c, vf *e, vf *o) {
    uint8x8_t b = vld1_u8(p + 8 * (c & 1));
    b = c >= 2 ? vshr_n_u8(b, 4) : vand_u8(b, vdup_n_u8(15));
    uint16x8_t w = vmovl_u8(b);
    *e = vcvtq_f32_u32(vmovl_u16(vget_low_u16(vuzp1q_u16(w, w))));
    *o = vcvtq_f32_u32(vmovl_u16(vget_low_u16(vuzp2q_u16(w, w))));
}
#else
ALWAYS void widen_bf16(const uint16_t *p, vf *e, vf *o) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *o = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
ALWAYS void widen_i8(const int8_t *p, vf *e, vf *o) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    *e = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
    *o = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
}
ALWAYS void widen_q4(const uint8_t *p, int c, vf *e, vf *o) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), f = _mm256_set1_epi32(15);
    if (c) v = _mm256_srli_epi32(v, 4);
    *e = _mm256_cvtepi32_ps(_mm256_and_si256(v, f));
    *o = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), f));
}
#endif

/* The pair's W column weights: kind 0 bf16, 1 int8 (``p``: the pair's 32 values for 16 columns). */
ALWAYS void widen_pair(const void *p, int kind, int c, vf *e, vf *o) {
    if (kind == 0) widen_bf16((const uint16_t *)p + 2 * W * c, e, o);
    else widen_i8((const int8_t *)p + 2 * W * c, e, o);
}

ALWAYS vf wide_out(vf s, const float *scale, const float *bias, int at) {
    if (scale) s = vmul(s, vload_f32(scale + at));
    return bias ? vadd(s, vload_f32(bias + at)) : s;
}

/* One tile of the bf16 or int8 product: mr rows (fp32, xs apart) x nb blocks of 16 columns (``stride`` pairs
   apart in wp), over ``pairs`` pairs of inputs. */
ALWAYS void wide_tile(const float *x, int64_t xs, const void *wp, int64_t pairs, int64_t stride, const float *scale,
                      const float *bias, uint16_t *out, int64_t os, int mr, int nb, int kind) {
    vf acc[WIDE_MR][4 * WIDE_CV];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nb * WIDE_CV; j++) acc[m][j] = vzero();
    int64_t bytes = kind == 0 ? 2 : 1;
    for (int64_t p = 0; p < pairs; p++) {
        vf e[4 * WIDE_CV], o[4 * WIDE_CV];
        if (mr <= 2) { /* each vector's weights widened as they are used: the rows' inputs stay in registers */
            for (int j = 0; j < nb * WIDE_CV; j++) {
                widen_pair((const char *)wp + ((j / WIDE_CV) * stride + p) * 32 * bytes, kind, j % WIDE_CV, e, o);
                for (int m = 0; m < mr; m++) {
                    acc[m][j] = vfma(vset1(x[m * xs + 2 * p]), e[0], acc[m][j]);
                    acc[m][j] = vfma(vset1(x[m * xs + 2 * p + 1]), o[0], acc[m][j]);
                }
            }
            continue;
        }
        /* more rows: the weights widened first, each row's two inputs then used at once (held across the
           columns, they would take the registers the sums need) */
        for (int j = 0; j < nb * WIDE_CV; j++)
            widen_pair((const char *)wp + ((j / WIDE_CV) * stride + p) * 32 * bytes, kind, j % WIDE_CV, e + j, o + j);
        for (int m = 0; m < mr; m++) {
            vf xe = vset1(x[m * xs + 2 * p]), xo = vset1(x[m * xs + 2 * p + 1]);
            for (int j = 0; j < nb * WIDE_CV; j++) acc[m][j] = vfma(xe, e[j], acc[m][j]);
            for (int j = 0; j < nb * WIDE_CV; j++) acc[m][j] = vfma(xo, o[j], acc[m][j]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nb * WIDE_CV; j++)
            vstore_bf16(out + m * os + W * j, vround_bf16(wide_out(acc[m][j], scale, bias, W * j)));
}

/* The tile shapes (rows, column blocks) whose sums (and, for blocks, their parts) fit the registers, and the
   rows a tile takes: ``wide_shape`` gives a call of M rows the widest such tile for its rows (so a one-row step
   runs enough chains to hide the multiply-add's latency), the remainders taking the narrower ones listed. */
#if WIDE_ACC / WIDE_CV >= 16
#define WIDE_SHAPES(C) C(1, 1) C(1, 2) C(1, 3) C(1, 4) C(2, 1) C(2, 2) C(2, 3) C(2, 4) \
    C(3, 1) C(3, 2) C(3, 3) C(3, 4) C(4, 1) C(4, 2) C(4, 3) C(4, 4)
#else /* 4 blocks of sums: AVX2 (2 vectors a block), NEON (4) */
#define WIDE_SHAPES(C) C(1, 1) C(1, 2) C(1, 3) C(1, 4) C(2, 1) C(2, 2) C(3, 1) C(4, 1)
#endif

static void wide_shape(int64_t M, int *mr, int *nb) {
    *mr = (int)(M < WIDE_MR ? M : WIDE_MR);
    int64_t n = WIDE_ACC / (WIDE_CV * *mr);
    *nb = n < 1 ? 1 : n > 4 ? 4 : (int)n;
}

#define WIDE_CASE(a, b) case a * 8 + b: WIDE_CALL(a, b); break;
/* Rows 0..M-1 (fp32, xs apart) against column blocks b0..b1-1 of ``kind`` 0 bf16 or 1 int8 weights (``pairs`` pairs
   a block; ``scale``: int8's, per column). */
static void wide_columns(const float *x, int64_t xs, const void *wp, int64_t K, const float *scale, const float *bias,
                         uint16_t *out, int64_t os, int64_t M, int64_t b0, int64_t b1, int kind) {
    int rows, width;
    wide_shape(M, &rows, &width);
    int64_t pairs = K / 2, chunk = row_chunk(K * (int64_t)sizeof(float), rows);
    for (int64_t c0 = 0; c0 < M; c0 += chunk)
    for (int64_t b = b0; b < b1; b += width) {
        int nb = b1 - b < width ? (int)(b1 - b) : width;
        for (int64_t m0 = c0; m0 < M && m0 < c0 + chunk; m0 += rows) {
            int mr = M - m0 < rows ? (int)(M - m0) : rows;
            if (m0 + mr > c0 + chunk) mr = (int)(c0 + chunk - m0);
            const float *xm = x + m0 * xs;
            uint16_t *om = out + m0 * os + b * 16;
            const float *bb = bias ? bias + b * 16 : 0;
            const char *wb = (const char *)wp + b * pairs * 32 * (kind == 0 ? 2 : 1);
            const float *sb = kind == 1 ? scale + b * 16 : 0;
            if (kind == 0) {
#define WIDE_CALL(a, c) wide_tile(xm, xs, wb, pairs, pairs, 0, bb, om, os, a, c, 0)
                switch (mr * 8 + nb) { WIDE_SHAPES(WIDE_CASE) }
#undef WIDE_CALL
            } else {
#define WIDE_CALL(a, c) wide_tile(xm, xs, wb, pairs, pairs, sb, bb, om, os, a, c, 1)
                switch (mr * 8 + nb) { WIDE_SHAPES(WIDE_CASE) }
#undef WIDE_CALL
            }
        }
    }
}

/* The call's rows in fp32 (M x K), in a buffer of the calling thread's, kept for its next calls (a step makes
   about 120 of them; the threads the call shares out to only read it). NULL: out of memory. */
static float *wide_rows(const uint16_t *x, int64_t xs, int64_t M, int64_t K) {
    static _Thread_local float *buf;
    static _Thread_local int64_t cap;
    if (M * K > cap) {
        free(buf);
        buf = malloc(M * K * sizeof *buf);
        cap = buf ? M * K : 0;
        if (!buf) return NULL;
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) buf[m * K + k] = bf16_to_f32(x[m * xs + k]);
    return buf;
}

/* ``kind``: 0 bf16, 1 int8 (``scale``: fp32 per column), 2 4-bit blocks, 3 8-bit blocks (``scale``: their fp16
   d (and m)), as ``fused_layer`` names them. */
static int64_t linear_run(const uint16_t *x, int64_t x_stride, const void *wp, int kind, const float *scale,
                          const float *bias, uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    if (kind >= 2) return qint_run(x, x_stride, wp, (const uint16_t *)scale, bias, out, M, K, N, threads, kind == 2 ? 4 : 8);
    if (N % 16 || K % 2) return -1;
    if (M <= 0) return 0; /* the probe's call: nothing to do */
    int64_t blocks = N / 16;
    const float *xf = wide_rows(x, x_stride, M, K);
    if (!xf) return -1;
    SHARE_COLUMNS(threads, blocks, wide_columns(xf, K, wp, K, scale, bias, out, N, M, b0, b1, kind));
    return 0;
}

/* No prefill attention on the linear's tiles here: a prefill runs the step's attention (``attention``), row
   by row (``attention.prefill_form``). */
int64_t causal_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t head_stride,
                    int64_t start, int64_t T, int64_t H, int64_t KV, int64_t D, float scale, uint16_t *out,
                    int64_t threads) {
    return -1;
}
#else
static int64_t linear_run(const uint16_t *x, int64_t x_stride, const void *wp, int kind, const float *scale,
                          const float *bias, uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    return -1; /* no vector instructions: the linears stay torch's */
}

int64_t linear_q4_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *nib, const uint16_t *dm, const float *bias,
                       uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    return -1;
}

int64_t linear_q8_bf16(const uint16_t *x, int64_t x_stride, const int8_t *q, const uint16_t *d, const float *bias,
                       uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    return -1;
}

int64_t causal_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t head_stride,
                    int64_t start, int64_t T, int64_t H, int64_t KV, int64_t D, float scale, uint16_t *out,
                    int64_t threads) {
    return -1;
}
#endif

/* The bf16 and int8 linears' entry points, whichever ``linear_run`` this build has. */
int64_t linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *wp, const float *bias, uint16_t *out,
                    int64_t M, int64_t K, int64_t N, int64_t threads) {
    return linear_run(x, x_stride, wp, 0, 0, bias, out, M, K, N, threads);
}

int64_t linear_int8_bf16(const uint16_t *x, int64_t x_stride, const int8_t *wp, const float *scale,
                         const float *bias, uint16_t *out, int64_t M, int64_t K, int64_t N, int64_t threads) {
    return linear_run(x, x_stride, wp, 1, scale, bias, out, M, K, N, threads);
}

#if defined(HAVE_SIMD)
#define FAST(NAME)                                                                                 \
    if (D % W == 0 && D / W <= MAXC && H / KV <= MAXG) item = attention_simd_##NAME, mapped = 1;
#else
#define FAST(NAME)
#endif
#if defined(HAVE_STEP)
#define FAST_bf16                                                                                  \
    FAST(bf16)                                                                                     \
    if (D % 32 == 0) item = attention_step_bf16, mapped = 1;
#else
#define FAST_bf16 FAST(bf16)
#endif
#define FAST_f32 FAST(f32)
ATTENTION_ENTRY(bf16)
ATTENTION_ENTRY(f32)

/* Whether a bf16 attention call of these heads reads a token tree's key map: its item is the step form or
   the SIMD one (the portable one reads no map). */
int64_t tree_keys_bf16(int64_t H, int64_t KV, int64_t D) {
    if (KV <= 0 || H % KV) return 0;
    void (*item)(const args_bf16 *, int64_t, int64_t, float *) = attention_any_bf16;
    int mapped = 0;
    FAST_bf16
    (void)item;
    return mapped;
}

/* The floats of scratch an ``attention`` call needs per thread, for G query heads per KV head, D values
   per head and L positions per slot: either item form's. */
int64_t attention_scratch(int64_t G, int64_t D, int64_t L) {
    int64_t simd = (2 * G + 1) * D + G * L + 16 + 2 * TREE_GATHER * D;
#if defined(HAVE_STEP)
    int64_t step = step_scratch(G, D, L);
    return step > simd ? step : simd;
#else
    return simd;
#endif
}

/* Which of the kernels' instruction sets the library was built for (``native.kernel_path``): the linears
   on avx512_bf16's tiles (``vdpbf16ps``), or widened to fp32 on AVX-512F, AVX2 with FMA or ARM64's NEON, or
   none of those (the portable attention; no linears). */
const char *kernel_path(void) {
#if defined(HAVE_AMX)
    return amx_ready() ? "amx" : "avx512_bf16";
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#elif defined(__aarch64__)
    return "neon";
#else
    return "portable";
#endif
}

/* Whether the library runs its kernels on OpenMP threads (``native.Linear`` is used only then, or on one
   thread: on one core it would lose to oneDNN's threads). */
int64_t built_with_openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

/* SiLU(gate) * up of rows of a gated MLP's fused projection, gu (rows, 2 I): gate is a row's first I
   values, up its last I; out (rows, I). Rounded as torch's two ops round: silu(g) = g / (1 + exp(-g))
   in fp32, rounded to the type, then the product rounded again. exp(-|g|) is ``softmax_exp``: for
   g < 0, g / (1 + exp(-g)) = g t / (1 + t) with t = exp(g). The compiler left this loop scalar, at
   about 7 ns a value, most of a 256-token prefill's time; where the SIMD block is compiled, W values
   at a time take the same operations in the same order (``vexp`` is ``softmax_exp``; a NaN gate
   gives NaN either way), so the bits do not change, and the scalar loop takes the rest of a row. */
#if defined(HAVE_SIMD)
static inline vf vsilu(vf x) { /* silu in fp32, before rounding: the scalar loop's operations */
    vf t = vexp(vselect_neg(x, x, vmul(x, vset1(-1.0f))));
    return vdiv(vselect_neg(x, vmul(x, t), x), vadd(vset1(1.0f), t));
}
#define SILU_SIMD_bf16(g, u, o, i)                                                                 \
    for (; i + W <= I; i += W) vstore_bf16(o + i, vround_bf16(vmul(vround_bf16(vsilu(vload_bf16(g + i))), vload_bf16(u + i))));
#define SILU_SIMD_f32(g, u, o, i) for (; i + W <= I; i += W) vstore(o + i, vmul(vsilu(vload_f32(g + i)), vload_f32(u + i)));
#else
#define SILU_SIMD_bf16(g, u, o, i)
#define SILU_SIMD_f32(g, u, o, i)
#endif
#define SILU_MUL(NAME, T, LOAD, STORE)                                                             \
    void silu_mul_##NAME(const T *gu, T *out, int64_t rows, int64_t I) {                           \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *g = gu + r * 2 * I, *u = g + I;                                               \
            T *o = out + r * I;                                                                    \
            int64_t i = 0;                                                                         \
            SILU_SIMD_##NAME(g, u, o, i)                                                           \
            for (; i < I; i++) {                                                                   \
                float x = LOAD(g[i]);                                                              \
                float t = softmax_exp(x < 0.0f ? x : -x);                                          \
                float s = STORE((x < 0.0f ? x * t : x) / (1.0f + t));                              \
                o[i] = STORE(LOAD(s) * LOAD(u[i]));                                                \
            }                                                                                      \
        }                                                                                          \
    }

SILU_MUL(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
SILU_MUL(f32, float, SAME, SAME)

/* One layer's weights for ``layers_bf16``: its norms' fp32 weights and eps, and its four projections in
   ``native.Linear``'s packed layout (qkv, o, gate_up, down), each with its kind and scales and its fp32
   bias (NULL: none), and its sliding window (0: none). */
typedef struct {
    const float *attn_norm, *mlp_norm;
    double attn_eps, mlp_eps;
    const void *w[4];
    const float *scale[4], *bias[4];
    int64_t window;
    int64_t kind[4]; /* each projection's weights: 0 bf16, 1 int8 (scale: fp32 per column), 2 4-bit blocks (scale:
                        their fp16 d and m, ``linear_q4_bf16``), 3 8-bit blocks (scale: their fp16 d,
                        ``linear_q8_bf16``) */
} fused_layer;

/* The rows' pass through a decoder's layers in one call, exactly as the per-op calls of ``decoder.Decoder``
   compute it (each op here is the kernel it calls: rms_norm, linear, rope, the cache write, attention,
   silu_mul, and the residual adds rounded as torch rounds a bf16 sum), so a row's bits are those of the
   per-op path, and as invariant to the call's rows. h (R, E) is the residual stream, updated in place;
   row r sits at position pos[r] of cache slot slots[r], and its K/V are written there. ``skip``: 2 n
   bytes (attention bits, then MLP bits; a set one leaves the sub-layer out), or NULL. cos and sin:
   the rotary tables, d values per position (sin signed), indexed by position. kc[i], vc[i]: layer i's
   cache buffers (slots_n slots slot_stride apart, KV heads head_stride apart, L positions of D).
   ``work``: R (2 E + 3 I + 3 (H + KV) D) bf16 values; ``scratch``: ``per`` floats a thread for the
   attention. A token tree's pass (``tree_pass.forward_tree``) writes row r's K/V at place wpos[r] of
   its slot rather than at pos[r], and reads its path's keys through a key map (``key_map_fits``: kstart,
   kmap, kmap_w); wpos NULL: at pos[r], and kmap NULL: no map. Returns 0, or -1 (a shape the kernels do
   not take, a row outside the cache, or a map the attention cannot read), before anything is computed. */
int64_t layers_bf16(const fused_layer *layers, int64_t n, const uint8_t *skip, uint16_t *h, int64_t R,
                    int64_t E, int64_t H, int64_t KV, int64_t D, int64_t I, const uint16_t *cos, const uint16_t *sin,
                    int64_t d, uint16_t *const *kc, uint16_t *const *vc, int64_t slots_n, int64_t slot_stride,
                    int64_t L, int64_t head_stride, const int64_t *slots, const int64_t *pos, float scale,
                    uint16_t *work, float *scratch, int64_t per, int64_t threads, const int64_t *wpos,
                    const int64_t *kstart, const int64_t *kmap, int64_t kmap_w) {
#if !defined(HAVE_LINEAR)
    return -1; /* no vector linears here: the layers run op by op */
#else
    int64_t QKVW = (H + 2 * KV) * D, QK = (H + KV) * D;
    if (R <= 0) return 0;
    if (KV <= 0 || H % KV || d % 2 || d > D || E % 2 || I % 2 || threads < 1) return -1;
    for (int64_t r = 0; r < R; r++)
        if (pos[r] < 0 || pos[r] >= L || slots[r] < 0 || slots[r] >= slots_n || (wpos && (wpos[r] < 0 || wpos[r] >= L)))
            return -1;
    if (kmap && (!tree_keys_bf16(H, KV, D) || !key_map_fits(kstart, kmap, kmap_w, pos, R, L))) return -1;
    uint16_t *x = work, *qkv = x + R * E, *qk = qkv + R * QKVW, *att = qk + R * QK, *y = att + R * H * D;
    uint16_t *gu = y + R * E, *act = gu + R * 2 * I;
    for (int64_t i = 0; i < n; i++) {
        const fused_layer *l = layers + i;
        if (!skip || !skip[i]) {
            rms_norm_bf16(h, l->attn_norm, x, R, E, (float)l->attn_eps);
            if (linear_run(x, E, l->w[0], (int)l->kind[0], l->scale[0], l->bias[0], qkv, R, E, QKVW, threads)) return -1;
            for (int64_t r = 0; r < R; r++) {
                rope_bf16(qkv + r * QKVW, QKVW, cos + pos[r] * d, sin + pos[r] * d, qk + r * QK, 1, H + KV, D, d);
                for (int64_t g = 0; g < KV; g++) {
                    int64_t at = slots[r] * slot_stride + g * head_stride + (wpos ? wpos[r] : pos[r]) * D;
                    memcpy(kc[i] + at, qk + r * QK + (H + g) * D, D * sizeof *h);
                    memcpy(vc[i] + at, qkv + r * QKVW + (H + KV + g) * D, D * sizeof *h);
                }
            }
            if (attention_run_bf16(qk, QK, kc[i], vc[i], slots_n, slot_stride, L, head_stride, slots, pos, att, R, H,
                                   KV, D, l->window, scale, scratch, per, threads, kstart, kmap, kmap_w)) return -1;
            if (linear_run(att, H * D, l->w[1], (int)l->kind[1], l->scale[1], l->bias[1], y, R, H * D, E, threads))
                return -1;
            for (int64_t j = 0; j < R * E; j++) h[j] = f32_to_bf16(bf16_to_f32(h[j]) + bf16_to_f32(y[j]));
        }
        if (!skip || !skip[n + i]) {
            rms_norm_bf16(h, l->mlp_norm, x, R, E, (float)l->mlp_eps);
            if (linear_run(x, E, l->w[2], (int)l->kind[2], l->scale[2], l->bias[2], gu, R, E, 2 * I, threads))
                return -1;
            silu_mul_bf16(gu, act, R, I);
            if (linear_run(act, I, l->w[3], (int)l->kind[3], l->scale[3], l->bias[3], y, R, I, E, threads)) return -1;
            for (int64_t j = 0; j < R * E; j++) h[j] = f32_to_bf16(bf16_to_f32(h[j]) + bf16_to_f32(y[j]));
        }
    }
    return 0;
#endif
}
