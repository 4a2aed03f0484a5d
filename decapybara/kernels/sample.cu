// Device sampler: the contract of decapybara/engine/sampling.py (read its module docstring first), in float64.
//
// Pipeline per call (rows = sequences, V = vocabulary):
//   sample_prep     y = float64(logits) with NaN -> -inf, +inf -> float32 max; resets argmin; without edits also
//                   the row max (rowmax zeroed by the caller), which sample_rowmax otherwise computes after them
//   sample_edits    sparse per-(row, token) edits: logit_bias, repetition / presence / frequency penalties,
//                   masks (-inf, the pre-mask value kept in `scratch`)
//   sample_rowmax   row max of y after edits (ordered-bits atomicMax: order independent, so deterministic)
//   sample_restore  a row left without a finite value by its masks gets its masked tokens back
//   (sample_greedy_pick: a batch of greedy rows with no edits and no logprobs stops here, the argmax found)
//   sample_tilemax  (rows that keep at most K tokens: top-k, logprob alternatives) each tile's first token in
//                   canonical order; sample_stats then sorts only tiles with fewer than K tiles' first tokens
//                   before their own (the others report that token alone, as a bound)
//   sample_stats    per tile of up to 2048 tokens: z = y / T (greedy: T = 1), w = exp(z - zmax), tile sums of w
//                   and of w >= min_p (and their count), greedy argmax (lowest id), and the tile's best L tokens
//                   in canonical order (z descending, ties by ascending id): for L <= 32 (vocabularies of 64+
//                   tiles) each warp's 64 sorted in registers and the warps' first 32 merged pairwise
//                   (`block_first`), else a bitonic sort of the tile in shared memory.
//                   Tile b of nblk holds the ids b, b + nblk, b + 2 nblk, ...: a vocabulary's likely tokens often
//                   sit in one id range (the frequent ones first), and contiguous tiles then put more than L of
//                   a row's best tokens in one tile, which cuts the certified prefix short (a full sort follows)
//   sample_final    one block per row: merges the tiles' candidates; the prefix of the merged order down to
//                   the best of the full tiles' L-th keys (reported, so included) and of the skipped tiles'
//                   first tokens (not reported, so strictly before them) is certified to be the row's canonical
//                   prefix;
//                   thread 0 then runs top-k, top-p, min-p and the inverse-CDF draw with sequential float64
//                   running sums exactly as the numpy reference; rows whose decision lies past the certified
//                   prefix are flagged (status 1) and redone by sample_scan_parts + sample_scan_pick over a
//                   full stable sort.
// Philox4x32-10 and u = ((x0 >> 8) + 0.5) * 2^-24 are bit-identical to decapybara.engine.philox.
// Caveat: row sums (Z) are computed in another order than numpy's pairwise np.sum, and exp() may differ in the
// last bit; a token can therefore differ only where u * Z lies within a few ulps of a CDF step (or w_i of
// min_p, or a running sum of p * Z).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define TILE 2048
#define NTOP 20
#define F32_MAX 3.4028234663852886e38
#define INF_D __longlong_as_double(0x7FF0000000000000ll)

__device__ __forceinline__ u64 ord64(double z) {
    u64 b = (u64)__double_as_longlong(z);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}
__device__ __forceinline__ double unord64(u64 o) {
    return __longlong_as_double((long long)((o >> 63) ? (o & 0x7FFFFFFFFFFFFFFFull) : ~o));
}
// a before b in canonical order (z descending, ties by ascending id)
__device__ __forceinline__ bool before(double za, int ia, double zb, int ib) {
    return za > zb || (za == zb && ia < ib);
}

__device__ __forceinline__ u32 philox_x0(u64 seed, u64 pos, u32 stream) {
    u32 c0 = (u32)pos, c1 = (u32)(pos >> 32), c2 = stream, c3 = 0;
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    return c0;
}
__device__ __forceinline__ double philox_uniform(u64 seed, u64 pos) {
    return ((double)(philox_x0(seed, pos, 0) >> 8) + 0.5) * 0x1p-24;
}

extern "C" __global__ void philox_uniforms(const u64* seeds, const u64* pos, u32 stream, double* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ((double)(philox_x0(seeds[i], pos[i], stream) >> 8) + 0.5) * 0x1p-24;
}

// The block's largest ordered key (one a thread), added to *dst by atomicMax (order independent: deterministic).
__device__ void block_max_to(u64 m, u64* dst) {
    __shared__ u64 red[32];
    for (int o = 16; o; o >>= 1) { u64 q = __shfl_xor_sync(0xFFFFFFFFu, m, o); m = q > m ? q : m; }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = red[w] > m ? red[w] : m;
        atomicMax(dst, m);
    }
}

// rowmax must be 0 before the launch where do_max is set (each block adds its maximum by atomicMax); without it
// sample_rowmax computes it after the edits. argmin is reset here (read by later launches only).
extern "C" __global__ void sample_prep(const void* logits, int kind, long long ld, int V, double* y, u64* rowmax,
                                       int* argmin, int* has_finite, int do_max) {
    const int row = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) argmin[row] = 0x7FFFFFFF;
    u64 m = 0;
    if (i < V) {
        double x;
        if (kind == 0) x = ((const float*)logits)[row * ld + i];
        else {
            u16 h = ((const u16*)logits)[row * ld + i];
            float f;
            if (kind == 1) f = __uint_as_float((u32)h << 16);
            else asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
            x = f;
        }
        if (x != x) x = -INF_D;
        else if (x == INF_D) x = F32_MAX;
        if (x != -INF_D) has_finite[row] = 1;
        y[(long long)row * V + i] = x;
        m = ord64(x);
    }
    if (do_max) block_max_to(m, rowmax + row);  // uniform per launch
}

// flags: 1 = seen (repetition penalty), 2 = masked, 4 = has bias
extern "C" __global__ void sample_edits(const int* e_row, const int* e_tok, const double* e_bias, const int* e_flags,
                                        const int* e_count, int E, const double* rep, const double* pres,
                                        const double* freq, double* y, int V, double* scratch) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    const int row = e_row[e], f = e_flags[e], cnt = e_count[e];
    double* p = y + (long long)row * V + e_tok[e];
    double x = *p;
    if (f & 4) x = __dadd_rn(x, e_bias[e]);
    const double r = rep[row], pr = pres[row], fr = freq[row];
    if ((f & 1) && r != 1.0) x = x > 0.0 ? __ddiv_rn(x, r) : __dmul_rn(x, r);
    if (cnt > 0 && (pr != 0.0 || fr != 0.0)) x = __dsub_rn(__dsub_rn(x, __dmul_rn((double)cnt, fr)), pr);
    if (f & 2) { scratch[e] = x; x = -INF_D; }
    *p = x;
}

extern "C" __global__ void sample_rowmax(const double* y, int V, u64* rowmax) {
    const int row = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    block_max_to(i < V ? ord64(y[(long long)row * V + i]) : 0, rowmax + row);
}

// Greedy rows without edits or logprobs (decapybara/backend/cupy_ops_extra.py `cuda_sample`'s short path, after
// sample_prep with its row max): argmin[row] = the lowest id whose value is the row's maximum.
extern "C" __global__ void sample_greedy_pick(const double* y, int V, const u64* rowmax, int* argmin) {
    const int row = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < V && y[(long long)row * V + i] == unord64(rowmax[row])) atomicMin(argmin + row, (int)i);
}

extern "C" __global__ void sample_restore(const int* e_ptr, const int* e_tok, const int* e_flags, const double* scratch,
                                          double* y, int V, u64* rowmax, int B) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= B || rowmax[row] != ord64(-INF_D)) return;
    u64 m = rowmax[row];
    for (int e = e_ptr[row]; e < e_ptr[row + 1]; ++e)
        if (e_flags[e] & 2) {
            y[(long long)row * V + e_tok[e]] = scratch[e];
            u64 o = ord64(scratch[e]);
            m = o > m ? o : m;
        }
    rowmax[row] = m;
}

// Bitonic sort of n (a power of two, at most TILE; default TILE) (z, id) pairs in shared memory into canonical
// order; blockDim.x == TILE / 2.
__device__ void bitonic(double* z, int* id, int n = TILE) {
    for (int k = 2; k <= n; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int l = i ^ j;
                if (l > i) {
                    const bool asc = (i & k) == 0;
                    if (asc ? before(z[l], id[l], z[i], id[i]) : before(z[i], id[i], z[l], id[l])) {
                        double tz = z[i]; z[i] = z[l]; z[l] = tz;
                        int ti = id[i]; id[i] = id[l]; id[l] = ti;
                    }
                }
            }
            __syncthreads();
        }
}

// A bitonic network over 64 (z, id) pairs of one warp, pair e = lane + 32 h in (z[h], id[h]): the stages of k from
// k0 (2: a full sort; 64: the merge of a bitonic sequence) to 64, each pair of a compare-exchange keeping the one
// first in canonical order where its place in the network asks for it. Sorted into canonical order: pair e is the
// e-th of the 64.
__device__ __forceinline__ void warp_bitonic64(double (&z)[2], int (&id)[2], int k0) {
    const int lane = threadIdx.x & 31;
    for (int k = k0; k <= 64; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            if (j == 32) {  // (only k = 64) the lane's two pairs: pair lane keeps the first
                if (before(z[1], id[1], z[0], id[0])) {
                    const double tz = z[0]; z[0] = z[1]; z[1] = tz;
                    const int ti = id[0]; id[0] = id[1]; id[1] = ti;
                }
                continue;
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const double pz = __shfl_xor_sync(0xFFFFFFFFu, z[h], j);
                const int pid = __shfl_xor_sync(0xFFFFFFFFu, id[h], j);
                const int e = lane + 32 * h;
                const bool take_first = ((e & j) == 0) == ((e & k) == 0);  // the lower place of an ascending run
                if (before(pz, pid, z[h], id[h]) == take_first) { z[h] = pz; id[h] = pid; }
            }
        }
}

// The first L <= 32 of a block's 2048 (z, id) pairs in canonical order (thread t holds pairs t and t + 1024 in
// z[0..1], id[0..1]) into out_z / out_id, without sorting them all: each warp sorts its 64 pairs in registers and
// keeps its first 32; warps then merge their lists pairwise in five rounds through shared memory (buf_z / buf_id,
// 32 x 32 pairs), each merge a bitonic merge of one list and the other reversed, its first 32 kept. The first L
// of the 2048 are among the first 32 of any group that holds them, so these are the full sort's first L (ids are
// unique: no ties). blockDim.x == TILE / 2.
__device__ void block_first(double (&z)[2], int (&id)[2], int L, double* buf_z, int* buf_id, double* out_z,
                            int* out_id) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_bitonic64(z, id, 2);
    for (int s = 1; s < 32; s <<= 1) {
        if (warp % (2 * s) == s) {
            buf_z[warp * 32 + lane] = z[0];
            buf_id[warp * 32 + lane] = id[0];
        }
        __syncthreads();
        if (warp % (2 * s) == 0) {
            z[1] = buf_z[(warp + s) * 32 + 31 - lane];  // the partner's list reversed: a bitonic sequence of 64
            id[1] = buf_id[(warp + s) * 32 + 31 - lane];
            warp_bitonic64(z, id, 64);
        }
    }
    if (warp == 0 && lane < L) {
        out_z[lane] = z[0];
        out_id[lane] = id[0];
    }
}

// Deterministic block sum (fixed tree) of one double per thread; result valid in thread 0.
__device__ double block_sum(double v, double* red) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) v += red[w];
    return v;
}

// Each tile's first token in canonical order (z = y / T, greedy rows T = 1): (tz, tzid)[row, tile]. The
// rows that keep only their first K tokens (keep[row] = K > 0: top-k, logprob alternatives) sort only the tiles
// whose first token is among the row's K best tiles' (sample_stats).
extern "C" __global__ void __launch_bounds__(TILE / 2) sample_tilemax(const double* y, int V, const double* temp,
                                                                     const int* greedy, double* tz, int* tzid) {
    __shared__ double rz[32];
    __shared__ int ri[32];
    const int row = blockIdx.y, nblk = gridDim.x, b = blockIdx.x, tid = threadIdx.x;
    const double T = greedy[row] ? 1.0 : temp[row];
    double bzv = -INF_D;
    int bi = 0x7FFFFFFF;
    for (int h = 0; h < 2; ++h) {
        const int i = b + nblk * (tid + h * (TILE / 2));
        if (i < V) {
            const double z = __ddiv_rn(y[(long long)row * V + i], T) + 0.0;  // as sample_stats computes it
            if (before(z, i, bzv, bi)) { bzv = z; bi = i; }
        }
    }
    for (int o = 16; o; o >>= 1) {
        const double qz = __shfl_xor_sync(0xFFFFFFFFu, bzv, o);
        const int qi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
        if (before(qz, qi, bzv, bi)) { bzv = qz; bi = qi; }
    }
    if ((tid & 31) == 0) { rz[tid >> 5] = bzv; ri[tid >> 5] = bi; }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (before(rz[w], ri[w], bzv, bi)) { bzv = rz[w]; bi = ri[w]; }
        tz[row * nblk + b] = bzv;
        tzid[row * nblk + b] = bi;
    }
}

// keep[row] > 0: a tile with at least keep[row] tiles whose first token comes before its own holds none of the
// row's first keep[row] tokens; it skips the sort and reports its first token alone (skipped[row, tile] = 1),
// which bounds the certified prefix as a full tile's L-th key does (sample_final).
extern "C" __global__ void __launch_bounds__(TILE / 2) sample_stats(
    const double* y, int V, const double* temp, const int* greedy, const int* want_sort, const double* min_p,
    const u64* rowmax, int L, const int* keep, const double* tz, const int* tzid, double* bz, double* bzm, int* bnm,
    int* argmin, double* cz, int* cid, int* skipped) {
    __shared__ double sz[TILE];
    __shared__ int sid[TILE];
    __shared__ int skip_tile;
    __shared__ double red[32];
    const int row = blockIdx.y, nblk = gridDim.x, b = blockIdx.x, tid = threadIdx.x;
    const double ymax = unord64(rowmax[row]);
    const double T = greedy[row] ? 1.0 : temp[row], zmax = __ddiv_rn(ymax, T), mp = min_p[row];
    double s = 0.0, sm = 0.0;
    int nm = 0, amin = 0x7FFFFFFF;
    double hz[2];  // this thread's pairs, tokens b + nblk j for j = tid, tid + TILE / 2
    int hid[2];
    for (int h = 0; h < 2; ++h) {
        const int j = tid + h * (TILE / 2), i = b + nblk * j;  // strided: tile b holds the ids = b (mod nblk)
        double z = -INF_D;
        int id = 0x7FFFFFFF;
        if (i < V) {
            const double yi = y[(long long)row * V + i];
            z = __ddiv_rn(yi, T) + 0.0;  // + 0.0: -0 and +0 tie, as in numpy's comparisons
            id = i;
            const double w = exp(z - zmax);
            s += w;
            if (mp > 0.0 && w >= mp) { sm += w; ++nm; }
            if (yi == ymax && i < amin) amin = i;
        }
        hz[h] = z;
        hid[h] = id;
        if (L > 32) {
            sz[j] = z;
            sid[j] = id;
        }
    }
    s = block_sum(s, red);
    sm = block_sum(sm, red);
    double nmd = block_sum((double)nm, red);
    for (int o = 16; o; o >>= 1) amin = min(amin, __shfl_xor_sync(0xFFFFFFFFu, amin, o));
    if ((tid & 31) == 0 && amin != 0x7FFFFFFF) atomicMin(argmin + row, amin);
    if (tid == 0) {
        bz[row * nblk + b] = s;
        bzm[row * nblk + b] = sm;
        bnm[row * nblk + b] = (int)nmd;
    }
    if (greedy[row] && !want_sort[row]) return;  // uniform per block
    const int kt = keep[row];
    if (kt > 0) {
        const long long t0 = (long long)row * nblk;
        const double z0 = tz[t0 + b];
        const int i0 = tzid[t0 + b];
        double ahead = 0.0;
        for (int c = tid; c < nblk; c += blockDim.x) ahead += before(tz[t0 + c], tzid[t0 + c], z0, i0) ? 1.0 : 0.0;
        ahead = block_sum(ahead, red);
        if (tid == 0) {
            skip_tile = ahead >= (double)kt;
            skipped[t0 + b] = skip_tile;
            if (skip_tile) {
                cz[(t0 + b) * L] = z0;
                cid[(t0 + b) * L] = i0;
            }
        }
        __syncthreads();
        if (skip_tile) return;  // uniform per block
    }
    __syncthreads();
    double* out_z = cz + ((long long)row * nblk + b) * L;
    int* out_id = cid + ((long long)row * nblk + b) * L;
    if (L <= 32) {  // (uniform) the first L without a full sort; sz / sid serve as the merges' lists
        block_first(hz, hid, L, sz, sid, out_z, out_id);
        return;
    }
    bitonic(sz, sid);
    for (int j = tid; j < L; j += blockDim.x) {
        out_z[j] = sz[j];
        out_id[j] = sid[j];
    }
}

// The reference's decision over a canonical prefix [0, n_cert) (n_cert == V: the whole row); w(i) is the
// weight exp(z_i - zmax) of the i-th token of the prefix. Returns 1 and the prefix index of the token when
// decided, 0 when the prefix is too short.
template <class W>
__device__ int decide(W w, int n_cert, int V, double z_all, double z_mp, int n_mp, int top_k, double top_p,
                      double min_p, double u, int* idx) {
    const int nk = (top_k > 0 && top_k < V) ? top_k : V;
    double zk = z_all;
    if (nk < V) {
        if (nk > n_cert) return 0;
        zk = 0.0;
        for (int i = 0; i < nk; ++i) zk += w(i);
    }
    int np = V;
    if (top_p < 1.0) {
        const double thr = top_p * zk;
        const int lim = min(nk, n_cert);
        double acc = 0.0;
        int i = 0;
        for (; i < lim; ++i) {
            if (acc >= thr) break;
            acc += w(i);
        }
        if (i < lim) np = i;
        else if (nk <= n_cert) np = nk;
        else return 0;
    }
    const int nm = min_p > 0.0 ? n_mp : V;
    const int nkeep = min(nk, min(np, nm));
    double zkeep;
    if (nkeep <= n_cert) {
        zkeep = 0.0;
        for (int i = 0; i < nkeep; ++i) zkeep += w(i);
    } else if (nkeep == nm && min_p > 0.0) zkeep = z_mp;
    else if (nkeep == V) zkeep = z_all;
    else return 0;
    const double target = u * zkeep;
    const int lim = min(nkeep, n_cert);
    double cdf = 0.0;
    int last_pos = -1;
    for (int i = 0; i < lim; ++i) {
        const double wi = w(i);
        if (wi > 0.0) last_pos = i;
        cdf += wi;
        if (cdf > target) { *idx = i; return 1; }
    }
    if (nkeep > n_cert) return 0;
    *idx = last_pos;
    return 1;
}

struct SmemW {
    const double* w;
    __device__ double operator()(int i) const { return w[i]; }
};
struct ScanZ {  // z and w of the i-th token of a full canonical order
    const double* y;
    const int* order;
    double T, zmax;
    __device__ double z(int i) const { return __ddiv_rn(y[order[i]], T) + 0.0; }
    __device__ double operator()(int i) const { return exp(z(i) - zmax); }
};

__device__ void write_top(int row, double zmax, double lse, int n, const double* z, const int* id, int* top_id,
                          float* top_lp) {
    for (int j = 0; j < NTOP; ++j) {  // thread 0 only
        top_id[row * NTOP + j] = j < n ? id[j] : -1;
        top_lp[row * NTOP + j] = j < n ? (float)((z[j] - zmax) - lse) : 0.f;
    }
}

// rowinfo[row] = {zmax, z_all, z_mp, u}; status: 0 decided, 1 needs the fallback scan.
extern "C" __global__ void __launch_bounds__(TILE / 2) sample_final(
    int V, int nblk, int L, const double* temp, const int* greedy, const int* want_top, const int* top_k,
    const double* top_p, const double* min_p, const u64* seeds, const u64* pos, const u64* rowmax,
    const double* bz, const double* bzm, const int* bnm, const int* argmin, const double* cz, const int* cid,
    const int* keep, const int* skipped, long long* token, float* logprob, int* status, double* rowinfo, int* rownm,
    int* top_id, float* top_lp) {
    __shared__ double sz[TILE], sw[TILE];
    __shared__ int sid[TILE];
    __shared__ double red[32];
    __shared__ int ired[33];
    __shared__ double tz_w[32];
    __shared__ int ti_w[32];
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, kt = keep[row];
    const bool gr = greedy[row] != 0;
    const double T = gr ? 1.0 : temp[row], zmax = __ddiv_rn(unord64(rowmax[row]), T);
    // The tiles' candidates gathered side by side (nblk <= TILE tiles; thread t takes tiles t and t + blockDim.x):
    // each thread's count of reported tokens, a block-wide exclusive scan for its offset in (sz, sid), and the
    // bound tau: the canonically first of the keys that everything a tile did not report is at or after (a full
    // tile's L-th key, a skipped tile's first token). Keys are unique (ids are), so any reduction order gives the
    // same tau; the candidates' order does not matter (they are sorted below).
    int cnt_t = 0;
    double tau_z = INF_D;
    int tau_id = -1;
    for (int b = tid; b < nblk; b += blockDim.x) {
        const bool skip = kt > 0 && skipped[(long long)row * nblk + b];  // its first token alone, not reported
        const int cnt = (V - b + nblk - 1) / nblk;  // tile b's ids: b, b + nblk, ..
        cnt_t += skip ? 0 : min(L, cnt);
        if (skip || cnt > L) {
            const long long k = ((long long)row * nblk + b) * L + (skip ? 0 : L - 1);
            const double kz = cz[k];
            const int ki = cid[k];
            if (tau_id < 0 || before(kz, ki, tau_z, tau_id)) { tau_z = kz; tau_id = ki; }
        }
    }
    int incl = cnt_t;  // warp inclusive scan
    for (int o = 1; o < 32; o <<= 1) {
        const int q = __shfl_up_sync(0xFFFFFFFFu, incl, o);
        if (lane >= o) incl += q;
    }
    for (int o = 16; o; o >>= 1) {  // tau: canonical minimum (tau_id < 0: none)
        const double qz = __shfl_xor_sync(0xFFFFFFFFu, tau_z, o);
        const int qi = __shfl_xor_sync(0xFFFFFFFFu, tau_id, o);
        if (qi >= 0 && (tau_id < 0 || before(qz, qi, tau_z, tau_id))) { tau_z = qz; tau_id = qi; }
    }
    if (lane == 31) ired[warp] = incl;
    if (lane == 0) { tz_w[warp] = tau_z; ti_w[warp] = tau_id; }
    __syncthreads();
    const int nwarps = (int)(blockDim.x >> 5);
    if (tid == 0) {
        int run = 0;
        for (int w = 0; w < nwarps; ++w) { const int c = ired[w]; ired[w] = run; run += c; }
        ired[32] = run;
        for (int w = 1; w < nwarps; ++w)
            if (ti_w[w] >= 0 && (ti_w[0] < 0 || before(tz_w[w], ti_w[w], tz_w[0], ti_w[0]))) {
                tz_w[0] = tz_w[w];
                ti_w[0] = ti_w[w];
            }
    }
    __syncthreads();
    const int n_c = ired[32];
    tau_z = tz_w[0];
    tau_id = ti_w[0];
    int off = ired[warp] + incl - cnt_t;
    for (int b = tid; b < nblk; b += blockDim.x) {
        const bool skip = kt > 0 && skipped[(long long)row * nblk + b];
        const int lb = skip ? 0 : min(L, (V - b + nblk - 1) / nblk);
        const long long base = ((long long)row * nblk + b) * L;
        for (int j = 0; j < lb; ++j) {
            sz[off + j] = cz[base + j];
            sid[off + j] = cid[base + j];
        }
        off += lb;
    }
    const bool need_sort = !gr || want_top[row] > 0;
    if (need_sort) {  // the candidates padded to a power of two (at least NTOP: write_top's reads)
        int n = 32;
        while (n < n_c) n <<= 1;
        for (int j = n_c + tid; j < n; j += blockDim.x) { sz[j] = -INF_D; sid[j] = 0x7FFFFFFF; }
        __syncthreads();
        bitonic(sz, sid, n);
        for (int j = tid; j < n; j += blockDim.x) sw[j] = exp(sz[j] - zmax);  // the same bits as in stats
        __syncthreads();
    }
    // the certified prefix: the sorted candidates at or before tau (a prefix of them, so a count)
    int n_cert = n_c;
    if (tau_id >= 0 && need_sort) {
        double c = 0.0;
        for (int j = tid; j < n_c; j += blockDim.x) c += before(tau_z, tau_id, sz[j], sid[j]) ? 0.0 : 1.0;
        n_cert = (int)block_sum(c, red);
    }
    if (tid != 0) return;
    double z_all = 0.0, z_mp = 0.0;
    int n_mp = 0;
    for (int b = 0; b < nblk; ++b) {
        z_all += bz[row * nblk + b];
        z_mp += bzm[row * nblk + b];
        n_mp += bnm[row * nblk + b];
    }
    const double u = philox_uniform(seeds[row], pos[row]), lse = log(z_all);
    rowinfo[row * 4 + 0] = zmax;
    rowinfo[row * 4 + 1] = z_all;
    rowinfo[row * 4 + 2] = z_mp;
    rowinfo[row * 4 + 3] = u;
    rownm[row] = n_mp;
    int st = (need_sort && want_top[row] > n_cert) ? 1 : 0, idx = 0;
    long long tok = argmin[row];
    if (!gr && !st) {
        if (decide(SmemW{sw}, n_cert, V, z_all, z_mp, n_mp, top_k[row], top_p[row], min_p[row], u, &idx))
            tok = sid[idx];
        else
            st = 1;
    }
    status[row] = st;
    token[row] = tok;
    if (!st) {
        const double zt = gr ? zmax : sz[idx];
        logprob[row] = (float)((zt - zmax) - lse);
        if (need_sort) write_top(row, zmax, lse, min(n_cert, NTOP), sz, sid, top_id, top_lp);
    }
}

#define SCAN_ITEMS 8  // sample_scan_parts: consecutive tokens a thread
#define SCAN_SPAN (SCAN_ITEMS * TILE / 2)  // tokens a sample_scan_parts block: 8,192

// Fallback for rows whose decision lies past the certified prefix, `order` being each such row's full canonical
// order (a stable argsort of -z): the reference's sequential running sums become a prefix scan in canonical order,
// P[i] = w(0) + ... + w(i), in two launches. sample_scan_parts, a block a (span of SCAN_SPAN tokens, row): the
// span's weights (wbuf) and inclusive prefix sums from the span's start (pbuf). sample_scan_pick, a warp a row:
// the spans' offsets (off[s + 1] = off[s] + the last of span s's sums, so that the first P of a span is the last P
// of the span before plus its weight), then P[i] = offset of i's span + pbuf[i]. P does not decrease along the
// order (weights are non-negative), but by rounding where a thread's sums start from the block's tree of totals
// rather than from the sum before it: a dip of an ulp where a weight is below an ulp of its running sum, that is
// in the row's far tail, where no draw lands (u < 1); and the weights never increase (z descending). So each of
// the reference's "first index where" loops (the top-p cut, the draw's CDF step, the last token of positive
// weight) is a search over a monotone predicate, 32 probes a round (`warp_first`). The same decision as `decide`
// over the whole row, but where u * Z (or the top-p threshold) lies within a few ulps of a running sum, whose bits
// the scan's order can change.
extern "C" __global__ void __launch_bounds__(TILE / 2) sample_scan_parts(
    const int* rows, const int* order, int V, const double* y, const double* temp, const int* greedy,
    const double* rowinfo, double* wbuf, double* pbuf) {
    __shared__ double red[32];
    const int r = blockIdx.y, span = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nw = (int)(blockDim.x >> 5), row = rows[r];
    if (greedy[row]) return;  // (uniform) a greedy row's token is its argmax: no scan
    const double T = temp[row];
    const ScanZ g{y + (long long)row * V, order + (long long)r * V, T, rowinfo[row * 4]};
    const int i0 = span * SCAN_SPAN + tid * SCAN_ITEMS;  // a thread's SCAN_ITEMS consecutive tokens: gathers in flight
    double w[SCAN_ITEMS];
#pragma unroll
    for (int k = 0; k < SCAN_ITEMS; ++k) w[k] = i0 + k < V ? g(i0 + k) : 0.0;
    double own = 0.0;
#pragma unroll
    for (int k = 0; k < SCAN_ITEMS; ++k) own += w[k];
    double s = own;  // the threads' totals, scanned: warp, then the warps' totals
    for (int o = 1; o < 32; o <<= 1) {
        const double q = __shfl_up_sync(0xFFFFFFFFu, s, o);
        if (lane >= o) s += q;
    }
    double excl = __shfl_up_sync(0xFFFFFFFFu, s, 1);  // the warp's sum before this thread
    if (lane == 0) excl = 0.0;
    if (lane == 31) red[warp] = s;
    __syncthreads();
    if (warp == 0) {
        double t = lane < nw ? red[lane] : 0.0;
        for (int o = 1; o < 32; o <<= 1) {
            const double q = __shfl_up_sync(0xFFFFFFFFu, t, o);
            if (lane >= o) t += q;
        }
        if (lane < nw) red[lane] = t;
    }
    __syncthreads();
    double run = (warp ? red[warp - 1] : 0.0) + excl;
    double* W = wbuf + (long long)r * V;
    double* P = pbuf + (long long)r * V;
#pragma unroll
    for (int k = 0; k < SCAN_ITEMS; ++k)
        if (i0 + k < V) {
            run += w[k];
            W[i0 + k] = w[k];
            P[i0 + k] = run;
        }
}

// The first i in [lo, hi) where pred(i) holds, pred being false then true along [lo, hi); hi where it never holds.
// A whole warp: 32 probes a round narrow the range 32-fold.
template <class Pred>
__device__ int warp_first(int lo, int hi, Pred pred) {
    const int lane = threadIdx.x & 31;
    while (hi - lo > 32) {
        const int step = (hi - lo + 31) / 32;
        const int p = min(lo + (lane + 1) * step - 1, hi - 1);  // the last place of lane's step
        const unsigned t = __ballot_sync(0xFFFFFFFFu, pred(p));
        if (t == 0) return hi;
        const int j = __ffs(t) - 1;
        const int pj = min(lo + (j + 1) * step - 1, hi - 1);
        lo = j ? lo + j * step : lo;  // after the last probe that did not hold
        hi = pj + 1;                   // pred(pj) holds: the answer is at most pj
    }
    const unsigned t = __ballot_sync(0xFFFFFFFFu, lo + lane < hi && pred(lo + lane));
    return t ? lo + __ffs(t) - 1 : hi;
}

extern "C" __global__ void sample_scan_pick(
    const int* rows, const int* order, int V, const double* y, const double* temp, const int* greedy,
    const int* top_k, const double* top_p, const double* min_p, const double* rowinfo, const int* rownm,
    const double* wbuf, const double* pbuf, long long* token, float* logprob, int* status, int* top_id,
    float* top_lp) {
    __shared__ double off[TILE * 128 / SCAN_SPAN + 1];  // the spans' offsets (SAMPLE_MAX_VOCAB / SCAN_SPAN spans)
    const int r = blockIdx.x, lane = threadIdx.x & 31, row = rows[r];
    const int* ord = order + (long long)r * V;
    const bool gr = greedy[row] != 0;
    const double T = gr ? 1.0 : temp[row];
    const double zmax = rowinfo[row * 4], z_all = rowinfo[row * 4 + 1], lse = log(z_all);
    const ScanZ g{y + (long long)row * V, ord, T, zmax};
    int idx = 0;
    if (!gr) {
        const int nspan = (V + SCAN_SPAN - 1) / SCAN_SPAN;
        if (lane == 0) {
            double o = 0.0;
            for (int c = 0; c < nspan; ++c) {
                off[c] = o;
                o += pbuf[(long long)r * V + min((c + 1) * SCAN_SPAN, V) - 1];  // the span's last sum
            }
        }
        __syncwarp();
        const double* W = wbuf + (long long)r * V;
        const double* Pl = pbuf + (long long)r * V;
        auto P = [&](int i) { return off[i / SCAN_SPAN] + Pl[i]; };
        const int nk = (top_k[row] > 0 && top_k[row] < V) ? top_k[row] : V;
        const double zk = nk < V ? P(nk - 1) : z_all;
        int np = V;
        if (top_p[row] < 1.0) {  // the first i < nk whose running sum before it reaches the threshold, else nk
            const double thr = top_p[row] * zk;
            np = warp_first(0, nk, [&](int i) { return (i ? P(i - 1) : 0.0) >= thr; });
        }
        const int nm = min_p[row] > 0.0 ? rownm[row] : V;
        const int nkeep = min(nk, min(np, nm));
        const double target = rowinfo[row * 4 + 3] * (nkeep > 0 ? P(nkeep - 1) : 0.0);
        idx = warp_first(0, nkeep, [&](int i) { return P(i) > target; });  // the draw's CDF step
        if (idx == nkeep)  // none: the last token of positive weight
            idx = warp_first(0, nkeep, [&](int i) { return !(W[i] > 0.0); }) - 1;
    }
    if (lane != 0) return;
    if (!gr) {
        token[row] = ord[idx];
        logprob[row] = (float)((g.z(idx) - zmax) - lse);
    } else {
        logprob[row] = (float)(-lse);  // the greedy token sits at zmax
    }
    for (int j = 0; j < NTOP; ++j) {
        top_id[row * NTOP + j] = j < V ? ord[j] : -1;
        top_lp[row * NTOP + j] = j < V ? (float)((g.z(j) - zmax) - lse) : 0.f;
    }
    status[row] = 0;
}

// The greedy guess and its softmax probability of float32 logits rows [R, V] (row stride ld) in two launches
// (the MTP head's drafts, `Backend.argmax_prob`): guess_partial over chunks of `chunk` tokens, a block each
// (chunk, row): the chunk's maximum, its lowest id holding it and sum(exp(x - max)); guess_finish, a warp a row:
// the row's maximum, the lowest id holding it, and 1 / sum over chunks of s_c exp(m_c - max). NaN reads as -inf
// (a row of only NaN and -inf: id 0, probability NaN).
extern "C" __global__ void guess_partial(const float* logits, long long ld, int V, int chunk, float* pmax, int* pidx,
                                         float* psum) {
    __shared__ float rm[32], rs[32];
    __shared__ int ri[32];
    const int row = blockIdx.y, c = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lo = c * chunk, hi = min(V, lo + chunk);
    const float* x = logits + row * ld;
    float m = -INFINITY;
    int mi = 0x7FFFFFFF;
    for (int i = lo + tid; i < hi; i += blockDim.x) {
        const float v = x[i];
        if (v > m) { m = v; mi = i; }  // strided: a thread's first maximum is its lowest id
    }
    for (int o = 16; o; o >>= 1) {
        const float q = __shfl_xor_sync(0xFFFFFFFFu, m, o);
        const int qi = __shfl_xor_sync(0xFFFFFFFFu, mi, o);
        if (q > m || (q == m && qi < mi)) { m = q; mi = qi; }
    }
    if (lane == 0) { rm[warp] = m; ri[warp] = mi; }
    __syncthreads();
    m = rm[0];
    mi = ri[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
        if (rm[w] > m || (rm[w] == m && ri[w] < mi)) { m = rm[w]; mi = ri[w]; }
    float s = 0.f;
    if (m != -INFINITY)
        for (int i = lo + tid; i < hi; i += blockDim.x) {
            const float v = x[i];
            if (v == v) s += expf(v - m);
        }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    if (lane == 0) rs[warp] = s;
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) s += rs[w];
        const long long k = (long long)row * gridDim.x + c;
        pmax[k] = m;
        pidx[k] = mi;
        psum[k] = s;
    }
}

extern "C" __global__ void guess_finish(const float* pmax, const int* pidx, const float* psum, int nchunk, int R,
                                        long long* guess, float* prob) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= R) return;  // uniform per warp
    const long long base = (long long)row * nchunk;
    float m = -INFINITY;
    int mi = 0x7FFFFFFF;
    for (int c = lane; c < nchunk; c += 32) {
        const float q = pmax[base + c];
        const int qi = pidx[base + c];
        if (q > m || (q == m && qi < mi)) { m = q; mi = qi; }
    }
    for (int o = 16; o; o >>= 1) {
        const float q = __shfl_xor_sync(0xFFFFFFFFu, m, o);
        const int qi = __shfl_xor_sync(0xFFFFFFFFu, mi, o);
        if (q > m || (q == m && qi < mi)) { m = q; mi = qi; }
    }
    float s = 0.f;
    if (m != -INFINITY)
        for (int c = lane; c < nchunk; c += 32) s += psum[base + c] * expf(pmax[base + c] - m);
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    if (lane == 0) {
        guess[row] = m == -INFINITY ? 0 : mi;
        prob[row] = m == -INFINITY ? __int_as_float(0x7FC00000) : 1.f / s;
    }
}
