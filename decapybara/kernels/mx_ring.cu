// One-row MXFP4 products (split-field E2M1 codes in band tiles: MX_E2M1 = 1, MX_TILED = 1) whose weights reach
// shared memory by large bulk copies (the TMA's `cp.async.bulk`), the `_1r` kernels' math (mx_gemv.cu) on them.
//
// Work: units (band b of 16 rows, K part p) of `cpu` chunks, unit u = b * kparts + p (a band's parts adjacent:
// one contiguous range of codes and of scales each). One block an SM, RG_WARPS warps; each warp takes units from a
// global counter as it needs them and streams each unit's chunks through its own ring of RG_SLOTS slots of up to
// RG_G chunks (G x 2 KB of codes, G x 128 bytes of scales: one bulk copy each, completing on the slot's
// mbarrier). Lane 0 refills a slot as soon as the warp has read it, so RG_SLOTS - 1 slots stay in flight while
// one is consumed; the first RG_SLOTS go out before the wait for the kernel before (pdl.cuh).
// x (one row, bf16 bits, K = Kp codes) is staged once per block as the `_1r` kernels stage a segment, its whole K.
// A unit's sums: kparts 1, stored to y; else float32 partials [kparts, N], the band's last part to finish adds
// them in part order (a counter per band, self-resetting), so the result depends on kparts only.
// Counters: ctr[0] hands out units, ctr[1] counts the warps done (the last one resets both), ctr[2 + b] bands.

#include "mx_gemv.cu"

#ifndef RG_WARPS
#define RG_WARPS 8
#endif
#ifndef RG_SLOTS
#define RG_SLOTS 3
#endif
#ifndef RG_G
#define RG_G 2
#endif
#ifndef RG_DIAG
#define RG_DIAG 0  // 1: the ring without the products (timing of the stream alone); 3: the products without the stream
#endif              // (each slot copied once, then its stale codes computed again); results wrong either way

namespace rg {
constexpr int CK = 256, CODE_B = 2048, SCALE_B = 128;               // a chunk: codes, code bytes, scale bytes
constexpr int SLOT_B = RG_G * (CODE_B + SCALE_B);                    // codes first, then scales
constexpr int ZX = 128;                                              // zero codes after x (R1Cols)

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n .reg .pred p;\n WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra WAIT_%=;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ u32 lds_u16(u32 a) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a) : "memory");
    return v;
}

struct Hdr {  // what a slot holds: unit (-1: no more), first chunk of the unit's range, chunks, last slot of the unit
    int unit, c, n, last;
};

// lane 0's producer state: the unit being streamed, the next one (fetched a unit ahead), its position
struct Prod {
    int cur, next, pos, end;
};
}  // namespace rg

extern "C" __global__ void __launch_bounds__(32 * RG_WARPS, 1)
    mx_ring_mxfp4_1r(const u8* W, const u8* S, const u16* x, float* y, float* partial, int* ctr, int N, int Kp,
                     int kparts) {
    using namespace rg;
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int nchunks = Kp / CK, nbands = N / 16, U = nbands * kparts, cpu = (nchunks + kparts - 1) / kparts;
    // layout: rings [warp][slot] | headers [warp][slot] | mbarriers [warp][slot] | x staging (nchunks CK + ZX codes)
    unsigned char* ring = smem + (size_t)warp * RG_SLOTS * SLOT_B;
    Hdr* hdr = (Hdr*)(smem + (size_t)RG_WARPS * RG_SLOTS * SLOT_B) + warp * RG_SLOTS;
    unsigned long long* bars =
        (unsigned long long*)(smem + (size_t)RG_WARPS * RG_SLOTS * (SLOT_B + sizeof(Hdr))) + warp * RG_SLOTS;
    u16* xs = (u16*)(smem + (size_t)RG_WARPS * RG_SLOTS * (SLOT_B + sizeof(Hdr) + 8));
    const u32 ring_a = smem_u32(ring), bar_a = smem_u32(bars);

    const u8* Wb = W;
    Prod p{0, 0, 0, 0};
    // lane 0: the next slot's work into slot s (header, then the copies on the slot's barrier)
    auto fetch = [&]() { return atomicAdd(ctr, 1); };
    auto start_unit = [&](int u) {
        p.cur = u;
        p.pos = (u % kparts) * cpu;
        p.end = min(nchunks, p.pos + cpu);
    };
    bool refill = false;  // RG_DIAG 3: after the first fill, slots re-armed without copies
    auto issue = [&](int s) {
        Hdr h{-1, 0, 0, 1};
        if (p.cur < U && RG_DIAG == 3 && refill) {
            const int n = min(RG_G, p.end - p.pos);
            hdr[s] = Hdr{p.cur, p.pos, n, p.pos + n >= p.end};
            mbar_arrive(bar_a + 8 * s);
            p.pos += n;
            if (p.pos >= p.end) {
                start_unit(p.next);
                if (p.next < U) p.next = fetch();
            }
        } else if (p.cur < U) {
            const int band = p.cur / kparts, n = min(RG_G, p.end - p.pos);
            h = Hdr{p.cur, p.pos, n, p.pos + n >= p.end};
            const u32 bar = bar_a + 8 * s, dst = ring_a + s * SLOT_B;
            hdr[s] = h;
            mbar_expect_tx(bar, n * (CODE_B + SCALE_B));
            bulk_g2s(dst, Wb + ((size_t)band * nchunks + p.pos) * CODE_B, n * CODE_B, bar);
            bulk_g2s(dst + RG_G * CODE_B, S + ((size_t)band * nchunks + p.pos) * SCALE_B, n * SCALE_B, bar);
            p.pos += n;
            if (p.pos >= p.end) {  // the next unit (already fetched), and the one after it asked for
                start_unit(p.next);
                if (p.next < U) p.next = fetch();
            }
        } else {
            hdr[s] = h;
            mbar_arrive(bar_a + 8 * s);
        }
    };
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < RG_SLOTS; ++s) mbar_init(bar_a + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        const int u = fetch();
        p.next = u < U ? fetch() : U;
        start_unit(u);
        for (int s = 0; s < RG_SLOTS; ++s) issue(s);
        refill = true;
    }
    __syncwarp();
    pdl_wait();
    // x staged as the `_1r` kernels stage one segment of one row (bf16 bits, pairs of groups), then zero codes
    {
        constexpr int G = CK / 8, LK = 64;
        const int segi = nchunks * (CK / 8) / 2;
        for (int i = tid; i < segi; i += blockDim.x) {
            const u32 iu = (u32)i, du = ((iu >> 2) << 3) | (iu & 3u), d8 = du * 8u;
            const int k0 = (int)((du / G) * CK + (du & 3u) * LK + ((du & (G - 1)) >> 2) * 8u);
            const uint4* q = (const uint4*)(x + k0);
            *(uint4*)(xs + d8) = stage_bf16<FMT_MXFP4>(q[0]);
            *(uint4*)(xs + d8 + 32) = stage_bf16<FMT_MXFP4>(q[1]);
        }
        if (tid < ZX / 8) *(uint4*)(xs + nchunks * CK + 8 * tid) = u4(0, 0, 0, 0);
    }
    __syncthreads();
    const u32 zxa = smem_u32(xs + nchunks * CK), xrow = smem_u32(xs + 8 * t);
    float fin[2] = {0.f, 0.f};
    u32 phase = 0;
    for (int s = 0;;) {
        mbar_wait(bar_a + 8 * s, phase);
        const Hdr h = hdr[s];
        if (h.unit < 0) break;
        const u32 sa = ring_a + s * SLOT_B;
        for (int i = 0; i < h.n; ++i) {
            const u32 ca = sa + i * CODE_B, sc = sa + RG_G * CODE_B + i * SCALE_B;
            LaneRow<FMT_MXFP4> r0, r1;
            const uint4 a0 = ld_shared_v4(ca + g * 128 + t * 32), a1 = ld_shared_v4(ca + g * 128 + t * 32 + 16);
            const uint4 b0 = ld_shared_v4(ca + (g + 8) * 128 + t * 32),
                        b1 = ld_shared_v4(ca + (g + 8) * 128 + t * 32 + 16);
            r0.w[0] = a0.x; r0.w[1] = a0.y; r0.w[2] = a0.z; r0.w[3] = a0.w;
            r0.w[4] = a1.x; r0.w[5] = a1.y; r0.w[6] = a1.z; r0.w[7] = a1.w;
            r1.w[0] = b0.x; r1.w[1] = b0.y; r1.w[2] = b0.z; r1.w[3] = b0.w;
            r1.w[4] = b1.x; r1.w[5] = b1.y; r1.w[6] = b1.z; r1.w[7] = b1.w;
            r0.s = lds_u16(sc + g * 8 + t * 2);
            r1.s = lds_u16(sc + (g + 8) * 8 + t * 2);
            if (RG_DIAG == 1) {
                fin[0] += __uint_as_float(r0.w[0] ^ r1.w[7] ^ r0.s);
            } else {
                const u32 xc = xrow + (u32)(h.c + i) * (2 * CK);
                mma_chunk_r1<FMT_MXFP4>(fin, r0, r1, g == 2 * t ? xc : zxa,
                                        g == 2 * t + 1 ? xc : zxa - 2 * R1Cols<FMT_MXFP4>::XB);
            }
        }
        __syncwarp();
        if (lane == 0) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue(s);
        }
        if (h.last) {  // the unit's sums: lanes t of rows g, g + 8 hold disjoint blocks
#pragma unroll
            for (int o = 1; o < 4; o <<= 1) {
                fin[0] += __shfl_xor_sync(0xffffffffu, fin[0], o);
                fin[1] += __shfl_xor_sync(0xffffffffu, fin[1], o);
            }
            const int band = h.unit / kparts, part = h.unit % kparts, r = band * 16 + g;
            if (kparts == 1) {
                if (t == 0) {
                    y[r] = fin[0];
                    y[r + 8] = fin[1];
                }
            } else {
                if (t == 0) {
                    partial[(size_t)part * N + r] = fin[0];
                    partial[(size_t)part * N + r + 8] = fin[1];
                }
                __syncwarp();
                int last = 0;
                if (lane == 0) {
                    __threadfence();
                    last = atomicAdd(ctr + 2 + band, 1) == kparts - 1;
                    if (last) __threadfence();
                }
                last = __shfl_sync(0xffffffffu, last, 0);
                if (last) {
                    if (lane < 16) {
                        float v = 0.f;
                        for (int q = 0; q < kparts; ++q) v += __ldcg(partial + (size_t)q * N + band * 16 + lane);
                        y[band * 16 + lane] = v;
                    }
                    if (lane == 0) ctr[2 + band] = 0;
                }
            }
            fin[0] = fin[1] = 0.f;
        }
        if (++s == RG_SLOTS) {
            s = 0;
            phase ^= 1u;
        }
    }
    pdl_trigger();
    if (lane == 0 && atomicAdd(ctr + 1, 1) == (int)(gridDim.x * RG_WARPS) - 1) {  // every warp done: reset
        ctr[0] = 0;
        ctr[1] = 0;
    }
}
