"""OpenAI legacy /v1/completions (raw prompt, no chat template) and /v1/models.

`echo`: the prompt's text comes before the completion's, and with `logprobs` its tokens' logprobs before the
completion's (the model's own, each given the tokens before it; the first token's None), computed over the whole
prompt (`SamplingParams.prompt_logprobs`: no prefix-cache reuse). With `echo`, `max_tokens` 0 scores the prompt
alone (what evaluation harnesses ask for a log-likelihood): the engine samples one token from the prompt's last
row, as any request's prefill does, and the response leaves it out.

`suffix`: fill-in-the-middle where the tokenizer has the markers (`Tokenizer.infill`): the prompt is the text
before the cursor, the suffix the text after it, and the completion the middle, ended by the model's FIM end
tokens as well as its eos. `best_of`: that many candidates a prompt are generated (engine requests of their own,
as `n`'s), and the `n` of them with the highest mean logprob a sampled token are returned, best first; every
candidate's tokens count in the usage.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

from decapybara.api import openai_schemas as oa
from decapybara.api.common import Collected, conversation_key, make_request, new_id, output_budget
from decapybara.api.errors import bad_request
from decapybara.api.openai_api import (
    MAX_CHOICES,
    finish_reason,
    loop_guard,
    sampling_params,
    summed_usage,
    usage,
)
from decapybara.api.streams import sse_data
from decapybara.engine.sequence import FinishReason, Request, TokenEvent

LEGACY_DEFAULT_MAX_TOKENS = 16  # the legacy API's default
MAX_PROMPTS = 64  # prompts a request may hold (a batch, as evaluation harnesses send), choices of all of them too


@dataclass(slots=True)
class CompletionPlan:
    request: Request
    model: str
    logprobs: bool
    include_usage: bool
    created: int
    n: int = 1  # choices generated (`openai_api.choice_requests`): `best_of` where it asks for more than n
    echo: str | None = None  # the prompt's text, where the request echoes it
    prompt_ids: tuple[int, ...] = ()  # ... and its tokens
    score_only: bool = False  # echo with max_tokens 0: the prompt alone (the engine's one token left out)
    # the prompt logprobs the first choice's engine request computed: a further choice's request asks for none (it
    # reads the prompt from the prefix cache) and echoes these (`choice_requests`, `CompletionStream`)
    shared: list = dataclasses.field(default_factory=list)
    response_id: str = ""  # the response's id where several prompts' plans make one response (else the request's)
    keep: int = 0  # choices returned (the request's n) where fewer than `n`: the best by mean logprob (`best_of`)

    @property
    def rid(self) -> str:
        return self.response_id or self.request.request_id


def prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a request: a string or token ids is one; a list of strings or of token-id lists is several
    (a batch, in order)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]


def prompt_ids(prompt: str | list[int], tokenizer: Any) -> tuple[int, ...]:
    """A prompt string (control-token text becomes control tokens) or token ids."""
    if isinstance(prompt, str):
        return tuple(tokenizer.encode(prompt))
    return tuple(prompt)


def plan_completions(body: oa.CompletionRequest, client: Any, model: str, conversation: str | None
                     ) -> list[CompletionPlan]:
    """One plan a prompt of the request, in order, each with its n choices; several prompts make one response
    (their choices indexed prompt by prompt, `batch_completion`), with the first plan's id."""
    prompts = prompt_list(body.prompt)
    n = min(max(body.n or 1, body.best_of or 1), MAX_CHOICES)  # (past their bounds: the plans' 400s name them)
    if len(prompts) > MAX_PROMPTS or len(prompts) * n > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts a request, their choices (n, or best_of, each) too",
                          "prompt")
    plans = [plan_completion(body, client, model, conversation, p) for p in prompts]
    for p in plans[1:]:  # one response: one id, one creation time
        p.response_id, p.created = plans[0].request.request_id, plans[0].created
    return plans


def plan_completion(body: oa.CompletionRequest, client: Any, model: str, conversation: str | None,
                    prompt: str | list[int] | None = None) -> CompletionPlan:
    """The plan of one prompt (`prompt`, else the request's only one)."""
    if prompt is None:
        prompts = prompt_list(body.prompt)
        if len(prompts) != 1:
            raise bad_request("one prompt expected here", "prompt")
        prompt = prompts[0]
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be from 1 to {MAX_CHOICES}", "n")
    best_of = n if body.best_of is None else body.best_of
    if not n <= best_of <= MAX_CHOICES:
        raise bad_request(f"best_of must be from n ({n}) to {MAX_CHOICES}", "best_of")
    if best_of > n and body.stream:
        raise bad_request("best_of above n cannot be streamed: the best are known once every candidate ends",
                          "best_of")
    ids = prompt_ids(prompt, client.tokenizer)
    if body.suffix:  # fill-in-the-middle: the prompt before the cursor, the suffix after it
        if body.echo:
            raise bad_request("echo cannot be given with a suffix", "suffix")
        ids = tuple(client.tokenizer.infill(ids, client.tokenizer.encode(body.suffix)))
    requested = LEGACY_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    score_only = bool(body.echo) and requested == 0 and not isinstance(requested, bool)
    max_tokens = 1 if score_only else output_budget(requested, len(ids), client.max_model_len, "max_tokens")
    # (best_of ranks candidates by their sampled tokens' logprobs: asked of the engine even where not returned)
    logprobs = body.logprobs if body.logprobs is not None or best_of == n else 0
    params = sampling_params(body, max(max_tokens, 1), logprobs)
    if body.echo and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    if body.suffix:
        params = dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(
            (*params.stop_token_ids, *client.tokenizer.fim_stop_ids))))
    text = prompt if isinstance(prompt, str) else ",".join(map(str, ids[:512]))
    key = conversation_key(conversation, body.user, None, text)
    request = make_request(new_id("cmpl-"), ids, params, key, client.max_model_len, client.vocab_size, "prompt",
                           scoring=score_only)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echo = None
    if body.echo:
        echo = prompt if isinstance(prompt, str) else client.tokenizer.decode(list(ids))
    return CompletionPlan(request, model, body.logprobs is not None, include_usage, int(time.time()), best_of, echo,
                          ids, score_only, keep=n if best_of > n else 0)


def echoed_logprobs(tokenizer: Any, ids: tuple[int, ...], prompt: list | None, decoder: Any
                    ) -> tuple[oa.LegacyLogprobs, int]:
    """An echoed prompt's part of the legacy logprobs: its tokens, their logprobs (the first None), alternatives and
    text offsets from 0, control tokens' text counted as the echoed text holds it; and the offset after it
    (`decoder` carries a character cut across the prompt's end)."""
    prompt = prompt or [None] * max(len(ids) - 1, 0)
    offsets, offset = [], 0
    for t in ids:
        offsets.append(offset)
        offset += len(decoder.decode(tokenizer.token_bytes(t)))
    tops = [None] + [_tops(tokenizer, p[1], t, p[0]) if p is not None else {} for p, t in zip(prompt, ids[1:])]
    return oa.LegacyLogprobs(tokens=[tokenizer.decode([t]) for t in ids],
                             token_logprobs=[None] + [p[0] if p is not None else None for p in prompt],
                             top_logprobs=tops, text_offset=offsets), offset


def _tops(tokenizer: Any, alts: list[tuple[int, float]], token: int, logprob: float | None) -> dict[str, float]:
    """One position's legacy `top_logprobs`: the best alternatives, then the token taken there where they do not hold
    it (as OpenAI's: "up to logprobs + 1 elements", the chosen token always among them)."""
    out = {tokenizer.decode([a]): lp for a, lp in alts}
    if logprob is not None:
        out.setdefault(tokenizer.decode([token]), logprob)
    return out


def legacy_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float],
                    top: list[list[tuple[int, float]]], offset: int, decoder: Any = None,
                    sampled: list[bool] | None = None) -> tuple[oa.LegacyLogprobs, int]:
    """The legacy format: token strings, their logprobs, {token: logprob} alternatives and text offsets; and the
    offset after these tokens. Offsets count the characters of the decoded text (a character cut across tokens
    counts at the token that completes it): `decoder`, a stream's UTF-8 decoder, carries a cut one over."""
    decoder = decoder or codecs.getincrementaldecoder("utf-8")(errors="replace")
    tokens, offsets, chosen = [], [], []
    for i, t in enumerate(token_ids):
        # forced tokens have no logprobs (but their text moves the offset)
        if sampled[i] if sampled is not None else i < len(logprobs):
            tokens.append(tokenizer.decode([t]))
            offsets.append(offset)
            chosen.append(t)
        if t not in tokenizer.skip_ids:
            offset += len(decoder.decode(tokenizer.token_bytes(t)))
    tops = [_tops(tokenizer, alts, t, lp) for alts, t, lp in zip(top, chosen, logprobs)]
    return oa.LegacyLogprobs(tokens=tokens, token_logprobs=list(logprobs), top_logprobs=tops,
                             text_offset=offsets), offset


def completion(plan: CompletionPlan, done: Collected, tokenizer: Any) -> oa.Completion:
    logprobs, text, out = None, done.text, done.num_output_tokens
    if plan.score_only:  # the engine's one token is not the client's
        done, out = Collected(finish_reason=FinishReason.LENGTH, num_prompt_tokens=done.num_prompt_tokens,
                              num_cached_tokens=done.num_cached_tokens, prompt_logprobs=done.prompt_logprobs), 0
    if plan.logprobs:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offset, head = 0, None
        if plan.echo is not None:
            head, offset = echoed_logprobs(tokenizer, plan.prompt_ids, done.prompt_logprobs, decoder)
        logprobs, _ = legacy_logprobs(tokenizer, done.token_ids, done.logprobs, done.top_logprobs, offset, decoder,
                                      sampled=done.sampled)
        if head is not None:
            logprobs = oa.LegacyLogprobs(tokens=head.tokens + logprobs.tokens,
                                         token_logprobs=head.token_logprobs + logprobs.token_logprobs,
                                         top_logprobs=head.top_logprobs + logprobs.top_logprobs,
                                         text_offset=head.text_offset + logprobs.text_offset)
    text = (plan.echo or "") + ("" if plan.score_only else text)
    choice = oa.CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason(done.finish_reason, False),
                                 loop_guard=loop_guard(done.finish_reason, done.note))
    u = usage(done.num_prompt_tokens or len(plan.request.prompt_ids), done.num_cached_tokens, out)
    return oa.Completion(id=plan.rid, created=plan.created, model=plan.model, choices=[choice], usage=u)


def completions(plan: CompletionPlan, dones: list[Collected], tokenizer: Any) -> oa.Completion:
    """The response of a request of several choices (`dones`, in the choices' order): each choice indexed, the
    prompt's tokens counted once, the outputs' summed; an echo's prompt logprobs the first choice's. Of best_of's
    candidates, the `plan.keep` best (`best_candidates`), every candidate's outputs counted."""
    for done in dones[1:]:
        done.prompt_logprobs = done.prompt_logprobs or dones[0].prompt_logprobs
    whole = [completion(plan, done, tokenizer) for done in dones]
    kept = best_candidates(dones, plan.keep) if plan.keep else range(len(whole))
    choices = [whole[k].choices[0].model_copy(update={"index": i}) for i, k in enumerate(kept)]
    return whole[0].model_copy(update={"choices": choices, "usage": summed_usage([c.usage for c in whole])})


def best_candidates(dones: list[Collected], keep: int) -> list[int]:
    """The indices of the `keep` candidates with the highest mean logprob over their sampled tokens, best first (a
    tie: the earlier; a candidate of no sampled token last)."""
    def mean(done: Collected) -> float:
        lps = [lp for lp in done.logprobs if not math.isnan(lp)]  # (NaN: none computed)
        return sum(lps) / len(lps) if lps else -float("inf")
    scores = [mean(d) for d in dones]
    return sorted(range(len(dones)), key=lambda i: -scores[i])[:keep]


def batch_completion(plans: list[CompletionPlan], dones: list[Collected], tokenizer: Any) -> oa.Completion:
    """The response of several prompts (`plans`, each with its n choices' `dones` in turn): the choices indexed
    prompt by prompt, each prompt's tokens counted once, everything summed (`batch_usage`)."""
    parts, k = [], 0
    for p in plans:
        parts.append(completions(p, dones[k:k + p.n], tokenizer))
        k += p.n
    choices = [c.model_copy(update={"index": i}) for i, c in enumerate(c for part in parts for c in part.choices)]
    return parts[0].model_copy(update={"choices": choices, "usage": added_usage([part.usage for part in parts])})


def added_usage(each: list[oa.Usage]) -> oa.Usage:
    """Several prompts' usages added up (each already its prompt once and its choices' outputs)."""
    return usage(sum(u.prompt_tokens for u in each), sum(u.prompt_tokens_details.cached_tokens for u in each),
                 sum(u.completion_tokens for u in each))


def batch_usage(plans: list[CompletionPlan], each: list[oa.Usage]) -> oa.Usage:
    """The usage of several prompts' choices (`each`, in `batch_completion`'s order): a prompt's choices summed
    with its prompt once, the prompts added up."""
    parts, k = [], 0
    for p in plans:
        parts.append(summed_usage(each[k:k + p.n]))
        k += p.n
    return added_usage(parts)


class CompletionStream:
    """SSE chunks of a legacy completion: text deltas, a final chunk with finish_reason, optional usage, [DONE];
    `index`: the choice's where the request asks for several (`finish`, `usage` and `tail` then its parts)."""

    def __init__(self, plan: CompletionPlan, tokenizer: Any, index: int = 0) -> None:
        self.plan, self.tokenizer, self.index = plan, tokenizer, index
        self.offset = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.echoed = plan.echo is None  # an echoed prompt goes out first, with the first event

    def _chunk(self, choices: list[oa.CompletionChoice], u: oa.Usage | None = None) -> str:
        p = self.plan
        return sse_data(oa.Completion(id=p.rid, created=p.created, model=p.model, choices=choices,
                                      usage=u).json_text())

    def start(self, first: TokenEvent | None) -> list[str]:
        return []

    def event(self, ev: TokenEvent) -> list[str]:
        lines = []
        if ev.prompt_logprobs is not None:  # (the first choice's: the others echo them, `shared`)
            self.plan.shared[:] = [ev.prompt_logprobs]
        if not self.echoed:  # the prompt's chunk: its text, and its tokens' logprobs where asked for
            self.echoed, logprobs = True, None
            if self.plan.logprobs:
                prompt = ev.prompt_logprobs or (self.plan.shared[0] if self.plan.shared else None)
                logprobs, self.offset = echoed_logprobs(self.tokenizer, self.plan.prompt_ids, prompt, self.decoder)
            lines.append(self._chunk([oa.CompletionChoice(index=self.index, text=self.plan.echo, logprobs=logprobs)]))
        if self.plan.score_only or (not ev.text and not (self.plan.logprobs and ev.token_ids)):
            return lines
        logprobs = None
        if self.plan.logprobs:
            logprobs, self.offset = legacy_logprobs(self.tokenizer, ev.token_ids, ev.logprobs, ev.top_logprobs,
                                                    self.offset, self.decoder)
        return [*lines, self._chunk([oa.CompletionChoice(index=self.index, text=ev.text, logprobs=logprobs)])]

    def finish(self, last: TokenEvent) -> list[str]:
        """The choice's last chunk (its finish_reason and loop_guard)."""
        reason = FinishReason.LENGTH if self.plan.score_only else last.finish_reason
        choice = oa.CompletionChoice(index=self.index, text="", finish_reason=finish_reason(reason, False),
                                     loop_guard=loop_guard(last.finish_reason, last.note))
        return [self._chunk([choice])]

    def usage(self, last: TokenEvent) -> oa.Usage:
        return usage(last.num_prompt_tokens or len(self.plan.request.prompt_ids), last.num_cached_tokens,
                     0 if self.plan.score_only else last.num_output_tokens)

    def tail(self, total: oa.Usage) -> list[str]:
        """What follows the choices' last chunks: the usage chunk where asked for, then ``data: [DONE]``."""
        return [*([self._chunk([], total)] if self.plan.include_usage else []), sse_data("[DONE]")]

    def end(self, last: TokenEvent) -> list[str]:
        return [*self.finish(last), *self.tail(self.usage(last))]


def model_list(name: str, max_model_len: int, created: int) -> oa.ModelList:
    return oa.ModelList(data=[oa.ModelCard(id=name, created=created, max_model_len=max_model_len)])
