"""The embedded demo model's pipeline: corpus split, tokenizer, MTP head, and a 3-step training run on CPU."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from decapybara.builder.corpus import chat_examples, chat_template, collect_corpus, split_of
from decapybara.builder.train_tokenizer import (
    build_demo_data,
    encode_documents,
    train_tokenizer,
    unigram_baseline,
)
from decapybara.model.config import ModelConfig
from decapybara.model.weights import expected_tensors, mtp_tensors
from decapybara.testing import SPECIAL_TOKENS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

train_demo = pytest.importorskip("decapybara.builder.train_demo")
ArchSpec, TrainSpec = train_demo.ArchSpec, train_demo.TrainSpec

MICRO = ArchSpec(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, intermediate_size=64, linear_num_key_heads=1, linear_num_value_heads=2,
                 linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256)
MICRO_TRAIN = TrainSpec(seq_len=32, batch_size=2, eval_tokens=200, eval_every_s=0, sample_tokens=3)


@pytest.fixture(scope="module")
def corpus():
    return collect_corpus()


def test_corpus_split_is_deterministic_disjoint_and_about_two_percent(corpus):
    again = collect_corpus()
    assert corpus.manifest() == again.manifest()
    train = {f.rel_path for f in corpus.split("train")}
    held = {f.rel_path for f in corpus.split("heldout")}
    assert train and held and not train & held
    assert train | held == {f.rel_path for f in corpus.files}
    assert 0.005 < len(held) / len(corpus.files) < 0.06
    paths = [f.rel_path for f in corpus.files]
    assert paths == sorted(paths)
    excluded = ("test/", "idlelib/idle_test/", "lib2to3/tests/", "site-packages/")
    assert not any(p.startswith(excluded) for p in paths)
    assert all(len(f.text.encode()) <= 400_000 for f in corpus.files)
    # the split is a function of the path alone
    assert all(split_of(f.rel_path) == f.split for f in corpus.files)
    assert corpus.root == str(Path(sysconfig.get_paths()["stdlib"]).resolve())


def test_chat_examples_are_deterministic_chatml_and_near_the_target_share(corpus):
    files = corpus.split("train")[:80]
    a, b = chat_examples(files, 0.2, seed=3), chat_examples(files, 0.2, seed=3)
    assert a == b and len(a) > 10
    assert {e.kind for e in a} == {"write_function", "explain_function", "complete_code"}
    template, _ = chat_template()
    for e in a[:50]:
        text = e.render(template)
        assert text.startswith("<|im_start|>") and text.endswith(e.answer + "<|im_end|>\n")
        assert "<|im_start|>assistant\n" in text
    chat_chars = sum(len(c) for e in a for _, c in e.messages) + sum(len(e.answer) for e in a)
    source_chars = sum(len(f.text) for f in files)
    assert 0.15 < chat_chars / (chat_chars + source_chars) < 0.3


def test_tokenizer_has_special_ids_first_and_round_trips_stdlib_source(corpus):
    tok = train_tokenizer([f.text for f in corpus.split("train")[:40]], vocab_size=1024)
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.get_vocab_size() == 1024
    for f in corpus.split("heldout")[:8]:
        assert tok.decode(tok.encode(f.text).ids) == f.text
    odd = "s = 'naïve café 日本語 🦫'\nx = '<|im_end|>'\n"
    assert tok.decode(tok.encode(odd).ids, skip_special_tokens=False) == odd
    raw = encode_documents(tok, [odd], parse_special=False)
    assert raw[-1] == 0 and 2 not in raw[:-1].tolist()  # raw source never yields <|im_end|>
    assert 2 in encode_documents(tok, [odd], parse_special=True).tolist()


def test_mtp_head_predicts_t_plus_2_with_the_qwen35_names_and_is_causal():
    data = {"vocab_size": 300, "special_tokens": {s: i for i, s in enumerate(SPECIAL_TOKENS)}}
    model, mtp = train_demo.build_model(MICRO, data, seed=0, device="cpu")
    cfg = ModelConfig.from_hf(model.config.to_dict())
    assert {f"mtp.{k}": tuple(v.shape) for k, v in mtp.state_dict().items()} == mtp_tensors(cfg)
    chunk = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    nt, mt = train_demo.forward_losses(model, mtp, chunk)
    assert nt.ndim == mt.ndim == 0
    assert abs(nt.item() - np.log(300)) < 1.0 and abs(mt.item() - np.log(300)) < 1.0
    (nt + 0.3 * mt).backward()
    assert mtp.fc.weight.grad is not None and mtp.fc.weight.grad.abs().sum() > 0
    with torch.no_grad():
        hidden = model.model(input_ids=chunk[:, :-1]).last_hidden_state
        out = mtp(hidden, model.model.embed_tokens(chunk[:, 1:]), model.model.rotary_emb)
        assert out.shape == hidden.shape == (2, 16, 32)
        changed = chunk.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 300
        out2 = mtp(hidden, model.model.embed_tokens(changed[:, 1:]), model.model.rotary_emb)
        assert torch.equal(out[:, :-1], out2[:, :-1]) and not torch.equal(out[:, -1], out2[:, -1])


def test_unigram_baseline_is_add_one_smoothed_cross_entropy():
    train_ids = np.array([0, 0, 1], dtype=np.uint16)
    got = unigram_baseline(train_ids, np.array([0, 2]), vocab_size=3)
    assert got == pytest.approx(-(np.log(3 / 6) + np.log(1 / 6)) / 2)


def _fake_stdlib(root: Path, corpus) -> None:
    """A few KB of real stdlib text under names that land in both splits."""
    texts = [f.text for f in corpus.files if f.rel_path in ("bisect.py", "colorsys.py", "fnmatch.py")]
    names = [f"mod{i}.py" for i in range(400)]
    held = [n for n in names if split_of(n) == "heldout"][:1]
    train = [n for n in names if split_of(n) == "train"][:3]
    for i, name in enumerate(held + train):
        (root / name).write_text(texts[i % len(texts)])
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text("excluded = True\n")


def test_three_step_cpu_run_saves_a_checkpoint_transformers_reloads_identically(tmp_path, corpus):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    _fake_stdlib(stdlib, corpus)
    data = build_demo_data(tmp_path / "data", vocab_size=300, stdlib=str(stdlib))
    assert data["num_files"] == {"train": 3, "heldout": 1}
    assert data["tokens"]["train_chat"] > 0
    again = build_demo_data(tmp_path / "data2", vocab_size=300, stdlib=str(stdlib))
    assert again["sha256"] == data["sha256"]

    out = tmp_path / "hf"
    res = train_demo.train(tmp_path / "data", out, minutes=None, steps=3, device="cpu", arch=MICRO,
                           spec=MICRO_TRAIN)
    assert res.report["steps"] == 3 and res.report["stopped_by"] == "steps"
    assert res.report["reload_max_abs_diff"] == {"logits": 0.0, "mtp_logits": 0.0}
    assert np.isfinite(res.report["heldout"]["ce"]) and res.report["unigram_baseline_ce"] > 0

    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "qwen3_5_text" and hf["mtp_num_hidden_layers"] == 1
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert (out / "generation_config.json").is_file() and (out / "train_report.json").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = f.keys()  # NOTE: a safe_open handle is not iterable itself
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    assert shapes == expected_tensors(ModelConfig.from_hf(hf))

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 50, 60, 70, 80, 2, 0, 99]])
    res.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, res.model(input_ids=ids).logits,
                                   rtol=0, atol=1e-6)
