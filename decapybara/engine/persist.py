"""A sequence's resumable state as plain data: what a paused conversation's tier unit carries besides its
KV and hybrid state, so that any engine on the same model (also after a server restart) can resume it and
produce exactly the tokens the uninterrupted run would have."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request, Sequence

FORMAT = 1


def params_to_dict(p: SamplingParams) -> dict[str, Any]:
    d = dataclasses.asdict(p)
    d["logit_bias"] = [[int(k), float(v)] for k, v in p.logit_bias.items()]
    d["stop_token_ids"], d["stop"] = list(p.stop_token_ids), list(p.stop)
    return d


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    """`params_to_dict`'s inverse; fields this version lacks (a later version's state) are left out."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    d = {k: v for k, v in d.items() if k in known}
    d["logit_bias"] = {int(k): float(v) for k, v in d.get("logit_bias", [])}
    d["stop_token_ids"], d["stop"] = tuple(d.get("stop_token_ids", ())), tuple(d.get("stop", ()))
    return SamplingParams(**d)


def sequence_state(seq: Sequence) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(JSON-able facts, arrays) of a sequence at a pause: everything but its KV and hybrid state, the output it
    holds back for its next event (no event has carried it yet) included."""
    req = seq.request
    meta = {
        "format": FORMAT, "request_id": req.request_id, "conversation": req.conversation,
        "history_end": req.history_end,
        "params": params_to_dict(req.params), "seed": seq.seed, "arrival": seq.arrival,
        "num_prompt": seq.num_prompt, "num_computed": seq.num_computed, "num_output": seq.num_output,
        "num_cached_prompt": seq.num_cached_prompt, "num_computed_prompt": seq.num_computed_prompt,
        "output_counts": [[int(k), int(v)] for k, v in seq.output_counts.items()],
        "loopguard": seq.loopguard.state.to_dict() if seq.loopguard is not None else None,
        "extra_penalty": seq.extra_penalty, "banned": list(seq.banned), "in_thinking": seq.in_thinking,
        "after_think": seq.after_think,
        "num_pauses": seq.num_pauses, "num_resumes": seq.num_resumes,
        "prompt_lps": None if seq.prompt_lps is None else [
            None if e is None else [e[0], [[int(t), float(v)] for t, v in e[1]]] for e in seq.prompt_lps],
        "prompt_lps_sent": seq.prompt_lps_sent,
        "pending": pending_to_dict(seq),
    }
    extras = {"tokens": np.asarray(seq.tokens, np.int64),
              "page_hashes": np.frombuffer(b"".join(seq.page_hashes), np.uint8).reshape(-1, 16).copy()}
    return meta, extras


def restore_sequence(meta: dict[str, Any], extras: dict[str, np.ndarray], loop_guard_for: Any) -> Sequence:
    """A paused `Sequence` rebuilt from `sequence_state` output (its bundle is attached by the caller);
    `loop_guard_for(params, state=None)` makes its LoopGuard (`Engine.loop_guard_for`).

    The detokeniser has no serialised state: the caller rebuilds it by replaying the output tokens as the live
    run pushed them (`Engine.import_paused`), which yields the same held-back text and stop-string state."""
    from decapybara.engine.loopguard import LoopGuardState
    from decapybara.errors import ConfigError

    if meta.get("format") != FORMAT:
        raise ValueError(f"unknown sequence state format {meta.get('format')!r}")
    tokens = [int(t) for t in extras["tokens"]]
    n_prompt = int(meta["num_prompt"])
    params = params_from_dict(meta["params"])
    req = Request(tuple(tokens[:n_prompt]), params, meta["request_id"], meta["conversation"], meta["arrival"],
                  meta.get("history_end"))
    seq = Sequence(req, int(meta["seed"]), float(meta["arrival"]), tokens=tokens, num_prompt=n_prompt,
                   num_computed=int(meta["num_computed"]))
    seq.num_output = int(meta["num_output"])
    seq.num_cached_prompt = int(meta["num_cached_prompt"])
    seq.num_computed_prompt = int(meta["num_computed_prompt"])
    seq.output_counts = {int(k): int(v) for k, v in meta["output_counts"]}
    seq.page_hashes = [bytes(row) for row in np.asarray(extras["page_hashes"], np.uint8).reshape(-1, 16)]
    if meta.get("loopguard") is not None:
        try:
            seq.loopguard = loop_guard_for(params, LoopGuardState.from_dict(meta["loopguard"]))
        except ConfigError:  # saved under another window or unit range (an earlier version): a fresh guard
            seq.loopguard = loop_guard_for(params)
    guarded = seq.loopguard is not None  # a guard's penalty and bans, not kept where none goes on (mode off)
    seq.extra_penalty = float(meta["extra_penalty"]) if guarded else 1.0
    seq.banned = tuple(int(t) for t in meta["banned"]) if guarded else ()
    seq.in_thinking = bool(meta["in_thinking"])
    seq.after_think = bool(meta.get("after_think", False))
    seq.num_pauses, seq.num_resumes = int(meta["num_pauses"]), int(meta["num_resumes"])
    lps = meta.get("prompt_lps")  # the prompt logprobs of chunks computed before the pause, not yet sent
    seq.prompt_lps = None if lps is None else [
        None if e is None else (float(e[0]), [(int(t), float(v)) for t, v in e[1]]) for e in lps]
    seq.prompt_lps_sent = bool(meta.get("prompt_lps_sent", False))
    pending_from_dict(seq, meta.get("pending"))
    return seq


def pending_to_dict(seq: Sequence) -> dict[str, Any]:
    """The output a sequence holds back for its next event (`EngineConfig.stream_interval` > 1, or a LoopGuard
    note): its tokens, their text, logprobs and alternatives, the note. Decoded but never sent, they are part of
    its state: an engine that adopts it sends them first."""
    return {"tokens": [int(t) for t in seq.pending_tokens], "text": seq.pending_text,
            "logprobs": [float(v) for v in seq.pending_logprobs],
            "top": [[[int(t), float(v)] for t, v in row] for row in seq.pending_top], "note": seq.pending_note}


def pending_from_dict(seq: Sequence, d: dict[str, Any] | None) -> None:
    """`pending_to_dict`'s output back onto `seq` (None, from a state saved before it was kept: nothing held)."""
    if d is None:
        return
    seq.pending_tokens = [int(t) for t in d["tokens"]]
    seq.pending_text = str(d["text"])
    seq.pending_logprobs = [float(v) for v in d["logprobs"]]
    seq.pending_top = [[(int(t), float(v)) for t, v in row] for row in d["top"]]
    seq.pending_note = d["note"]
