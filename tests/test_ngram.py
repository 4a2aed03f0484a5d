"""Prompt-lookup speculation (SPECULATOR ngram, decapybara/engine/ngram.py): the index proposes the token that
followed the latest earlier occurrence of the longest recurring suffix, kept up to date as tokens are appended;
through the engine the outputs are those without speculation (greedy and seeded, a hybrid model and a dense one
without an MTP head), and repeated text is drafted and accepted."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.config import DEMO_MODEL, EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.ngram import NgramIndex
from decapybara.engine.sampling import SamplingParams
from decapybara.model.load import load_model


def test_the_index_proposes_what_followed_the_latest_longest_match():
    assert NgramIndex().propose([1, 2, 3, 4, 1, 2, 3]) == ((4,), 3)
    assert NgramIndex().propose([5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]) == ((2,), 3)  # the latest occurrence
    assert NgramIndex().propose([9, 2, 3, 4, 8, 2, 3]) == ((4,), 2)  # (8, 2, 3) is new; (2, 3) recurs
    assert NgramIndex().propose([1, 2, 8, 4, 9, 2, 8]) == ((4,), 2)  # only two tokens recur: n = 2
    assert NgramIndex().propose([1, 2, 3, 4, 5]) == ((), 0)
    assert NgramIndex().propose([7]) == ((), 0) and NgramIndex().propose([]) == ((), 0)
    assert NgramIndex().propose([3, 3, 3]) == ((3,), 2)  # (3, 3) ended at 1; (3, 3, 3) never ended earlier
    # k tokens after the match (its continuation may run into the end)
    assert NgramIndex().propose([1, 2, 3, 4, 5, 6, 1, 2, 3], 4) == ((4, 5, 6, 1), 3)
    # past the list's end the text repeats with the match's period (4, then 1), the proposal's own tokens included
    assert NgramIndex().propose([1, 2, 3, 4, 1, 2, 3], 7) == ((4, 1, 2, 3, 4, 1, 2), 3)
    assert NgramIndex().propose([3, 3, 3], 5) == ((3, 3, 3, 3, 3), 2)
    assert NgramIndex().propose([5, 1, 2, 1, 2, 1], 4) == ((2, 1, 2, 1), 3)


def test_the_index_grows_with_the_tokens_as_one_built_afresh():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, 400).tolist()
    grown = NgramIndex()
    for n in range(0, 400, 7):
        assert grown.propose(tokens[:n]) == NgramIndex().propose(tokens[:n]), n
    assert grown.upto == 398
    chunked = NgramIndex()  # a prompt indexed chunk by chunk as it is computed, then proposals
    for upto in (0, 50, 51, 200, 399, 1000):
        chunked.extend(tokens, upto)
    assert chunked.upto == 399 and chunked.propose(tokens) == NgramIndex().propose(tokens)
    assert NgramIndex().last == {}  # fresh instances share no state


@functools.cache
def demo():
    return load_model(str(DEMO_MODEL), NumpyBackend())


REPEAT = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
          "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n",
          "import os\nimport sys\nimport os\nimport sys\nimport os\n"]


def run(model, tokenizer, speculator, prompts, params, **cfg):
    settings = {"page_size": 16, "num_pages": 256, "max_batch_tokens": 256, "loop_guard": "off",
                "spec_adaptive": False, **cfg}
    e = Engine(model, EngineConfig(speculator=speculator, **settings), tokenizer=tokenizer)
    return e.generate(prompts, params), e


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prompt_lookup_keeps_the_tokens_and_its_drafts_are_accepted(temperature):
    loaded = demo()
    prompts = [loaded.tokenizer.encode(t) for t in REPEAT]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=48, ignore_eos=True)
              for i in range(len(prompts))]
    ref, _ = run(loaded.model, loaded.tokenizer, "off", prompts, params)
    got, e = run(loaded.model, loaded.tokenizer, "ngram", prompts, params)
    assert e.speculate and not e.mtp
    assert got == ref
    s = e.stats
    print(f"t={temperature}: drafted {s.drafted_tokens}, accepted {s.accepted_tokens}, steps {s.steps}")
    assert 0 < s.accepted_tokens <= s.drafted_tokens
    if temperature == 0:
        assert s.accepted_tokens / s.drafted_tokens > 0.3 and s.steps < 48
    else:  # sampled: some drafts rejected, so rollbacks ran
        assert s.accepted_tokens < s.drafted_tokens


def test_prompt_lookup_on_a_model_without_an_mtp_head():
    from decapybara.testing import tiny_qwen

    model = tiny_qwen("qwen3")[0]
    assert not model.has_mtp
    rng = np.random.default_rng(5)
    base = rng.integers(0, 500, 12).tolist()
    prompts = [base * 3, rng.integers(0, 500, 9).tolist() * 2]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 2
    cfg = {"page_size": 8, "num_pages": 64, "max_batch_tokens": 64, "max_slots": 4}
    ref, _ = run(model, None, "off", prompts, params, **cfg)
    got, e = run(model, None, "ngram", prompts, params, **cfg)
    assert got == ref and e.stats.drafted_tokens > 0


def test_the_ngram_setting_reaches_the_engine():
    from decapybara.server.config import AppConfig

    assert AppConfig(speculator="ngram").engine_config(cuda=False).speculator == "ngram"
    with pytest.raises(Exception, match="speculator"):
        EngineConfig(speculator="eagle")
