"""What a persistent form of a decode step's products could gain, in reads alone.

    PYTHONUNBUFFERED=1 python3 bench/chain_bound.py        # JSON to $OUT/chain_bound.json

A one-stream step's products read their weights one after another, each behind the one before (its x is the one
before's output). Launched one a product, each pays a fixed cost (its blocks start, wait, and end apart: the
eleventh session's `gemv_fixed`/`gemv_trace`); a persistent kernel whose blocks walk the chain would let a block
done with one product start the next product's reads while the others finish. This times that, with reads only
(bench/chain_bound.cu: no arithmetic, no x), over the bytes of the model's one-row MXFP4 step (codes and scales)
in the step's order (`step_chain`: per layer its input product, out, gate|up, down; lm_head last):

- `launch`: one launch a product, all in one CUDA graph and overlapped (PDL) as a decode graph launches the
  products: a block copies its share's first `ahead` rows to shared memory, waits for the kernel before, reads
  the rest, then lets the next kernel launch. Its `bps` blocks take an SM's shared memory between them, so that, as
  with the products, whose registers fill their SMs, a next kernel's block starts on an SM only as one leaves;
- `spare`: the same launches with only the shared memory of their rows ahead, so that the next kernel's blocks
  start beside them (what products of a smaller footprint would have);
- `persist`: one launch of `bps` blocks an SM, all resident, walking the chain; a product's reads past a block's
  first `ahead` rows wait until every block is done with the product before (counters in global memory);
- `read`: the persistent launch without the waits: the chain's bytes at the read rate, the bound of both.

A variant is kind:layout:bps:ahead[:work]: layout `c` (each block a contiguous share of a product's 4 KB rows, as
the products' stream-K units fall to blocks) or `i` (rows interleaved over the grid, a grid-stride read as
`probe_read`'s); `work` dependent FMAs a thread after each four rows' loads, standing in for a product's arithmetic
(read_pattern.py's `work`; default 0). CHAIN_VARIANTS (comma-separated, default `DEFAULT_VARIANTS`), CHAIN_MODEL
(default qwen3.8-27b), CHAIN_LAYERS (distinct layers of buffers, default 4: a product's bytes are read again four
layers, ~0.8 GB, later, so from DRAM as in a step), CHAIN_ROUNDS (default 7: the variants' graph replays, interleaved).
Each variant's reads are first checked (the xor of every word a block read, against the buffers'); then the table:
ms a step, TB/s, the copy bandwidth's share, the ratio to the fastest `read`, and the cost beyond it a product (us).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from step_products import step_products  # bench/step_products.py

from decapybara.model.config import LINEAR_ATTENTION, ModelConfig, named_config

THREADS = 256
ROW_BYTES = THREADS * 16  # a row of bench/chain_bound.cu: one 16-byte word a thread
KERNEL = ROOT / "bench" / "chain_bound.cu"
KINDS = ("launch", "spare", "persist", "read")
DEFAULT_VARIANTS = ("launch:i:8:0,launch:c:2:0,launch:c:2:8,launch:c:2:24,launch:c:3:4,spare:c:2:0,spare:c:2:8,"
                    "persist:c:2:0,persist:c:2:8,persist:c:2:24,persist:c:3:12,persist:i:2:8,persist:i:4:4,"
                    "read:c:2:0,read:i:6:0,launch:c:2:8:32,persist:c:2:24:32,read:c:2:0:32")


@dataclass(frozen=True)
class Variant:
    kind: str    # launch | spare | persist | read
    layout: int  # 0 contiguous shares, 1 interleaved rows
    bps: int     # blocks an SM
    ahead: int   # rows a block copies to shared memory before its wait
    work: int = 0  # dependent FMAs a thread after each four rows' loads (a stand-in for a product's arithmetic)

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """kind:layout:bps:ahead[:work], e.g. "persist:c:2:8" or "launch:c:2:0:64"."""
        parts = spec.strip().split(":")
        if len(parts) == 4:
            parts.append("0")
        if len(parts) != 5 or parts[0] not in KINDS or parts[1] not in ("c", "i") \
                or not all(p.isdigit() for p in parts[2:]) or int(parts[2]) < 1:
            raise ValueError(f"a variant is {'|'.join(KINDS)}:c|i:<blocks an SM>:<rows ahead>[:<FMAs>], got {spec!r}")
        return cls(parts[0], "ci".index(parts[1]), *map(int, parts[2:]))

    @property
    def name(self) -> str:
        return f"{self.kind}:{'ci'[self.layout]}:{self.bps}:{self.ahead}" + (f":{self.work}" if self.work else "")

    @property
    def launched(self) -> bool:
        """One launch a product (else one launch for the chain)."""
        return self.kind in ("launch", "spare")


def mxfp4_bytes(n: int, k: int) -> int:
    """Bytes of an MXFP4 [N, K] weight: codes (K / 2 a row) and E8M0 scales (K / 32 a row)."""
    return n * (k // 2 + k // 32)


def step_chain(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(role, layer, bytes) of each one-row product of a decode step, in the order the step runs them: per layer
    its input product (qkv|z in a DeltaNet layer, q|k|v in an attention one), out, then the MLP's gate|up and down
    where the model has them (an MoE layer's experts are grouped launches: left out as `step_products` leaves
    them); the lm_head last (layer -1). Shapes from `step_products`, bytes as MXFP4."""
    shapes = {role: shape for role, (shape, _) in step_products(cfg).items()}
    out = []
    for i, kind in enumerate(cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers):
        for role in ("qkv|z" if kind == LINEAR_ATTENTION else "q|k|v", "out", "gate|up", "down"):
            if role in shapes:
                out.append((role, i, mxfp4_bytes(*shapes[role])))
    out.append(("lm_head", -1, mxfp4_bytes(*shapes["lm_head"])))
    return out


def rows_of(nbytes: int) -> int:
    return -(-nbytes // ROW_BYTES)


def load_kernels(cp: Any) -> tuple[Any, Any]:
    """(chain_launch, chain_persistent) of bench/chain_bound.cu."""
    mod = cp.RawModule(code=KERNEL.read_text(), options=("-std=c++17", f"-I{ROOT / 'decapybara' / 'kernels'}"))
    return mod.get_function("chain_launch"), mod.get_function("chain_persistent")


def fill(cp: Any, words: int, seed: int) -> Any:
    """uint32 [words] of a fixed pseudo-random pattern (the high half of a multiplicative hash of the index)."""
    i = cp.arange(words, dtype=cp.uint64)
    offset = np.uint64((seed * 0x632BE59BD9B4E019 + 1) % 2**64)
    return ((i * np.uint64(0x9E3779B97F4A7C15) + offset) >> np.uint64(32)).astype(cp.uint32)


class Chain:
    """The chain's buffers on the device, its launches by variant, and the check of what a launch read."""

    def __init__(self, cp: Any, sizes: list[tuple[Any, int]], sms: int):
        """`sizes`: (buffer key, bytes) of each product in order; products of one key share one buffer."""
        self.cp, self.sms = cp, sms
        self.launch_k, self.persist_k = load_kernels(cp)
        self.bufs: dict[Any, Any] = {}
        self.xor: dict[Any, int] = {}
        for key, nbytes in sizes:
            if key not in self.bufs:
                buf = fill(cp, rows_of(nbytes) * ROW_BYTES // 4, len(self.bufs))
                self.bufs[key] = buf
                self.xor[key] = int(np.bitwise_xor.reduce(cp.asnumpy(buf)))
        self.keys = [key for key, _ in sizes]
        self.rows = [rows_of(nbytes) for _, nbytes in sizes]
        self.nbytes = sum(r * ROW_BYTES for r in self.rows)
        from decapybara.backend import cupy_ops  # its device-pointer helper (the host emulator's too)

        self.ptrs = cp.asarray(np.array([cupy_ops.dev_ptr(self.bufs[k]) for k in self.keys], np.uint64))
        self.rows_dev = cp.asarray(np.array(self.rows, np.uint64))
        self.counters = cp.zeros(len(self.keys) + 1, cp.uint32)
        self.sums = cp.zeros(len(self.keys), cp.uint32)
        self.err = cp.zeros(1, cp.uint32)
        self.seen = cp.zeros(len(self.keys), cp.uint32)  # check(): the fewest blocks done a block saw (.cu)
        self.allowed: dict[int, int] = {}  # dynamic shared memory allowed each kernel (`kernel`)

    def smem(self, v: Variant) -> int:
        """Dynamic shared memory of a block of the variant: its rows ahead; a `launch` block at least its share of
        an SM's (less the 1 KB the device keeps a block), so that `bps` of them fill the SM."""
        ahead = v.ahead * ROW_BYTES
        if v.kind != "launch":
            return ahead
        attrs = self.cp.cuda.Device().attributes
        share = (attrs["MaxSharedMemoryPerMultiprocessor"] // v.bps - 1024) // 128 * 128
        return max(ahead, min(share, attrs["MaxSharedMemoryPerBlockOptin"]))

    def kernel(self, v: Variant) -> Any:
        """The variant's kernel, allowed its shared memory (past the 48 KB a launch gets unasked). The allowance
        only grows, so that graphs captured for other variants before stay valid."""
        kernel = self.launch_k if v.launched else self.persist_k
        if self.smem(v) > self.allowed.get(id(kernel), 48 * 1024):
            kernel.max_dynamic_shared_size_bytes = self.allowed[id(kernel)] = self.smem(v)
        return kernel

    def resident(self, v: Variant) -> int:
        """Blocks of the variant's kernel an SM keeps resident at its shared memory (0 where not known)."""
        from decapybara.backend import pdl

        return pdl.resident_blocks(self.kernel(v), THREADS, self.smem(v)) or 0

    def run(self, v: Variant, launch: Any = None, record: bool = False) -> None:
        """Enqueue the variant's reads of the whole chain (`launch`: how a launch-a-product kernel is launched, e.g.
        decapybara.backend.pdl.launch; default the CuPy call). `record`: the persistent launch keeps, in `seen`, how
        many blocks were done with each product's predecessor when a block went on to it."""
        grid, kernel, smem = self.sms * v.bps, self.kernel(v), self.smem(v)
        if v.launched:
            for p, key in enumerate(self.keys):
                args = (self.bufs[key], np.int64(self.rows[p]), np.int32(v.ahead), np.int32(v.layout),
                        np.int32(v.work), self.sums[p:p + 1])
                if launch is None:
                    kernel((grid,), (THREADS,), args, shared_mem=smem)
                else:
                    launch(kernel, (grid,), (THREADS,), args, smem)
            return
        kernel((grid,), (THREADS,), (self.ptrs, self.rows_dev, np.int32(len(self.keys)), np.int32(v.ahead),
                                     np.int32(v.layout), np.int32(v.work), np.int32(v.kind == "persist"),
                                     self.counters, self.sums, self.err, self.seen if record else None),
               shared_mem=smem)

    def check(self, v: Variant, launch: Any = None) -> list[str]:
        """Run the variant once and return what is wrong: products whose xor of the words read differs from
        their buffer's (a row read twice or never), a timed-out wait, counters not zeroed, and (`persist`) a
        product a block went on to before every block was done with the one before."""
        self.reset()
        self.run(v, launch, record=True)
        return self.problems(v, record=True)

    def reset(self) -> None:
        """The read sums, the timeout flag and the counts seen, as a checked run starts from (then a device sync)."""
        self.sums[...] = 0
        self.err[...] = 0
        self.seen[...] = np.uint32(0xFFFFFFFF)
        self.cp.cuda.runtime.deviceSynchronize()

    def problems(self, v: Variant, record: bool) -> list[str]:
        """What is wrong with the run since `reset` (see `check`; the counts seen where it `record`ed them). A
        timed-out wait is reported alone: the counts after it say nothing more."""
        cp = self.cp
        sums = cp.asnumpy(self.sums)
        bad = [f"product {p} ({k}): xor {int(sums[p]):#x}, its buffer's {self.xor[k]:#x}"
               for p, k in enumerate(self.keys) if int(sums[p]) != self.xor[k]]
        timed_out = bool(int(cp.asnumpy(self.err)[0]))
        if timed_out:
            bad.append("a wait timed out (blocks not all resident)")
        if cp.asnumpy(self.counters).any():
            bad.append(f"counters left {cp.asnumpy(self.counters).tolist()}")
        if v.kind == "persist" and record and not timed_out:
            blocks, seen = self.sms * v.bps, cp.asnumpy(self.seen)
            bad += [f"product {p}: a block went on with {int(seen[p])} of {blocks} blocks done with product {p - 1}"
                    for p in range(1, len(self.keys)) if int(seen[p]) != blocks]
        return bad


def measure(c: Chain, variants: list[Variant], rounds: int) -> tuple[dict[str, list[float]], dict[str, list[str]]]:
    """(seconds of each checked variant's graph replays, `rounds` of them interleaved with the other variants' after
    one untimed; what is wrong with the others, or why they were skipped). Each variant's launches are checked once,
    then captured in a CUDA graph of its own (launch-a-product kernels overlapped, as a decode graph's); after the
    timing each graph is replayed once more and checked the same way (all but the counts seen, which its
    launches do not keep), and a variant whose graph reads wrong, or whose wait timed out, is dropped."""
    import cupy as cp
    from gpu import interleaved_times  # bench/gpu.py

    from decapybara.backend import pdl
    from decapybara.backend.cuda_graph import capture_graph

    graphs, wrong = {}, {}
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    for v in variants:
        have = c.resident(v)
        if v.kind == "persist" and have and have < v.bps:  # its waits need every block resident
            wrong[v.name] = [f"skipped: {have} blocks an SM resident at {c.smem(v)} B of shared memory"]
            continue
        if v.kind == "launch" and have and have != v.bps:  # the blocks would not fill their SMs as meant
            wrong[v.name] = [f"skipped: {have} blocks an SM resident, not {v.bps}, at {c.smem(v)} B"]
            continue
        bad = c.check(v, pdl.launch)
        if bad:
            wrong[v.name] = bad[:8]
            continue
        graphs[v.name] = capture_graph(lambda v=v: c.run(v, pdl.launch), stream, pool)[0]
    times = interleaved_times(graphs, stream, rounds)
    if int(cp.asnumpy(c.err)[0]):  # a persistent launch's wait gave up while timed: its timings are not of waits
        for name in [n for n in times if Variant.parse(n).kind == "persist"]:
            wrong[name] = ["a wait timed out during the timed replays"]
            del times[name]
    for name, graph in graphs.items():
        if name not in times:
            continue
        c.reset()
        graph.launch(stream)
        stream.synchronize()
        bad = c.problems(Variant.parse(name), record=False)
        if bad:
            wrong[name] = ["its graph: " + b for b in bad[:8]]
            del times[name]
    return times, wrong


def main() -> int:
    import cupy as cp
    from gpu import bench_roofline  # bench/gpu.py

    from decapybara.backend import pdl

    model = os.environ.get("CHAIN_MODEL", "qwen3.8-27b")
    layers = int(os.environ.get("CHAIN_LAYERS", "4"))
    rounds = int(os.environ.get("CHAIN_ROUNDS", "7"))
    variants = [Variant.parse(s) for s in os.environ.get("CHAIN_VARIANTS", DEFAULT_VARIANTS).split(",")]
    pdl.MODE["pdl"] = os.environ.get("DECAPYBARA_PDL", "1")
    copy_bw = bench_roofline() * 1e9
    chain = step_chain(named_config(model))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    c = Chain(cp, [((role, layer % layers if layer >= 0 else -1), nbytes) for role, layer, nbytes in chain], sms)
    print(f"{model}: {len(chain)} products a step, {c.nbytes / 1e9:.2f} GB (MXFP4), {len(c.bufs)} distinct buffers; "
          f"{sms} SMs; copy bandwidth {copy_bw / 1e12:.2f} TB/s; at it {c.nbytes / copy_bw * 1e3:.3f} ms")
    times, wrong = measure(c, variants, rounds)
    for name, why in wrong.items():
        print(f"{name}: {'; '.join(why[:4])}")
    res: dict[str, Any] = {"model": model, "products": len(chain), "bytes": c.nbytes, "copy_Bps": copy_bw,
                           "variants": {n: {"wrong": w} for n, w in wrong.items()}}
    med = {n: float(np.median(ts)) for n, ts in times.items()}
    reads = [t for n, t in med.items() if n.startswith("read:")]
    best = min(reads) if reads else min(med.values())
    print(f"\n{'variant':<18}{'ms':>8}{'TB/s':>7}{'% copy':>8}{'x read':>8}{'us/product':>12}  (medians of {rounds})")
    for name, t in med.items():
        extra = (t - best) / len(chain) * 1e6
        print(f"{name:<18}{t * 1e3:8.3f}{c.nbytes / t / 1e12:7.2f}{100 * c.nbytes / copy_bw / t:8.1f}"
              f"{t / best:8.3f}{extra:12.2f}")
        res["variants"][name] = {"s": t, "rounds_s": times[name], "x_read": t / best, "us_per_product": extra}
    Path(os.environ.get("OUT", ".")).joinpath("chain_bound.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
