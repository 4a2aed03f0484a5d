"""The RAM tier actor's spills to the disk tier, driven without a cluster (a fake disk tier whose writes the test
lets land one by one): a unit on its way down stays readable, and one taken meanwhile leaves no disk copy."""

from __future__ import annotations

import asyncio

from actors.kv_tier_actors import RamTierActor


class _Method:
    def __init__(self, fn):
        self.remote = fn


class FakeDisk:
    """Writes wait for the test (`gate`); deletes land at once, as a call ahead of a write queued later would."""

    def __init__(self):
        self.units: dict[str, object] = {}
        self.gate: asyncio.Queue = asyncio.Queue()
        self.put_ref = _Method(self._put_ref)
        self.delete = _Method(self._delete)

    def _put_ref(self, key, boxed, next_use=None):
        async def go():
            await self.gate.get()
            self.units[key] = boxed[0]
            return 0
        return asyncio.ensure_future(go())

    def _delete(self, key):
        fut = asyncio.get_event_loop().create_future()
        fut.set_result(self.units.pop(key, None) is not None)
        return fut


def test_units_on_their_way_to_disk_stay_readable_and_a_take_leaves_no_copy():
    async def main():
        disk = FakeDisk()
        ram = RamTierActor(200, disk)
        await ram._keep("conv/a/0", "A", 100, 5.0, None)
        await ram._keep("conv/b/0", "B", 100, 4.0, None)
        spill = asyncio.ensure_future(ram._keep("conv/c/0", "C", 200, 0.0, None))  # spills a, then b
        await asyncio.sleep(0)
        # a's write is in flight, b's not sent yet: both are still found (here, or on the disk)
        for key, ref in (("conv/a/0", "A"), ("conv/b/0", "B")):
            got = ram.get(key)
            assert got == [ref] or disk.units.get(key) == ref, key
        # the engine takes b (a resumed conversation): the RAM tier and the disk tier are both told
        assert ram.pop("conv/b/0") == ["B"]
        await disk.delete.remote("conv/b/0")
        disk.gate.put_nowait(None)
        disk.gate.put_nowait(None)
        assert await spill == 2
        assert disk.units == {"conv/a/0": "A"}  # b was taken: no copy of it is left behind
        assert ram.get("conv/a/0") is None and ram.get("conv/c/0") == ["C"]

    asyncio.run(main())
