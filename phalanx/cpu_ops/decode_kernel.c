/* Decode attention on the CPU, straight from the paged KV pool (phalanx/cpu_ops/decode_kernel.py).
 *
 * Each sequence's one query (its query heads folded under their kv head) against its own keys,
 * read where they lie: row `slot` of the pool holds every kv head's keys at k + slot * stride
 * and values at v + slot * stride. Two passes over the sequence's rows, keys then values, each
 * half-row read once, whole, with the half-row `AHEAD` keys on prefetched (a sequence's slots
 * are contiguous only within a block, so the hardware prefetcher, which stops at page ends,
 * cannot see them coming). The softmax is exact, as the flash kernel's: scores, their max,
 * exponentials, sum, in float32. Sequences are spread over `threads` OpenMP threads (torch's
 * count, passed in: a thread that never called omp_set_num_threads would use every core), which
 * are torch's own (this library binds to the libgomp torch loaded).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define AHEAD 4

static void prefetch_span(const float* start, int64_t floats)
{
    const char* at = (const char*)start;
    for (int64_t byte = 0; byte < floats * 4; byte += 64)
        __builtin_prefetch(at + byte);
}

/* q (n, kv_heads, group, dim) contiguous; slots (n, slot_stride): keys first[s]..end[s]-1 of
 * sequence s are at slots[s][first[s]..end[s]-1]; scratch (n, kv_heads * group, max_keys);
 * out (n, kv_heads, group, vdim) contiguous. */
void phalanx_decode_attention(const float* q, const float* k, const float* v, int64_t stride,
                              const int64_t* slots, int64_t slot_stride, const int64_t* first, const int64_t* end,
                              int64_t n, int64_t kv_heads, int64_t group, int64_t dim, int64_t vdim, float scale,
                              float* scratch, int64_t max_keys, float* out, int threads)
{
    const int64_t heads = kv_heads * group;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t s = 0; s < n; s++) {
        const float* queries = q + s * heads * dim;
        const int64_t* mine = slots + s * slot_stride + first[s];
        const int64_t count = end[s] - first[s];
        float* scores = scratch + s * heads * max_keys;  /* (heads, max_keys) */
        for (int64_t j = 0; j < count; j++) {
            if (j + AHEAD < count)
                prefetch_span(k + mine[j + AHEAD] * stride, kv_heads * dim);
            const float* row = k + mine[j] * stride;
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
                prefetch_span(v + mine[j + AHEAD] * stride, kv_heads * vdim);
            const float* row = v + mine[j] * stride;
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
