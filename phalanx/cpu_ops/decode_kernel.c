/* Decode attention on the CPU, straight from the paged KV pool (phalanx/cpu_ops/decode_kernel.py).
 *
 * Each sequence's one query (its query heads folded under their kv head) against its own keys,
 * read where they lie: row `slot` of the pool holds every kv head's keys at k + slot * stride
 * and values at v + slot * stride. Two passes over the sequence's rows, keys then values, each
 * half-row read once, whole, with the half-row `AHEAD` keys on prefetched (a sequence's slots
 * are contiguous only within a block, so the hardware prefetcher, which stops at page ends,
 * cannot see them coming). The softmax is exact, as the flash kernel's: scores, their max,
 * exponentials, sum, in float32. The pool holds float32 or bfloat16 (one body, `decode`,
 * specialised for each by the compiler: `bf16` is a constant in each exported function); a
 * bfloat16 half-row is widened to float32 into a buffer as it is read (its 16 bits are a
 * float32's high half), so the arithmetic is float32's in both. Sequences are spread over `threads` OpenMP threads (torch's
 * count, passed in: a thread that never called omp_set_num_threads would use every core), which
 * are torch's own (this library binds to the libgomp torch loaded).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define AHEAD 4

static void prefetch_span(const char* at, int64_t bytes)
{
    for (int64_t byte = 0; byte < bytes; byte += 64)
        __builtin_prefetch(at + byte);
}

typedef uint32_t __attribute__((may_alias)) float_bits;

/* `count` bfloat16 values widened to float32 into `out` (each one's 16 bits become a float32's
 * high half: one vectorised shift, so the products below stay the float32 loops). */
static inline void widen(const uint16_t* in, float* out, int64_t count)
{
    float_bits* bits = (float_bits*)out;
    #pragma omp simd
    for (int64_t c = 0; c < count; c++)
        bits[c] = (uint32_t)in[c] << 16;
}

/* The half-row at element `at` of a float32 (bf16 = 0) or bfloat16 pool, as float32: in place,
 * or widened into `buffer`. */
static inline const float* half_row(const void* pool, int64_t at, int64_t count, float* buffer, int bf16)
{
    if (!bf16)
        return (const float*)pool + at;
    widen((const uint16_t*)pool + at, buffer, count);
    return buffer;
}

/* q (n, kv_heads, group, dim) contiguous; slots (n, slot_stride): keys first[s]..end[s]-1 of
 * sequence s are at slots[s][first[s]..end[s]-1]; scratch (n, kv_heads * group, max_keys);
 * out (n, kv_heads, group, vdim) contiguous. */
static inline __attribute__((always_inline)) void decode(
    const float* q, const void* k, const void* v, int64_t stride, const int64_t* slots, int64_t slot_stride,
    const int64_t* first, const int64_t* end, int64_t n, int64_t kv_heads, int64_t group, int64_t dim, int64_t vdim,
    float scale, float* scratch, int64_t max_keys, float* out, int threads, int bf16)
{
    const int64_t heads = kv_heads * group;
    const int64_t size = bf16 ? 2 : 4;  /* bytes per element of the pool */
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t s = 0; s < n; s++) {
        const float* queries = q + s * heads * dim;
        const int64_t* mine = slots + s * slot_stride + first[s];
        const int64_t count = end[s] - first[s];
        float* scores = scratch + s * heads * max_keys;  /* (heads, max_keys) */
        float buffer[bf16 ? kv_heads * (dim > vdim ? dim : vdim) : 1];  /* a widened half-row */
        for (int64_t j = 0; j < count; j++) {
            if (j + AHEAD < count)
                prefetch_span((const char*)k + mine[j + AHEAD] * stride * size, kv_heads * dim * size);
            const float* row = half_row(k, mine[j] * stride, kv_heads * dim, buffer, bf16);
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t g = 0; g < group; g++) {
                    const float* query = queries + (h * group + g) * dim;
                    const float* key = row + h * dim;
                    float dot = 0.f;
                    #pragma omp simd reduction(+:dot)
                    for (int64_t c = 0; c < dim; c++)
                        dot += query[c] * key[c];
                    scores[(h * group + g) * max_keys + j] = dot * scale;
                }
        }
        float* result = out + s * heads * vdim;
        for (int64_t r = 0; r < heads; r++) {
            float* p = scores + r * max_keys;
            float top = -FLT_MAX, sum = 0.f;
            for (int64_t j = 0; j < count; j++)
                top = p[j] > top ? p[j] : top;
            for (int64_t j = 0; j < count; j++) {
                p[j] = expf(p[j] - top);
                sum += p[j];
            }
            for (int64_t j = 0; j < count; j++)
                p[j] /= sum;
            for (int64_t c = 0; c < vdim; c++)
                result[r * vdim + c] = 0.f;
        }
        for (int64_t j = 0; j < count; j++) {
            if (j + AHEAD < count)
                prefetch_span((const char*)v + mine[j + AHEAD] * stride * size, kv_heads * vdim * size);
            const float* row = half_row(v, mine[j] * stride, kv_heads * vdim, buffer, bf16);
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t g = 0; g < group; g++) {
                    const float weight = scores[(h * group + g) * max_keys + j];
                    const float* value = row + h * vdim;
                    float* acc = result + (h * group + g) * vdim;
                    #pragma omp simd
                    for (int64_t c = 0; c < vdim; c++)
                        acc[c] += weight * value[c];
                }
        }
    }
}

/* q, scratch and out float32; k and v point into a float32 pool (strides in elements). */
void phalanx_decode_attention(const float* q, const float* k, const float* v, int64_t stride,
                              const int64_t* slots, int64_t slot_stride, const int64_t* first, const int64_t* end,
                              int64_t n, int64_t kv_heads, int64_t group, int64_t dim, int64_t vdim, float scale,
                              float* scratch, int64_t max_keys, float* out, int threads)
{
    decode(q, k, v, stride, slots, slot_stride, first, end, n, kv_heads, group, dim, vdim, scale, scratch, max_keys,
           out, threads, 0);
}

/* The same over a bfloat16 pool (k and v as raw 16-bit words); q, scratch and out float32. */
void phalanx_decode_attention_bf16(const float* q, const uint16_t* k, const uint16_t* v, int64_t stride,
                                   const int64_t* slots, int64_t slot_stride, const int64_t* first, const int64_t* end,
                                   int64_t n, int64_t kv_heads, int64_t group, int64_t dim, int64_t vdim, float scale,
                                   float* scratch, int64_t max_keys, float* out, int threads)
{
    decode(q, k, v, stride, slots, slot_stride, first, end, n, kv_heads, group, dim, vdim, scale, scratch, max_keys,
           out, threads, 1);
}
