// Mixture-of-experts routing, dispatch and combine (the function of NumpyBackend.moe; the expert SwiGLU runs
// through the grouped mode of mx_gemv.cu between dispatch and combine).
//
// moe_route     one warp per token: softmax over E router logits (float32, rows ldl apart), top-k by probability
//               with ties to the lower expert id (= numpy's stable argsort of -probs), optional renormalisation of
//               the k weights. E <= 1024, k <= 32. A NaN logit counts as -inf and infinite ones stay finite in
//               the softmax (the maxima weigh 1), so the k ids are always distinct experts below E. With `shared`
//               (k <= 31): a slot k more, expert E (a shared expert stacked after the routed ones), weighing
//               sigmoid of the logit after the router's (column E: the shared gate's, stacked with the router);
//               the dispatch and combine then see E + 1 experts and k + 1 slots.
// moe_dispatch  one block: per-expert counts and exclusive offsets, for every (token, slot) pair its row in the
//               expert-grouped order: gather[pos] = token, slot_pos[token * k + slot] = pos; and the groups the
//               products launch over, the experts with rows in ascending id: ids[j], offsets[j], counts[j] for
//               j < the number hit, counts 0 for the rest of the G slots (G = min(E, P): the launch's groups, whose
//               blocks past the hit experts exit at once). The order of tokens inside one expert's group depends
//               on atomics, never the result: rows are independent and the combine reads each token's slots in
//               slot order.
// moe_route_dispatch  both in one block of 512 threads (steps of few tokens: one launch fewer): its warps route
//               the tokens, then the block dispatches them from the ids kept in shared memory (dynamic: 2 (E +
//               shared) + T (k + shared) ints); 1024 threads would need routing in 64 registers. Where the rows
//               are a fused norm's (nsq != 0: the logits' product divided them, decapybara/backend/cupy_ops_extra.py
//               `NormedRows`), it also copies each gathered row's nsq_tiles sums of squares to g_nsq by y row
//               (pos), for the experts' grouped products to divide theirs (mx_gemv.cu's grouped consumer).
// moe_silu_mul  h = silu(gate) * up (float32 math), any of f32 / bf16 / f16 in and out.
// moe_combine   out[t] = sum over slots s (in order) of w[t, s] * y[slot_pos[t, s]], float32 accumulation; with a
//               shared expert (sh != 0): + sigmoid(sg[t]) * sh[t] after the routed sum (the float operations of
//               sigmoid_f32, a multiply and an add); or, where the routing gave it a slot (`shared_slot`: the
//               last of the k), that slot's weight times its row, with the same two operations.
// moe_combine_norm  the combine, then the residual add and RMSNorm of the next layer's input (decode_ops.cu's
//               rms_norm_block's operations), a block a token: one launch where the two ran apart.
// Every kernel here starts with pdl_begin (pdl.cuh): launched overlapped (decapybara/backend/pdl.py), it lets the
// next kernel launch, then waits for the one before; it reads and writes nothing before.

#ifndef MOE_JPL
#define MOE_JPL 32  // router logits a lane holds: E <= 32 MOE_JPL (the wrapper builds ceil(E / 32) rounded up to 8, 16, 32)
#endif
// block_sum and store_out as decode_ops.cu's norms use them
#include "common.cuh"
#include "act_kind.cuh"
#include "pdl.cuh"

// token t's top-k (one warp; lane = the thread's lane), then, where `shared`, slot k: expert E (the shared expert
// stacked after the routed ones) weighing sigmoid(logit E) (the shared gate's logit beside the router's); a token's
// slots k + shared apart
// (the selection: probabilities p >= 0 as keys float bits + 1, monotonic in p; taken experts and padding lanes key 0,
// never picked: each slot takes the largest key of the warp, then the lowest expert id holding it, two warp
// reductions)
__device__ __forceinline__ void route_token(const float* logits, long long ldl, int t, int E, int k, int normalize,
                                            int shared, int* topk_ids, float* topk_w, int lane, int* s_ids = nullptr) {
    const float* l = logits + (long long)t * ldl;
    float p[MOE_JPL];
    float m = -__int_as_float(0x7F800000);
#pragma unroll
    for (int j = 0; j < MOE_JPL; ++j) {
        const int e = j * 32 + lane;
        const float v = e < E ? l[e] : -__int_as_float(0x7F800000);
        p[j] = v == v ? v : -__int_as_float(0x7F800000);  // a NaN logit counts as -inf
        m = fmaxf(m, p[j]);
    }
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < MOE_JPL; ++j) {
        // the maxima weigh 1 (also where m is +-inf: no inf - inf); padding lanes -1, below every candidate
        p[j] = j * 32 + lane < E ? (p[j] == m ? 1.f : expf(p[j] - m)) : -1.f;
        s += p[j] > 0.f ? p[j] : 0.f;
    }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    unsigned key[MOE_JPL];  // p / s >= 0 (at most 1): its bits + 1; padding 0
#pragma unroll
    for (int j = 0; j < MOE_JPL; ++j) key[j] = p[j] >= 0.f ? __float_as_uint(p[j] / s) + 1u : 0u;
    float wsum = 0.f, mine = 0.f;
    int my_id = -1;
    for (int slot = 0; slot < k; ++slot) {
        unsigned best = 0u;
        int bid = 0x7FFFFFFF;
#pragma unroll
        for (int j = 0; j < MOE_JPL; ++j)
            if (key[j] > best) { best = key[j]; bid = j * 32 + lane; }  // ascending e per lane: ties keep the lower id
        const unsigned top = __reduce_max_sync(0xFFFFFFFFu, best);
        bid = (int)__reduce_min_sync(0xFFFFFFFFu, best == top ? (unsigned)bid : 0x7FFFFFFFu);
        if ((bid & 31) == lane) {
#pragma unroll
            for (int j = 0; j < MOE_JPL; ++j) if (j == (bid >> 5)) key[j] = 0u;
        }
        const float w = __uint_as_float(top - 1u);
        wsum += w;
        if (lane == slot) { mine = w; my_id = bid; }
    }
    const int kk = k + shared;
    if (lane < k) {
        topk_ids[t * kk + lane] = my_id;
        topk_w[t * kk + lane] = normalize ? mine / wsum : mine;
        if (s_ids) s_ids[t * kk + lane] = my_id;
    } else if (shared && lane == k) {
        topk_ids[t * kk + k] = E;
        topk_w[t * kk + k] = sigmoid_f(l[E]);
        if (s_ids) s_ids[t * kk + k] = E;
    }
}

extern "C" __global__ void moe_route(const float* logits, long long ldl, int T, int E, int k, int normalize,
                                     int shared, int* topk_ids, float* topk_w) {
    pdl_begin();  // overlapped launch (pdl.cuh)
    const int t = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (t < T) route_token(logits, ldl, t, E, k, normalize, shared, topk_ids, topk_w, threadIdx.x & 31);
}

// (exclusive prefix sum of v over the block's threads, the block's total): one chunk of blockDim.x values; ws:
// 32 ints of shared memory
__device__ __forceinline__ int2 block_scan(int v, int* ws) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xFFFFFFFFu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) ws[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < warps ? ws[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xFFFFFFFFu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < warps) ws[lane] = w;  // inclusive totals of warps 0 .. lane
    }
    __syncthreads();
    const int before = warp ? ws[warp - 1] : 0, total = ws[warps - 1];
    __syncthreads();  // ws free for the next scan
    return make_int2(before + x - v, total);
}

// an expert id clamped into [0, E): ids from outside the router never index past the counters
__device__ __forceinline__ int expert_of(int id, int E) { return min(max(id, 0), E - 1); }

// the dispatch of P = T k (token, slot) pairs by one block (see the header); cnt, cur: 2 E ints of shared memory.
// Offsets and the hit experts' list by block-wide prefix sums over the experts, blockDim.x of them a pass.
__device__ __forceinline__ void dispatch(const int* topk_ids, int P, int E, int G, int* counts, int* offsets,
                                         int* ids, int* gather, int* slot_pos, int k, int* cnt, int* cur,
                                         const float* nsq = nullptr, int nsq_tiles = 0, float* g_nsq = nullptr) {
    __shared__ int ws[32];
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(cnt + expert_of(topk_ids[i], E), 1);
    __syncthreads();
    int rows = 0, hits = 0;  // before this pass: the rows and the experts hit of the experts below it
    for (int e0 = 0; e0 < E; e0 += blockDim.x) {
        const int e = e0 + threadIdx.x, c = e < E ? cnt[e] : 0;
        const int2 r = block_scan(c, ws), h = block_scan(c > 0, ws);
        if (e < E) cur[e] = rows + r.x;
        if (c > 0 && hits + h.x < G) {
            ids[hits + h.x] = e;
            offsets[hits + h.x] = rows + r.x;
            counts[hits + h.x] = c;
        }
        rows += r.y;
        hits += h.y;
    }
    for (int j = hits + threadIdx.x; j < G; j += blockDim.x) { ids[j] = 0; offsets[j] = rows; counts[j] = 0; }
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        const int pos = atomicAdd(cur + expert_of(topk_ids[i], E), 1);
        gather[pos] = i / k;
        slot_pos[i] = pos;
        if (g_nsq)  // the gathered row's sums of squares, by y row (the experts' fused norm consumer)
            for (int j = 0; j < nsq_tiles; ++j) g_nsq[(long long)pos * nsq_tiles + j] = nsq[(long long)(i / k) * nsq_tiles + j];
    }
}

extern "C" __global__ void moe_dispatch(const int* topk_ids, int P, int E, int G, int* counts, int* offsets, int* ids,
                                        int* gather, int* slot_pos, int k) {
    pdl_begin();  // overlapped launch (pdl.cuh)
    extern __shared__ int sh[];  // counts[E], cursor[E]
    dispatch(topk_ids, P, E, G, counts, offsets, ids, gather, slot_pos, k, sh, sh + E);
}

extern "C" __global__ void __launch_bounds__(512) moe_route_dispatch(const float* logits, long long ldl, int T, int E, int k, int normalize,
                                              int shared, int* topk_ids, float* topk_w, int G, int* counts, int* offsets,
                                              int* ids, int* gather, int* slot_pos, const float* nsq, int nsq_tiles,
                                              float* g_nsq) {
    pdl_begin();  // overlapped launch (pdl.cuh)
    extern __shared__ int sh[];  // counts[E + shared], cursor[E + shared], then the ids of T (k + shared) slots
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31, ne = E + shared, kk = k + shared;
    int* s_ids = sh + 2 * ne;
    for (int t = threadIdx.x >> 5; t < T; t += warps)
        route_token(logits, ldl, t, E, k, normalize, shared, topk_ids, topk_w, lane, s_ids);
    // the ids reach the dispatch's reads through its first barrier, from shared memory (no round trip to L2)
    dispatch(s_ids, T * kk, ne, G, counts, offsets, ids, gather, slot_pos, kk, sh, sh + ne, nsq, nsq_tiles, g_nsq);
}

extern "C" __global__ void moe_silu_mul(const void* g, const void* u, int kind_in, void* h, int kind_out, long long n) {
    pdl_begin();  // overlapped launch (pdl.cuh)
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float a = load_kind(g, kind_in, i), b = load_kind(u, kind_in, i);
    store_kind(h, kind_out, i, a / (1.f + expf(-a)) * b);
}

// token t's combined column c (moe_combine's function, header)
__device__ __forceinline__ float combine_at(const void* y, int kind_y, const float* topk_w, const int* slot_pos, int k,
                                           int H, const float* sh, const float* sg, long long ldg, int shared_slot,
                                           int t, int c) {
    float acc = 0.f;
    const int routed = k - shared_slot;
#pragma unroll 4
    for (int s = 0; s < routed; ++s)
        acc += topk_w[t * k + s] * load_kind(y, kind_y, (long long)slot_pos[t * k + s] * H + c);
    if (shared_slot) {  // the shared expert's slot, as `sh` below
        const float v = load_kind(y, kind_y, (long long)slot_pos[t * k + routed] * H + c);
        acc = __fadd_rn(acc, __fmul_rn(topk_w[t * k + routed], v));
    } else if (sh) {
        const float g = sigmoid_f(sg[(long long)t * ldg]);
        acc = __fadd_rn(acc, __fmul_rn(g, sh[(long long)t * H + c]));  // a multiply, then an add (no fused FMA)
    }
    return acc;
}

extern "C" __global__ void moe_combine(const void* y, int kind_y, const float* topk_w, const int* slot_pos, int k,
                                       int H, void* out, int kind_out, const float* sh, const float* sg, long long ldg,
                                       int shared_slot) {
    pdl_begin();  // overlapped launch (pdl.cuh)
    const int t = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= H) return;
    store_kind(out, kind_out, (long long)t * H + c, combine_at(y, kind_y, topk_w, slot_pos, k, H, sh, sg, ldg, shared_slot, t, c));
}

// moe_combine's rows, then the residual add and RMSNorm after them (the operations of decode_ops.cu's
// rms_norm_block, whose cached elements and summation order it keeps: h = combined + res, res_out = h, out =
// h / sqrt(mean(h^2) + eps) * (offset + w), float32 or bf16 bits): one block of blockDim.x threads a token.
// A thread's MC_J columns (i = thread + j blockDim.x) are summed slot by slot in slot order, as combine_at sums
// one column, but the loads of MC_GROUP slots' rows are issued before their adds: a step of one or a few tokens
// runs one or a few blocks, whose time is the round trips of their loads, not their bytes. The slots' weights and
// row offsets are read once into shared memory. Columns past MC_J blockDim.x (rows longer than the build's
// cache) are combined by combine_at, twice (for the sum of squares and for the output).
#ifndef MC_J
#define MC_J 16  // columns a thread caches: the wrapper builds ceil(H / blockDim.x) rounded up to 1, 2, 4, 8 or 16
#endif
#define MC_GROUP (MC_J >= 16 ? 2 : MC_J >= 8 ? 4 : 8)  // slots whose row loads are in flight together
#define MC_SLOTS 33  // a token's slots at most: MOE_TOP_K routed and a shared one
// acc[j] += w[u] * (row u's column thread + j step) for slots u < G in order (combine_at's operation), the G rows'
// loads issued before the adds
template <int G>
__device__ __forceinline__ void add_slots(float (&acc)[MC_J], const void* y, int kind_y, const float* w,
                                          const i64* off, int H, int step) {
    float v[G][MC_J];
#pragma unroll
    for (int u = 0; u < G; ++u)
#pragma unroll
        for (int j = 0; j < MC_J; ++j) {
            const int i = threadIdx.x + j * step;
            v[u][j] = i < H ? load_kind(y, kind_y, off[u] + i) : 0.0f;
        }
#pragma unroll
    for (int u = 0; u < G; ++u)
#pragma unroll
        for (int j = 0; j < MC_J; ++j) acc[j] += w[u] * v[u][j];
}
extern "C" __global__ void __launch_bounds__(512) moe_combine_norm(const void* y, int kind_y, const float* topk_w, const int* slot_pos, int k,
                                            int H, const float* sh, const float* sg, long long ldg, int shared_slot,
                                            const float* __restrict__ res, const float* __restrict__ w, float eps,
                                            float offset, void* out, int out_bf16, float* __restrict__ res_out) {
    pdl_begin();  // overlapped launch (pdl.cuh)
    __shared__ float scratch[33];
    __shared__ float s_w[MC_SLOTS];
    __shared__ i64 s_off[MC_SLOTS];
    const int t = blockIdx.x, step = blockDim.x, tail = threadIdx.x + MC_J * step;
    const i64 base = (i64)t * H;
    if (threadIdx.x < k) {
        s_w[threadIdx.x] = topk_w[t * k + threadIdx.x];
        s_off[threadIdx.x] = (i64)slot_pos[t * k + threadIdx.x] * H;
    }
    float acc[MC_J], rv[MC_J], wv[MC_J];
#pragma unroll
    for (int j = 0; j < MC_J; ++j) {  // the loads that need no slot first
        const int i = threadIdx.x + j * step;
        rv[j] = i < H ? res[base + i] : 0.0f;
        wv[j] = i < H ? w[i] : 0.0f;
        acc[j] = 0.0f;
    }
    __syncthreads();
    const int routed = k - shared_slot;
    int s = 0;
    for (; s + MC_GROUP <= routed; s += MC_GROUP) add_slots<MC_GROUP>(acc, y, kind_y, s_w + s, s_off + s, H, step);
    for (; s < routed; ++s) add_slots<1>(acc, y, kind_y, s_w + s, s_off + s, H, step);
    const float g = !shared_slot && sh ? sigmoid_f(sg[(long long)t * ldg]) : 0.0f;
    float hv[MC_J];
#pragma unroll
    for (int j = 0; j < MC_J; ++j) {
        const int i = threadIdx.x + j * step;
        float a = acc[j];
        if (i < H && shared_slot) {  // the shared expert's slot, as combine_at adds it
            a = __fadd_rn(a, __fmul_rn(s_w[routed], load_kind(y, kind_y, s_off[routed] + i)));
        } else if (i < H && sh) {
            a = __fadd_rn(a, __fmul_rn(g, sh[base + i]));
        }
        hv[j] = i < H ? __fadd_rn(a, rv[j]) : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < MC_J; ++j) ss += hv[j] * hv[j];  // the order of the plain strided loop
    for (int i = tail; i < H; i += step) {
        const float h = __fadd_rn(combine_at(y, kind_y, topk_w, slot_pos, k, H, sh, sg, ldg, shared_slot, t, i), res[base + i]);
        ss += h * h;
    }
    const float denom = sqrtf(block_sum(ss, scratch) / (float)H + eps);
#pragma unroll
    for (int j = 0; j < MC_J; ++j) {
        const int i = threadIdx.x + j * step;
        if (i < H) {
            res_out[base + i] = hv[j];
            store_out(out, out_bf16, base + i, (hv[j] / denom) * (offset + wv[j]));
        }
    }
    for (int i = tail; i < H; i += step) {  // rows longer than MC_J * blockDim.x: combined again
        const float h = __fadd_rn(combine_at(y, kind_y, topk_w, slot_pos, k, H, sh, sg, ldg, shared_slot, t, i), res[base + i]);
        res_out[base + i] = h;
        store_out(out, out_bf16, base + i, (h / denom) * (offset + w[i]));
    }
}
