/* The native kernels' row-invariance on one instruction set, runnable where Python is not: built for a level
   (``-march=x86-64-v3``, ``-march=armv8-a`` ...) and run natively or under qemu-user (tests/test_native_isa.py).

   Every check computes rows in one call and the same rows alone (or another way that must give the same
   bits) and compares them bitwise: the linears (bf16, int8, 4-bit and 8-bit blocks), the attention (rows
   alone, and a token tree's row reading its path through a key map against its chain row), and whole
   layers in one call (a pass of R rows against R one-row steps, and a tree's pass against its chain's).
   It prints the kernel path, a digest of the bf16 and int8 linears' outputs (the wide paths of every instruction
   set must agree on it: their arithmetic is the same, column by column), one of the 4-bit and 8-bit blocks'
   (every path must agree on it, avx512_bf16's too), and "ok", or a line per failure
   and exits 1. */
#include "native.c"

#include <stdio.h>

static uint64_t state = 88172645463325252ull;
static uint32_t draw(void) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (uint32_t)(state >> 16);
}
static float uniform(void) { return (float)(draw() % 20001) / 10000.0f - 1.0f; } /* -1..1 */
static uint16_t bf16(float scale) { return f32_to_bf16(uniform() * scale); }
static uint16_t half_bits(float v) { /* a normal positive or negative fp16 value near v (|v| in [2^-10, 1)) */
    float a = fabsf(v) < 0.001f ? 0.001f : fabsf(v);
    int e = (int)floorf(log2f(a));
    int m = (int)((a / ldexpf(1.0f, e) - 1.0f) * 1024.0f);
    return (uint16_t)((v < 0 ? 0x8000 : 0) | ((e + 15) << 10) | (m & 1023));
}

static int failures;
static uint64_t digest = 1469598103934665603ull;
static void fold(const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) digest = (digest ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
}
#define FAIL(...) (failures++, printf("FAIL "), printf(__VA_ARGS__), printf("\n"))

#if defined(HAVE_LINEAR)
/* One linear of ``kind`` (0 bf16, 1 int8, 2 4-bit, 3 8-bit blocks): M rows in one call (on ``threads``), each row
   alone, and the rows strided, bitwise equal. */
static void check_linear(int kind, int64_t N, int64_t K, int64_t M, int threads) {
    int64_t kb = K / 32, bytes = kind == 0 ? 2 * N * K : kind == 2 ? N * K / 2 : N * K;
    uint8_t *w = malloc(bytes);
    for (int64_t i = 0; i < bytes; i++) w[i] = (uint8_t)draw();
    if (kind == 0)
        for (int64_t i = 0; i < N * K; i++) ((uint16_t *)w)[i] = bf16(0.1f);
    int64_t nscale = kind == 1 ? N : kind == 2 ? N * kb * 2 : N * kb;
    void *scale = malloc(nscale * 4);
    for (int64_t i = 0; i < nscale; i++) {
        if (kind == 1) ((float *)scale)[i] = 0.01f * (1.5f + uniform());
        else ((uint16_t *)scale)[i] = half_bits(kind == 2 && (i / 16) % 2 ? -0.05f * (1.2f + uniform()) : 0.01f * (1.5f + uniform()));
    }
    float *bias = malloc(N * sizeof *bias);
    for (int64_t i = 0; i < N; i++) bias[i] = uniform();
    int64_t xs = K + 48;
    uint16_t *x = malloc(M * xs * 2), *all = malloc(M * N * 2), *one = malloc(N * 2), *strided = malloc(M * N * 2);
    for (int64_t i = 0; i < M * xs; i++) x[i] = bf16(3.0f);
    uint16_t *xc = malloc(M * K * 2); /* the rows contiguous */
    for (int64_t m = 0; m < M; m++) memcpy(xc + m * K, x + m * xs, K * 2);
#define RUN(X, XS, OUT, ROWS, T) linear_run(X, XS, w, kind, scale, bias, OUT, ROWS, K, N, T)
    if (RUN(xc, K, all, M, threads)) FAIL("linear kind %d %ldx%ld: refused", kind, (long)N, (long)K);
    for (int64_t m = 0; m < M; m++) {
        RUN(xc + m * K, K, one, 1, 1);
        if (memcmp(one, all + m * N, N * 2)) FAIL("linear kind %d %ldx%ld: row %ld of %ld differs alone", kind, (long)N, (long)K, (long)m, (long)M);
    }
    RUN(x, xs, strided, M, threads);
    if (memcmp(strided, all, M * N * 2)) FAIL("linear kind %d: strided rows differ", kind);
    fold(all, M * N * 2);
    free(w), free(scale), free(bias), free(x), free(all), free(one), free(strided), free(xc);
}

#endif

/* Attention: R rows at positions start.. of slot 1 against each row alone; then a token tree's rows (the chain's
   tokens, their K/V written at other places of the slot and read through a key map) against the chain's rows. */
static void check_attention(int64_t H, int64_t KV, int64_t D, int64_t start, int64_t R, int64_t window, int threads) {
    int64_t L = 256, S = 2, slot_stride = KV * L * D, G = H / KV;
    uint16_t *k = malloc(S * slot_stride * 2), *v = malloc(S * slot_stride * 2), *q = malloc(R * H * D * 2);
    for (int64_t i = 0; i < S * slot_stride; i++) k[i] = bf16(1.0f), v[i] = bf16(1.0f);
    for (int64_t i = 0; i < R * H * D; i++) q[i] = bf16(1.0f);
    int64_t per = attention_scratch(G, D, L), slots[16], pos[16], kstart[16], kmap[16 * 16];
    float *scratch = malloc(per * threads * 4);
    uint16_t *all = malloc(R * H * D * 2), *one = malloc(H * D * 2), *tree = malloc(R * H * D * 2);
    for (int64_t r = 0; r < R; r++) slots[r] = 1, pos[r] = start + r;
    if (attention_run_bf16(q, H * D, k, v, S, slot_stride, L, L * D, slots, pos, all, R, H, KV, D, window, 0.125f,
                           scratch, per, threads, NULL, NULL, 0))
        FAIL("attention: refused");
    for (int64_t r = 0; r < R; r++) {
        attention_run_bf16(q + r * H * D, H * D, k, v, S, slot_stride, L, L * D, slots + r, pos + r, one, 1, H, KV, D,
                           window, 0.125f, scratch, per, 1, NULL, NULL, 0);
        if (memcmp(one, all + r * H * D, H * D * 2)) FAIL("attention: row %ld of %ld differs alone", (long)r, (long)R);
    }
    if (!tree_keys_bf16(H, KV, D)) return; /* the portable item reads no key map */
    int64_t far = start + R + 7; /* the tree's places: the chain's keys copied there */
    for (int64_t g = 0; g < KV; g++)
        for (int64_t r = 0; r < R; r++) {
            int64_t src = slot_stride + g * L * D + (start + r) * D, dst = slot_stride + g * L * D + (far + r) * D;
            memcpy(k + dst, k + src, D * 2), memcpy(v + dst, v + src, D * 2);
        }
    for (int64_t r = 0; r < R; r++) {
        kstart[r] = start;
        for (int64_t p = start; p <= pos[r]; p++) kmap[r * 16 + p - start] = far + p - start;
    }
    if (attention_run_bf16(q, H * D, k, v, S, slot_stride, L, L * D, slots, pos, tree, R, H, KV, D, window, 0.125f,
                           scratch, per, threads, kstart, kmap, 16))
        FAIL("attention: a tree's key map refused");
    else if (memcmp(tree, all, R * H * D * 2))
        FAIL("attention: a tree's rows differ from their chain's (start %ld)", (long)start);
    free(k), free(v), free(q), free(scratch), free(all), free(one), free(tree);
}

#if defined(HAVE_LINEAR)
/* Whole layers in one call (``layers_bf16``) over random weights of ``kind`` (0 bf16, 2 4-bit): R rows at
   positions start.. against R one-row calls in order, the hidden rows and the K/V written bitwise equal; then
   the same rows as a token tree (K/V written at other places and read through a key map). */
static void check_layers(int kind, int64_t R, int64_t start, int threads) {
    enum { NL = 2 };
    int64_t E = 64, H = 4, KV = 2, D = 32, I = 96, L = 128, d = D, S = 1, slot_stride = KV * L * D;
    int64_t outs[4] = {(H + 2 * KV) * D, E, 2 * I, E}, ins[4] = {E, H * D, E, I};
    fused_layer layers[NL];
    void *owned[NL * 12];
    int n_owned = 0;
    for (int i = 0; i < NL; i++) {
        float *an = malloc(E * 4), *mn = malloc(E * 4);
        for (int64_t j = 0; j < E; j++) an[j] = 1.0f + 0.1f * uniform(), mn[j] = 1.0f + 0.1f * uniform();
        layers[i].attn_norm = an, layers[i].mlp_norm = mn, layers[i].attn_eps = layers[i].mlp_eps = 1e-5;
        layers[i].window = 0;
        owned[n_owned++] = an, owned[n_owned++] = mn;
        for (int j = 0; j < 4; j++) {
            int64_t N = outs[j], K = ins[j], kb = K / 32;
            layers[i].kind[j] = kind;
            layers[i].bias[j] = NULL;
            if (kind == 0) {
                uint16_t *w = malloc(N * K * 2);
                for (int64_t t = 0; t < N * K; t++) w[t] = bf16(0.2f);
                layers[i].w[j] = w, layers[i].scale[j] = NULL, owned[n_owned++] = w;
            } else {
                uint8_t *w = malloc(N * K / 2);
                uint16_t *dm = malloc(N * kb * 2 * 2);
                for (int64_t t = 0; t < N * K / 2; t++) w[t] = (uint8_t)draw();
                for (int64_t t = 0; t < N * kb * 2; t++) dm[t] = half_bits((t / 16) % 2 ? -0.1f : 0.02f * (1.5f + uniform()));
                layers[i].w[j] = w, layers[i].scale[j] = (const float *)dm, owned[n_owned++] = w, owned[n_owned++] = dm;
            }
        }
    }
    uint16_t *cosv = malloc(L * d * 2), *sinv = malloc(L * d * 2);
    for (int64_t t = 0; t < L * d; t++) cosv[t] = bf16(1.0f), sinv[t] = bf16(1.0f);
    uint16_t *kc[3][NL], *vc[3][NL]; /* caches: the pass, the steps, the tree */
    uint16_t *base_k = malloc(slot_stride * 2), *base_v = malloc(slot_stride * 2);
    for (int64_t t = 0; t < slot_stride; t++) base_k[t] = bf16(1.0f), base_v[t] = bf16(1.0f);
    for (int c = 0; c < 3; c++)
        for (int i = 0; i < NL; i++) {
            kc[c][i] = malloc(slot_stride * 2), vc[c][i] = malloc(slot_stride * 2);
            memcpy(kc[c][i], base_k, slot_stride * 2), memcpy(vc[c][i], base_v, slot_stride * 2);
        }
    uint16_t *h0 = malloc(R * E * 2), *h[3];
    for (int64_t t = 0; t < R * E; t++) h0[t] = bf16(2.0f);
    for (int c = 0; c < 3; c++) h[c] = malloc(R * E * 2), memcpy(h[c], h0, R * E * 2);
    int64_t per = attention_scratch(H / KV, D, L), slots[16] = {0}, pos[16], wpos[16], kstart[16], kmap[16 * 16];
    float *scratch = malloc(per * threads * 4);
    uint16_t *work = malloc(R * (2 * E + 3 * I + 3 * (H + KV) * D) * 2);
    for (int64_t r = 0; r < R; r++) pos[r] = start + r, wpos[r] = start + R + 3 + r, kstart[r] = start;
    for (int64_t r = 0; r < R; r++)
        for (int64_t p = start; p <= pos[r]; p++) kmap[r * 16 + p - start] = start + R + 3 + p - start;
#define LAYERS(C, X, ROWS, POS, T, WPOS, KS, KM)                                                           \
    layers_bf16(layers, NL, NULL, X, ROWS, E, H, KV, D, I, cosv, sinv, d, kc[C], vc[C], S, slot_stride, L, L * D, \
                slots, POS, 0.17f, work, scratch, per, T, WPOS, KS, KM, 16)
    if (LAYERS(0, h[0], R, pos, threads, NULL, NULL, NULL)) FAIL("layers kind %d: refused", kind);
    for (int64_t r = 0; r < R; r++) LAYERS(1, h[1] + r * E, 1, pos + r, 1, NULL, NULL, NULL);
    if (memcmp(h[0], h[1], R * E * 2)) FAIL("layers kind %d: a pass of %ld rows differs from its steps", kind, (long)R);
    for (int i = 0; i < NL; i++)
        if (memcmp(kc[0][i], kc[1][i], slot_stride * 2) || memcmp(vc[0][i], vc[1][i], slot_stride * 2))
            FAIL("layers kind %d: the K/V a pass wrote differ from its steps'", kind);
    if (tree_keys_bf16(H, KV, D)) {
        if (LAYERS(2, h[2], R, pos, threads, wpos, kstart, kmap)) FAIL("layers kind %d: a tree refused", kind);
        else if (memcmp(h[2], h[0], R * E * 2)) FAIL("layers kind %d: a tree's rows differ from its chain's", kind);
    }
    fold(h[0], R * E * 2);
    for (int i = 0; i < n_owned; i++) free(owned[i]);
    for (int c = 0; c < 3; c++) {
        free(h[c]);
        for (int i = 0; i < NL; i++) free(kc[c][i]), free(vc[c][i]);
    }
    free(cosv), free(sinv), free(base_k), free(base_v), free(h0), free(scratch), free(work);
}

#endif

int main(void) {
    printf("path %s\n", kernel_path());
#if defined(HAVE_LINEAR)
    int64_t shapes[][2] = {{16, 32}, {48, 96}, {96, 576}, {80, 160}};
    for (int kind = 0; kind < 4; kind++) {
        for (int s = 0; s < 4; s++)
            for (int64_t M = 1; M <= 37; M += M < 13 ? 4 : 12) check_linear(kind, shapes[s][0], shapes[s][1], M, 2);
        if (kind == 1) { /* bf16 and int8 weights: the wide paths' bits (avx512_bf16's its own) */
            printf("linears %016llx\n", (unsigned long long)digest);
            digest = 1469598103934665603ull;
        }
    }
    printf("blocks %016llx\n", (unsigned long long)digest); /* 4-bit and 8-bit: every path's bits the same */
    check_layers(0, 5, 9, 2);
    check_layers(0, 1, 20, 2);
    check_layers(2, 6, 14, 2);
#endif
    check_attention(8, 2, 32, 0, 5, 0, 2);
    check_attention(9, 3, 64, 37, 7, 0, 2);
    check_attention(4, 4, 16, 100, 3, 0, 1);
    check_attention(8, 2, 32, 60, 4, 16, 2); /* a sliding window */
    if (failures) return 1;
    printf("ok\n");
    return 0;
}
