"""Stage 1 of the demo model (CPU): corpus -> byte-level BPE tokenizer -> token files.

``python -m decapybara.builder.train_tokenizer --out .data/demo [--vocab-size 8192]`` writes into ``--out``:

- ``tokenizer.json``: byte-level BPE trained on the train split's source, the ChatML special tokens of
  `decapybara.testing.SPECIAL_TOKENS` first (ids 0..8, in that order), Qwen2's pre-tokenizer split.
- ``train.bin`` / ``heldout.bin``: uint16 token ids; every document is followed by ``<|endoftext|>``.
  ``train.bin`` holds the train source files (sorted by path), then the chat examples; ``heldout.bin`` the
  held-out source files only.
- ``corpus.json``: the corpus manifest (python version, every file's sha256 and split).
- ``data.json``: token counts, special-token ids, the chat layout used, hashes of every output.

Everything is deterministic for a given interpreter (checked by hashing two runs in the tests). The reading
side, `window_batches` and `unigram_baseline`, serves ``train_demo`` (numpy only, safe on the GPU machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from decapybara.builder.corpus import chat_examples, chat_template, collect_corpus
from decapybara.testing import SPECIAL_TOKENS

DEFAULT_VOCAB_SIZE = 8192
EOT = "<|endoftext|>"
# Qwen2/Qwen3's pre-tokenizer split: single digits, words with one leading non-letter, newline runs apart.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts`, SPECIAL_TOKENS at ids 0..len-1."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if not len(SPECIAL_TOKENS) + 256 < vocab_size <= 65536:
        raise ValueError(f"vocab_size {vocab_size} must exceed the 256 bytes + special tokens and fit uint16")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def encode_documents(tok: Any, texts: list[str], parse_special: bool) -> np.ndarray:
    """uint16 ids of `texts`, each followed by <|endoftext|>.

    With `parse_special` False, a special token's text inside a document is encoded as plain text (raw
    source must never produce control tokens); chat examples are encoded with it True.
    """
    eot = tok.token_to_id(EOT)
    tok.encode_special_tokens = not parse_special
    try:
        encs = tok.encode_batch(texts, add_special_tokens=False)
    finally:
        tok.encode_special_tokens = False
    parts = [np.asarray(e.ids + [eot], dtype=np.uint16) for e in encs]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_demo_data(out: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, stdlib: str | None = None,
                    max_files: int | None = None, chat_fraction: float = 0.2,
                    seed: int = 0) -> dict[str, Any]:
    """Run stage 1 into `out` and return the data.json dict (also written there)."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    corpus = collect_corpus(stdlib, max_files=max_files)
    train_files, heldout_files = corpus.split("train"), corpus.split("heldout")
    if not train_files or not heldout_files:
        raise ValueError(f"corpus has {len(train_files)} train and {len(heldout_files)} held-out files")
    template, template_source = chat_template()
    chats = chat_examples(train_files, chat_fraction, seed)
    chat_texts = [c.render(template) for c in chats]
    t_corpus = time.perf_counter()

    train_texts = [f.text for f in train_files]
    tok = train_tokenizer(train_texts, vocab_size)
    t_tok = time.perf_counter()

    source_ids = encode_documents(tok, train_texts, parse_special=False)
    chat_ids = encode_documents(tok, chat_texts, parse_special=True)
    heldout_ids = encode_documents(tok, [f.text for f in heldout_files], parse_special=False)
    np.concatenate([source_ids, chat_ids]).tofile(out_dir / "train.bin")
    heldout_ids.tofile(out_dir / "heldout.bin")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "corpus.json").write_text(json.dumps(corpus.manifest(), indent=1))
    t_enc = time.perf_counter()

    train_source_chars = sum(len(t) for t in train_texts)
    data: dict[str, Any] = {
        "format": "uint16 token ids, every document followed by <|endoftext|>",
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": {s: tok.token_to_id(s) for s in SPECIAL_TOKENS},
        "eot_id": tok.token_to_id(EOT),
        "seed": seed,
        "chat_template_source": template_source,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "num_files": {"train": len(train_files), "heldout": len(heldout_files)},
        "num_chat_examples": dict(sorted(Counter(c.kind for c in chats).items())),
        "tokens": {
            "train": int(source_ids.size + chat_ids.size),
            "train_source": int(source_ids.size),
            "train_chat": int(chat_ids.size),
            "heldout": int(heldout_ids.size),
        },
        "chat_token_fraction": round(chat_ids.size / max(1, source_ids.size + chat_ids.size), 4),
        "chars_per_token_train_source": round(train_source_chars / max(1, source_ids.size), 3),
        "seconds": {"corpus_and_chat": round(t_corpus - t0, 2),
                    "tokenizer_training": round(t_tok - t_corpus, 2),
                    "encoding_and_writing": round(t_enc - t_tok, 2), "total": round(t_enc - t0, 2)},
        "sha256": {name: _sha256(out_dir / name)
                   for name in ("tokenizer.json", "train.bin", "heldout.bin", "corpus.json")},
    }
    (out_dir / "data.json").write_text(json.dumps(data, indent=1))
    return data


# ---- the reading side (used by train_demo) --------------------------------------------------------------
def window_batches(num_tokens: int, seq_len: int, batch_size: int,
                   seed: int) -> Iterator[tuple[int, np.ndarray]]:
    """Endless deterministic (epoch, window starts [batch_size]) for windows of seq_len + 1 tokens.

    Each epoch draws a grid offset in [0, seq_len) and shuffles the grid with a generator keyed by
    (seed, epoch); a batch never straddles two epochs.
    """
    if (num_tokens - seq_len - 1) // seq_len < batch_size:
        raise ValueError(f"{num_tokens} tokens do not fill one batch of {batch_size} x {seq_len + 1}")
    epoch = 0
    while True:
        rng = np.random.default_rng([seed, epoch])
        starts = np.arange(int(rng.integers(0, seq_len)), num_tokens - seq_len - 1, seq_len)
        rng.shuffle(starts)
        for i in range(0, len(starts) - batch_size + 1, batch_size):
            yield epoch, starts[i: i + batch_size]
        epoch += 1


def unigram_baseline(train_ids: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats) on `targets` of the add-one smoothed unigram distribution of `train_ids`."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    return float(-np.log(counts / counts.sum())[targets].mean())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder, e.g. .data/demo")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    ap.add_argument("--stdlib", default=None, help="stdlib root (default: this interpreter's)")
    ap.add_argument("--max-files", type=int, default=None, help="only the first N eligible files (tests)")
    ap.add_argument("--chat-fraction", type=float, default=0.2, help="target share of chat text in train")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    data = build_demo_data(args.out, args.vocab_size, args.stdlib, args.max_files, args.chat_fraction,
                           args.seed)
    print(json.dumps({k: data[k] for k in ("vocab_size", "special_tokens", "num_files", "num_chat_examples",
                                           "tokens", "chat_token_fraction", "chars_per_token_train_source",
                                           "seconds")}, indent=1))


if __name__ == "__main__":
    main()
