"""Prometheus text exposition (format 0.0.4) of the engine's stats dict and the HTTP layer's counters.

Known stats keys get fixed names and types; any other number becomes a gauge of the same name, and any dict
of numbers a labelled gauge, so stats from other `EngineClient`s (e.g. the Ray scheduler) still show up.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from numbers import Real
from typing import Any

PREFIX = "decapybara_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# stats key -> help text; exposed as counters named PREFIX + key + "_total"
COUNTERS = {
    "steps": "Engine steps run.",
    "prompt_tokens": "Prompt tokens of admitted requests.",
    "computed_prompt_tokens": "Prompt tokens run through the model.",
    "reused_prompt_tokens": "Prompt tokens taken from the prefix cache.",
    "generated_tokens": "Tokens generated.",
    "forward_tokens": "Token rows run through the model (prefill and decode).",
    "drafted_tokens": "Speculation: drafts verified as more rows of a decode.",
    "accepted_tokens": "Speculation: drafts the sampled token matched.",
    "withheld_steps": "Speculation: steps whose drafts spec_adaptive withheld (verifying measured slower there).",
    "pauses": "Conversations paused (KV and state moved out of the pool).",
    "resumes": "Conversations resumed.",
    "finished": "Requests finished (any reason).",
    "aborted": "Requests aborted (client gone or cancelled; also a reasoning cut at its thinking budget, whose "
               "answer continues as a new request).",
    "step_seconds": "Seconds spent in engine steps.",
    "engine_errors": "Engine steps that raised.",
    "offloaded_pages": "Prefix pages evicted from the pool into the KV tiers.",
    "restored_pages": "Prefix pages brought back from the KV tiers instead of being recomputed.",
    "lost_pages": "Prefix pages a tier no longer had, had damaged, or had without their state snapshot.",
    "restored_snapshots": "State snapshots of in-pool prefix pages brought back from a tier's copy of the page.",
    "lost_bundles": "Paused conversations whose bundle was lost (recomputed from their tokens).",
    "demoted_pages": "Cached pages of expired conversations made the next evicted.",
    "saved_pages": "Prefix pages copied to the KV tiers at a graceful stop, for the next server.",
}
# stats key -> help text; exposed as gauges named PREFIX + key
GAUGES = {
    "running": "Requests holding a slot.",
    "waiting": "Requests queued for a slot.",
    "paused": "Requests paused out of the pool.",
    "free_pages": "Free KV pages.",
    "used_pages": "KV pages in use by running requests.",
    "cached_pages": "KV pages kept only for prefix reuse.",
    "total_pages": "KV pages in the pool.",
    "snapshots": "Hybrid-state snapshots kept for prefix reuse.",
    "snapshot_bytes": "Bytes held by hybrid-state snapshots.",
    "open_requests": "Requests the HTTP layer is waiting on.",
    "uptime_seconds": "Seconds since the engine client started.",
}


def _name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def prometheus_text(stats: Mapping[str, Any], http_requests: Mapping[tuple[str, int], int] | None = None) -> str:
    """The exposition text of `stats` (an EngineClient.stats() dict) and HTTP request counts by (route, code)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, str]]) -> None:
        if not samples:
            return
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    for key, help_text in COUNTERS.items():
        value = _num(stats.get(key))
        if value is not None:
            family(f"{PREFIX}{key}_total", "counter", help_text, [("", value)])
    for key, help_text in GAUGES.items():
        value = _num(stats.get(key))
        if value is not None:
            family(f"{PREFIX}{key}", "gauge", help_text, [("", value)])
    used, total = stats.get("used_pages"), stats.get("total_pages")
    if _num(used) is not None and _num(total) is not None and total:
        family(f"{PREFIX}kv_pool_usage_ratio", "gauge", "Share of the KV pool in use by running requests.",
               [("", _num(used / total))])
    loopguard = stats.get("loopguard")
    if isinstance(loopguard, Mapping):
        samples = [(f'{{action="{_label(k)}"}}', v) for k, raw in sorted(loopguard.items())
                   if (v := _num(raw)) is not None]
        family(f"{PREFIX}loopguard_events_total", "counter", "LoopGuard interventions by action.", samples)
    spec = stats.get("speculation")  # the governor's rates: width -> {on_tok_s, off_tok_s, ..., verify}
    if isinstance(spec, Mapping):
        rows = [(w, r) for w, r in sorted(spec.items(), key=lambda kv: int(kv[0])) if isinstance(r, Mapping)]
        family(f"{PREFIX}spec_tokens_per_second", "gauge",
               "Speculation governor: measured tokens/s of decode steps by width (decoding agents) and arm.",
               [(f'{{width="{_label(w)}",arm="{arm}"}}', v) for w, r in rows for arm, k in
                (("verify", "on_tok_s"), ("withhold", "off_tok_s")) if (v := _num(r.get(k))) is not None])
        family(f"{PREFIX}spec_verify", "gauge",
               "Speculation governor: 1 where drafts are verified at this width, 0 where withheld.",
               [(f'{{width="{_label(w)}"}}', v) for w, r in rows if (v := _num(r.get("verify"))) is not None])
    for key, raw in sorted(stats.items()):
        if key in COUNTERS or key in GAUGES or key in ("loopguard", "speculation"):
            continue
        if isinstance(raw, Mapping):
            samples = [(f'{{key="{_label(k)}"}}', v) for k, r in sorted(raw.items(), key=lambda kv: str(kv[0]))
                       if (v := _num(r)) is not None]
            samples += [(f'{{key="{_label(k)}",field="{_label(f)}"}}', v)  # one level deeper: e.g. tiers.ram.hits
                        for k, r in sorted(raw.items(), key=lambda kv: str(kv[0])) if isinstance(r, Mapping)
                        for f, x in sorted(r.items(), key=lambda kv: str(kv[0])) if (v := _num(x)) is not None]
            family(f"{PREFIX}{_name(key)}", "gauge", f"Engine stat {key}.", samples)
        elif (value := _num(raw)) is not None:
            family(f"{PREFIX}{_name(key)}", "gauge", f"Engine stat {key}.", [("", value)])
    if http_requests:
        samples = [(f'{{route="{_label(route)}",code="{code}"}}', str(n))
                   for (route, code), n in sorted(http_requests.items())]
        family(f"{PREFIX}http_requests_total", "counter", "HTTP requests answered, by route and status code.",
               samples)
    return "\n".join(lines) + "\n"
