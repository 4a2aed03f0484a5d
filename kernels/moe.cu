// Mixture-of-experts routing, dispatch and combine (the function of NumpyBackend.moe; the expert SwiGLU runs
// through the grouped mode of mx_gemv.cu between dispatch and combine).
//
// moe_route     one warp per token: softmax over E router logits (float32), top-k by probability with ties to
//               the lower expert id (= numpy's stable argsort of -probs), optional renormalisation of the k
//               weights. E <= 1024, k <= 32.
// moe_dispatch  one block: per-expert counts, exclusive offsets, and for every (token, slot) pair its row in
//               the expert-grouped order: gather[pos] = token, slot_pos[token * k + slot] = pos. The order of
//               tokens inside one expert's group depends on atomics, never the result: rows are independent
//               and the combine reads each token's slots in slot order.
// moe_silu_mul  h = silu(gate) * up (float32 math), any of f32 / bf16 / f16 in and out.
// moe_combine   out[t] = sum over slots s (in order) of w[t, s] * y[slot_pos[t, s]], float32 accumulation.

typedef unsigned int u32;
typedef unsigned short u16;
#include "act_kind.cuh"

extern "C" __global__ void moe_route(const float* logits, int T, int E, int k, int normalize, int* topk_ids,
                                     float* topk_w) {
    const int t = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (t >= T) return;
    const float* l = logits + (long long)t * E;
    float p[32];
    float m = -__int_as_float(0x7F800000);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int e = j * 32 + lane;
        p[j] = e < E ? l[e] : -__int_as_float(0x7F800000);
        m = fmaxf(m, p[j]);
    }
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        p[j] = j * 32 + lane < E ? expf(p[j] - m) : -1.f;  // -1: never selected
        s += p[j] > 0.f ? p[j] : 0.f;
    }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
#pragma unroll
    for (int j = 0; j < 32; ++j) if (p[j] >= 0.f) p[j] = p[j] / s;
    float wsum = 0.f, mine = 0.f;
    int my_id = -1;
    for (int slot = 0; slot < k; ++slot) {
        float best = -2.f;
        int bid = 0x7FFFFFFF;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int e = j * 32 + lane;
            if (p[j] > best) { best = p[j]; bid = e; }  // ascending e per lane: ties keep the lower id
        }
        for (int o = 16; o; o >>= 1) {
            const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, o);
            const int oi = __shfl_xor_sync(0xFFFFFFFFu, bid, o);
            if (ob > best || (ob == best && oi < bid)) { best = ob; bid = oi; }
        }
        if ((bid & 31) == lane) {
#pragma unroll
            for (int j = 0; j < 32; ++j) if (j == (bid >> 5)) p[j] = -2.f;
        }
        wsum += best;
        if (lane == slot) { mine = best; my_id = bid; }
    }
    if (lane < k) {
        topk_ids[t * k + lane] = my_id;
        topk_w[t * k + lane] = normalize ? mine / wsum : mine;
    }
}

extern "C" __global__ void moe_dispatch(const int* topk_ids, int P, int E, int* counts, int* offsets, int* gather,
                                        int* slot_pos, int k) {
    extern __shared__ int sh[];  // counts[E], cursor[E]
    int* cnt = sh;
    int* cur = sh + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) { cnt[e] = 0; cur[e] = 0; }
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(cnt + topk_ids[i], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int e = 0; e < E; ++e) { offsets[e] = acc; counts[e] = cnt[e]; cur[e] = acc; acc += cnt[e]; }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        const int pos = atomicAdd(cur + topk_ids[i], 1);
        gather[pos] = i / k;
        slot_pos[i] = pos;
    }
}

extern "C" __global__ void moe_silu_mul(const void* g, const void* u, int kind_in, void* h, int kind_out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float a = load_kind(g, kind_in, i), b = load_kind(u, kind_in, i);
    store_kind(h, kind_out, i, a / (1.f + expf(-a)) * b);
}

extern "C" __global__ void moe_combine(const void* y, int kind_y, const float* topk_w, const int* slot_pos, int k,
                                       int H, void* out, int kind_out) {
    const int t = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= H) return;
    float acc = 0.f;
    for (int s = 0; s < k; ++s)
        acc += topk_w[t * k + s] * load_kind(y, kind_y, (long long)slot_pos[t * k + s] * H + c);
    store_kind(out, kind_out, (long long)t * H + c, acc);
}
