"""The engine with the KV tiers: pause to RAM / disk / across a restart and resume exactly, no re-prefill,
evicted prefix pages restored instead of recomputed, damaged or lost units recomputed (never wrong output)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request
from decapybara.kv.disk_tier import DiskTierStore
from decapybara.kv.ram_tier import RamTierStore
from decapybara.kv.stores import TierStores
from decapybara.kv.tiers import KVTiers
from decapybara.testing import tiny_qwen

GREEDY = SamplingParams(temperature=0, max_tokens=40)


@functools.cache
def model(family: str):
    return tiny_qwen(family)[0]


def make_engine(family: str, url: str, ram_bytes: int, kv_mode=None, **kw) -> tuple[Engine, TierStores]:
    cfg = dict(page_size=8, num_pages=64, loop_guard="stop", kv_mode=kv_mode, snapshot_interval=8)
    cfg.update(kw)
    engine = Engine(model(family), EngineConfig(**cfg))
    stores = TierStores(KVTiers(RamTierStore(ram_bytes), DiskTierStore(url, 64 << 20)), engine.blocks.salt)
    engine.bundle_store = stores
    engine.set_page_store(stores)
    return engine, stores


def run_until_done(engine: Engine, outs: dict[str, list[int]]) -> None:
    while engine.has_work():
        for ev in engine.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("where", ["ram", "disk", "restart"])
@pytest.mark.parametrize("kv_mode", [None, "8/8", "6/4"])
def test_pause_to_tier_and_resume_is_exact(family, where, kv_mode, tmp_path):
    p = prompt(1, 29)
    ref = Engine(model(family), EngineConfig(page_size=8, num_pages=64, kv_mode=kv_mode)).generate([p], GREEDY)[0]
    url = f"file://{tmp_path}/kv"
    engine, stores = make_engine(family, url, ram_bytes=(64 << 20) if where == "ram" else 0, kv_mode=kv_mode)
    engine.add_request(Request(tuple(p), GREEDY, "agent"))
    outs: dict[str, list[int]] = {}
    pause_at = int(np.random.default_rng(hash((family, where, kv_mode)) % 2**32).integers(3, 12))
    for _ in range(pause_at):
        for ev in engine.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
    seq = engine.seqs["agent"]
    engine.admission = lambda e: None  # nothing resumes it behind the test's back
    engine.pause(seq)
    key = seq.paused_bundle
    assert stores.tiers.where(key) == ("ram" if where == "ram" else "disk")
    computed = engine.stats.computed_prompt_tokens
    if where == "restart":  # a new server: fresh tiers over the same disk, a fresh engine
        del engine, stores
        engine, stores = make_engine(family, url, 64 << 20, kv_mode=kv_mode)
        assert key in stores.tiers.disk.keys()
        seq = engine.import_paused(stores.take_unit(key))
        computed = engine.stats.computed_prompt_tokens
        assert seq.num_computed > 0
    else:
        engine.admission = lambda e: None
    assert engine.resume(seq)
    engine.admission = lambda e: None
    run_until_done(engine, outs)
    assert outs["agent"] == ref
    assert engine.stats.computed_prompt_tokens == computed  # nothing prefilled again
    assert engine.stats.lost_bundles == 0


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_disk_unit_falls_back_to_recompute(damage, tmp_path):
    p = prompt(2, 21)
    ref = Engine(model("qwen3_5_text"), EngineConfig(page_size=8, num_pages=64)).generate([p], GREEDY)[0]
    engine, stores = make_engine("qwen3_5_text", f"file://{tmp_path}/kv", ram_bytes=0)
    engine.add_request(Request(tuple(p), GREEDY, "agent"))
    outs: dict[str, list[int]] = {}
    for _ in range(6):
        for ev in engine.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
    seq = engine.seqs["agent"]
    engine.pause(seq)
    path = stores.tiers.disk.path_of(seq.paused_bundle).replace("file://", "")
    raw = bytearray(open(path, "rb").read())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x40
    else:
        raw = raw[: len(raw) // 3]
    open(path, "wb").write(bytes(raw))
    run_until_done(engine, outs)  # the default policy resumes it: the unit is found damaged
    assert engine.stats.lost_bundles == 1 and stores.tiers.disk.stats["corrupt"] == 1
    assert outs["agent"] == ref  # recomputed from its tokens: the output is still exact


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text", "qwen3_5_text without snapshots"])
def test_evicted_prefix_pages_are_restored_not_recomputed(family, tmp_path):
    """... and a tier copy that comes back without the state snapshot it was recorded with (a store shared with
    another writer, say) is taken as lost, never resumed from a zeroed state."""
    bare = family.endswith("without snapshots")
    family = family.split()[0]
    engine, stores = make_engine(family, f"file://{tmp_path}/kv", ram_bytes=1 << 20, num_pages=12,
                                 loop_guard="off")
    system = prompt(3, 40)  # five pages
    first = system + prompt(4, 3)
    outs: dict[str, list[int]] = {}
    engine.add_request(Request(tuple(first), SamplingParams(temperature=0, max_tokens=4), "a"))
    run_until_done(engine, outs)
    for i in range(3):  # other traffic pushes the system prompt's pages out of the 12-page pool
        engine.add_request(Request(tuple(prompt(10 + i, 60)), SamplingParams(temperature=0, max_tokens=4), f"x{i}"))
        run_until_done(engine, outs)
    assert engine.stats.offloaded_pages >= 5
    second = system + prompt(5, 9)
    before = engine.stats.computed_prompt_tokens
    if bare:
        fetch_many = stores.fetch_many
        stores.fetch_many = lambda hs: [None if got is None else (got[0], None) for got in fetch_many(hs)]
    engine.add_request(Request(tuple(second), GREEDY, "b"))
    run_until_done(engine, outs)
    if bare:
        assert engine.stats.lost_pages >= 1 and engine.stats.computed_prompt_tokens - before == len(second)
    else:
        assert engine.stats.restored_pages >= 5
        assert engine.stats.computed_prompt_tokens - before == len(second) - 40  # the system prompt came back
    ref = Engine(model(family), EngineConfig(page_size=8, num_pages=64, enable_prefix_cache=False, loop_guard="off",
                                             max_model_len=engine.max_model_len)).generate([second], GREEDY)[0]
    assert outs["b"] == ref  # to the same served context (the 12-page pool's: 11 pages for one conversation)


def test_fixed_context_mode_reserves_the_whole_context_and_never_pauses():
    ps = [prompt(20 + i, 20) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30)
    ref = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=256)).generate(ps, params)
    e = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=28, context_mode="fixed",
                                            enable_prefix_cache=False))
    assert e.generate(ps, params) == ref
    assert e.stats.pauses == 0  # admission waited for room instead
    pooled = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=28, enable_prefix_cache=False))
    assert pooled.generate(ps, params) == ref and pooled.stats.pauses > 0


def test_fixed_context_mode_reserves_the_whole_context_again_on_resume():
    """A conversation the policy pauses in fixed mode comes back with its whole context reserved, as at its
    admission, and its greedy tokens are the uninterrupted run's."""
    p, params = prompt(21, 20), SamplingParams(temperature=0, max_tokens=30)
    ref = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=64)).generate([p], params)[0]
    e = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=28, context_mode="fixed", loop_guard="off"))
    seq = e.add_request(Request(tuple(p), params, "a"))
    out = []
    for _ in range(5):
        out += [t for ev in e.step() for t in ev.token_ids]
    whole = e.blocks.pages_for(20 + 30)
    assert len(seq.pages) == whole
    e.pause(seq)
    assert e.resume(seq) and len(seq.pages) == whole
    while e.has_work():
        out += [t for ev in e.step() for t in ev.token_ids]
    assert out == ref


@pytest.mark.parametrize("mode", ["pool", "fixed"])
def test_an_admission_short_of_pages_reads_no_tier_pages(tmp_path, mode):
    """Where the pool cannot take a request, its admission refuses before fetching the tier-held pages of its
    prefix (disk reads on the engine's thread, for nothing, at every retry); with room it fetches and restores."""
    engine, stores = make_engine("qwen3", f"file://{tmp_path}/kv", ram_bytes=1 << 20, num_pages=12, loop_guard="off",
                                 context_mode=mode)
    system = prompt(3, 40)  # five pages
    outs: dict[str, list[int]] = {}
    engine.add_request(Request(tuple(system + prompt(4, 3)), SamplingParams(temperature=0, max_tokens=4), "a"))
    run_until_done(engine, outs)
    for i in range(3):  # other traffic pushes the system prompt's pages out of the pool into the tiers
        engine.add_request(Request(tuple(prompt(10 + i, 60)), SamplingParams(temperature=0, max_tokens=4), f"x{i}"))
        run_until_done(engine, outs)
    assert engine.stats.offloaded_pages >= 5
    fetches = []
    fetch_many = stores.fetch_many
    stores.fetch_many = lambda hs: fetches.extend(hs) or fetch_many(hs)
    hog = engine.add_request(Request(tuple(prompt(20, 70)), SamplingParams(temperature=0, max_tokens=4), "hog"))
    engine.admit(hog)  # nine of the eleven usable pages
    seq = engine.add_request(Request(tuple(system + prompt(5, 9)), GREEDY, "b"))
    for _ in range(3):
        assert not engine.admit(seq)
    assert fetches == []
    engine.abort("hog")
    assert engine.admit(seq) and len(fetches) >= 5 and engine.stats.restored_pages >= 5


def test_an_adopted_conversation_keeps_stop_strings_out_of_its_reasoning(tmp_path):
    """A paused conversation adopted from the disk tier by a new engine (a restart) rebuilds its detokeniser as
    the live run fed it: a stop string in the reasoning does not end the answer after it."""
    from decapybara.testing import make_tokenizer_json
    from decapybara.tokenizer import Tokenizer

    tok = Tokenizer.from_json(make_tokenizer_json())
    sp = tok.special_ids
    script = [sp.think, *tok.encode("\nA > B, think.\n"), sp.end_think, *tok.encode("\n\nAnswer here > there.")]

    def scripted(seq, logits):
        out = np.full_like(logits, -30.0)
        i = seq.num_tokens - seq.num_prompt
        out[script[i] if i < len(script) else tok.eos_token_ids[0]] = 30.0
        return out

    def engine(url: str) -> tuple[Engine, TierStores]:
        e = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=64, loop_guard="off"), tokenizer=tok,
                   logits_processor=scripted)
        stores = TierStores(KVTiers(RamTierStore(0), DiskTierStore(url, 64 << 20)), e.blocks.salt)
        e.bundle_store = stores
        e.set_page_store(stores)
        return e, stores

    params, p = SamplingParams(temperature=0, max_tokens=60, stop=(">",)), tuple(tok.encode("hello there"))
    ref = engine(f"file://{tmp_path}/ref")[0]
    ref.add_request(Request(p, params, "r"))
    ref_text = ""
    while ref.has_work():
        ref_text += "".join(ev.text for ev in ref.step())
    assert ref_text.endswith("Answer here ")
    e, stores = engine(f"file://{tmp_path}/kv")
    seq = e.add_request(Request(p, params, "r"))
    text = ""
    while seq.num_output < script.index(sp.end_think) + 2:  # just after the reasoning closed
        text += "".join(ev.text for ev in e.step())
    e.pause(seq)
    key = seq.paused_bundle
    e, stores = engine(f"file://{tmp_path}/kv")  # a restart: the unit is adopted from the disk tier
    seq = e.import_paused(stores.take_unit(key))
    assert e.resume(seq)
    while e.has_work():
        text += "".join(ev.text for ev in e.step())
    assert text == ref_text


@pytest.mark.parametrize("where", ["ram", "disk", "lost", "evicted again"])
def test_a_resumed_conversations_next_turn_reuses_its_prompt(where, tmp_path):
    """A conversation paused while the pool gave its cached prompt pages to the tiers (their state snapshots with
    them) comes back from its bundle, which puts those pages in the pool again without their snapshots. The next
    turn still reuses the prompt: the snapshot comes back from the tier copy, and the turn's tokens are those of
    a run that never paused; also where the pool evicts those pages once more before it (a copy without the
    snapshot does not replace the tier's). A tier copy lost meanwhile is forgotten, and the turn computes what it
    must."""
    p1 = prompt(1, 100)
    p2 = p1 + prompt(2, 40)
    cfg = {"page_size": 8, "num_pages": 64, "loop_guard": "stop"}
    ref = Engine(model("qwen3_5_text"), EngineConfig(**cfg)).generate([p1, p2], GREEDY)
    engine, _ = make_engine("qwen3_5_text", f"file://{tmp_path}/kv", (64 << 20) if where == "ram" else 0,
                            snapshot_interval=256)
    engine.add_request(Request(tuple(p1), GREEDY, "t1", conversation="A"))
    outs: dict[str, list[int]] = {}
    for _ in range(5):  # the prompt computed, a few tokens decoded
        for ev in engine.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
    seq, policy = engine.seqs["t1"], engine.admission
    engine.admission = lambda e: None
    engine.pause(seq)
    engine.blocks.evict_all_cached()  # the pool needed the pages meanwhile: they go to the tiers
    with_snapshots = sum(engine.page_store._pages.values())  # tier copies with a state snapshot
    assert engine.resume(seq)
    engine.admission = policy
    run_until_done(engine, outs)
    if where == "evicted again":
        offloaded = engine.stats.offloaded_pages
        engine.blocks.evict_all_cached()
        # all 17 full pages (139 tokens computed) but those whose tier copy has a snapshot the page lacks
        assert 0 < with_snapshots and engine.stats.offloaded_pages - offloaded == 139 // 8 - with_snapshots
    before, snapshots = engine.stats.reused_prompt_tokens, engine.stats.restored_snapshots
    if where == "lost":  # every tier copy gone: no snapshot comes back
        engine.page_store.fetch_many = lambda hs: [None] * len(hs)
    engine.add_request(Request(tuple(p2), GREEDY, "t2", conversation="A"))
    run_until_done(engine, outs)
    if where == "lost":
        assert engine.stats.reused_prompt_tokens - before < 96 and engine.stats.lost_pages >= 1
    else:  # the prompt's last page boundary before token 100
        assert engine.stats.reused_prompt_tokens - before == 96
        assert engine.stats.restored_snapshots - snapshots == (where != "evicted again")  # else with its page
    assert [outs["t1"], outs["t2"]] == ref


@pytest.mark.parametrize("other", ["kv_mode", "weights", "page_size"])
def test_a_paused_conversation_is_adopted_only_by_an_engine_on_its_model(other, tmp_path):
    """A conversation unit carries its engine's mark (model config, weights, KV mode, page size): an engine that
    differs in any refuses to adopt it before taking pool pages, instead of failing inside its resume (another KV
    mode's arrays) or resuming it over KV another set of weights computed (wrong output)."""
    import copy

    from decapybara.errors import ConfigError

    url = f"file://{tmp_path}/kv"
    engine, stores = make_engine("qwen3_5_text", url, 0)  # no RAM tier: the unit goes to disk, as for a restart
    engine.add_request(Request(tuple(prompt(1, 29)), GREEDY, "agent"))
    for _ in range(4):
        engine.step()
    seq = engine.seqs["agent"]
    engine.admission = lambda e: None
    engine.pause(seq)
    key = seq.paused_bundle
    del engine, stores
    same, _ = make_engine("qwen3_5_text", url, 0)  # (its re-put of the adopted unit goes to disk again)
    assert same.import_paused(same.bundle_store.tiers.get(key, promote=False)).request_id == "agent"  # its own
    if other == "weights":  # the same architecture, other weights (another preset of one model, say)
        m = copy.copy(model("qwen3_5_text"))
        m.weights_id = "another file"
        engine = Engine(m, EngineConfig(page_size=8, num_pages=64, loop_guard="stop", snapshot_interval=8))
        stores = TierStores(KVTiers(RamTierStore(64 << 20), DiskTierStore(url, 64 << 20)), engine.blocks.salt)
        engine.bundle_store = stores
        engine.set_page_store(stores)
    else:
        engine, stores = make_engine("qwen3_5_text", url, 64 << 20,
                                     **({"kv_mode": "8/8"} if other == "kv_mode" else {"page_size": 16}))
    free = engine.blocks.num_free
    with pytest.raises(ConfigError, match="another model"):
        engine.import_paused(stores.take_unit(key))
    assert engine.blocks.num_free == free and not engine.seqs  # nothing taken


def test_a_store_that_fails_to_keep_an_evicted_page_loses_only_its_copy(tmp_path):
    """A tier store that raises on an evicted page (a backend's own error, not an OSError) costs that page's copy:
    the pool keeps the page, the step goes on, and the outputs are exact."""
    engine, stores = make_engine("qwen3_5_text", f"file://{tmp_path}/kv", ram_bytes=1 << 20, num_pages=12,
                                 loop_guard="off")

    def broken(*args):
        raise NotImplementedError("this backend cannot write")

    stores.offload = broken
    outs: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0, max_tokens=4)
    ps = [prompt(30 + i, 60) for i in range(4)]
    for i, p in enumerate(ps):  # each pushes the one before out of the 12-page pool
        engine.add_request(Request(tuple(p), params, f"x{i}"))
        run_until_done(engine, outs)
    assert engine.stats.lost_pages > 0 and engine.stats.offloaded_pages == 0
    assert engine.blocks.num_free == engine.blocks.num_pages  # every page obtainable again
    ref = Engine(model("qwen3_5_text"), EngineConfig(page_size=8, num_pages=64, loop_guard="off",
                                                      max_model_len=engine.max_model_len)).generate(ps, params)
    assert [outs[f"x{i}"] for i in range(4)] == ref


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_a_restarted_engine_restores_the_prefix_cache_it_saved(family, tmp_path):
    """A graceful stop saves the pool's pages to the disk tier (`save_cached_pages`); an engine started over the same
    disk adopts them (`adopt_pages`), and a prompt that starts the same way prefills only its new tokens, with the
    greedy tokens of an engine without any cache. An engine on another KV mode adopts none of them."""
    url = f"file://{tmp_path}/kv"
    engine, stores = make_engine(family, url, ram_bytes=64 << 20, loop_guard="off")
    system = prompt(3, 40)  # five pages
    engine.add_request(Request(tuple(system + prompt(4, 3)), SamplingParams(temperature=0, max_tokens=4), "a"))
    run_until_done(engine, {})
    assert engine.stats.offloaded_pages == 0  # nothing was evicted: the pages are only in the pool
    saved = engine.save_cached_pages()
    assert saved == 5 and engine.stats.saved_pages == 5 and engine.stats.offloaded_pages == 0
    assert engine.save_cached_pages() == 0  # held already
    assert engine.save_cached_pages(budget_s=0) == 0
    del engine, stores

    engine, stores = make_engine(family, url, ram_bytes=64 << 20, loop_guard="off")  # fresh RAM, the same disk
    assert make_engine(family, url, ram_bytes=0, kv_mode="8/8")[1].adopt_pages() == 0  # another salt
    assert stores.adopt_pages() == saved and stores.adopt_pages() == 0
    second = system + prompt(5, 9)
    outs: dict[str, list[int]] = {}
    engine.add_request(Request(tuple(second), GREEDY, "b"))
    run_until_done(engine, outs)
    assert engine.stats.restored_pages == 5 and engine.stats.lost_pages == 0
    assert engine.stats.computed_prompt_tokens == len(second) - 40
    ref = Engine(model(family), EngineConfig(page_size=8, num_pages=64, enable_prefix_cache=False, loop_guard="off",
                                             max_model_len=engine.max_model_len)).generate([second], GREEDY)[0]
    assert outs["b"] == ref


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_a_server_learns_the_pages_another_one_writes_to_a_shared_disk(family, tmp_path, monkeypatch):
    """Two engines on one disk folder, each with its own RAM tier: the pages one writes after the other started
    reach the other as news (`TierStores.news`, `adopt`: the GPU actor asks every NEWS_S), so a prompt the second
    never saw restores them instead of prefilling them, with the greedy tokens of an engine without any cache;
    news comes once, and an engine on another KV mode learns none of them."""
    from decapybara.kv import disk_tier

    monkeypatch.setattr(disk_tier, "NEWS_LIST_S", 0.0)  # each call lists the folder (else every minute at most)
    monkeypatch.setattr(disk_tier, "NEWS_LIST_TIMES", 0)
    url = f"file://{tmp_path}/kv"
    first, first_stores = make_engine(family, url, ram_bytes=64 << 20, loop_guard="off")
    second, second_stores = make_engine(family, url, ram_bytes=64 << 20, loop_guard="off")
    other = make_engine(family, url, ram_bytes=0, kv_mode="8/8")[1]
    assert second_stores.adopt_pages() == 0 and second_stores.news()[1] == {} and other.news()[1] == {}
    system = prompt(3, 40)  # five pages
    first.add_request(Request(tuple(system + prompt(4, 3)), SamplingParams(temperature=0, max_tokens=4), "a"))
    run_until_done(first, {})
    assert first.save_cached_pages() == 5
    mark, news = second_stores.news()
    assert len(news) == 5 and other.news()[1] == {}
    assert second_stores.news()[1] == news  # not adopted (the engine's thread did not take it): it comes again
    assert second_stores.adopt(news, mark) == 5 and second_stores.adopt(news, mark) == 0
    assert second_stores.news()[1] == {}
    ask = system + prompt(5, 9)
    outs: dict[str, list[int]] = {}
    second.add_request(Request(tuple(ask), GREEDY, "b"))
    run_until_done(second, outs)
    assert second.stats.restored_pages == 5 and second.stats.computed_prompt_tokens == len(ask) - 40
    ref = Engine(model(family), EngineConfig(page_size=8, num_pages=64, enable_prefix_cache=False, loop_guard="off",
                                             max_model_len=second.max_model_len)).generate([ask], GREEDY)[0]
    assert outs["b"] == ref


def test_a_save_stops_where_the_disk_keeps_no_room(tmp_path):
    """The pages a save ranks first are the ones kept: live requests' pages, then the most recently used."""
    engine, stores = make_engine("qwen3", f"file://{tmp_path}/kv", ram_bytes=64 << 20, loop_guard="off")
    for i in range(3):
        engine.add_request(Request(tuple(prompt(30 + i, 17)), SamplingParams(temperature=0, max_tokens=2), f"r{i}"))
        run_until_done(engine, {})
    newest = engine.blocks.hash_of_page[next(reversed(engine.blocks.lru))]
    unit_bytes = stores.tiers.disk.used_bytes
    assert unit_bytes == 0
    probe = engine.save_cached_pages()
    assert probe == 6
    size = stores.tiers.disk.used_bytes // probe
    engine, stores = make_engine("qwen3", f"file://{tmp_path}/small", ram_bytes=64 << 20, loop_guard="off")
    stores.tiers.disk.set_budget(4 * size)
    for i in range(3):
        engine.add_request(Request(tuple(prompt(30 + i, 17)), SamplingParams(temperature=0, max_tokens=2), f"r{i}"))
        run_until_done(engine, {})
    assert engine.save_cached_pages() == 4
    assert stores.lookup(newest) and len(stores.tiers.disk) == 4


def test_a_save_takes_the_ram_tiers_pages_too_and_a_restart_keeps_its_ranks(tmp_path):
    """Pages evicted to the RAM tier (which does not outlive the process) are saved after the pool's; the saved
    pages lose their ranks when the save ends, and the disk's recency follows them, across a restart too: the
    pool's most recently used page is evicted last, the RAM tier's least recent first."""
    url = f"file://{tmp_path}/kv"
    engine, stores = make_engine("qwen3", url, ram_bytes=64 << 20, num_pages=12, loop_guard="off")
    system = prompt(3, 40)  # five pages
    engine.add_request(Request(tuple(system + [1, 2, 3]), SamplingParams(temperature=0, max_tokens=4), "a"))
    run_until_done(engine, {})
    for i in range(3):  # its pages go to the RAM tier
        engine.add_request(Request(tuple(prompt(10 + i, 60)), SamplingParams(temperature=0, max_tokens=4), f"x{i}"))
        run_until_done(engine, {})
    in_ram = [k for k in stores.tiers.ram.keys() if k.startswith("page/")]
    assert len(in_ram) >= 5 and len(stores.tiers.disk) == 0
    pool = [engine.blocks.hash_of_page[p] for p in reversed(engine.blocks.lru) if p in engine.blocks.hash_of_page]
    saved = engine.save_cached_pages()
    assert saved == len(pool) + len(in_ram) and len(stores.tiers.disk) == saved
    disk = stores.tiers.disk
    assert all(disk.next_use(k) is None for k in disk.keys())  # the ranks are gone with the save
    from decapybara.kv.units import page_key
    newest = page_key(engine.blocks.salt, pool[0])
    for order in (disk.eviction_order(), DiskTierStore(url, 64 << 20).eviction_order()):  # and after a restart
        assert order[-1] == newest and order[0] in in_ram
    engine, stores = make_engine("qwen3", url, ram_bytes=0, loop_guard="off")
    assert stores.adopt_pages() == saved
    second = system + prompt(5, 9)
    before = engine.stats.computed_prompt_tokens
    engine.add_request(Request(tuple(second), GREEDY, "b"))
    run_until_done(engine, {})
    assert engine.stats.computed_prompt_tokens - before == len(second) - 40  # the RAM tier's pages came back


@pytest.mark.parametrize("pause_at", [1, 6])
def test_prompt_logprobs_survive_a_pause_across_a_restart(pause_at, tmp_path):
    """A request for prompt logprobs paused to disk mid-prompt (its first chunk's computed, not yet sent) or after
    they went out, then adopted by a fresh engine: the first event carries every prompt token's logprob as the
    uninterrupted run's, and no later event carries them again."""
    p = prompt(5, 29)
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2)
    plain = Engine(model("qwen3_5_text"), EngineConfig(page_size=8, num_pages=64, max_batch_tokens=12, max_slots=2))
    plain.add_request(Request(tuple(p), params, "agent"))
    ref = [ev for _ in range(100) if plain.has_work() for ev in plain.step()]
    url = f"file://{tmp_path}/kv"
    engine, stores = make_engine("qwen3_5_text", url, ram_bytes=0, max_batch_tokens=12, max_slots=2)
    engine.add_request(Request(tuple(p), params, "agent"))
    events = [ev for _ in range(pause_at) for ev in engine.step()]
    seq = engine.seqs["agent"]
    assert (seq.num_computed < len(p)) == (pause_at == 1)
    engine.admission = lambda e: None
    engine.pause(seq)
    key = seq.paused_bundle
    del engine, stores
    engine, stores = make_engine("qwen3_5_text", url, 64 << 20, max_batch_tokens=12, max_slots=2)
    engine.resume(engine.import_paused(stores.take_unit(key)))
    while engine.has_work():
        events.extend(engine.step())
    assert [t for ev in events for t in ev.token_ids] == [t for ev in ref for t in ev.token_ids]
    carried = [ev.prompt_logprobs for ev in events if ev.prompt_logprobs is not None]
    want = [ev.prompt_logprobs for ev in ref if ev.prompt_logprobs is not None]
    assert len(carried) == len(want) == 1 and len(carried[0]) == len(p) - 1 and None not in carried[0]
    assert [[i for i, _ in t] for _, t in carried[0]] == [[i for i, _ in t] for _, t in want[0]]
    flat = [[v, *(x for _, x in t)] for v, t in carried[0]]
    assert np.allclose(flat, [[v, *(x for _, x in t)] for v, t in want[0]], atol=1e-5)


def test_an_adopted_conversation_sends_the_tokens_its_pause_held_back(tmp_path):
    """With `stream_interval` > 1 a pause can come while some decoded tokens wait for their event (with their
    logprobs). A fresh engine that adopts the paused conversation (a restart) sends them, in order, before the
    tokens it decodes: the stream is the uninterrupted run's, no token skipped or sent twice."""
    p = prompt(3, 21)
    params = SamplingParams(temperature=0, max_tokens=23, logprobs=2)
    plain = Engine(model("qwen3_5_text"), EngineConfig(page_size=8, num_pages=64, stream_interval=4))
    plain.add_request(Request(tuple(p), params, "agent"))
    ref = [ev for _ in range(100) if plain.has_work() for ev in plain.step()]
    url = f"file://{tmp_path}/kv"
    engine, stores = make_engine("qwen3_5_text", url, ram_bytes=0, stream_interval=4)
    engine.add_request(Request(tuple(p), params, "agent"))
    events = [ev for _ in range(7) for ev in engine.step()]  # the prompt, then 7 tokens: 3 of them held back
    seq = engine.seqs["agent"]
    assert len(seq.pending_tokens) == 3
    engine.admission = lambda e: None
    engine.pause(seq)
    key = seq.paused_bundle
    del engine, stores
    engine, stores = make_engine("qwen3_5_text", url, 64 << 20, stream_interval=4)
    engine.resume(engine.import_paused(stores.take_unit(key)))
    while engine.has_work():
        events.extend(engine.step())
    assert [t for ev in events for t in ev.token_ids] == [t for ev in ref for t in ev.token_ids]
    assert [len(ev.token_ids) for ev in events] == [len(ev.token_ids) for ev in ref]
    got, want = [x for ev in events for x in ev.logprobs], [x for ev in ref for x in ev.logprobs]
    assert np.allclose(got, want, atol=1e-5)
    assert [[i for i, _ in t] for ev in events for t in ev.top_logprobs] == \
        [[i for i, _ in t] for ev in ref for t in ev.top_logprobs]


def _pool_is_whole(engine: Engine, stores: TierStores) -> None:
    """Every page's reference count is the number of live sequences holding it; a page is free, cached (a full
    page's hash or a partial tail registered) or held, never two of them; slots are each free or held once; the
    snapshot bytes add up; once the engine is idle no paused conversation is left in either tier."""
    b = engine.blocks
    held = np.zeros(b.num_pages, np.int64)
    for s in engine.running:
        np.add.at(held, np.asarray(s.pages, np.int64), 1)
    assert all(not s.pages for s in engine.waiting + engine.paused)
    assert np.array_equal(held, b.ref)
    free, cached = set(b.free), set(b.lru)
    assert len(free) == len(b.free) and not free & cached
    assert all(p not in b.hash_of_page and p not in b.tail_of_page for p in free)
    assert all(b.ref[p] == 0 and (p in b.hash_of_page or p in b.tail_of_page) for p in cached)
    assert len(free) + len(cached) + int(np.count_nonzero(b.ref)) == b.num_pages
    slots = [s.state_slot for s in engine.running]
    assert sorted(slots + engine.free_slots) == list(range(engine.cfg.max_slots))
    assert b.snapshot_bytes == sum(nb for _, nb in b.snapshots.values())
    if not engine.has_work():
        keys = [*stores.tiers.ram.keys(), *stores.tiers.disk.keys()]
        assert not [k for k in keys if k.startswith("conv")], keys


def test_features_mixed_under_a_tight_pool_give_each_request_its_tokens_alone(tmp_path):
    """A seeded mix on the demo model (hybrid, MTP head chained three deep, every guess drafted so that drafts are
    rejected at every depth): requests arriving over steps, sharing openings (a prefix stored once), n = 2 choices
    of one prompt, greedy and seeded sampling, a stop string, a JSON answer, a quick LoopGuard, a pool too small
    for all of them (pauses under pressure) plus pauses forced at random, a RAM tier too small for a paused
    conversation (each one spilled to files on the disk), and an abort of a paused choice. Each request that is not
    aborted ends with the tokens, text and finish reason it gets alone on a fresh engine, and the pool and the tiers
    hold nothing that leaked, step by step and at the end. The trained model on float32 KV: its margins are wide,
    whereas the arithmetic is not batch-invariant (a chunk's or a batch's rows round apart by ~1e-6), so near-ties
    (a random model's sampled rows, a rounding flip of quantised KV) can come apart and are no fault."""
    from decapybara.engine.loopguard import LoopGuardConfig
    from tests.test_speculation import demo

    loaded = demo()
    tok = loaded.tokenizer
    cfg = EngineConfig(page_size=8, num_pages=20, max_batch_tokens=32, max_slots=4, snapshot_interval=8,
                       speculator="mtp", draft_len=3, spec_min_confidence=0.0, spec_adaptive=False, loop_guard="stop")
    quick = LoopGuardConfig(mode="stop", min_covered_chars=24, min_repeats=3, tokens_per_step=2, relax_after_tokens=6,
                            cap_tokens=8)

    def fresh() -> Engine:
        e = Engine(loaded.model, cfg, tokenizer=tok)
        e._loop_cfg = quick  # a guard quick to act: short replies reach its ramp
        return e

    engine = fresh()
    stores = TierStores(KVTiers(RamTierStore(60_000), DiskTierStore(f"file://{tmp_path}/kv", 64 << 20)),
                        engine.blocks.salt)
    engine.bundle_store = stores
    engine.set_page_store(stores)
    opening = tok.encode("# utilities shared by the tools below\nimport re\nimport json\n\n")
    greedy = SamplingParams(temperature=0, max_tokens=24)
    asks = [  # (arrival step, prompt, params)
        (0, opening + tok.encode("def main():\n    print("), dataclasses.replace(greedy, max_tokens=40)),
        (0, opening + tok.encode("class Stack:\n"), SamplingParams(temperature=0.8, seed=3, max_tokens=30)),
        (0, opening + tok.encode("class Stack:\n"), SamplingParams(temperature=0.8, seed=4, max_tokens=30)),
        (2, opening + tok.encode("def parse(text):\n"), dataclasses.replace(greedy, stop=("\n\n",))),
        (3, tok.encode("The quick brown fox"), dataclasses.replace(greedy, json_object=True, max_tokens=30)),
        (5, opening + tok.encode("    for i in range(10):\n"), dataclasses.replace(greedy, ignore_eos=True)),
        (6, opening + tok.encode("import os\n"), greedy),
    ]
    rng = np.random.default_rng(7)
    outs: dict[str, list] = {}
    step, aborted = 0, set()
    while step <= asks[-1][0] or engine.has_work():
        for i, (at, p, params) in enumerate(asks):
            if at == step:
                engine.add_request(Request(tuple(p), params, f"r{i}"))
                outs[f"r{i}"] = [[], "", None]
        if engine.running and rng.random() < 0.3:
            engine.pause(engine.running[int(rng.integers(len(engine.running)))])
        if step == 9:  # the second choice aborted while paused: its unit leaves the tiers
            if engine.seqs["r2"] in engine.running:
                engine.pause(engine.seqs["r2"])
            aborted.add("r2")
            engine.abort("r2")
        for ev in engine.step():
            got = outs[ev.request_id]
            got[0] += ev.token_ids
            got[1] += ev.text
            got[2] = ev.finish_reason or got[2]
        _pool_is_whole(engine, stores)
        step += 1
    s = engine.stats
    assert s.pauses > 0 and s.resumes > 0 and 0 < s.accepted_tokens < s.drafted_tokens
    assert s.reused_prompt_tokens > 0 and s.loopguard and stores.tiers.stats.hits_disk > 0
    for i, (_, p, params) in enumerate(asks):
        if f"r{i}" in aborted:
            continue
        alone = fresh()
        alone.add_request(Request(tuple(p), params, "alone"))
        want = [[], "", None]
        while alone.has_work():
            for ev in alone.step():
                want[0] += ev.token_ids
                want[1] += ev.text
                want[2] = ev.finish_reason or want[2]
        assert outs[f"r{i}"] == want, f"r{i}"
