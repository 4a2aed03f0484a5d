"""Decode graphs' layer tails as persistent product chains (decapybara/backend/product_chain.py): the option
`chains` of `DecodeGraphRunner` (the engine's `product_chains`, off by default: on an H200 a chain ran a layer's
products 1.2x slower than their launches, docs/perf.md's fiftieth session).

A decode step's layer tail (`QwenModel.block_tail`: the output projection with the residual add and the next
norm, the MLP's gate|up product and activation, down with its residual add and norm, the next layer's input
products) is, up to FUSED_ROWS rows over packed or bf16 weights, a run of one-n-tile skinny products, each reading
the one before's output. Launched, each pays its blocks' start, its wait for the product before and its blocks'
spread at the end. `ChainTails` records each tail's launches (`pdl.recording()`), cuts them into runs of
consecutive launches of one kernel module and block width (`product_chain.chain_key`) and runs each run of
CHAIN["min_items"] or more products as one `ProductChain` launch, every other launch as recorded
(`pdl.Launch.make`). A DeltaNet layer's b|a product, which `linear_pair` runs on a side stream beside qkv|z,
becomes the item after qkv|z.

Within a graph capture (`capture_graph`: a warm-up call, then the captured one), layer by layer:
- warm-up: the tail runs as launched (the reference), then is recorded over the same inputs (the arrays it
  allocates meanwhile poisoned), its chains built and run; the two outputs are compared byte for byte. Equal: the
  layer's tail is chained in the capture. Not equal (e.g. an op that `recording()` does not keep ran out of order
  between the products, over poison; `stats["differs"]` says where), or its chains could not be built
  (`stats["errors"]`): the layer stays launched for good and `stats["launched"]` names it.
- capture: the tail is recorded again (over the capture's arrays, not the warm-up's); where its cuts are the
  warm-up's, its chains are launched (graph nodes) and their items, which still name the warm-up's arrays,
  are rewritten by `commit()` once the capture has ended (`ProductChain.retarget`); where they are not
  (`stats["recut"]`), the recording is dropped and the tail launched as without chains.
The last layer's tail (its residual add has no norm after it: an elementwise op) runs as launched.

One ChainTails a graph: its chains run one after another inside it, so they share one set of split-K counters and
one pair of timeout flags (`err`). Every chain's grid must be resident at once (product_chain.py): kernels that run
beside a graph with chains (other streams, other processes) can make its waits time out (`timed_out()`); the decode
graph copies the flag to the host at its end, and `DecodeGraphRunner` turns chains off when it finds it set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np

from decapybara.backend import pdl
from decapybara.backend.product_chain import ProductChain, chain_key, timed_out

# blocks: a chain's grid (None: what the device keeps resident); prefetch: MX_CHAIN_PF (None: the kernel's);
# min_items: the fewest consecutive products of one kernel module that run as a chain
CHAIN: dict[str, Any] = {"blocks": None, "prefetch": None, "min_items": 2}


def cuts(launches: list[pdl.Launch]) -> list[list[pdl.Launch]]:
    """`launches` in order, cut into runs of consecutive launches of one `chain_key` (launches no chain runs
    alone)."""
    out: list[list[pdl.Launch]] = []
    last = None
    for launch in launches:
        key = chain_key(launch)
        if out and key is not None and key == last:
            out[-1].append(launch)
        else:
            out.append([launch])
        last = key
    return out


@dataclass
class _Cut:
    """A run of a tail's launches: a chain, or launches made as recorded (`chain` None)."""

    count: int
    chain: ProductChain | None


@contextlib.contextmanager
def _poisoned_allocations() -> Iterator[None]:
    """Device memory allocated inside (through the current CuPy allocator) is first filled with 0xFF bytes (NaN in
    float32 and bf16) on the current stream. The recorded run of a tail allocates its arrays here: an op that the
    recording does not keep then reads poison, not bytes that the launched run left in memory the allocator hands
    out again."""
    base = cp.cuda.get_allocator()

    def malloc(size: int) -> Any:
        mem = base(size)
        if size:
            mem.memset_async(0xFF, size)
        return mem

    with cp.cuda.using_allocator(malloc):
        yield


def _first_difference(a: Any, b: Any) -> str | None:
    """None where two tails' outputs ((inputs, h)) hold the same bytes, else where they first differ: the output's
    index, its shape, how many of its elements differ and the first one's flat index and values (a host sync)."""
    xs, ys = [*(a[0] or []), a[1]], [*(b[0] or []), b[1]]
    if len(xs) != len(ys):
        return f"{len(xs)} outputs against {len(ys)}"
    for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
        hx, hy = (np.ascontiguousarray(cp.asnumpy(v)) for v in (x, y))
        if hx.shape != hy.shape or hx.dtype != hy.dtype:
            return f"output {k}: {hx.dtype}{hx.shape} against {hy.dtype}{hy.shape}"
        bx, by = hx.reshape(-1).view(np.uint8), hy.reshape(-1).view(np.uint8)
        if not np.array_equal(bx, by):
            diff = np.flatnonzero((bx != by).reshape(-1, hx.dtype.itemsize).any(axis=1))
            j = int(diff[0])
            return (f"output {k} {hx.dtype}{hx.shape}: {diff.size} elements differ, the first at {j}: "
                    f"{hx.reshape(-1)[j]!r} launched, {hy.reshape(-1)[j]!r} chained")
    return None


class ChainTails:
    """A decode graph's layer tails as product chains (module docstring): `QwenModel.forward`'s `tails`
    protocol (`start(model, h)` -> a run whose `tail(i, out, h)` stands in for `block_tail`), and `commit()`
    after the capture."""

    def __init__(self) -> None:
        self.sites: dict[int, list[_Cut] | None] = {}  # layer -> its cuts (None: its tail stays launched)
        self.pending: list[tuple[ProductChain, list[pdl.Launch]]] = []  # chains to retarget after the capture
        self.counters: Any = None  # split-K tile counters of this graph's chains
        self.err: Any = None  # their timeout flags (ProductChain `err`): [0] set once any of their waits gave up
        self.stats: dict[str, Any] = {"chains": 0, "chained_products": 0, "launched": [], "recut": [],
                                      "retargeted": 0, "errors": {}, "differs": {}}

    def start(self, model: Any, h: Any) -> _ChainRun:
        return _ChainRun(self, model)

    def commit(self) -> None:
        """Point the chains launched in the capture that just ended at that capture's arrays (a host sync; call
        after `end_capture`, before the graph's first replay)."""
        for chain, launches in self.pending:
            chain.retarget(launches)
            self.stats["retargeted"] += 1
        self.pending.clear()

    def timed_out(self) -> bool:
        """Whether a wait of any of the chains gave up (their outputs then wrong); a host sync."""
        return self.err is not None and timed_out(self.err)

    def build(self, launches: list[pdl.Launch]) -> list[_Cut]:
        """The cuts of a tail's recorded launches, chains made for runs of CHAIN["min_items"]+ products."""
        site = []
        for part in cuts(launches):
            chain = None
            if len(part) >= CHAIN["min_items"] and chain_key(part[0]) is not None:
                if self.counters is None:  # a graph's first chain (one without chains has no flags to copy)
                    self.counters, self.err = cp.zeros(1 << 16, cp.int32), cp.zeros(2, cp.uint32)
                chain = ProductChain(part, blocks=CHAIN["blocks"], prefetch=CHAIN["prefetch"], counters=self.counters,
                                     err=self.err)
            site.append(_Cut(len(part), chain))
        return site


def _make(site: list[_Cut], parts: list[list[pdl.Launch]], pending: list | None = None) -> None:
    """A tail's cut launches (`parts`, as `cuts` gives them) made by its `site`: each chain launched (with the
    launches it stands for appended to `pending`, to be retargeted at them), the other launches as recorded."""
    for part, cut in zip(parts, site, strict=True):
        if cut.chain is None:
            for launch in part:
                launch.make()
        else:
            cut.chain()
            if pending is not None:
                pending.append((cut.chain, part))


class _ChainRun:
    """One forward's tails (`ChainTails.start`)."""

    def __init__(self, tails: ChainTails, model: Any) -> None:
        self.tails, self.model = tails, model

    def finish(self, h: Any) -> Any:
        return h

    def tail(self, i: int, out: Any, h: Any) -> tuple[Any, Any]:
        if i + 1 >= self.model.cfg.num_hidden_layers:
            return self.model.block_tail(i, out, h)
        return self._captured(i, out, h) if pdl.in_capture() else self._warm(i, out, h)

    def _warm(self, i: int, out: Any, h: Any) -> tuple[Any, Any]:
        """Outside a capture: the tail launched, then recorded (every array it allocates meanwhile poisoned first)
        and chained over the same inputs; the layer is chained in captures if both give the same bytes."""
        tails, model = self.tails, self.model
        ref = model.block_tail(i, out, h)
        if i in tails.sites and tails.sites[i] is None:  # failed its check before: launched for good
            return ref
        with _poisoned_allocations(), pdl.recording() as launches:
            got = model.block_tail(i, out, h)
        try:
            site = tails.build(launches)
        except Exception as e:  # noqa: BLE001 - e.g. the chain kernel's build: the layer stays launched
            site = None
            tails.stats["errors"][i] = f"{type(e).__name__}: {e}"
        if site is None:
            for launch in launches:
                launch.make()
        else:
            _make(site, cuts(launches))
        differs = None if site is None else _first_difference(ref, got)
        if differs is not None:
            tails.stats["differs"][i] = differs
        if site is None or differs is not None:
            tails.sites[i] = None
            if i not in tails.stats["launched"]:
                tails.stats["launched"].append(i)
            return ref
        if i not in tails.sites:
            chained = [c for c in site if c.chain is not None]
            tails.stats["chains"] += len(chained)
            tails.stats["chained_products"] += sum(c.count for c in chained)
        tails.sites[i] = site
        return got

    def _captured(self, i: int, out: Any, h: Any) -> tuple[Any, Any]:
        """In a capture: the warm-up's chains over this call's launches (retargeted by `commit`)."""
        tails, model = self.tails, self.model
        site = tails.sites.get(i)
        if not site or all(c.chain is None for c in site):  # launched as without chains (b|a on its side stream)
            return model.block_tail(i, out, h)
        with pdl.recording() as launches:
            got = model.block_tail(i, out, h)
        parts = cuts(launches)
        if [len(p) for p in parts] != [c.count for c in site] or not all(
                c.chain is None or c.chain.matches(p) for p, c in zip(parts, site, strict=True)):
            tails.stats["recut"].append(i)  # the recording dropped: the tail launched as without chains
            return model.block_tail(i, out, h)
        _make(site, parts, tails.pending)
        return got
