/* The CPU kernels of the w8a16 and w8a8 modes (AVX-512 VNNI): an int8 linear for decode and
 * prefill, and decode attention.
 *
 * y[m, n] = wscale[n] * rscale[m] * sum_k q[n, k] * (hi[m, k] + lo[m, k] / 254)   (lo: w8a16 only)
 *
 * Weights: int8, one scale per output channel (as the int8 mode), stored + 128 as uint8 and
 * packed as [n/32][k/4][32][4], so one 64-byte load holds 4 consecutive inputs of 16 output
 * channels (vpdpbusd's operand shape) and a block of 32 channels is one sequential stream. A
 * tile runs up to 8 digit rows over a block: 16 accumulators and 2 weight vectors in registers,
 * the activations as vpdpbusd's embedded 4-byte broadcast. At 8 digit rows the tile still keeps
 * about pace with memory (8 sequences of one digit cost ~1.2-1.4x one); 8 sequences of two
 * digits (16 rows) are compute-bound.
 * Activations: each row is quantized on its own (never a scale shared by a batch) into one or two
 * digits ("passes"): hi is round(x / s) with s = max|x| / 127, lo is round((x / s - hi) * 254),
 * so a row of two digits carries ~15 bits
 * (finer than bf16's 8-bit mantissa for the values that matter to a dot product). Sums are int32
 * and exact: a row's output is bit-identical whatever its batch-mates and however the rows are
 * tiled. The +128 offset of the weights is taken out with each digit row's sum.
 *
 * Built once by local_backend/llama/native.py (cc -O3 -fopenmp -mavx512f -mavx512bw -mavx512vl
 * -mavx512vnni) and called through ctypes, which releases the GIL. With threads > 1 the work is
 * split across OpenMP threads: libgomp.so.1 is the runtime torch itself loads, so both share one
 * pool. Each output element is computed by one thread with the same code, so the bits do not
 * depend on the thread count either.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define LO_STEP 254.0f /* the second digit's step is 1/254 of the first's */
#define BLOCK 32       /* output channels per packed block: two 16-lane vectors */
#define MAX_ROWS 8     /* digit rows per tile: 16 accumulators + 2 weight vectors in zmm */

int q8_abi_version(void) { return 4; }

/* w [n, k] int8 -> out [np/32][kp/4][32][4] uint8 (w + 128; padding holds 128, i.e. a zero weight). */
void q8_pack(const int8_t *w, int64_t n, int64_t k, int64_t np, int64_t kp, uint8_t *out) {
    for (int64_t nb = 0; nb < np / BLOCK; nb++)
        for (int64_t k4 = 0; k4 < kp / 4; k4++)
            for (int64_t j = 0; j < BLOCK; j++)
                for (int64_t b = 0; b < 4; b++) {
                    int64_t row = nb * BLOCK + j, col = k4 * 4 + b;
                    int v = (row < n && col < k) ? w[row * k + col] : 0;
                    out[((nb * (kp / 4) + k4) * BLOCK + j) * 4 + b] = (uint8_t)(v + 128);
                }
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

/* e^x for x <= 0 (attention scores minus their maximum, -|x| for SiLU): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, degree-6
 * Taylor polynomial (relative error ~2e-7, as expf). */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}


/* silu(g) * u for 16 values: g * sigmoid(g), sigmoid from e^-|g| (never overflows). */
static inline __m512 silu_mul(__m512 g, __m512 u) {
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    sig = _mm512_mask_mul_ps(sig, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), sig, e); /* g < 0: e / (1 + e) */
    return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

/* One row: optional RMSNorm (weight g, eps) or gated SiLU (the row is [gate | up], 2k wide:
 * silu(gate) * up), then the int8 digits (hi, lo, kp wide, zero padded), their sums and the row
 * scale. x is read, never written. */
static void quantize_row(const float *x, int64_t k, int64_t kp, const float *g, float eps, int glu, float *tmp,
                         int passes, int8_t *hi, int8_t *lo, int32_t *sums, float *scale) {
    const float *src = x;
    if (glu) {
        for (int64_t j = 0; j < k; j += 16) {
            __mmask16 mk = tail_mask(k - j);
            _mm512_mask_storeu_ps(tmp + j, mk, silu_mul(_mm512_maskz_loadu_ps(mk, x + j), _mm512_maskz_loadu_ps(mk, x + k + j)));
        }
        src = tmp;
    } else if (g) {
        __m512 ss = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j += 16) {
            __m512 v = _mm512_maskz_loadu_ps(tail_mask(k - j), x + j);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        float r = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)k + eps);
        for (int64_t j = 0; j < k; j += 16) {
            __mmask16 mk = tail_mask(k - j);
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, x + j), _mm512_set1_ps(r)), _mm512_maskz_loadu_ps(mk, g + j));
            _mm512_mask_storeu_ps(tmp + j, mk, v);
        }
        src = tmp;
    }
    __m512 amax = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask(k - j), src + j)));
    float s = _mm512_reduce_max_ps(amax) / 127.0f;
    if (s < 1e-30f) s = 1e-30f;
    *scale = s;
    const __m512 inv = _mm512_set1_ps(1.0f / s), step = _mm512_set1_ps(LO_STEP);
    __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
    for (int64_t j = 0; j < kp; j += 16) {
        __mmask16 mk = tail_mask(k - j < 0 ? 0 : k - j), mp = tail_mask(kp - j);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, src + j), inv);
        __m512 h = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i hi32 = _mm512_cvtps_epi32(h);
        sh = _mm512_add_epi32(sh, hi32);
        _mm_mask_storeu_epi8(hi + j, mp, _mm512_cvtepi32_epi8(hi32));
        if (passes == 2) {
            __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, h), step), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i lo32 = _mm512_cvtps_epi32(l);
            sl = _mm512_add_epi32(sl, lo32);
            _mm_mask_storeu_epi8(lo + j, mp, _mm512_cvtepi32_epi8(lo32));
        }
    }
    sums[0] = _mm512_reduce_add_epi32(sh);
    if (passes == 2) sums[1] = _mm512_reduce_add_epi32(sl);
}

/* Two 16-channel vectors of one block x R digit rows; int32 sums to out [R][32]. Unrolled by
 * hand (GCC keeps arrays of vector accumulators on the stack); the activation bytes are
 * vpdpbusd's {1to16} memory operand, so no broadcast occupies a register or a shuffle port. */
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

/* y[m, :n] (= or +=) x[m, :k] @ W.T for the packed W. Prologue: norm != NULL applies RMSNorm
 * with weight norm and eps to each row first; glu != 0 reads rows of 2k values [gate | up] and
 * uses silu(gate) * up. passes: 1 (hi digit only) or 2. Returns 0, or -1 when out of memory. */
int q8_linear(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int64_t n, int64_t np,
              const uint8_t *wp, const float *wscale, const float *norm, float eps, int glu, int passes,
              float *y, int64_t ldy, int accumulate, int threads) {
    const int64_t erows = m * passes;
    int8_t *digits = (int8_t *)aligned_alloc(64, (size_t)((erows * kp + 63) / 64 * 64));
    int32_t *dsum = (int32_t *)malloc((size_t)erows * sizeof(int32_t));
    float *rscale = (float *)malloc((size_t)m * sizeof(float));
    float *tmp = (norm || glu) ? (float *)malloc((size_t)k * sizeof(float)) : NULL;
    if (!digits || !dsum || !rscale || ((norm || glu) && !tmp)) {
        free(digits); free(dsum); free(rscale); free(tmp);
        return -1;
    }
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * ldx, k, kp, norm, eps, glu, tmp, passes, digits + r * passes * kp,
                     digits + (r * passes + 1) * kp, dsum + r * passes, rscale + r);
    const __m512 inv_step = _mm512_set1_ps(1.0f / LO_STEP);
    /* Blocks of output channels split across threads (torch's OpenMP pool: the same libgomp). */
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t nb = 0; nb < np / BLOCK; nb++) {
        int32_t sums[MAX_ROWS * BLOCK] __attribute__((aligned(64)));
        const uint8_t *wblock = wp + nb * kp * BLOCK;
        /* Row chunks inside the block loop: the block's weights come from memory once, then cache. */
        for (int64_t e0 = 0; e0 < erows;) {
            int64_t left = erows - e0;
            int rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (rows == 8) tile_8(digits + e0 * kp, kp, wblock, sums);
            else if (rows == 4) tile_4(digits + e0 * kp, kp, wblock, sums);
            else if (rows == 2) tile_2(digits + e0 * kp, kp, wblock, sums);
            else tile_1(digits + e0 * kp, kp, wblock, sums);
            for (int t = 0; t < BLOCK / 16; t++) {
                int64_t n0 = nb * BLOCK + t * 16;
                if (n0 >= n) break;
                __mmask16 mk = tail_mask(n - n0);
                __m512 ws = _mm512_maskz_loadu_ps(mk, wscale + n0);
                for (int e = 0; e < rows; e += passes) {
                    int64_t row = (e0 + e) / passes;
                    /* sum (q + 128) * d = sum q * d + 128 * sum d */
                    __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(
                        _mm512_load_si512((const void *)(sums + e * BLOCK + t * 16)), _mm512_set1_epi32(dsum[e0 + e] * 128)));
                    if (passes == 2) {
                        __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(
                            _mm512_load_si512((const void *)(sums + (e + 1) * BLOCK + t * 16)), _mm512_set1_epi32(dsum[e0 + e + 1] * 128)));
                        v = _mm512_fmadd_ps(lo, inv_step, v);
                    }
                    v = _mm512_mul_ps(_mm512_mul_ps(v, ws), _mm512_set1_ps(rscale[row]));
                    float *dst = y + row * ldy + n0;
                    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, dst));
                    _mm512_mask_storeu_ps(dst, mk, v);
                }
            }
            e0 += rows;
        }
    }
    free(digits); free(dsum); free(rscale); free(tmp);
    return 0;
}

/* ---- decode attention: RoPE, the K/V write and attention over each row's own length ---- */

/* x * cos + rotate_half(x) * sin for one head of hd values (sin carries rotate_half's sign). */
static void rope_head(const float *x, const float *cos, const float *sin, int64_t hd, float *out) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < hd; i++) out[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
}

/* For each of b rows (cache rows 0..b-1), with qkv [b, (nh + 2 nkv) * hd] (Q already scaled by
 * 1/sqrt(hd)) and the row's write position pos[r]: RoPE on Q and K, K and V written at pos[r],
 * then softmax(Q K^T) V over positions 0..pos[r] into out [b, nh * hd]. keys/values are one
 * layer's [slots, nkv, cap, hd]. hd must be a multiple of 16 and at most 256. Returns 0, or -1
 * when out of memory or hd is unsupported. */
int q8_attend(const float *qkv, int64_t ldqkv, int64_t b, int64_t nh, int64_t nkv, int64_t hd, const int64_t *pos,
              const float *cos, const float *sin, float *keys, float *values, int64_t cap, float *out, int64_t ldout,
              int threads) {
    if (hd % 16 || hd > 256 || nh % nkv) return -1;
    const int64_t group = nh / nkv, chunks = hd / 16;
    int64_t width_max = 0;
    for (int64_t r = 0; r < b; r++) width_max = pos[r] + 1 > width_max ? pos[r] + 1 : width_max;
    const int64_t per_row = (width_max + 15) / 16 * 16 + nh * hd; /* scores, then the roped Q */
    float *scratch = (float *)malloc((size_t)(b * per_row) * sizeof(float));
    if (!scratch) return -1;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && b > 1) schedule(static)
    for (int64_t r = 0; r < b; r++) {
        float *scores = scratch + r * per_row, *q = scores + (width_max + 15) / 16 * 16;
        const int64_t p = pos[r], width = p + 1;
        const float *row = qkv + r * ldqkv, *c = cos + p * hd, *s = sin + p * hd;
        for (int64_t h = 0; h < nh; h++) rope_head(row + h * hd, c, s, hd, q + h * hd);
        for (int64_t kv = 0; kv < nkv; kv++) {
            float *kbase = keys + ((r * nkv + kv) * cap) * hd, *vbase = values + ((r * nkv + kv) * cap) * hd;
            rope_head(row + (nh + kv) * hd, c, s, hd, kbase + p * hd);
            for (int64_t i = 0; i < hd; i++) vbase[p * hd + i] = row[(nh + nkv + kv) * hd + i];
            for (int64_t g = 0; g < group; g++) {
                const float *qh = q + (kv * group + g) * hd;
                __m512 qv[16];
                for (int64_t ch = 0; ch < chunks; ch++) qv[ch] = _mm512_loadu_ps(qh + ch * 16);
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int64_t j = 0; j < width; j++) {
                    const float *kj = kbase + j * hd;
                    __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kj));
                    for (int64_t ch = 1; ch < chunks; ch++) acc = _mm512_fmadd_ps(qv[ch], _mm512_loadu_ps(kj + ch * 16), acc);
                    scores[j] = _mm512_reduce_add_ps(acc);
                }
                for (int64_t j = 0; j < width; j += 16) mx = _mm512_mask_max_ps(mx, tail_mask(width - j), mx, _mm512_loadu_ps(scores + j));
                const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
                __m512 total = _mm512_setzero_ps();
                for (int64_t j = 0; j < width; j += 16) {
                    __mmask16 mk = tail_mask(width - j);
                    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, scores + j), m));
                    e = _mm512_maskz_mov_ps(mk, e);
                    total = _mm512_add_ps(total, e);
                    _mm512_mask_storeu_ps(scores + j, mk, e);
                }
                const float inv = 1.0f / _mm512_reduce_add_ps(total);
                __m512 acc[16];
                for (int64_t ch = 0; ch < chunks; ch++) acc[ch] = _mm512_setzero_ps();
                for (int64_t j = 0; j < width; j++) {
                    const __m512 pj = _mm512_set1_ps(scores[j]);
                    const float *vj = vbase + j * hd;
                    for (int64_t ch = 0; ch < chunks; ch++) acc[ch] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + ch * 16), acc[ch]);
                }
                float *o = out + r * ldout + (kv * group + g) * hd;
                for (int64_t ch = 0; ch < chunks; ch++) _mm512_storeu_ps(o + ch * 16, _mm512_mul_ps(acc[ch], _mm512_set1_ps(inv)));
            }
        }
    }
    free(scratch);
    return 0;
}
