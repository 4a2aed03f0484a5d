// Integrity scan of weights / KV pages: a Fletcher-style 64-bit checksum per chunk, so a flipped bit is both
// detected and located to its chunk.
//
// A chunk is `chunk_words` little-endian u32 words w_0..w_{n-1} (bytes past the buffer's end count as 0).
// With M = 2^32 - 1:  s1 = sum w_i mod M,  s2 = sum (n - i) w_i mod M  (= the running Fletcher-64 sum of sums),
// out[chunk] = s2 << 32 | s1. A single flipped bit changes w_i by +-2^b, which is never 0 mod M, so s1 always
// changes. One block per chunk: each thread folds its words with 128-bit loads, then a warp butterfly
// (__shfl_xor_sync) and a pass over the warps combine the partial sums, reducing mod M at every step.
// Requires chunk_words <= 65536 (products and partial sums stay below 2^64).

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;

#define MOD 0xFFFFFFFFull

__device__ __forceinline__ u64 fold(u64 x) {  // x mod (2^32 - 1), result in [0, 2^32 - 1)
    x = (x & MOD) + (x >> 32);
    x = (x & MOD) + (x >> 32);
    return x == MOD ? 0 : x;
}

__device__ __forceinline__ u32 word_at(const u8* p, u64 nbytes, u64 byte) {
    u32 w = 0;
    for (int j = 0; j < 4; ++j)
        if (byte + j < nbytes) w |= (u32)p[byte + j] << (8 * j);
    return w;
}

extern "C" __global__ void checksum_fletcher64(const u8* buf, u64 nbytes, int chunk_words, u64* out) {
    __shared__ u64 red1[32], red2[32];
    const u64 chunk = blockIdx.x;
    const u64 base = chunk * (u64)chunk_words * 4;  // byte offset of the chunk
    u64 s1 = 0, s2 = 0;
    for (int q = threadIdx.x * 4; q < chunk_words; q += blockDim.x * 4) {
        u32 w[4];
        const u64 b = base + (u64)q * 4;
        if (b + 16 <= nbytes && (((u64)(buf + b)) & 15) == 0 && q + 4 <= chunk_words) {
            uint4 v = *(const uint4*)(buf + b);
            w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
        } else {
            for (int j = 0; j < 4; ++j) w[j] = q + j < chunk_words ? word_at(buf, nbytes, b + 4 * j) : 0u;
        }
        for (int j = 0; j < 4; ++j) {
            s1 += w[j];
            s2 += (u64)w[j] * (u64)(chunk_words - (q + j));
        }
        s1 = fold(s1);
        s2 = fold(s2);
    }
    for (int o = 16; o; o >>= 1) {  // butterfly: every lane ends with the warp's sums
        s1 = fold(s1 + __shfl_xor_sync(0xFFFFFFFFu, s1, o));
        s2 = fold(s2 + __shfl_xor_sync(0xFFFFFFFFu, s2, o));
    }
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) { red1[warp] = s1; red2[warp] = s2; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < (int)(blockDim.x >> 5); ++i) { s1 = fold(s1 + red1[i]); s2 = fold(s2 + red2[i]); }
        out[chunk] = (s2 << 32) | s1;
    }
}
