"""bench/gpu.py's arithmetic without a GPU: the roofline's bytes a decode step (`step_bytes`), counted by hand from
the 27B's shapes, and HF's prefill timed on our prefill's prompt.

bench/gpu.py imports CuPy, so it runs in a subprocess over the host emulator's stand-in (tools/cuda_emu/fake_cupy,
no-op launches: nothing is built or run), which keeps the real CuPy, if any, out of this process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decapybara.launcher import capacity
from decapybara.model.config import named_config
from decapybara.model.quant.presets import tensor_role
from decapybara.model.weights import expected_tensors

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((1, 1024), (12, 1024), (1, 32768), (12, 32768))

# by hand from the qwen3.8-27b config: 4-bit MXFP4 weights at 0.5 + 1/32 bytes a weight (E8M0 scale per 32):
# MLPs 64 x 3 x 17408 x 5120, DeltaNet 48 x (10240 + 6144 + 6144) x 5120, attention 16 x (12288 + 1024 + 1024 +
# 6144) x 5120, LM head 248320 x 5120; bf16 b / a gates 48 x 2 x 48 x 5120 x 2 B; float32 norms, conv1d, A_log and
# dt_bias 10,582,016 B; no embedding table (a row a sequence), no MTP head
WEIGHTS = 25_598_361_600 * 17 // 32 + 47_185_920 + 10_582_016
KV_TOKEN = 16 * 2 * 4 * 256 * 2  # 16 attention layers, k and v, 4 KV heads of 256, bf16
STATE = 48 * (48 * 128 * 128 + 10240 * 3) * 4  # 48 DeltaNet layers: float32 recurrent + conv (kernel 4) state
EXPECTED = {f"{b}x{c}": WEIGHTS + b * c * KV_TOKEN + 2 * b * STATE for b, c in SHAPES}


def test_hand_count():
    assert WEIGHTS == 13_656_897_536
    assert EXPECTED == {"1x1024": 14_037_792_768, "12x1024": 18_227_640_320, "1x32768": 16_118_167_552,
                        "12x32768": 43_192_137_728}


def mxfp4_bytes(name: str, shape: tuple[int, ...]) -> int:
    """bench/gpu.py's `build_model` for variant mxfp4: float32 and bf16 roles as the presets keep them, every
    other matrix (LM head and embedding included) MXFP4."""
    n = 1
    for s in shape:
        n *= s
    role = tensor_role(name, shape, False)
    return 4 * n if role == "f32" else 2 * n if role == "bf16" else n // 2 + n // 32


LOAD = """
import importlib.util, json, sys, types
sys.path.insert(0, sys.argv[1] + "/tools/cuda_emu")
import fake_cupy
fake_cupy.install()
spec = importlib.util.spec_from_file_location("bench_gpu", sys.argv[1] + "/bench/gpu.py")
g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)
"""
SCRIPT = LOAD + """
from decapybara.backend.cupy_backend import CupyBackend
sizes = json.loads(sys.stdin.read())
model = types.SimpleNamespace(w={k: types.SimpleNamespace(nbytes=v) for k, v in sizes.items()})
kv = CupyBackend("bf16").new_kv_cache(g.CFG, 2, g.PAGE, "16/16")
print(json.dumps({"mtp_layers": g.CFG.mtp_num_hidden_layers, "kv_layers": len(kv.store),
                  "weights": g.weight_bytes(model),
                  "steps": {f"{b}x{c}": g.step_bytes(model, kv, b, c) for c in g.CONTEXTS for b in g.BATCHES}}))
"""


def run_bench(script: str, stdin: str = "", **bench_env: str) -> dict:
    """The last line of `script`'s output (JSON), run over bench/gpu.py loaded as `g` (LOAD) with `bench_env`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    env.update(CUDA_EMU_NOOP="1", PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    env.update({k: v for k, v in bench_env.items() if v})
    out = subprocess.run([sys.executable, "-c", script, str(ROOT)], check=False, input=stdin, env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mtp", ["", "1"])
def test_step_bytes_match_the_hand_count(mtp):
    """The roofline's bytes of the 27B MXFP4 step at 1 and 12 sequences, 1k and 32k, as bench/gpu.py counts them:
    with the MTP head in the run (BENCH_MTP=1, whose pass the bench times apart) its weights and its layer's KV
    pages are no part of the decode step's bytes."""
    cfg = named_config("qwen3.8-27b")
    sizes = {k: mxfp4_bytes(k, s) for k, s in expected_tensors(cfg, include_mtp=True).items()}
    got = run_bench(SCRIPT, json.dumps(sizes), BENCH_MTP=mtp)
    assert got["mtp_layers"] == (1 if mtp else 0) and got["kv_layers"] == 16 + got["mtp_layers"]
    assert got["weights"] == WEIGHTS
    assert got["steps"] == EXPECTED
    # the launcher's planner counts the same step (capacity.decode_roofline at 1 byte/s: steps/s = 1 / bytes)
    for key, want in EXPECTED.items():
        b, c = (int(v) for v in key.split("x"))
        assert b / capacity.decode_roofline(cfg, sizes, "16/16", [c] * b, 1.0) == pytest.approx(want, rel=1e-12)


HF_SCRIPT = LOAD + """
import dataclasses, functools
import transformers
from decapybara.model.config import ModelConfig
from decapybara.testing import TINY_HF_CONFIGS
g.CFG = ModelConfig.from_hf(dict(TINY_HF_CONFIGS["qwen3_5_text"]))
calls = []
make = transformers.AutoModelForCausalLM.from_config

def recording(*a, **k):
    model = make(*a, **k)
    forward = model.forward

    @functools.wraps(forward)
    def counted(*fa, **fk):
        cache = fk.get("past_key_values", fk.get("cache"))
        calls.append([list(fk["input_ids"].shape), cache is not None and int(cache.get_seq_length()) > 0,
                      fk.get("logits_to_keep", 0)])
        return forward(*fa, **fk)
    model.forward = counted
    return model

transformers.AutoModelForCausalLM.from_config = recording
out = g.bench_hf_layers(g.CFG.num_hidden_layers, (64,))
print(json.dumps({"prefill_tokens": g.PREFILL_TOKENS, "calls": calls, "out": out}))
"""


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_hf_prefill_times_our_prefill_prompt():
    """HF's prefill tok/s (the table's prefill "vs HF") is timed on the prompt ours is: PREFILL_TOKENS tokens from
    position 0, the last row's logits, a warm-up then the median of two calls; not the 1,023-token prompt of its 1k
    decode cache (every row's logits) timed once. (A tiny qwen3_5_text model on the host.)"""
    got = run_bench(HF_SCRIPT, BENCH_HF_DEVICE="cpu", BENCH_PREFILL_TOKENS="96")  # a short prompt: a fast test
    n = got["prefill_tokens"]
    assert n == 96
    fresh = [[shape, keep] for shape, cached, keep in got["calls"] if not cached]
    assert fresh.count([[1, n], 1]) == 3  # one warm-up and two timed, the last row's logits (as ours)
    assert got["out"]["prefill_tok_s"] > 0
    assert {"b1_ctx64", "b12_ctx64"} <= got["out"].keys()
