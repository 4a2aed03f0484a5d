// Many device-to-device copies in one launch: a hybrid state's per-layer arrays (a speculative draft's rollback,
// a slot copied to another) in one launch where a launch an array took ~6 us of host time each (96 arrays at 27B).
// table [n, 3] int64: source address, destination address, bytes (a multiple of 4). Grid (blocks, n), 256 threads:
// the blocks of column y stride copy y, in 16-byte words where both addresses and the length are multiples of 16,
// else in 4-byte words.

extern "C" __global__ void copy_segments(const long long* __restrict__ table) {
  const long long* t = table + 3 * blockIdx.y;
  const long long src = t[0], dst = t[1], bytes = t[2];
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (((src | dst | bytes) & 15) == 0) {
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    for (long long i = i0; i < bytes / 16; i += stride) d[i] = s[i];
  } else {
    const float* s = (const float*)src;
    float* d = (float*)dst;
    for (long long i = i0; i < bytes / 4; i += stride) d[i] = s[i];
  }
}
