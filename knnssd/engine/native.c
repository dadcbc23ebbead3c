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
