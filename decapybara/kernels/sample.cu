// Device sampler: the contract of decapybara/engine/sampling.py (read its module docstring first), in float64.
//
// Pipeline per call (rows = sequences, V = vocabulary):
//   sample_prep     y = float64(logits) with NaN -> -inf, +inf -> float32 max; resets per-row accumulators
//   sample_edits    sparse per-(row, token) edits: logit_bias, repetition / presence / frequency penalties,
//                   masks (-inf, the pre-mask value kept in `scratch`)
//   sample_rowmax   row max of y (ordered-bits atomicMax: order independent, so deterministic)
//   sample_restore  a row left without a finite value by its masks gets its masked tokens back
//   (sample_greedy_pick: a batch of greedy rows with no edits and no logprobs stops here, the argmax found)
//   sample_tilemax  (rows that keep at most K tokens: top-k, logprob alternatives) each tile's first token in
//                   canonical order; sample_stats then sorts only tiles with fewer than K tiles' first tokens
//                   before their own (the others report that token alone, as a bound)
//   sample_stats    per tile of up to 2048 tokens: z = y / T (greedy: T = 1), w = exp(z - zmax), tile sums of w
//                   and of w >= min_p (and their count), greedy argmax (lowest id), and the tile's best L tokens
//                   in canonical order (z descending, ties by ascending id) by a bitonic sort in shared memory.
//                   Tile b of nblk holds the ids b, b + nblk, b + 2 nblk, ...: a vocabulary's likely tokens often
//                   sit in one id range (the frequent ones first), and contiguous tiles then put more than L of
//                   a row's best tokens in one tile, which cuts the certified prefix short (a full sort follows)
//   sample_final    one block per row: merges the tiles' candidates; the prefix of the merged order down to
//                   the best of the full tiles' L-th keys (reported, so included) and of the skipped tiles'
//                   first tokens (not reported, so strictly before them) is certified to be the row's canonical
//                   prefix;
//                   thread 0 then runs top-k, top-p, min-p and the inverse-CDF draw with sequential float64
//                   running sums exactly as the numpy reference; rows whose decision lies past the certified
//                   prefix are flagged (status 1) and redone by sample_scan over a full stable sort.
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

extern "C" __global__ void sample_prep(const void* logits, int kind, long long ld, int V, double* y, u64* rowmax,
                                       int* argmin, int* has_finite) {
    const int row = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) { rowmax[row] = 0; argmin[row] = 0x7FFFFFFF; }
    if (i >= V) return;
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
    __shared__ u64 red[32];
    const int row = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    u64 m = i < V ? ord64(y[(long long)row * V + i]) : 0;
    for (int o = 16; o; o >>= 1) { u64 q = __shfl_xor_sync(0xFFFFFFFFu, m, o); m = q > m ? q : m; }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = red[w] > m ? red[w] : m;
        atomicMax(rowmax + row, m);
    }
}

// Greedy rows without edits or logprobs (decapybara/backend/cupy_ops_extra.py `cuda_sample`'s short path, after
// sample_prep and sample_rowmax): argmin[row] = the lowest id whose value is the row's maximum.
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

// Bitonic sort of n = TILE (z, id) pairs in shared memory into canonical order; blockDim.x == TILE / 2.
__device__ void bitonic(double* z, int* id) {
    for (int k = 2; k <= TILE; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < TILE; i += blockDim.x) {
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
        sz[j] = z;
        sid[j] = id;
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
    bitonic(sz, sid);
    for (int j = tid; j < L; j += blockDim.x) {
        cz[((long long)row * nblk + b) * L + j] = sz[j];
        cid[((long long)row * nblk + b) * L + j] = sid[j];
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

// rowinfo[row] = {zmax, z_all, z_mp, u}; status: 0 decided, 1 needs sample_scan.
extern "C" __global__ void __launch_bounds__(TILE / 2) sample_final(
    int V, int nblk, int L, const double* temp, const int* greedy, const int* want_top, const int* top_k,
    const double* top_p, const double* min_p, const u64* seeds, const u64* pos, const u64* rowmax,
    const double* bz, const double* bzm, const int* bnm, const int* argmin, const double* cz, const int* cid,
    const int* keep, const int* skipped, long long* token, float* logprob, int* status, double* rowinfo, int* rownm,
    int* top_id, float* top_lp) {
    __shared__ double sz[TILE], sw[TILE];
    __shared__ int sid[TILE];
    const int row = blockIdx.x, tid = threadIdx.x, kt = keep[row];
    const bool gr = greedy[row] != 0;
    const double T = gr ? 1.0 : temp[row], zmax = __ddiv_rn(unord64(rowmax[row]), T);
    double tau_z = INF_D;
    int tau_id = -1, n_c = 0;
    for (int b = 0; b < nblk; ++b) {  // every thread walks the (small) block list: same n_c, tau everywhere
        const bool skip = kt > 0 && skipped[(long long)row * nblk + b];  // its first token alone, not reported
        const int cnt = (V - b + nblk - 1) / nblk, lb = skip ? 0 : min(L, cnt);  // tile b's ids: b, b + nblk, ..
        for (int j = tid; j < lb; j += blockDim.x) {
            sz[n_c + j] = cz[((long long)row * nblk + b) * L + j];
            sid[n_c + j] = cid[((long long)row * nblk + b) * L + j];
        }
        if (skip || cnt > L) {  // everything the tile did not report is at or after this key
            const double kz = cz[((long long)row * nblk + b) * L + (skip ? 0 : L - 1)];
            const int ki = cid[((long long)row * nblk + b) * L + (skip ? 0 : L - 1)];
            if (tau_id < 0 || before(kz, ki, tau_z, tau_id)) { tau_z = kz; tau_id = ki; }
        }
        n_c += lb;
    }
    const bool need_sort = !gr || want_top[row] > 0;
    if (need_sort) {
        for (int j = n_c + tid; j < TILE; j += blockDim.x) { sz[j] = -INF_D; sid[j] = 0x7FFFFFFF; }
        __syncthreads();
        bitonic(sz, sid);
        for (int j = tid; j < TILE; j += blockDim.x) sw[j] = exp(sz[j] - zmax);  // the same bits as in stats
        __syncthreads();
    }
    if (tid != 0) return;
    double z_all = 0.0, z_mp = 0.0;
    int n_mp = 0;
    for (int b = 0; b < nblk; ++b) {
        z_all += bz[row * nblk + b];
        z_mp += bzm[row * nblk + b];
        n_mp += bnm[row * nblk + b];
    }
    int n_cert = n_c;
    if (tau_id >= 0 && need_sort) {
        n_cert = 0;
        while (n_cert < n_c && !before(tau_z, tau_id, sz[n_cert], sid[n_cert])) ++n_cert;
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

// Fallback for one row per block: `order` is the row's full canonical order (a stable argsort of -z).
extern "C" __global__ void sample_scan(const int* rows, const int* order, int V, const double* y, const double* temp,
                                       const int* greedy, const int* top_k, const double* top_p,
                                       const double* min_p, const double* rowinfo, const int* rownm,
                                       long long* token, float* logprob, int* status, int* top_id, float* top_lp) {
    if (threadIdx.x != 0) return;
    const int row = rows[blockIdx.x];
    const int* ord = order + (long long)blockIdx.x * V;
    const double* yr = y + (long long)row * V;
    const bool gr = greedy[row] != 0;
    const double T = gr ? 1.0 : temp[row];
    const double zmax = rowinfo[row * 4], z_all = rowinfo[row * 4 + 1], lse = log(z_all);
    ScanZ g{yr, ord, T, zmax};
    int idx = 0;
    if (!gr) {
        decide(g, V, V, z_all, rowinfo[row * 4 + 2], rownm[row], top_k[row], top_p[row], min_p[row],
               rowinfo[row * 4 + 3], &idx);
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
