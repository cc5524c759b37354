/* The CPU kernels of the w8a16 and w8a8 modes: an int8 linear for decode and prefill, and attention
 * (decode and prefill). One source, built once per instruction set by local_backend/llama/native.py:
 *
 *   -DQ8_AVX512  AVX-512 F/BW/VL + VNNI: vpdpbusd, u8 x s8 -> s32, 64 products an instruction
 *   -DQ8_AVX2    AVX2 + FMA: vpmaddwd on int16, 16 products an instruction
 *
 * Both give the same bits: every float operation is written out once over a 16-lane vector type
 * (vf: one zmm, or two ymm), sums of int8 x int16 products are exact integers, horizontal sums use
 * one fixed tree (reduce_add), and the build uses -ffp-contract=off so no a * b + c is fused behind
 * our back. So a model answers the same on an AVX2 server as on an AVX-512 one, and the AVX2 path is
 * tested bit for bit against the VNNI one wherever both run.
 *
 * y[m, n] = wscale[n] * rscale[m] * sum_k q[n, k] * a[m, k]
 *
 * Weights: int8, one scale per output channel. Activations: each row quantized on its own (never a
 * scale shared by a batch) into a = round(x / s), with s = max|x| / 127 (one digit: w8a8) or
 * s = max|x| / 32639 (two digits: w8a16, ~16 bits). The sums are exact (int32, widened to int64 where
 * they could overflow) and rounded to fp32 once, so a row's output is bit-identical whatever its
 * batch-mates, however rows are tiled and whatever the thread count (each output element is computed
 * by one thread with the same code).
 *
 * AVX-512 VNNI carries a two-digit value as hi * 256 + lo (hi in -127..127, lo in -128..127), two
 * int8 rows that vpdpbusd multiplies with the weights stored + 128 as uint8 (the offset is taken out
 * with each digit row's sum); packed [n/32][k/4][32][4], so one 64-byte load holds 4 inputs of 16
 * channels and a block of 32 channels is one sequential stream. A tile runs up to 8 digit rows over a
 * block with the activation bytes as vpdpbusd's {1to16} memory operand.
 * AVX2 multiplies the int16 value directly (vpmaddwd: one multiply where the digits need two) with
 * signed int8 weights widened on the fly, packed [n/8][k/4][8][4]; a tile runs up to 4 rows over a
 * block of 8 channels, and the int32 lanes are widened (to doubles, exact for these integers) every
 * 1,024 inputs, before they can overflow.
 *
 * Attention (q8_attend): RoPE on Q and K, the K/V write, then softmax(Q K^T) V over positions 0..pos
 * of the row's own cache slot, one query row at a time in a fixed order. Prefill (many rows of one
 * slot) and decode (one row per slot) run the same code, so a token's K/V and output are the same
 * bits whichever pass computed them: a prefix cached from an earlier request, even from its answer,
 * continues exactly as a cold prompt would.
 *
 * ctypes releases the GIL for each call. With threads > 1 the work is split across OpenMP threads:
 * libgomp.so.1 is the runtime torch itself loads, so both share one pool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(Q8_AVX512) && !defined(Q8_AVX2)
#error "build with -DQ8_AVX512 or -DQ8_AVX2"
#endif

#define ABI_VERSION 5
#define Q1_MAX 127      /* one digit: |a| <= 127 */
#define Q2_MAX 32639    /* two digits: hi * 256 + lo with hi <= 127, lo <= 127 */

int q8_abi_version(void) { return ABI_VERSION; }

#ifdef Q8_AVX512
const char *q8_isa(void) { return "avx512_vnni"; }
#else
const char *q8_isa(void) { return "avx2"; }
#endif

/* ---- 16 fp32 lanes ------------------------------------------------------------------------------ */

#ifdef Q8_AVX512
typedef __m512 vf;
static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_loadn(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
static inline vf vf_loadn_or(const float *p, int64_t n, float fill) { return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), lanes(n), p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_keepn(vf v, int64_t n) { return _mm512_maskz_mov_ps(lanes(n), v); }
static inline void vf_storen(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   /* a * b + c, one rounding */
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b, one rounding */
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* lanes where x < 0 take a, the others b */
static inline vf vf_where_neg(vf x, vf a, vf b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), b, a); }
/* 2^n for integral n in -126..127 (exact) */
static inline vf vf_pow2(vf n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline __m256 vf_low8(vf v) { return _mm512_castps512_ps256(v); }
static inline __m256 vf_high8(vf v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#else
typedef struct { __m256 lo, hi; } vf; /* lanes 0-7, 8-15 */
static inline __m256i lanes8(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int32_t c = n >= 8 ? 8 : n <= 0 ? 0 : (int32_t)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), idx);
}
static inline vf mk(__m256 lo, __m256 hi) { vf r; r.lo = lo; r.hi = hi; return r; }
static inline vf vf_zero(void) { return mk(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float x) { return mk(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline vf vf_load(const float *p) { return mk(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline vf vf_loadn(const float *p, int64_t n) {
    return mk(_mm256_maskload_ps(p, lanes8(n)), _mm256_maskload_ps(p + 8, lanes8(n - 8)));
}
static inline vf vf_loadn_or(const float *p, int64_t n, float fill) {
    __m256i m0 = lanes8(n), m1 = lanes8(n - 8);
    __m256 f = _mm256_set1_ps(fill);
    return mk(_mm256_blendv_ps(f, _mm256_maskload_ps(p, m0), _mm256_castsi256_ps(m0)),
              _mm256_blendv_ps(f, _mm256_maskload_ps(p + 8, m1), _mm256_castsi256_ps(m1)));
}
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline vf vf_keepn(vf v, int64_t n) {
    return mk(_mm256_and_ps(v.lo, _mm256_castsi256_ps(lanes8(n))), _mm256_and_ps(v.hi, _mm256_castsi256_ps(lanes8(n - 8))));
}
static inline void vf_storen(float *p, vf v, int64_t n) { _mm256_maskstore_ps(p, lanes8(n), v.lo); _mm256_maskstore_ps(p + 8, lanes8(n - 8), v.hi); }
static inline vf vf_add(vf a, vf b) { return mk(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline vf vf_sub(vf a, vf b) { return mk(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline vf vf_mul(vf a, vf b) { return mk(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline vf vf_div(vf a, vf b) { return mk(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return mk(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return mk(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)); }
static inline vf vf_max(vf a, vf b) { return mk(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline vf vf_abs(vf a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return mk(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m));
}
static inline vf vf_round(vf a) {
    return mk(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf vf_where_neg(vf x, vf a, vf b) {
    const __m256 z = _mm256_setzero_ps();
    return mk(_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, z, _CMP_LT_OQ)), _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, z, _CMP_LT_OQ)));
}
static inline __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vf_pow2(vf n) { return mk(pow2_8(n.lo), pow2_8(n.hi)); }
static inline __m256 vf_low8(vf v) { return v.lo; }
static inline __m256 vf_high8(vf v) { return v.hi; }
#endif

/* The sum of 16 lanes in one fixed tree: (l + l+8), then (l + l+4), (l + l+2), (l + l+1). */
static inline float vf_reduce_add(vf v) {
    __m256 a = _mm256_add_ps(vf_low8(v), vf_high8(v));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

/* 16 sums at once, each by vf_reduce_add's tree (the same pairs at each level, so the same bits):
 * out[j] = reduce_add(a[j]). A transpose interleaved with the adds: ~2 operations a sum, not ~8. */
static inline void vf_reduce_add16(const vf *a, float *out) {
#ifdef Q8_AVX512
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* lanes l + l+8: [key 2i | key 2i+1], 8 lanes each */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* l + l+4: 128-bit lane k holds key 4i + k */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* l + l+2: lane k holds keys 8i + k (elements 0, 1) and 8i + 4 + k (2, 3) */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* l + l+1: element e of lane k holds key k + 4e */
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s));
#else
    __m256 b[16], c[8], d[4];
    for (int i = 0; i < 16; i++) b[i] = _mm256_add_ps(a[i].lo, a[i].hi); /* l + l+8 */
    for (int i = 0; i < 8; i++) /* l + l+4: 128-bit lane k holds key 2i + k */
        c[i] = _mm256_add_ps(_mm256_permute2f128_ps(b[2 * i], b[2 * i + 1], 0x20), _mm256_permute2f128_ps(b[2 * i], b[2 * i + 1], 0x31));
    for (int i = 0; i < 4; i++) /* l + l+2: lane k holds keys 4i + k (elements 0, 1) and 4i + 2 + k (2, 3) */
        d[i] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < 2; i++) { /* l + l+1: element e of lane k holds key 8i + k + 2e */
        __m256 s = _mm256_add_ps(_mm256_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
        _mm256_storeu_ps(out + 8 * i, _mm256_permutevar8x32_ps(s, order));
    }
#endif
}

/* max is exact whatever the order */
static inline float vf_reduce_max(vf v) {
    __m256 a = _mm256_max_ps(vf_low8(v), vf_high8(v));
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_max_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_max_ss(c, _mm_movehdup_ps(c)));
}

/* e^x for x <= 0 (attention scores minus their maximum, -|x| for SiLU): 2^n * p(r), x = n ln2 + r,
 * |r| <= ln2 / 2, degree-6 Taylor polynomial (relative error ~2e-7, as expf). */
static inline vf exp_nonpositive(vf x) {
    x = vf_max(x, vf_set1(-87.0f));
    vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693145751953125f), x);
    r = vf_fnmadd(n, vf_set1(1.428606765330187045e-06f), r);
    vf p = vf_set1(1.0f / 720.0f);
    p = vf_fmadd(p, r, vf_set1(1.0f / 120.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 24.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 6.0f));
    p = vf_fmadd(p, r, vf_set1(0.5f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    return vf_mul(p, vf_pow2(n));
}

/* silu(g) * u for 16 values: g * sigmoid(g), sigmoid from e^-|g| (never overflows). */
static inline vf silu_mul(vf g, vf u) {
    vf e = exp_nonpositive(vf_sub(vf_zero(), vf_abs(g)));
    vf sig = vf_div(vf_set1(1.0f), vf_add(vf_set1(1.0f), e));
    sig = vf_where_neg(g, vf_mul(sig, e), sig); /* g < 0: e / (1 + e) */
    return vf_mul(vf_mul(g, sig), u);
}

/* ---- activation rows ---------------------------------------------------------------------------- */

/* One row's prologue: RMSNorm (weight g, eps), or gated SiLU (the row is [gate | up], 2k wide:
 * silu(gate) * up), or nothing. Returns the k values to quantize (x itself, or tmp). */
static const float *prologue(const float *x, int64_t k, const float *g, float eps, int glu, float *tmp) {
    if (glu) {
        for (int64_t j = 0; j < k; j += 16) vf_storen(tmp + j, silu_mul(vf_loadn(x + j, k - j), vf_loadn(x + k + j, k - j)), k - j);
        return tmp;
    }
    if (g) {
        vf ss = vf_zero();
        for (int64_t j = 0; j < k; j += 16) {
            vf v = vf_loadn(x + j, k - j);
            ss = vf_fmadd(v, v, ss);
        }
        const float r = 1.0f / sqrtf(vf_reduce_add(ss) / (float)k + eps);
        for (int64_t j = 0; j < k; j += 16)
            vf_storen(tmp + j, vf_mul(vf_mul(vf_loadn(x + j, k - j), vf_set1(r)), vf_loadn(g + j, k - j)), k - j);
        return tmp;
    }
    return x;
}

/* The row's scale s (qmax = 127 or 32639) and 1 / s. */
static float row_scale(const float *src, int64_t k, int32_t qmax, float *inv) {
    vf amax = vf_zero();
    for (int64_t j = 0; j < k; j += 16) amax = vf_max(amax, vf_abs(vf_loadn(src + j, k - j)));
    float s = vf_reduce_max(amax) / (float)qmax;
    if (s < 1e-30f) s = 1e-30f;
    *inv = 1.0f / s;
    return s;
}

#ifdef Q8_AVX512
/* 16 values -> round(v * inv) as int32, clamped to +-qmax */
static inline __m512i quantize16(vf v, float inv, int32_t qmax) {
    __m512i q = _mm512_cvtps_epi32(vf_round(vf_mul(v, vf_set1(inv))));
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(qmax)), _mm512_set1_epi32(-qmax));
}

/* Digit rows of one activation row (kp wide, zero padded): one (a) or two (hi, lo); their sums. */
static void quantize_row(const float *src, int64_t k, int64_t kp, int digits, int8_t *hi, int8_t *lo, int32_t *sums, float *scale) {
    float inv;
    const int32_t qmax = digits == 2 ? Q2_MAX : Q1_MAX;
    *scale = row_scale(src, k, qmax, &inv);
    __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
    for (int64_t j = 0; j < kp; j += 16) {
        __mmask16 mp = lanes(kp - j);
        __m512i q = quantize16(vf_loadn(src + j, k - j), inv, qmax);
        if (digits == 2) {
            __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8); /* floor((q + 128) / 256) */
            __m512i l = _mm512_sub_epi32(q, _mm512_slli_epi32(h, 8));
            sh = _mm512_add_epi32(sh, h);
            sl = _mm512_add_epi32(sl, l);
            _mm_mask_storeu_epi8(hi + j, mp, _mm512_cvtepi32_epi8(h));
            _mm_mask_storeu_epi8(lo + j, mp, _mm512_cvtepi32_epi8(l));
        } else {
            sh = _mm512_add_epi32(sh, q);
            _mm_mask_storeu_epi8(hi + j, mp, _mm512_cvtepi32_epi8(q));
        }
    }
    sums[0] = _mm512_reduce_add_epi32(sh);
    if (digits == 2) sums[1] = _mm512_reduce_add_epi32(sl);
}
#else
/* The row as int16 values round(v * inv), clamped to +-qmax (kp wide, zero padded). */
static void quantize_row16(const float *src, int64_t k, int64_t kp, int digits, int16_t *a, float *scale) {
    float inv;
    const int32_t qmax = digits == 2 ? Q2_MAX : Q1_MAX;
    *scale = row_scale(src, k, qmax, &inv);
    const __m256i hi = _mm256_set1_epi32(qmax), lo = _mm256_set1_epi32(-qmax);
    for (int64_t j = 0; j < kp; j += 16) {
        vf v = vf_mul(vf_loadn(src + j, k - j), vf_set1(inv));
        __m256i q0 = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(vf_round(v).lo), hi), lo);
        __m256i q1 = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(vf_round(v).hi), hi), lo);
        /* packs interleaves 128-bit halves: put them back in order */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
        if (kp - j >= 16) {
            _mm256_storeu_si256((__m256i *)(a + j), p);
        } else {
            int16_t t[16];
            _mm256_storeu_si256((__m256i *)t, p);
            memcpy(a + j, t, (size_t)(kp - j) * sizeof(int16_t));
        }
    }
}
#endif

/* ---- packing ------------------------------------------------------------------------------------ */

#ifdef Q8_AVX512
#define BLOCK 32 /* output channels per packed block: two 16-lane vectors */
#define MAX_ROWS 8
#else
#define BLOCK 8 /* output channels per packed block: two 4-channel x 4-input int16 vectors */
#define MAX_ROWS 4
#endif

int64_t q8_block(void) { return BLOCK; }

/* w [n, k] int8 -> out [np/BLOCK][kp/4][BLOCK][4]: + 128 as uint8 (VNNI), as is (AVX2); padding is a zero weight. */
void q8_pack(const int8_t *w, int64_t n, int64_t k, int64_t np, int64_t kp, uint8_t *out) {
    for (int64_t nb = 0; nb < np / BLOCK; nb++)
        for (int64_t k4 = 0; k4 < kp / 4; k4++)
            for (int64_t j = 0; j < BLOCK; j++)
                for (int64_t b = 0; b < 4; b++) {
                    int64_t row = nb * BLOCK + j, col = k4 * 4 + b;
                    int v = (row < n && col < k) ? w[row * k + col] : 0;
#ifdef Q8_AVX512
                    out[((nb * (kp / 4) + k4) * BLOCK + j) * 4 + b] = (uint8_t)(v + 128);
#else
                    out[((nb * (kp / 4) + k4) * BLOCK + j) * 4 + b] = (uint8_t)(int8_t)v;
#endif
                }
}

/* ---- the int8 linear ---------------------------------------------------------------------------- */

#ifdef Q8_AVX512
/* Two 16-channel vectors of one block x R digit rows; int32 sums to out [R][32]. Unrolled by hand
 * (GCC keeps arrays of vector accumulators on the stack); the activation bytes are vpdpbusd's
 * {1to16} memory operand, so no broadcast occupies a register or a shuffle port. */
#define DPBUSD(acc, w, p) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(p)))
#define ACC(r) __m512i c0_##r = _mm512_setzero_si512(), c1_##r = c0_##r;
#define STEP(r) { const int8_t *ar = a + (r) * kp + k4 * 4; DPBUSD(c0_##r, w0, ar); DPBUSD(c1_##r, w1, ar); }
#define LOADS                                                                                      \
    const __m512i w0 = _mm512_loadu_si512((const void *)(wp + k4 * 128));                          \
    const __m512i w1 = _mm512_loadu_si512((const void *)(wp + k4 * 128 + 64));
#define STORE(r)                                                                                   \
    _mm512_storeu_si512((void *)(out + (r) * BLOCK), c0_##r);                                      \
    _mm512_storeu_si512((void *)(out + (r) * BLOCK + 16), c1_##r);
#define TILE(R, ACCS, STEPS, STORES)                                                               \
    static void tile_##R(const int8_t *a, int64_t kp, const uint8_t *wp, int32_t *out) {           \
        ACCS                                                                                       \
        for (int64_t k4 = 0; k4 < kp / 4; k4++) { LOADS STEPS }                                    \
        STORES                                                                                     \
    }
TILE(1, ACC(0), STEP(0), STORE(0))
TILE(2, ACC(0) ACC(1), STEP(0) STEP(1), STORE(0) STORE(1))
TILE(4, ACC(0) ACC(1) ACC(2) ACC(3), STEP(0) STEP(1) STEP(2) STEP(3), STORE(0) STORE(1) STORE(2) STORE(3))
TILE(8, ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7),
     STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7),
     STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7))

/* 16 exact sums -> fp32: hi * 256 + lo for two digits (exact in double, then rounded once). */
static inline __m512 sums_to_float(__m512i hi, const __m512i *lo) {
    if (!lo) return _mm512_cvtepi32_ps(hi);
    const __m512d k256 = _mm512_set1_pd(256.0);
    __m512d a = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(hi)), k256),
                              _mm512_cvtepi32_pd(_mm512_castsi512_si256(*lo)));
    __m512d b = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(hi, 1)), k256),
                              _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(*lo, 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(a))),
                                               _mm256_castps_pd(_mm512_cvtpd_ps(b)), 1));
}
#else
/* 8 channels (two int16 vectors of 4 channels x 4 inputs) x R rows; exact sums to out [R][8], as doubles
 * (integers below 2^53 are exact there, and AVX2 converts doubles, not int64, to floats). Each int32
 * lane gains at most 2 * 127 * 32639 per step: 256 steps fit, then it is widened. */
#define A_ACC(r) __m256i c0_##r = _mm256_setzero_si256(), c1_##r = c0_##r;
/* One row's step in asm: in C, GCC hoists every row's broadcast first and then spills an accumulator,
 * and the store-to-load round trip of that spill bounded the loop (measured: ~3x slower). */
#define A_STEP(r) {                                                                                 \
        __m256i t0, t1;                                                                             \
        __asm__("vpbroadcastq %[a], %[t0]\n\t"                                                      \
                "vpmaddwd %[w0], %[t0], %[t1]\n\t"                                                  \
                "vpaddd %[t1], %[c0], %[c0]\n\t"                                                    \
                "vpmaddwd %[w1], %[t0], %[t1]\n\t"                                                  \
                "vpaddd %[t1], %[c1], %[c1]"                                                        \
                : [c0] "+x"(c0_##r), [c1] "+x"(c1_##r), [t0] "=&x"(t0), [t1] "=&x"(t1)              \
                : [w0] "x"(w0), [w1] "x"(w1), [a] "m"(*(const int64_t *)(a + (r) * kp + k4 * 4))); }
#define A_LOADS                                                                                     \
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wp + k4 * 32)));      \
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wp + k4 * 32 + 16)));
#define A_FLUSH(r) { widen(c0_##r, out + (r) * BLOCK); widen(c1_##r, out + (r) * BLOCK + 4); }
#define A_TILE(R, ACCS, STEPS, FLUSHES)                                                             \
    static void tile_##R(const int16_t *a, int64_t kp, const uint8_t *wp, double *out) {            \
        for (int64_t i = 0; i < (R) * BLOCK; i++) out[i] = 0.0;                                      \
        for (int64_t c0 = 0; c0 < kp / 4; c0 += 256) {                                              \
            const int64_t c1 = c0 + 256 < kp / 4 ? c0 + 256 : kp / 4;                               \
            ACCS                                                                                    \
            for (int64_t k4 = c0; k4 < c1; k4++) { A_LOADS STEPS }                                  \
            FLUSHES                                                                                 \
        }                                                                                           \
    }
/* lanes (2c, 2c + 1) hold channel c's two halves: add them, widened (exactly), into out[c] */
static inline void widen(__m256i acc, double *out) {
    __m256d lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(acc)), hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256(acc, 1));
    __m256d pairs = _mm256_permute4x64_pd(_mm256_hadd_pd(lo, hi), 0xD8); /* hadd gives channels 0, 2, 1, 3 */
    _mm256_storeu_pd(out, _mm256_add_pd(_mm256_loadu_pd(out), pairs));
}
A_TILE(1, A_ACC(0), A_STEP(0), A_FLUSH(0))
A_TILE(2, A_ACC(0) A_ACC(1), A_STEP(0) A_STEP(1), A_FLUSH(0) A_FLUSH(1))
A_TILE(4, A_ACC(0) A_ACC(1) A_ACC(2) A_ACC(3), A_STEP(0) A_STEP(1) A_STEP(2) A_STEP(3),
       A_FLUSH(0) A_FLUSH(1) A_FLUSH(2) A_FLUSH(3))
#endif

/* y[m, :n] (= or +=) x[m, :k] @ W.T for the packed W. Prologue: norm != NULL applies RMSNorm with
 * weight norm and eps to each row first; glu != 0 reads rows of 2k values [gate | up] and uses
 * silu(gate) * up. digits: 1 or 2. Returns 0, or -1 when out of memory. */
int q8_linear(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int64_t n, int64_t np,
              const uint8_t *wp, const float *wscale, const float *norm, float eps, int glu, int digits,
              float *y, int64_t ldy, int accumulate, int threads) {
    float *rscale = (float *)malloc((size_t)m * sizeof(float));
    float *tmp = (norm || glu) ? (float *)malloc((size_t)(k + 16) * sizeof(float)) : NULL;
#ifdef Q8_AVX512
    const int64_t erows = m * digits; /* digit rows */
    int8_t *act = (int8_t *)aligned_alloc(64, (size_t)((erows * kp + 63) / 64 * 64));
    int32_t *dsum = (int32_t *)malloc((size_t)erows * sizeof(int32_t));
#else
    const int64_t erows = m;
    int16_t *act = (int16_t *)aligned_alloc(64, (size_t)((erows * kp * 2 + 63) / 64 * 64));
    int32_t *dsum = NULL;
#endif
    if (!act || !rscale || ((norm || glu) && !tmp)
#ifdef Q8_AVX512
        || !dsum
#endif
    ) {
        free(act); free(dsum); free(rscale); free(tmp);
        return -1;
    }
    for (int64_t r = 0; r < m; r++) {
        const float *src = prologue(x + r * ldx, k, norm, eps, glu, tmp);
#ifdef Q8_AVX512
        quantize_row(src, k, kp, digits, act + r * digits * kp, act + (r * digits + 1) * kp, dsum + r * digits, rscale + r);
#else
        quantize_row16(src, k, kp, digits, act + r * kp, rscale + r);
#endif
    }
    /* Blocks of output channels split across threads (torch's OpenMP pool: the same libgomp). */
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t nb = 0; nb < np / BLOCK; nb++) {
        const uint8_t *wblock = wp + nb * kp * BLOCK;
        /* Row chunks inside the block loop: the block's weights come from memory once, then cache. */
        for (int64_t e0 = 0; e0 < erows;) {
            int64_t left = erows - e0;
#ifdef Q8_AVX512
            int32_t sums[MAX_ROWS * BLOCK] __attribute__((aligned(64)));
            int rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (rows == 8) tile_8(act + e0 * kp, kp, wblock, sums);
            else if (rows == 4) tile_4(act + e0 * kp, kp, wblock, sums);
            else if (rows == 2) tile_2(act + e0 * kp, kp, wblock, sums);
            else tile_1(act + e0 * kp, kp, wblock, sums);
            for (int t = 0; t < BLOCK / 16; t++) {
                int64_t n0 = nb * BLOCK + t * 16;
                if (n0 >= n) break;
                __mmask16 mk = lanes(n - n0);
                __m512 ws = _mm512_maskz_loadu_ps(mk, wscale + n0);
                for (int e = 0; e < rows; e += digits) {
                    int64_t row = (e0 + e) / digits;
                    /* sum (q + 128) * d = sum q * d + 128 * sum d */
                    __m512i hi = _mm512_sub_epi32(_mm512_load_si512((const void *)(sums + e * BLOCK + t * 16)), _mm512_set1_epi32(dsum[e0 + e] * 128));
                    __m512i lo;
                    if (digits == 2)
                        lo = _mm512_sub_epi32(_mm512_load_si512((const void *)(sums + (e + 1) * BLOCK + t * 16)), _mm512_set1_epi32(dsum[e0 + e + 1] * 128));
                    __m512 v = _mm512_mul_ps(_mm512_mul_ps(sums_to_float(hi, digits == 2 ? &lo : NULL), ws), _mm512_set1_ps(rscale[row]));
                    float *dst = y + row * ldy + n0;
                    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, dst));
                    _mm512_mask_storeu_ps(dst, mk, v);
                }
            }
#else
            double sums[MAX_ROWS * BLOCK];
            int rows = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (rows == 4) tile_4(act + e0 * kp, kp, wblock, sums);
            else if (rows == 2) tile_2(act + e0 * kp, kp, wblock, sums);
            else tile_1(act + e0 * kp, kp, wblock, sums);
            const int64_t n0 = nb * BLOCK, live = n - n0 < BLOCK ? n - n0 : BLOCK;
            const __m256 ws = _mm256_maskload_ps(wscale + n0, lanes8(live));
            for (int e = 0; e < rows; e++) {
                const int64_t row = e0 + e;
                float *dst = y + row * ldy + n0;
                /* the exact sum rounded once, then x channel scale x row scale, as the VNNI lanes */
                __m256 v = _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(sums + e * BLOCK + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(sums + e * BLOCK)));
                v = _mm256_mul_ps(_mm256_mul_ps(v, ws), _mm256_set1_ps(rscale[row]));
                if (accumulate) v = _mm256_add_ps(v, _mm256_maskload_ps(dst, lanes8(live)));
                _mm256_maskstore_ps(dst, lanes8(live), v);
            }
#endif
            e0 += rows;
        }
    }
    free(act); free(dsum); free(rscale); free(tmp);
    return 0;
}

/* ---- attention: RoPE, the K/V write and softmax(Q K^T) V per row ------------------------------- */

/* x * cos + rotate_half(x) * sin for one head of hd values (sin carries rotate_half's sign). */
static void rope_head(const float *x, const float *cos, const float *sin, int64_t hd, float *rot, float *out) {
    const int64_t half = hd / 2;
    memcpy(rot, x + half, (size_t)half * sizeof(float));
    memcpy(rot + half, x, (size_t)half * sizeof(float));
    for (int64_t i = 0; i < hd; i += 16)
        vf_store(out + i, vf_fmadd(vf_load(x + i), vf_load(cos + i), vf_mul(vf_load(rot + i), vf_load(sin + i))));
}

#define MAX_GROUP 4 /* query heads attended together over one pass of their K/V head */

/* Query heads q[0..g-1] (g <= MAX_GROUP, hd apart) sharing one K/V head: over positions 0..width-1 of
 * one slot's keys/values, out[h * hd..] = softmax(q_h K^T) V. Each key and value is read once for the
 * g heads; each head's arithmetic is the same operations in the same order as for a row of any pass
 * (scores: one fma chain over the head's 16-lane chunks, then the fixed tree; softmax sums per lane
 * over 16-key chunks, then the tree; the weighted values one fma per key, in key order).
 * scores: room for g x width rounded up to 16. */
static inline __attribute__((always_inline)) void attend_group_n(const float *q, int64_t g, const float *kbase, const float *vbase,
                                                                int64_t width, int64_t hd, float *scores, float *out, const int64_t chunks) {
    const int64_t stride = (width + 15) / 16 * 16;
    int64_t j0 = 0;
    for (; j0 + 16 <= width; j0 += 16) /* 16 keys at a time: independent chains, then one transposed reduce */
        for (int64_t h = 0; h < g; h++) {
            const float *qh = q + h * hd;
            vf acc[16];
            for (int64_t j = 0; j < 16; j++) {
                const float *kj = kbase + (j0 + j) * hd;
                acc[j] = vf_mul(vf_load(qh), vf_load(kj));
                for (int64_t ch = 1; ch < chunks; ch++) acc[j] = vf_fmadd(vf_load(qh + ch * 16), vf_load(kj + ch * 16), acc[j]);
            }
            vf_reduce_add16(acc, scores + h * stride + j0);
        }
    for (int64_t j = j0; j < width; j++) {
        const float *kj = kbase + j * hd;
        for (int64_t h = 0; h < g; h++) {
            const float *qh = q + h * hd;
            vf acc = vf_mul(vf_load(qh), vf_load(kj));
            for (int64_t ch = 1; ch < chunks; ch++) acc = vf_fmadd(vf_load(qh + ch * 16), vf_load(kj + ch * 16), acc);
            scores[h * stride + j] = vf_reduce_add(acc);
        }
    }
    vf inv[MAX_GROUP];
    for (int64_t h = 0; h < g; h++) {
        float *sc = scores + h * stride;
        vf mx = vf_set1(-INFINITY);
        for (int64_t j = 0; j < width; j += 16) mx = vf_max(mx, vf_loadn_or(sc + j, width - j, -INFINITY));
        const vf m = vf_set1(vf_reduce_max(mx));
        vf total = vf_zero();
        for (int64_t j = 0; j < width; j += 16) {
            /* lanes past the width load 0 - m and are cleared after the exp: they add nothing */
            vf e = vf_keepn(exp_nonpositive(vf_sub(vf_loadn(sc + j, width - j), m)), width - j);
            total = vf_add(total, e);
            vf_storen(sc + j, e, width - j);
        }
        inv[h] = vf_set1(1.0f / vf_reduce_add(total));
    }
    vf acc[MAX_GROUP][16];
    for (int64_t h = 0; h < g; h++)
        for (int64_t ch = 0; ch < chunks; ch++) acc[h][ch] = vf_zero();
    for (int64_t j = 0; j < width; j++) {
        const float *vj = vbase + j * hd;
        vf v[16];
        for (int64_t ch = 0; ch < chunks; ch++) v[ch] = vf_load(vj + ch * 16);
        for (int64_t h = 0; h < g; h++) {
            const vf pj = vf_set1(scores[h * stride + j]);
            for (int64_t ch = 0; ch < chunks; ch++) acc[h][ch] = vf_fmadd(pj, v[ch], acc[h][ch]);
        }
    }
    for (int64_t h = 0; h < g; h++)
        for (int64_t ch = 0; ch < chunks; ch++) vf_store(out + h * hd + ch * 16, vf_mul(acc[h][ch], inv[h]));
}

/* The same code with the head's chunk count a constant (hd 64 and 128: SmolLM2, Llama 3), so the
 * compiler keeps the chunk arrays in registers; any other hd takes the general one (same bits). */
static void attend_group(const float *q, int64_t g, const float *kbase, const float *vbase, int64_t width, int64_t hd,
                         float *scores, float *out) {
    switch (hd / 16) {
    case 4: attend_group_n(q, g, kbase, vbase, width, hd, scores, out, 4); break;
    case 8: attend_group_n(q, g, kbase, vbase, width, hd, scores, out, 8); break;
    default: attend_group_n(q, g, kbase, vbase, width, hd, scores, out, hd / 16); break;
    }
}

/* For each of b query rows, with qkv [b, (nh + 2 nkv) * hd] (Q already scaled by 1/sqrt(hd)), its
 * cache slot slot[r] and position pos[r]: RoPE on Q and K, K and V written at pos[r] of the slot,
 * then (once every row's K/V is written) softmax(Q K^T) V over positions 0..pos[r] into
 * out [b, nh * hd]. Decode: one row per slot. Prefill: rows of one slot at consecutive positions.
 * keys/values are one layer's [slots, nkv, cap, hd]. hd must be a multiple of 16 and at most 256.
 * Returns 0, or -1 when out of memory or hd is unsupported. */
int q8_attend(const float *qkv, int64_t ldqkv, int64_t b, int64_t nh, int64_t nkv, int64_t hd, const int64_t *slot,
              const int64_t *pos, const float *cos, const float *sin, float *keys, float *values, int64_t cap, float *out,
              int64_t ldout, int threads) {
    if (hd % 16 || hd > 256 || nh % nkv) return -1;
    const int64_t group = nh / nkv;
    int64_t width_max = 0;
    for (int64_t r = 0; r < b; r++) width_max = pos[r] + 1 > width_max ? pos[r] + 1 : width_max;
    float *qrot = (float *)malloc((size_t)(b * nh * hd) * sizeof(float));
    if (!qrot) return -1;
    int failed = 0;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && b > 1) schedule(static)
    for (int64_t r = 0; r < b; r++) {
        float rot[256];
        const int64_t p = pos[r];
        const float *row = qkv + r * ldqkv, *c = cos + p * hd, *s = sin + p * hd;
        for (int64_t h = 0; h < nh; h++) rope_head(row + h * hd, c, s, hd, rot, qrot + (r * nh + h) * hd);
        for (int64_t kv = 0; kv < nkv; kv++) {
            const int64_t at = ((slot[r] * nkv + kv) * cap + p) * hd;
            rope_head(row + (nh + kv) * hd, c, s, hd, rot, keys + at);
            memcpy(values + at, row + (nh + nkv + kv) * hd, (size_t)hd * sizeof(float));
        }
    }
    /* (row, kv head) pairs: decode's one row still splits over threads */
    #pragma omp parallel num_threads(threads) if (threads > 1 && b * nkv > 1)
    {
        float *scores = (float *)malloc((size_t)(MAX_GROUP * ((width_max + 15) / 16 * 16)) * sizeof(float));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < b * nkv; i++) {
            if (!scores) continue;
            const int64_t r = i / nkv, kv = i % nkv;
            const int64_t base = (slot[r] * nkv + kv) * cap * hd;
            for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP) {
                const int64_t h = kv * group + g0, g = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP;
                attend_group(qrot + (r * nh + h) * hd, g, keys + base, values + base, pos[r] + 1, hd, scores, out + r * ldout + h * hd);
            }
        }
        free(scores);
    }
    free(qrot);
    return failed ? -1 : 0;
}
