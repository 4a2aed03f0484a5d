#!/usr/bin/env bash
# The embedded demo model, in two stages (see decapybara/builder/train_tokenizer.py and train_demo.py).
#
#   stage 1, here on a CPU (~30 s on 2 cores):   scripts/prepare_demo_data.sh data
#       this interpreter's stdlib -> corpus.json (files, sha256, split) -> BPE tokenizer.json (vocab 8192,
#       ChatML special tokens at ids 0..8) -> train.bin / heldout.bin (uint16) + data.json, in $DATA.
#   stage 2, on the GPU machine (no network, no Ray; carry $DATA there):   scripts/prepare_demo_data.sh train
#       python3 -m decapybara.builder.train_demo --data $DATA --out $HF --minutes 4 --device cuda
#       -> HF folder $HF (config.json, model.safetensors with mtp.*, tokenizer files, train_report.json).
#   moving $HF back in parts of at most 15 MiB:   scripts/prepare_demo_data.sh pack $OUT   (GPU side)
#                                                 scripts/prepare_demo_data.sh unpack DIR  (here)
# Then the project's builder turns $HF into the shipped .mcapy (decapybara.builder.build).
# $DATA and $HF default to .data/demo and .data/demo-hf (ignored by git: /.data/ in .gitignore).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-.data/demo}
HF=${HF:-.data/demo-hf}
PY=${PYTHON:-$(command -v python3 || command -v python)}

case "${1:-}" in
  data)
    time "$PY" -m decapybara.builder.train_tokenizer --out "$DATA" --vocab-size "${VOCAB:-8192}" ;;
  train)
    PYTHONUNBUFFERED=1 "$PY" -m decapybara.builder.train_demo --data "$DATA" --out "$HF" \
      --minutes "${MINUTES:-4}" --device "${DEVICE:-cuda}" --seed "${SEED:-0}" ;;
  pack)
    dest=${2:?usage: pack DEST_DIR}
    tar -C "$(dirname "$HF")" -cf - "$(basename "$HF")" | split -b 15m - "$dest/demo-hf.tar.part-" ;;
  unpack)
    src=${2:?usage: unpack PARTS_DIR}
    mkdir -p "$(dirname "$HF")"
    cat "$src"/demo-hf.tar.part-* | tar -C "$(dirname "$HF")" -xf - ;;
  *)
    echo "usage: $0 data | train | pack DEST_DIR | unpack PARTS_DIR" >&2
    exit 2 ;;
esac
