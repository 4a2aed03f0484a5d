"""Speculative decoding with the MTP head on the cupy backend (GPU only): the demo model's greedy and seeded
outputs with `speculator="mtp"` are those without it and those of the numpy reference, with decode graphs on
(one-token decodes replay decode graphs, steps with drafts verification graphs; both hand back their rows'
normed hidden states to the MTP pass, verification graphs their drafts' rollback states; the MTP pass replays
graphs of its own) and off, drafts accepted and rejected."""

from __future__ import annotations

import functools

import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from decapybara.backend.cupy_backend import CupyBackend
from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.config import DEMO_MODEL, EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.model.load import load_model

pytestmark = pytest.mark.gpu

TEXTS = ["def main():\n    print(", "import os\nimport sys\n\n\ndef ", "class Stack:\n    def __init__(self):\n",
         "    for i in range(10):\n        if i % 2"]


@functools.cache
def loaded(backend: str):
    return load_model(str(DEMO_MODEL), CupyBackend("fp32") if backend == "cupy" else NumpyBackend())


@pytest.mark.parametrize("graphs,confidence", [(True, 0.9), (False, 0.0)])
def test_gpu_speculation_gives_the_tokens_of_decoding_without_it(graphs, confidence):
    """With graphs, only the head's surest guesses are drafted (`spec_min_confidence` 0.9), so that many decodes
    have no draft and replay decode graphs, others verification graphs (sequences with and without drafts
    side by side), whose normed rows then feed the MTP pass."""
    ref_model = loaded("numpy")
    prompts = [ref_model.tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (48, 40, 56, 33)]
    params[1] = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    cfg = EngineConfig(page_size=16, num_pages=128, max_batch_tokens=128, loop_guard="off", cuda_graphs=graphs,
                       spec_adaptive=False)
    ref = Engine(ref_model.model, cfg, tokenizer=ref_model.tokenizer).generate(prompts, params)
    gpu = loaded("cupy")
    plain = Engine(gpu.model, cfg, tokenizer=gpu.tokenizer).generate(prompts, params)
    spec_engine = Engine(gpu.model, cfg.replace(speculator="mtp", spec_min_confidence=confidence),
                         tokenizer=gpu.tokenizer)
    spec = spec_engine.generate(prompts, params)
    s = spec_engine.snapshot_stats()
    print(f"graphs {graphs}: drafted {s['drafted_tokens']} accepted {s['accepted_tokens']} steps {s['steps']} "
          f"graph steps {s['graphs']['graph_steps']} (verify {s['graphs']['verify_steps']}), MTP passes "
          f"{s['graphs']['mtp_steps']} replayed, {s['graphs']['mtp_eager']} eager")
    assert spec == plain == ref
    assert 0 < s["accepted_tokens"] <= s["drafted_tokens"]
    if graphs:
        g = s["graphs"]
        assert g["graph_steps"] > g["verify_steps"] > 0 and g["mtp_steps"] > 0 and not s["graph_failures"], g


def test_gpu_prompt_lookup_through_verification_graphs_keeps_the_tokens():
    """SPECULATOR ngram with decode graphs: repeated text drafts what followed it; the steps with drafts replay
    verification graphs (no MTP pass) and the tokens are those without speculation, greedy and seeded (whose
    rejected drafts roll back through the graphs' device views)."""
    gpu = loaded("cupy")
    text = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("
    prompts = [gpu.tokenizer.encode(text), gpu.tokenizer.encode("import os\nimport sys\nimport os\nimport sys\n"),
               gpu.tokenizer.encode(text)]
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.9, seed=3, max_tokens=32, ignore_eos=True)]
    cfg = EngineConfig(page_size=16, num_pages=128, max_batch_tokens=128, loop_guard="off", spec_adaptive=False)
    plain = Engine(gpu.model, cfg, tokenizer=gpu.tokenizer).generate(prompts, params)
    e = Engine(gpu.model, cfg.replace(speculator="ngram"), tokenizer=gpu.tokenizer)
    assert e.generate(prompts, params) == plain
    g = e.snapshot_stats()["graphs"]
    print(f"ngram: drafted {e.stats.drafted_tokens} accepted {e.stats.accepted_tokens} steps {e.stats.steps} "
          f"graph steps {g['graph_steps']} (verify {g['verify_steps']})")
    assert 0 < e.stats.accepted_tokens < e.stats.drafted_tokens, "both sides of the verification"
    assert g["verify_steps"] > 0 and g["mtp_steps"] == 0 and not g["failures"], g


@pytest.mark.parametrize("speculator,graphs", [("mtp", False), ("ngram", False), ("mtp", True), ("ngram", True)])
def test_gpu_several_drafts_a_step_keep_the_tokens(speculator, graphs):
    """draft_len 4 on the cupy backend: without decode graphs, steps of several drafts a sequence (their rollback
    points on the device) and the MTP head's chained passes, eagerly; with graphs a step of decodes alone verifies
    as many drafts a sequence as a verification graph of its width takes (`max_drafts`: 3 at four sequences, 4
    at one to three), through graphs of more than two rows a sequence, and the MTP head's passes after it through
    graphs of as many pair rows. The tokens are those without speculation and the numpy reference's, greedy and
    seeded."""
    ref_model = loaded("numpy")
    text = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("
    prompts = [ref_model.tokenizer.encode(t) for t in (*TEXTS[:3], text)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (48, 40, 56, 40)]
    params[1] = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    cfg = EngineConfig(page_size=16, num_pages=128, max_batch_tokens=128, loop_guard="off", spec_adaptive=False,
                       cuda_graphs=graphs)
    ref = Engine(ref_model.model, cfg, tokenizer=ref_model.tokenizer).generate(prompts, params)
    gpu = loaded("cupy")
    e = Engine(gpu.model, cfg.replace(speculator=speculator, draft_len=4, spec_min_confidence=0.3),
               tokenizer=gpu.tokenizer)
    assert (e.graph_drafts is not None) == graphs
    assert e.generate(prompts, params) == ref
    s = e.snapshot_stats()
    g = s["graphs"]
    print(f"{speculator} draft_len 4, graphs {graphs}: drafted {s['drafted_tokens']} accepted {s['accepted_tokens']} "
          f"steps {s['steps']}, graphs: {g}")
    # both sides of the verification (prompt lookup, drafting a repeated text's loop k deep, may be right every
    # time: its rollbacks are the MTP head's cases' and the eager ones')
    assert 0 < s["accepted_tokens"] < s["drafted_tokens"] or (speculator == "ngram" and graphs)
    assert s["drafted_tokens"] > s["steps"]
    if graphs:
        rows = {k[2] for k in e.runner.graphs._graphs if k[0] not in ("mtp", "mtpkv")}
        assert g["verify_steps"] > 0 and max(rows) > 2 and not s["graph_failures"], (g, rows)
        assert g["eager_steps"] < g["graph_steps"], g


def test_gpu_governor_withholds_through_graphs_and_keeps_the_tokens():
    """`spec_adaptive` on the cupy backend with graphs: steps whose drafts are withheld replay decode graphs and the
    head's KV-only graphs, the others verification graphs and the head's graph; a step that captured a
    graph (or followed a head pass that did) is never measured; verified rows made to cost five steps by a fake
    timer are withheld; the tokens are those without speculation."""
    gpu = loaded("cupy")
    prompts = [gpu.tokenizer.encode(t) for t in TEXTS[:2]]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)]
    cfg = EngineConfig(page_size=16, num_pages=128, max_batch_tokens=128, loop_guard="off")
    plain = Engine(gpu.model, cfg, tokenizer=gpu.tokenizer).generate(prompts, params)
    e = Engine(gpu.model, cfg.replace(speculator="mtp", spec_min_confidence=0.0), tokenizer=gpu.tokenizer)
    now = [0.0]
    e.timer = lambda: now[0]
    run, captured = e.runner.run, []

    def costed(plan, normed=False):
        now[0] += 0.010 + 0.050 * sum(bool(c.drafts) for c in plan.chunks)
        return run(plan, normed=normed)

    e.runner.run = costed
    record = e.governor.record

    def checked(width, allowed, tokens, seconds):
        captured.append(e.runner.captures())
        record(width, allowed, tokens, seconds)

    e.governor.record = checked
    assert e.generate(prompts, params) == plain
    g = e.snapshot_stats()["graphs"]
    s = e.governor.summary()
    print("governor:", s, "withheld", e.stats.withheld_steps, "graphs", g)
    assert g["verify_steps"] > 0 and g["graph_steps"] > g["verify_steps"] and g["mtp_steps"] > 0, g
    assert g["mtp_kv_steps"] > 0 and not g["failures"], g
    assert s["2"]["verify"] == 0.0 and e.stats.withheld_steps > 20, s
    assert captured and g["captures"] >= 3  # decode, verification and MTP graphs captured, none in a measure


@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_json_mode_gives_the_reference_tokens(graphs):
    """JSON mode on the cupy backend (its masks reach the device sampler as edit lists of most of the vocabulary),
    greedy and seeded, beside a plain request and with speculation asked for (JSON rows draft nothing): the numpy
    reference's tokens, and answers that are JSON objects, or prefixes of one where max_tokens cut them."""
    import json

    from decapybara.engine.json_mode import JsonState, JsonVocab

    ref_model = loaded("numpy")
    tok = ref_model.tokenizer
    prompt = tok.apply_chat([{"role": "user", "content": "Describe is_even(n) as a JSON object."}],
                            enable_thinking=False)
    params = [SamplingParams(temperature=0, max_tokens=96, json_object=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=96, json_object=True),
              SamplingParams(temperature=0, max_tokens=32)]
    cfg = EngineConfig(page_size=16, num_pages=128, max_batch_tokens=128, loop_guard="off", cuda_graphs=graphs,
                       spec_adaptive=False)
    ref = Engine(ref_model.model, cfg, tokenizer=tok).generate([prompt] * 3, params)
    gpu = loaded("cupy")
    got = Engine(gpu.model, cfg.replace(speculator="mtp"), tokenizer=gpu.tokenizer).generate([prompt] * 3, params)
    assert got == ref
    for ids in ref[:2]:  # an answer that ends where its object closes is one; one cut by max_tokens a prefix of one
        st = JsonState(JsonVocab(tok, tok.vocab_size))
        st.advance(b"".join(tok.token_bytes(t) for t in ids))
        assert not st.dead and st.done == (len(ids) < 96)
        if st.done:
            assert isinstance(json.loads(tok.decode(ids)), dict)


@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_schemas_and_forced_tool_calls_give_the_reference_tokens(graphs):
    """A JSON Schema's answer, a reply forced to tool calls and replies whose calls are constrained once they open
    one (tool_choice auto) on the cupy backend (their masks set where the logits are), greedy and seeded, beside a
    plain request and with speculation asked for: the numpy reference's tokens, and answers the schema's automaton
    reads (valid where they ended by themselves)."""
    import json

    import jsonschema

    from decapybara.engine.json_schema import compile_schema, schema_text, tool_call_spec

    ref_model = loaded("numpy")
    tok = ref_model.tokenizer
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8, "pattern": "^[A-Za-z]+$"},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "pattern": "^[\\w/]{1,24}\\.py$"}}, "required": ["path"]}}}]
    prompt = tok.apply_chat([{"role": "user", "content": "A person as JSON."}], enable_thinking=False)
    tool_prompt = tok.apply_chat([{"role": "user", "content": "Read main.py."}], tools, enable_thinking=False)
    params = [SamplingParams(temperature=0, max_tokens=96, json_schema=schema_text(schema)),
              SamplingParams(temperature=0.9, seed=4, max_tokens=96, json_schema=schema_text(schema)),
              SamplingParams(temperature=0.9, seed=2, max_tokens=96, tool_calls=tool_call_spec(tools, None, False)),
              SamplingParams(temperature=0, max_tokens=32),
              # tool_choice auto: free until the call opens (the bias on `<tool_call>` opens it at once, and again
              # after each close where parallel), the calls constrained, drafts while free
              *(SamplingParams(temperature=0.9, seed=5 + par, max_tokens=96, lazy_tool_calls=True,
                               tool_calls=tool_call_spec(tools, None, par),
                               logit_bias={tok.special_ids.tool_call: 30.0}) for par in (False, True))]
    prompts = [prompt, prompt, tool_prompt, prompt, tool_prompt, tool_prompt]
    cfg = EngineConfig(page_size=16, num_pages=128, max_batch_tokens=128, loop_guard="off", cuda_graphs=graphs,
                       spec_adaptive=False)
    ref = Engine(ref_model.model, cfg, tokenizer=tok).generate(prompts, params)
    gpu = loaded("cupy")
    got = Engine(gpu.model, cfg.replace(speculator="mtp"), tokenizer=gpu.tokenizer).generate(prompts, params)
    assert got == ref
    dfa = compile_schema(schema)
    for ids in ref[:2]:
        data = b"".join(tok.token_bytes(t) for t in ids if t not in tok.eos_token_ids)
        s, w = dfa.start, 0
        for b in data:
            s, w = dfa.step(s, w, b)
        assert s >= 0
        if len(ids) < 96:
            jsonschema.validate(json.loads(data), schema)
    assert tok.decode(ref[2], skip_special_tokens=False).lstrip().startswith('<tool_call>\n{"name": "read_file"')
    one, many = (tok.decode(ids, skip_special_tokens=False) for ids in ref[4:6])
    assert one.startswith('<tool_call>\n{"name": "read_file", "arguments": {') and one.count("<tool_call>") == 1
    assert many.count('<tool_call>\n{"name": "read_file"') >= 2, many
