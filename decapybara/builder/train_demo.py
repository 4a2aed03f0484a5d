"""Stage 2 of the demo model (GPU or CPU): train a small qwen3_5_text hybrid with one MTP layer.

``python -m decapybara.builder.train_demo --data .data/demo --out .data/demo-hf --minutes 4 --device cuda``
reads stage 1's folder (train.bin, heldout.bin, tokenizer.json, data.json), trains a `Qwen3_5ForCausalLM`
built with transformers' ``from_config`` plus `MTPHead` (loss = next-token CE + `mtp_weight` * MTP CE), stops
cleanly at ``--minutes``, ``--steps`` or ``--max-epochs`` (default 8: on this ~4M-token corpus more epochs
overfit; an H200 gets there in ~170 s), evaluates on held-out tokens against the add-one unigram baseline,
and writes a HF folder: config.json (``mtp_num_hidden_layers: 1``), model.safetensors holding exactly
``decapybara.model.weights.expected_tensors`` (``mtp.*`` included), tokenizer files, generation_config.json
and train_report.json. Needs torch, transformers, numpy, safetensors and jinja2; no network, no Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from decapybara.builder.corpus import chat_template, render_chat
from decapybara.builder.train_tokenizer import unigram_baseline, window_batches
from decapybara.model.config import ModelConfig
from decapybara.model.weights import expected_tensors


@dataclass(slots=True)
class ArchSpec:
    """Demo architecture (qwen3_5_text field names). Default: 9.93M parameters with the MTP layer, 19.9 MB
    in bf16 at vocab 8192 (DeltaNet: 2 key heads, 4 value heads, all of dim 64)."""

    hidden_size: int = 256
    num_hidden_layers: int = 8
    full_attention_interval: int = 4  # layer i is full attention when (i + 1) % interval == 0
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    mtp_num_hidden_layers: int = 1

    def hf_config(self, vocab_size: int, eos_ids: list[int], pad_id: int) -> Any:
        from transformers import AutoConfig

        if self.mtp_num_hidden_layers != 1:
            raise ValueError("the demo trains exactly one MTP layer")
        kw = {k: v for k, v in dataclasses.asdict(self).items()
              if k not in ("full_attention_interval", "rope_theta", "partial_rotary_factor")}
        n, k = self.num_hidden_layers, self.full_attention_interval
        return AutoConfig.for_model(
            "qwen3_5_text", vocab_size=vocab_size, **kw,
            layer_types=["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)],
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
            tie_word_embeddings=True, eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None,
            architectures=["Qwen3_5ForCausalLM"],
        )


@dataclass(slots=True)
class TrainSpec:
    """Optimisation and evaluation settings; the defaults are the ones measured on an H200 (module doc)."""

    seq_len: int = 512
    batch_size: int = 64  # sequences per step: ~200k tokens/s on an H200 with transformers' torch DeltaNet
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.03  # fraction of the run
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    dropout: float = 0.1  # on each mixer / MLP output while training (the corpus is small: many epochs)
    max_epochs: float = 8.0  # stop after this many passes over train.bin even if time is left
    eval_tokens: int = 200_000
    eval_every_s: float = 30.0  # a quick held-out check (first 32k tokens) for the log; 0 turns it off
    sample_tokens: int = 64
    log_every_s: float = 10.0


class MTPHead(nn.Module):
    """Qwen3.5-style multi-token prediction: token t+2 from the final hidden state at t and token t+1.

    h = fc(concat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)]) -> one full-attention
    decoder layer (the model's own class) -> norm -> the model's tied lm_head. `h_t` is the model's output
    after its final norm (what the engine hands the drafter). Parameter names: `mtp_tensors` without 'mtp.'.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.config
        if cfg._attn_implementation != "sdpa":
            raise ValueError("MTPHead relies on sdpa's implicit causal mask; build the model with sdpa")
        full = cfg.layer_types.index("full_attention")
        norm_cls, h = type(model.model.norm), cfg.hidden_size
        self.pre_fc_norm_embedding = norm_cls(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([type(model.model.layers[full])(cfg, full)])
        self.norm = norm_cls(h, eps=cfg.rms_norm_eps)

    def init_weights(self, generator: torch.Generator, std: float) -> None:
        """As HF initialises the model: linear weights N(0, std), zero-centred norm weights 0."""
        with torch.no_grad():
            for p in self.parameters():
                if p.ndim == 1:
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, rotary: nn.Module) -> torch.Tensor:
        """hidden, next_embeds: [B, T, H] -> normed MTP hidden states [B, T, H] (causal over T)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device)[None, None].expand(3, b, t)  # [3, B, T]: text-only mrope
        pe = rotary(x, pos)
        for layer in self.layers:
            out = layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos[0])
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)


def predict(model: nn.Module, mtp: MTPHead, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk [B, L+1] -> (next-token logits [B, L, V] for chunk[:, 1:], MTP logits [B, L-1, V] for
    chunk[:, 2:])."""
    hidden = model.model(input_ids=chunk[:, :-1], use_cache=False).last_hidden_state  # [B, L, H], normed
    next_embeds = model.model.embed_tokens(chunk[:, 1:-1])  # [B, L-1, H]
    mtp_h = mtp(hidden[:, :-1], next_embeds, model.model.rotary_emb)  # [B, L-1, H]
    return model.lm_head(hidden), model.lm_head(mtp_h)


def forward_losses(model: nn.Module, mtp: MTPHead, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk [B, L+1] -> (next-token CE over L targets, MTP CE over L-1 targets), means in fp32."""
    logits, mtp_logits = predict(model, mtp, chunk)
    return (F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten()),
            F.cross_entropy(mtp_logits.float().flatten(0, 1), chunk[:, 2:].flatten()))


def build_model(arch: ArchSpec, data: dict[str, Any], seed: int, device: str) -> tuple[nn.Module, MTPHead]:
    """A freshly initialised (model, MTP head) on `device`, fp32 master weights, fixed by `seed`."""
    from transformers import AutoModelForCausalLM

    ids = data["special_tokens"]
    cfg = arch.hf_config(data["vocab_size"], [ids["<|im_end|>"], ids["<|endoftext|>"]], ids["<|endoftext|>"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    mtp = MTPHead(model)
    mtp.init_weights(torch.Generator().manual_seed(seed + 1), cfg.initializer_range)
    return model.to(device), mtp.to(device)


def param_counts(model: nn.Module, mtp: MTPHead) -> dict[str, int]:
    """Unique parameters (the tied lm_head counted once) and the bf16 bytes of the whole checkpoint."""
    main = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    extra = sum(p.numel() for p in mtp.parameters())
    return {"model": main, "mtp": extra, "total": main + extra, "bf16_bytes": 2 * (main + extra)}


def lr_at(spec: TrainSpec, progress: float) -> float:
    """Linear warm-up then cosine decay to `min_lr_ratio` * lr, over progress in [0, 1]."""
    if progress < spec.warmup:
        return spec.lr * max(progress, 1e-3) / spec.warmup
    frac = min(1.0, (progress - spec.warmup) / max(1e-9, 1.0 - spec.warmup))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def evaluate(model: nn.Module, mtp: MTPHead, ids: torch.Tensor, seq_len: int, batch_size: int,
             autocast: Any) -> dict[str, float]:
    """Mean CE (nats) and top-1 of next-token and MTP predictions over the full windows of `ids`.

    Windows of seq_len + 1 tokens start every seq_len tokens, so ids[1 : 1 + tokens] are each a next-token
    target exactly once; the MTP targets are all but the first of each window.
    """
    model.eval()
    mtp.eval()
    n_win = (ids.numel() - 1) // seq_len
    sums = torch.zeros(4, dtype=torch.float64)
    for i in range(0, n_win, batch_size):
        starts = torch.arange(i, min(n_win, i + batch_size), device=ids.device) * seq_len
        chunk = ids[starts[:, None] + torch.arange(seq_len + 1, device=ids.device)]  # [b, L+1]
        with autocast:
            logits, mtp_logits = predict(model, mtp, chunk)
        for j, (lg, tgt) in enumerate(((logits, chunk[:, 1:]), (mtp_logits, chunk[:, 2:]))):
            lg = lg.float().flatten(0, 1)
            sums[2 * j] += F.cross_entropy(lg, tgt.flatten(), reduction="sum").item()
            sums[2 * j + 1] += (lg.argmax(-1) == tgt.flatten()).sum().item()
    model.train()
    mtp.train()
    n, m = max(1, n_win * seq_len), max(1, n_win * (seq_len - 1))
    return {"ce": sums[0].item() / n, "top1": sums[1].item() / n, "tokens": n_win * seq_len,
            "mtp_ce": sums[2].item() / m, "mtp_top1": sums[3].item() / m}


CHAT_PROBES = ("Write a Python function `is_prime(n)`: Return True if n is a prime number.",
               "Write a Python function `read_json(path)`: Load and return the JSON document stored at path.")


@torch.no_grad()
def samples(model: nn.Module, tok: Any, heldout_text: list[str], data: dict[str, Any], n_new: int,
            device: str, autocast: Any) -> list[dict[str, str]]:
    """Greedy completions (no cache: short prompts only) of three held-out snippets (a function's first lines)
    and of the `CHAT_PROBES` rendered with the chat template; each stops at <|im_end|> or <|endoftext|>."""
    stop = {data["special_tokens"]["<|endoftext|>"], data["special_tokens"]["<|im_end|>"]}
    snippets = []
    for lines in (text.splitlines() for text in heldout_text):
        at = next((i for i, ln in enumerate(lines) if ln.startswith("def ")), None)
        if at is not None:
            snippets.append("\n".join(lines[at: at + 4]) + "\n")
    template, _ = chat_template()
    prompts = [("heldout", p) for p in snippets[:3]] + [
        ("chat", render_chat(template, [{"role": "user", "content": ask}])) for ask in CHAT_PROBES]
    model.eval()
    out = []
    for kind, prompt in prompts:
        ids, new = tok.encode(prompt).ids, []
        while len(new) < n_new and not (new and new[-1] in stop):
            with autocast:
                logits = model(input_ids=torch.tensor([ids + new], device=device), use_cache=False).logits
            new.append(int(logits[0, -1].argmax()))
        out.append({"kind": kind, "prompt": prompt, "completion": tok.decode(new, skip_special_tokens=False)})
    model.train()
    return out


def save_checkpoint(model: nn.Module, mtp: MTPHead, data_dir: Path, out: Path,
                    dtype: torch.dtype) -> list[str]:
    """Write the HF folder; model.safetensors holds exactly `expected_tensors` of the config (returned)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = dtype
    model.config.save_pretrained(out)
    hf = json.loads((out / "config.json").read_text())
    expected = expected_tensors(ModelConfig.from_hf(hf))
    own = {k: v for k, v in model.state_dict().items()}
    own.update({f"mtp.{k}": v for k, v in mtp.state_dict().items()})
    tensors = {}
    for name, shape in expected.items():
        if name not in own or tuple(own[name].shape) != shape:
            raise RuntimeError(f"tensor {name} {shape} missing or misshapen in the trained model")
        tensors[name] = own[name].detach().to("cpu", dtype).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    data = json.loads((data_dir / "data.json").read_text())
    st = data["special_tokens"]
    eos = [st["<|im_end|>"], st["<|endoftext|>"]]
    GenerationConfig(eos_token_id=eos, pad_token_id=st["<|endoftext|>"], do_sample=True, temperature=0.6,
                     top_p=0.95, top_k=20).save_pretrained(out)
    shutil.copyfile(data_dir / "tokenizer.json", out / "tokenizer.json")
    template, _ = chat_template()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model.config.max_position_embeddings, "chat_template": template,
    }, indent=1))
    return list(tensors)


@dataclass(slots=True)
class TrainResult:
    model: nn.Module
    mtp: MTPHead
    report: dict[str, Any]


def add_dropout(model: nn.Module, mtp: MTPHead, p: float) -> None:
    """Dropout on every token mixer and MLP output (training mode only) by forward hooks; nothing is saved."""
    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, tuple):  # attention returns (output, weights)
            return (F.dropout(out[0], p, module.training), *out[1:])
        return F.dropout(out, p, module.training)

    if p > 0:
        for layer in [*model.model.layers, *mtp.layers]:
            mixer = layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn
            mixer.register_forward_hook(hook)
            layer.mlp.register_forward_hook(hook)


def fit(model: nn.Module, mtp: MTPHead, train_ids: torch.Tensor, heldout_ids: torch.Tensor, spec: TrainSpec,
        seed: int, minutes: float | None, steps: int | None, autocast: Any) -> dict[str, Any]:
    """The training loop. Progress in [0, 1] is the largest of elapsed/budget, step/steps, epochs/max_epochs;
    it drives the LR schedule and the stop (the periodic 32k-token held-out check counts as time).
    Returns steps, seconds, why it stopped and the log."""
    device = train_ids.device
    params = list({id(p): p for p in [*model.parameters(), *mtp.parameters()]}.values())  # tied: once
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": spec.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # no decay: norms, A_log...
    opt = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    batches = window_batches(train_ids.numel(), spec.seq_len, spec.batch_size, seed)
    tokens_per_step = spec.batch_size * spec.seq_len
    limits = {"minutes": None if minutes is None else minutes * 60.0, "steps": steps,
              "epochs": spec.max_epochs * train_ids.numel() / tokens_per_step}
    log: list[dict[str, float]] = []
    step, t0 = 0, time.perf_counter()
    last_log = last_eval = t0
    while True:
        elapsed = time.perf_counter() - t0
        done = {k: (elapsed if k == "minutes" else step) / v for k, v in limits.items() if v}
        stop, progress = max(done.items(), key=lambda kv: kv[1])
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(spec, progress)
        epoch, starts = next(batches)
        idx = torch.as_tensor(starts, device=device)[:, None] + torch.arange(spec.seq_len + 1, device=device)
        with autocast:
            nt, mt = forward_losses(model, mtp, train_ids[idx])  # [B, L+1] windows
            loss = nt + spec.mtp_weight * mt
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        opt.step()
        step += 1
        now = time.perf_counter()
        if now - last_log >= spec.log_every_s or step == 1:
            entry = {"step": step, "s": round(now - t0, 1), "epoch": epoch, "lr": opt.param_groups[0]["lr"],
                     "loss": round(nt.item(), 4), "mtp_loss": round(mt.item(), 4),
                     "tok_s": round(step * tokens_per_step / (now - t0))}
            if spec.eval_every_s and now - last_eval >= spec.eval_every_s:
                entry["heldout_32k"] = round(evaluate(model, mtp, heldout_ids[:32_769], spec.seq_len,
                                                      spec.batch_size, autocast)["ce"], 4)
                last_eval = time.perf_counter()
            print(json.dumps(entry), flush=True)
            log.append(entry)
            last_log = now
    seconds = time.perf_counter() - t0
    return {"steps": step, "stopped_by": stop, "train_seconds": round(seconds, 1),
            "epochs_seen": round(step * tokens_per_step / train_ids.numel(), 2),
            "tokens_per_second": round(step * tokens_per_step / max(seconds, 1e-9)), "log": log}


def train(data_dir: str | Path, out: str | Path, minutes: float | None, steps: int | None, device: str,
          seed: int = 0, arch: ArchSpec | None = None, spec: TrainSpec | None = None,
          save_dtype: str = "float32") -> TrainResult:
    """Train (`fit` says when it stops), evaluate, sample, save and verify the reload; see the module doc."""
    from tokenizers import Tokenizer

    arch, spec = arch or ArchSpec(), spec or TrainSpec()
    if not (minutes or steps or spec.max_epochs):
        raise ValueError("no stop: give minutes, steps or max_epochs")
    data_dir, out = Path(data_dir), Path(out)
    data = json.loads((data_dir / "data.json").read_text())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    train_np = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    heldout_np = np.fromfile(data_dir / "heldout.bin", dtype=np.uint16)
    train_ids = torch.from_numpy(train_np.astype(np.int64)).to(device)
    heldout_ids = torch.from_numpy(heldout_np[: spec.eval_tokens + 1].astype(np.int64)).to(device)

    model, mtp = build_model(arch, data, seed, device)
    add_dropout(model, mtp, spec.dropout)
    counts = param_counts(model, mtp)
    print(f"params: model {counts['model']:,} + mtp {counts['mtp']:,} = {counts['total']:,} "
          f"({counts['bf16_bytes'] / 1e6:.1f} MB in bf16); train tokens {train_np.size:,}", flush=True)
    run = fit(model, mtp, train_ids, heldout_ids, spec, seed, minutes, steps, autocast)

    ev = evaluate(model, mtp, heldout_ids, spec.seq_len, spec.batch_size, autocast)
    uni = unigram_baseline(train_np, heldout_np[1: ev["tokens"] + 1], data["vocab_size"])
    print(f"held-out CE {ev['ce']:.4f} nats (ppl {math.exp(ev['ce']):.2f}, top-1 {ev['top1']:.3f}) over "
          f"{ev['tokens']:,} tokens; MTP CE {ev['mtp_ce']:.4f} (top-1 {ev['mtp_top1']:.3f}); "
          f"unigram baseline {uni:.4f}", flush=True)
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    # NOTE: the held-out text comes from heldout.bin, not the stdlib: the GPU machine has another Python.
    docs = np.split(heldout_np, np.flatnonzero(heldout_np == data["eot_id"]) + 1)
    held_text = [tok.decode(d.tolist()) for d in docs[:8] if d.size > 1]
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "seed": seed, "arch": dataclasses.asdict(arch), "train": dataclasses.asdict(spec), "params": counts,
        **{k: v for k, v in run.items() if k != "log"},
        "heldout": {**{k: round(v, 4) for k, v in ev.items() if k != "tokens"}, "tokens": ev["tokens"],
                    "ppl": round(math.exp(ev["ce"]), 2)},
        "unigram_baseline_ce": round(uni, 4), "log": run["log"],
        "data": {k: data[k] for k in ("tokens", "chat_token_fraction", "chat_template_source", "sha256")},
        "samples": samples(model, tok, held_text, data, spec.sample_tokens, device, autocast),
    }
    report["tensors"] = len(save_checkpoint(model, mtp, data_dir, out, getattr(torch, save_dtype)))
    report["reload_max_abs_diff"] = verify_reload(model, mtp, out, heldout_ids[:129], device)
    (out / "train_report.json").write_text(json.dumps(report, indent=1))
    return TrainResult(model, mtp, report)


@torch.no_grad()
def verify_reload(model: nn.Module, mtp: MTPHead, out: Path, ids: torch.Tensor,
                  device: str) -> dict[str, float]:
    """Reload `out` with AutoModelForCausalLM (and the mtp.* tensors into a fresh head); max |logit diff|."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    reloaded = reloaded.to(device)
    head = MTPHead(reloaded).to(device)
    head.load_state_dict({k[4:]: v for k, v in load_file(str(out / "model.safetensors")).items()
                          if k.startswith("mtp.")})
    for m in (model, mtp, head):
        m.eval()
    (a, am), (b, bm) = predict(model, mtp, ids[None]), predict(reloaded, head, ids[None])
    model.train()
    mtp.train()
    return {"logits": float((a - b).abs().max()), "mtp_logits": float((am - bm).abs().max())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="stage 1 folder (train_tokenizer --out)")
    ap.add_argument("--out", required=True, help="HF checkpoint folder to write")
    ap.add_argument("--minutes", type=float, default=None, help="training budget (eval comes after)")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", default="{}", help='ArchSpec overrides as JSON: \'{"num_hidden_layers": 4}\'')
    ap.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32")
    defaults = TrainSpec()
    for name in ("batch_size", "seq_len", "lr", "max_epochs", "dropout", "weight_decay", "mtp_weight",
                 "eval_tokens"):
        value = getattr(defaults, name)
        flag = "--" + name.replace("_", "-")
        ap.add_argument(flag, type=type(value), default=value, help=f"TrainSpec.{name}")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    spec = TrainSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSpec)
                        if hasattr(args, f.name)})
    res = train(args.data, args.out, args.minutes, args.steps, args.device, args.seed,
                ArchSpec(**json.loads(args.arch)), spec, args.save_dtype)
    print(json.dumps({k: res.report[k] for k in ("steps", "stopped_by", "epochs_seen", "train_seconds",
                                                 "tokens_per_second", "heldout", "unigram_baseline_ce",
                                                 "reload_max_abs_diff")}))


if __name__ == "__main__":
    main()
