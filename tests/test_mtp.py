"""The multi-token-prediction head (`QwenModel.mtp_forward`) against the torch head it was trained as
(decapybara/builder/train_demo.py `MTPHead`, built on transformers' own decoder layer), on tiny models with random
head weights: the same logits over a whole prompt, and the same when the head's KV is filled in pieces."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig
from decapybara.model.qwen import QwenModel
from decapybara.testing import canonical_tensors, make_hf_model


def with_mtp_head(family: str, seed: int = 0):
    """(our model on numpy, the transformers model, its torch MTP head) with the same weights; the head's norm
    weights spread too, so that every part of it counts."""
    from decapybara.builder.train_demo import MTPHead

    hf = make_hf_model(family, seed, overrides={"mtp_num_hidden_layers": 1})
    if hf.config._attn_implementation != "sdpa":
        hf.config._attn_implementation = "sdpa"
    head = MTPHead(hf)
    gen = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():
        for _, p in head.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1]) ** 0.5)
    head.eval()
    tensors = canonical_tensors(hf)
    as_model = SimpleNamespace(state_dict=head.state_dict, config=SimpleNamespace(tie_word_embeddings=False))
    tensors.update({f"mtp.{k}": v for k, v in canonical_tensors(as_model).items()})  # experts stacked as ours
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    assert cfg.mtp_num_hidden_layers == 1
    return QwenModel.from_tensors(cfg, NumpyBackend(), tensors), hf, head


def torch_mtp_logits(hf, head, ids: list[int]) -> np.ndarray:
    """[L - 1, V]: the head's logits for pairs (hidden p, token p + 1), p = 0 .. L - 2 (train_demo.predict)."""
    from decapybara.builder.train_demo import predict

    with torch.no_grad():
        chunk = torch.tensor([ids + [0]])  # predict() takes L + 1 tokens; the last is a target only
        _, mtp_logits = predict(hf, head, chunk)
    return mtp_logits[0].float().numpy()


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_mtp_head_matches_the_trained_torch_head(family):
    model, hf, head = with_mtp_head(family)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, model.cfg.vocab_size, 37).tolist()
    ref = torch_mtp_logits(hf, head, ids)  # [36, V]
    kv = model.new_kv_cache(8, 16)
    states = model.new_state_pool(1) if model.cfg.linear_layers else None
    table = np.arange(8, dtype=np.int32)
    main = ForwardBatch.build([(ids, 0, table, 0 if states is not None else None)], 16, logits="none")
    main.normed_rows = True
    out = model.forward(main, kv, states)
    assert out.normed.shape == (37, model.cfg.hidden_size)

    def mtp(lo: int, hi: int, cache) -> np.ndarray:  # pairs lo .. hi - 1 on top of the head's KV of pairs < lo
        b = ForwardBatch.build([(ids[lo + 1:hi + 1], lo, table, None)], 16, logits="all")
        return model.mtp_forward(b, out.normed[lo:hi], cache)

    whole = mtp(0, 36, kv)
    # draft_vocab 100: the first 112 ids' logits, then those of the extra ids past them (7 is among the first)
    head = model.draft_head(100, extra=[300, 7, 511])
    assert (head.rows, head.extra_ids) == (112, (300, 511)) and head is model.draft_head(100, [511, 300])
    sliced = model.mtp_forward(ForwardBatch.build([(ids[1:37], 0, table, None)], 16, logits="all"), out.normed[0:36],
                               model.new_kv_cache(8, 16), head=head)
    assert sliced.shape == (36, 114)
    assert np.allclose(sliced, whole[:, [*range(112), 300, 511]], rtol=1e-5, atol=1e-6)
    sliced[::3, 113] += 50.0  # (an extra id's column the best in every third row)
    guess, prob = model.draft_guesses(sliced, head)  # the columns' ids, the probability among them
    best = np.asarray([*range(112), 300, 511])[np.argmax(sliced, axis=1)]
    assert np.array_equal(guess, best) and (guess[::3] == 511).all() and (guess[1::3] < 112).all()
    assert np.allclose(prob, 1 / np.exp(sliced - sliced.max(axis=1, keepdims=True)).sum(axis=1), rtol=1e-5)
    assert model.draft_head(0).weight is model.w["lm_head.weight"] and model.draft_head(0).rows == 512
    assert model.draft_head(model.cfg.vocab_size - 3).weight is model.w["lm_head.weight"]  # rounded past it: all
    scale = np.abs(ref).max()
    assert np.abs(whole - ref).max() <= 1e-4 * scale, np.abs(whole - ref).max() / scale  # fp32, as the model tests
    fresh = model.new_kv_cache(8, 16)  # the head's KV filled in pieces: 20 pairs, then one, then the rest
    pieces = np.concatenate([mtp(0, 20, fresh), mtp(20, 21, fresh), mtp(21, 36, fresh)])
    assert np.abs(pieces - whole).max() <= 1e-5 * scale
    # the head differs from the main model's next-token logits: it predicts one further
    assert np.abs(whole - model.backend.to_host(model.forward(
        ForwardBatch.build([(ids, 0, table, None if states is None else 0)], 16, logits="all"),
        model.new_kv_cache(8, 16), model.new_state_pool(1) if states is not None else None).logits)[:36]).max() > 0.1


def test_a_model_without_a_head_refuses():
    model, _, _ = with_mtp_head("qwen3_5_text")
    hf = make_hf_model("qwen3", 0)
    plain = QwenModel.from_tensors(ModelConfig.from_hf(hf.config.to_dict()), NumpyBackend(), canonical_tensors(hf))
    assert model.has_mtp and not plain.has_mtp
    with pytest.raises(ValueError, match="no MTP head"):
        plain.mtp_forward(ForwardBatch.build([([1, 2], 0, np.arange(1, dtype=np.int32), None)], 16), None, None)
