/* CPU kernels of the quantization codec: fused quantize+pack and unpack+dequantize.
 *
 * Built once per machine by commsched.kernels.cpu (the system C compiler, -O3
 * -march=native -ffp-contract=off -fno-trapping-math), loaded with ctypes. Must equal
 * commsched.quant.reference bit for bit (quantize_reference, dequantize_reference):
 * every float operation below is one IEEE float32 operation in the order the spec
 * gives, and -ffp-contract=off forbids fused multiply-adds.
 *
 * Shape contract (checked by the Python launcher, not here):
 *   x       float32 [N, D], row stride x_rs (elements), unit column stride
 *   out     uint8   [N, B], B = ceil(D * bits / 8), row stride out_rs (bytes)
 *   meta    float32 [N, 2], contiguous: per row (scale, zero point = row minimum)
 *   y       float32 [N, D], row stride y_rs (elements), unit column stride
 * bits is 2, 4 or 8; K = 8 / bits slots per byte; planar packing: byte j of a row
 * holds columns j, j + B, j + 2B, ... in bit slots 0, bits, 2 * bits, ...
 *
 * No row depends on another, and one call handles any N and D: there is one kernel
 * for every width and shape.
 */
#include <math.h>
#include <stdint.h>

#define RANDOM_BITS 24
#define LANES 16

static inline uint32_t lowbias32(uint32_t h)
{
    h ^= h >> 16;
    h *= 0x7feb352dU;
    h ^= h >> 15;
    h *= 0x846ca68bU;
    h ^= h >> 16;
    return h;
}

/* Row minimum and maximum; NaN anywhere in the row makes both NaN (as torch.amin and
 * torch.amax do), so the caller's finite check on the metadata sees it. Sixteen
 * independent lanes so that the compiler vectorises the reduction. */
static void row_min_max(const float *xr, int64_t D, float *lo_out, float *hi_out)
{
    float lo[LANES], hi[LANES];
    int64_t d = 0;
    for (int k = 0; k < LANES; k++) {
        lo[k] = xr[0];
        hi[k] = xr[0];
    }
    for (; d + LANES <= D; d += LANES) {
        for (int k = 0; k < LANES; k++) {
            float v = xr[d + k];
            lo[k] = (v < lo[k] || v != v) ? v : lo[k];
            hi[k] = (v > hi[k] || v != v) ? v : hi[k];
        }
    }
    for (; d < D; d++) {
        float v = xr[d];
        lo[0] = (v < lo[0] || v != v) ? v : lo[0];
        hi[0] = (v > hi[0] || v != v) ? v : hi[0];
    }
    float l = lo[0], h = hi[0];
    for (int k = 1; k < LANES; k++) {
        l = (lo[k] < l || lo[k] != lo[k]) ? lo[k] : l;
        h = (hi[k] > h || hi[k] != hi[k]) ? hi[k] : h;
    }
    *lo_out = l;
    *hi_out = h;
}

/* Returns the number of rows whose metadata is not finite (0 on good input). */
int64_t cs_quantize(const float *x, int64_t N, int64_t D, int64_t x_rs, uint8_t *out,
                    int64_t out_rs, float *meta, int bits, uint32_t key, int64_t row0)
{
    const int K = 8 / bits;
    const int64_t B = (D * bits + 7) / 8;
    const int32_t L = (1 << bits) - 1;
    const float Lf = (float)L;
    const float range_min = 0x1p-100f;
    const float two24 = (float)(1 << RANDOM_BITS);
    int64_t bad = 0;
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * x_rs;
        uint8_t *o = out + n * out_rs;
        float lo, hi;
        row_min_max(xr, D, &lo, &hi);
        const float rng = hi - lo;
        float scale = 0.0f, inv = 0.0f;
        if (rng >= range_min) {
            scale = rng / Lf;
            inv = (1.0f / rng) * Lf;
        }
        meta[2 * n] = scale;
        meta[2 * n + 1] = lo;
        if (!isfinite(scale) || !isfinite(lo) || !isfinite(rng) || rng != rng)
            bad++;
        /* counter of element (n, d): ((row0 + n) * D + d + key) mod 2^32 */
        const uint32_t base = (uint32_t)((uint64_t)(row0 + n) * (uint64_t)D + (uint64_t)key);
        for (int s = 0; s < K; s++) {
            const int64_t c0 = (int64_t)s * B;
            int64_t w = D - c0;
            if (w <= 0)
                break;
            if (w > B)
                w = B;
            const float *xs = xr + c0;
            const uint32_t bs = base + (uint32_t)c0;
            const int shift = s * bits;
            if (s == 0) {
                for (int64_t j = 0; j < w; j++) {
                    float r = (float)(lowbias32(bs + (uint32_t)j) >> (32 - RANDOM_BITS));
                    float t = (xs[j] - lo) * inv;
                    float f = floorf(t);
                    int32_t q = (int32_t)((r < (t - f) * two24) ? f + 1.0f : f);
                    q = q < L ? q : L;
                    o[j] = (uint8_t)q;
                }
                for (int64_t j = w; j < B; j++)
                    o[j] = 0;
            } else {
                for (int64_t j = 0; j < w; j++) {
                    float r = (float)(lowbias32(bs + (uint32_t)j) >> (32 - RANDOM_BITS));
                    float t = (xs[j] - lo) * inv;
                    float f = floorf(t);
                    int32_t q = (int32_t)((r < (t - f) * two24) ? f + 1.0f : f);
                    q = q < L ? q : L;
                    o[j] = (uint8_t)(o[j] | (uint8_t)(q << shift));
                }
            }
        }
    }
    return bad;
}

void cs_dequantize(const uint8_t *p, int64_t N, int64_t B, int64_t p_rs, const float *meta,
                   float *y, int64_t D, int64_t y_rs, int bits)
{
    const int K = 8 / bits;
    const int mask = (1 << bits) - 1;
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *pr = p + n * p_rs;
        float *yr = y + n * y_rs;
        const float scale = meta[2 * n], lo = meta[2 * n + 1];
        for (int s = 0; s < K; s++) {
            const int64_t c0 = (int64_t)s * B;
            int64_t w = D - c0;
            if (w <= 0)
                break;
            if (w > B)
                w = B;
            const int shift = s * bits;
            float *ys = yr + c0;
            for (int64_t j = 0; j < w; j++) {
                float q = (float)((pr[j] >> shift) & mask);
                float v = scale * q;
                ys[j] = lo + v;
            }
        }
    }
}

/* The ABI version the loader checks, so a stale library from an older source is rebuilt. */
int cs_abi_version(void) { return 1; }
