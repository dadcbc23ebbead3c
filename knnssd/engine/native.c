/* Small CPU kernels for the decode step (``native.py`` builds and loads them).

   Every kernel computes each row alone, with one fixed loop over its n values, so a row's result
   never depends on how many rows the call has: row-invariant by construction. */
#include <math.h>
#include <stdint.h>
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

/* Attention of R query rows over a static KV cache, each row alone: row r (query heads q + r *
   q_stride, each D values, heads D apart) at position pos[r] of cache slot slots[r] reads keys
   lo..pos[r] of that slot (lo = pos[r] - window + 1 for a sliding window, else 0) and nothing else:
   scores q.k * scale in fp32 (fixed lanes), softmax (max, exp, sum in fixed lanes), then the sum of
   p_j v_j over the keys in order, divided by the sum and rounded once to T. The G = H / KV query
   heads of KV head g (heads g G .. g G + G - 1) are computed together, each key and value read once
   for them. K and V share their layout: slot s, KV head g, position j at s * slot_stride + g *
   head_stride + j * D. A row's result depends on nothing but its own query, position and keys:
   invariant to the call's rows, their order and the cache's key length.
   ``scratch``: (2 G + 1) D + G (the most keys a row reads) floats. */
#define ATTENTION(NAME, T, LOAD, STORE)                                                            \
    static void NAME(const T *q, int64_t q_stride, const T *k, const T *v, int64_t slot_stride,            \
              int64_t head_stride, const int64_t *slots, const int64_t *pos, T *out, int64_t rows,  \
              int64_t H, int64_t KV, int64_t D, int64_t window, float scale, float *scratch) {     \
        int64_t G = H / KV, most = 0;                                                              \
        for (int64_t r = 0; r < rows; r++) most = pos[r] + 1 > most ? pos[r] + 1 : most;           \
        float *qf = scratch, *kf = qf + G * D, *o = kf + D, *p = o + G * D;                        \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            int64_t end = pos[r] + 1, lo = window > 0 && end > window ? end - window : 0;           \
            int64_t n = end - lo;                                                                  \
            for (int64_t g = 0; g < KV; g++) {                                                     \
                const T *kg = k + slots[r] * slot_stride + g * head_stride + lo * D;               \
                const T *vg = v + slots[r] * slot_stride + g * head_stride + lo * D;               \
                for (int64_t i = 0; i < G * D; i++) qf[i] = LOAD(q[r * q_stride + g * G * D + i]); \
                for (int64_t j = 0; j < n; j++) {                                                  \
                    for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kg[j * D + d]);                   \
                    for (int64_t h = 0; h < G; h++) {                                              \
                        const float *qh = qf + h * D;                                              \
                        float acc[LANES] = {0};                                                    \
                        int64_t d = 0;                                                             \
                        for (; d + LANES <= D; d += LANES)                                         \
                            for (int l = 0; l < LANES; l++) acc[l] += qh[d + l] * kf[d + l];       \
                        for (int l = 0; d < D; d++, l++) acc[l] += qh[d] * kf[d];                  \
                        p[h * most + j] = sum_lanes(acc) * scale;                                  \
                    }                                                                              \
                }                                                                                  \
                for (int64_t h = 0; h < G; h++) {                                                  \
                    float *ph = p + h * most, m = -INFINITY, sums[LANES] = {0};                    \
                    for (int64_t j = 0; j < n; j++) m = ph[j] > m ? ph[j] : m;                     \
                    int64_t j = 0;                                                                 \
                    for (; j + LANES <= n; j += LANES)                                             \
                        for (int l = 0; l < LANES; l++) {                                          \
                            ph[j + l] = softmax_exp(ph[j + l] - m);                                \
                            sums[l] += ph[j + l];                                                  \
                        }                                                                          \
                    for (int l = 0; j < n; j++, l++) {                                             \
                        ph[j] = softmax_exp(ph[j] - m);                                            \
                        sums[l] += ph[j];                                                          \
                    }                                                                              \
                    float inv = 1.0f / sum_lanes(sums);                                            \
                    for (j = 0; j < n; j++) ph[j] *= inv;                                          \
                }                                                                                  \
                for (int64_t i = 0; i < G * D; i++) o[i] = 0.0f;                                   \
                for (int64_t j = 0; j < n; j++) {                                                  \
                    for (int64_t d = 0; d < D; d++) kf[d] = LOAD(vg[j * D + d]);                   \
                    for (int64_t h = 0; h < G; h++) {                                              \
                        float pj = p[h * most + j];                                                \
                        for (int64_t d = 0; d < D; d++) o[h * D + d] += pj * kf[d];                \
                    }                                                                              \
                }                                                                                  \
                T *dst = out + r * H * D + g * G * D;                                              \
                for (int64_t i = 0; i < G * D; i++) dst[i] = STORE(o[i]);                          \
            }                                                                                      \
        }                                                                                          \
    }

ATTENTION(attention_any_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
ATTENTION(attention_any_f32, float, SAME, SAME)

#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 exp16(__m512 x) { /* softmax_exp on 16 lanes */
    __m512 c = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                                  _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(c, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), y);
}
#define MAXG 16
#define MAXC 16
/* The same attention with AVX-512 (where the compiler targets it, and D is a multiple of 16): a key's
   D values as D / 16 vectors, its G dot products by fused multiply-adds each summed by
   _mm512_reduce_add_ps; the softmax on 16 scores at a time (max, exp16, sums in 16 lanes); p_j v_j
   by fused multiply-adds into G D / 16 vectors. A fixed sequence of operations per row, so as
   row-invariant as the portable form, which it does not match bit for bit. ``scratch``: G (the most
   keys a row reads) + 16 floats. */
#define ATT512(NAME, T, LOADV, STORE) \
static void NAME(const T *q, int64_t q_stride, const T *k, const T *v, int64_t slot_stride, int64_t head_stride, \
                 const int64_t *slots, const int64_t *pos, T *out, int64_t rows, int64_t H, int64_t KV, int64_t D, \
                 int64_t window, float scale, float *scratch) { \
    int64_t G = H / KV, nc = D / 16, most = 0; \
    for (int64_t r = 0; r < rows; r++) most = pos[r] + 1 > most ? pos[r] + 1 : most; \
    float *p = scratch, *o = scratch + G * most; \
    for (int64_t r = 0; r < rows; r++) { \
        int64_t end = pos[r] + 1, lo = window > 0 && end > window ? end - window : 0, n = end - lo; \
        for (int64_t g = 0; g < KV; g++) { \
            const T *kg = k + slots[r] * slot_stride + g * head_stride + lo * D; \
            const T *vg = v + slots[r] * slot_stride + g * head_stride + lo * D; \
            const T *qg = q + r * q_stride + g * G * D; \
            __m512 qv[MAXG * MAXC], kv[MAXC]; \
            for (int64_t i = 0; i < G * nc; i++) qv[i] = LOADV(qg + 16 * i); \
            for (int64_t j = 0; j < n; j++) { \
                for (int64_t c = 0; c < nc; c++) kv[c] = LOADV(kg + j * D + 16 * c); \
                for (int64_t h = 0; h < G; h++) { \
                    __m512 acc = _mm512_mul_ps(qv[h * nc], kv[0]); \
                    for (int64_t c = 1; c < nc; c++) acc = _mm512_fmadd_ps(qv[h * nc + c], kv[c], acc); \
                    p[h * most + j] = _mm512_reduce_add_ps(acc) * scale; \
                } \
            } \
            for (int64_t h = 0; h < G; h++) { \
                float *ph = p + h * most; \
                __m512 mx = _mm512_set1_ps(-INFINITY), sums = _mm512_setzero_ps(); \
                for (int64_t j = 0; j < n; j += 16) { \
                    __mmask16 m = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1); \
                    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, ph + j)); \
                } \
                __m512 mb = _mm512_set1_ps(_mm512_reduce_max_ps(mx)); \
                for (int64_t j = 0; j < n; j += 16) { \
                    __mmask16 m = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1); \
                    __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, ph + j), mb)); \
                    _mm512_mask_storeu_ps(ph + j, m, e); \
                    sums = _mm512_mask_add_ps(sums, m, sums, e); \
                } \
                __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sums)); \
                for (int64_t j = 0; j < n; j += 16) { \
                    __mmask16 m = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1); \
                    _mm512_mask_storeu_ps(ph + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ph + j), inv)); \
                } \
            } \
            __m512 ov[MAXG * MAXC]; \
            for (int64_t i = 0; i < G * nc; i++) ov[i] = _mm512_setzero_ps(); \
            for (int64_t j = 0; j < n; j++) { \
                for (int64_t c = 0; c < nc; c++) kv[c] = LOADV(vg + j * D + 16 * c); \
                for (int64_t h = 0; h < G; h++) { \
                    __m512 pj = _mm512_set1_ps(p[h * most + j]); \
                    for (int64_t c = 0; c < nc; c++) ov[h * nc + c] = _mm512_fmadd_ps(pj, kv[c], ov[h * nc + c]); \
                } \
            } \
            T *dst = out + r * H * D + g * G * D; \
            for (int64_t i = 0; i < G * nc; i++) { \
                _mm512_storeu_ps(o, ov[i]); \
                for (int l = 0; l < 16; l++) dst[16 * i + l] = STORE(o[l]); \
            } \
        } \
    } \
}
ATT512(attention_512_bf16, uint16_t, load16_bf16, f32_to_bf16)
ATT512(attention_512_f32, float, load16_f32, SAME)
#endif

/* Exported: the AVX-512 form where it is compiled and the shapes suit it, else the portable one (one
   choice per model, never per call). The cache holds ``slots_n`` slots of L positions; a row outside
   them returns -1 before anything is computed. ``scratch``: (2 G + 1) D + G L + 16 floats. */
#define ATTENTION_ENTRY(NAME, T)                                                                   \
    int64_t attention_##NAME(const T *q, int64_t q_stride, const T *k, const T *v, int64_t slots_n,  \
                             int64_t slot_stride, int64_t L, int64_t head_stride, const int64_t *slots, \
                             const int64_t *pos, T *out, int64_t rows, int64_t H, int64_t KV,       \
                             int64_t D, int64_t window, float scale, float *scratch) {              \
        if (KV <= 0 || H % KV) return -1;                                                          \
        for (int64_t r = 0; r < rows; r++)                                                         \
            if (pos[r] < 0 || pos[r] >= L || slots[r] < 0 || slots[r] >= slots_n) return -1;        \
        FAST_##NAME                                                                                \
        attention_any_##NAME(q, q_stride, k, v, slot_stride, head_stride, slots, pos, out, rows, H, \
                             KV, D, window, scale, scratch);                                       \
        return 0;                                                                                  \
    }

#if defined(__AVX512F__)
#define FAST(NAME)                                                                                 \
    if (D % 16 == 0 && D / 16 <= MAXC && H / KV <= MAXG) {                                         \
        attention_512_##NAME(q, q_stride, k, v, slot_stride, head_stride, slots, pos, out, rows, H, \
                             KV, D, window, scale, scratch);                                       \
        return 0;                                                                                  \
    }
#else
#define FAST(NAME)
#endif
#define FAST_bf16 FAST(bf16)
#define FAST_f32 FAST(f32)
ATTENTION_ENTRY(bf16, uint16_t)
ATTENTION_ENTRY(f32, float)
