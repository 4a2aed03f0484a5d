"""JSON mode (OpenAI `response_format: {"type": "json_object"}`): each answer token is sampled only among the
tokens that keep the answer a prefix of a JSON object, so a reply that ends by itself parses.

A byte-level automaton reads RFC 8259 JSON whose top-level value is an object: strings (escapes, `\\u` and four hex digits; control bytes refused; other bytes, UTF-8 included,
taken as they come), numbers, `true` / `false` / `null`, objects and arrays nested up to `MAX_DEPTH`, and
whitespace between tokens, at most `MAX_WS` bytes in a run (so a model cannot pad for ever), `TOP_WS` before the
object. Once the object
closes, the answer ends (the engine finishes it; an end-of-sequence token is the only one allowed there);
before that, none is. Added tokens (the chat markup,
`<think>`, `<tool_call>`, ...) are never allowed inside the answer. A reply cut by `max_tokens` or a stop string
is a prefix, as with OpenAI. The LoopGuard's bans apply where they leave a token the automaton allows.

One step function (`_step`) moves the automaton over one byte for an array of states at once: `JsonVocab` runs
it over every token of the vocabulary together from one state, to find the tokens allowed there (a bitmap,
cached by state), and `JsonState` over each sampled token's bytes. The engine sets the banned tokens' logits to
-inf before sampling, on the device where the logits are.

Reasoning goes unconstrained: where the prompt opens it, the constraint starts after `</think>`; where it does not
(a model that may open it itself), `<think>` is allowed as the answer's first token (`JsonState.think`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

# automaton modes (int16): where the next byte is read
(TOP, VALUE, OBJ_FIRST, OBJ_KEY, COLON, AFTER, ARR_FIRST, STR, ESC, U1, U2, U3, U4, MINUS, ZERO, INT, DOT, FRAC, EXP_E,
 EXP_SIGN, EXP, LIT, DONE) = range(23)
DEAD = -1
MAX_DEPTH = 62  # nesting held in one int64 of bits (1: an object, 0: an array)
MAX_WS = 32  # whitespace bytes in a run (a newline and indentation; a model cannot pad for ever)
TOP_WS = 2  # ... before the object (the "\n\n" after a model's reasoning)
LITERALS = (b"true", b"false", b"null")
_LIT_TABLE = np.zeros((3, 6), np.int16)  # literal, position -> the byte expected there (0 past its end)
for _i, _lit in enumerate(LITERALS):
    _LIT_TABLE[_i, :len(_lit)] = list(_lit)
_LIT_LEN = np.array([len(x) for x in LITERALS], np.int16)


def _class(chars: bytes) -> np.ndarray:
    t = np.zeros(256, bool)
    t[list(chars)] = True
    return t


WS, DIGIT, DIGIT19 = _class(b" \t\n\r"), _class(b"0123456789"), _class(b"123456789")
HEX, ESCAPES, EXP_MARK, SIGN = _class(b"0123456789abcdefABCDEF"), _class(b'"\\/bfnrt'), _class(b"eE"), _class(b"+-")
_LIT_OF = np.full(256, -1, np.int16)
_LIT_OF[ord("t")], _LIT_OF[ord("f")], _LIT_OF[ord("n")] = 0, 1, 2


@dataclass(slots=True)
class _States:
    """Automaton states, one a token (or one alone): arrays of the same length."""

    mode: np.ndarray  # int16
    depth: np.ndarray  # int64
    stack: np.ndarray  # int64 bits: level i holds an object
    key: np.ndarray  # bool: the string being read is an object's key
    lit: np.ndarray  # int16: the literal being read (`LITERALS`)
    pos: np.ndarray  # int16: bytes of it read
    ws: np.ndarray  # int16: whitespace bytes in the current run

    @classmethod
    def start(cls, n: int = 1) -> _States:
        return cls(np.full(n, TOP, np.int16), np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool),
                   np.zeros(n, np.int16), np.zeros(n, np.int16), np.zeros(n, np.int16))

    def take(self, idx: np.ndarray) -> _States:
        return _States(self.mode[idx], self.depth[idx], self.stack[idx], self.key[idx], self.lit[idx], self.pos[idx],
                       self.ws[idx])

    def repeat(self, n: int) -> _States:
        return self.take(np.zeros(n, np.int64))

    def key_of(self, i: int = 0) -> tuple[int, ...]:
        return (int(self.mode[i]), int(self.depth[i]), int(self.stack[i]), bool(self.key[i]), int(self.lit[i]),
                int(self.pos[i]), int(self.ws[i]))

    @classmethod
    def of_key(cls, key: tuple[int, ...]) -> _States:
        """The one state `key_of` gave."""
        mode, depth, stack, is_key, lit, pos, ws = key
        return cls(np.array([mode], np.int16), np.array([depth], np.int64), np.array([stack], np.int64),
                   np.array([is_key], bool), np.array([lit], np.int16), np.array([pos], np.int16),
                   np.array([ws], np.int16))


def _step(s: _States, b: np.ndarray) -> _States:
    """Every state of `s` after reading its byte of `b` (uint8, same length); DEAD where the byte cannot follow."""
    m = s.mode
    # a number ends at a byte that cannot continue it: that byte is then read after the value
    cont = np.where(m == ZERO, (b == ord(".")) | EXP_MARK[b],
                    np.where((m == INT) | (m == FRAC), DIGIT[b] | EXP_MARK[b] | ((m == INT) & (b == ord("."))),
                             DIGIT[b]))
    m = np.where(np.isin(m, (ZERO, INT, FRAC, EXP)) & ~cont, AFTER, m).astype(np.int16)
    depth, stack = s.depth, s.stack
    nm = np.full(len(m), DEAD, np.int16)
    nd, nstk, nkey, nlit, npos = depth.copy(), stack.copy(), s.key.copy(), s.lit.copy(), s.pos.copy()
    nws = np.zeros(len(m), np.int16)
    level = np.left_shift(np.int64(1), np.minimum(depth, MAX_DEPTH))  # the bit of a new level
    top_obj = (depth > 0) & ((np.right_shift(stack, np.maximum(depth - 1, 0)) & 1) == 1)

    def put(sel: np.ndarray, mode: int | np.ndarray) -> None:
        nm[sel] = mode if np.isscalar(mode) else mode[sel]

    structural = np.isin(m, (TOP, VALUE, OBJ_FIRST, OBJ_KEY, COLON, AFTER, ARR_FIRST))
    sel = structural & WS[b] & (s.ws < np.where(m == TOP, TOP_WS, MAX_WS))
    put(sel, m)
    nws[sel] = s.ws[sel] + 1
    value = (m == VALUE) | (m == ARR_FIRST)
    room = depth < MAX_DEPTH
    sel = (value | (m == TOP)) & (b == ord("{")) & room  # an object opens
    put(sel, OBJ_FIRST)
    nstk[sel] |= level[sel]
    nd[sel] += 1
    sel = value & (b == ord("[")) & room  # an array opens
    put(sel, ARR_FIRST)
    nstk[sel] &= ~level[sel]
    nd[sel] += 1
    sel = value & (b == ord('"'))
    put(sel, STR)
    nkey[sel] = False
    put(value & (b == ord("-")), MINUS)
    put(value & (b == ord("0")), ZERO)
    put(value & DIGIT19[b], INT)
    sel = value & (_LIT_OF[b] >= 0)
    put(sel, LIT)
    nlit[sel], npos[sel] = _LIT_OF[b][sel], 1
    sel = ((m == OBJ_FIRST) | (m == OBJ_KEY)) & (b == ord('"'))  # a key
    put(sel, STR)
    nkey[sel] = True
    closes = (((m == OBJ_FIRST) | ((m == AFTER) & top_obj)) & (b == ord("}"))) | \
             (((m == ARR_FIRST) | ((m == AFTER) & ~top_obj & (depth > 0))) & (b == ord("]")))
    nd[closes] -= 1
    put(closes, np.where(nd > 0, AFTER, DONE).astype(np.int16))
    sel = (m == AFTER) & (depth > 0) & (b == ord(","))
    put(sel, np.where(top_obj, OBJ_KEY, VALUE).astype(np.int16))
    put((m == COLON) & (b == ord(":")), VALUE)
    in_str = m == STR
    sel = in_str & (b == ord('"'))
    put(sel, np.where(s.key, COLON, AFTER).astype(np.int16))
    put(in_str & (b == ord("\\")), ESC)
    put(in_str & (b >= 0x20) & (b != ord('"')) & (b != ord("\\")), STR)
    put((m == ESC) & ESCAPES[b], STR)
    put((m == ESC) & (b == ord("u")), U1)
    for here, nxt in ((U1, U2), (U2, U3), (U3, U4), (U4, STR)):
        put((m == here) & HEX[b], nxt)
    put((m == MINUS) & (b == ord("0")), ZERO)
    put((m == MINUS) & DIGIT19[b], INT)
    put(((m == ZERO) | (m == INT)) & (b == ord(".")), DOT)
    put((m == INT) & DIGIT[b], INT)
    put(((m == DOT) | (m == FRAC)) & DIGIT[b], FRAC)
    put(((m == ZERO) | (m == INT) | (m == FRAC)) & EXP_MARK[b], EXP_E)
    put((m == EXP_E) & SIGN[b], EXP_SIGN)
    put(((m == EXP_E) | (m == EXP_SIGN) | (m == EXP)) & DIGIT[b], EXP)
    lit = m == LIT
    if lit.any():
        want = _LIT_TABLE[s.lit, np.minimum(s.pos, 5)]
        sel = lit & (b == want)
        npos[sel] = s.pos[sel] + 1
        put(sel, np.where(npos >= _LIT_LEN[s.lit], AFTER, LIT).astype(np.int16))
    # fields the new mode does not read are cleared, so that states alike in everything that matters are equal
    nstk &= np.left_shift(np.int64(1), np.minimum(nd, MAX_DEPTH)) - 1  # closed levels' bits
    nkey &= np.isin(nm, (STR, ESC, U1, U2, U3, U4))
    outside = nm != LIT
    nlit[outside], npos[outside] = 0, 0
    return _States(nm, nd, nstk, nkey, nlit, npos, nws)


class MaskCache:
    """Token masks (bool [vocab_size]) kept as bitmaps for the `size` keys last asked; `misses` counts the masks
    not found."""

    def __init__(self, vocab_size: int, size: int) -> None:
        self.vocab_size, self.size = vocab_size, size
        self._bits: OrderedDict[Any, np.ndarray] = OrderedDict()
        self.misses = 0

    def get(self, key: Any) -> np.ndarray | None:
        bits = self._bits.get(key)
        if bits is None:
            self.misses += 1
            return None
        self._bits.move_to_end(key)
        return np.unpackbits(bits, count=self.vocab_size).view(bool)

    def put(self, key: Any, allowed: np.ndarray) -> None:
        self._bits[key] = np.packbits(allowed)
        if len(self._bits) > self.size:
            self._bits.popitem(last=False)


RESERVED = 0xF8  # bytes from here up are in no UTF-8 text: the automata read markup tokens as them


class JsonVocab:
    """A tokenizer's vocabulary as the automaton reads it: each token's bytes (added tokens none, so never allowed,
    but the `markup` ids, read as the reserved bytes given for them (`RESERVED` and up, which no UTF-8 text holds,
    so that no string can hold a tag) for a tool-call reply's automaton, and banned from any other's masks), and
    the tokens allowed in a state (`allowed`: a bool [vocab_size] mask of every token the state can read whole,
    the end-of-sequence ids only once the object is closed), kept as bitmaps for the `CACHE` states last asked.

    States that no token can tell apart share a cache entry (`_canonical`): nesting deeper than any token can
    close counts as that depth, and a run of whitespace too short for any token to overrun `MAX_WS` as none."""

    CACHE = 1024

    def __init__(self, tokenizer: Any, vocab_size: int, markup: dict[int, bytes] | None = None) -> None:
        table = tokenizer._byte_table()
        markup = {m: b for m, b in (markup or {}).items() if m < vocab_size}
        added = set(tokenizer.added_ids) if hasattr(tokenizer, "added_ids") else set()
        added -= set(markup)  # markup tokens read as their reserved bytes (a tool-call reply's `<tool_call>`)
        self.vocab_size = vocab_size
        self.markup = np.array(sorted(markup), np.int64)
        self.markup_bytes = markup  # token id -> the bytes the automata read for it
        self.eos = np.array(sorted(i for i in tokenizer.eos_token_ids if i < vocab_size), np.int64)
        toks = [markup[i] if i in markup else b"" if (i >= len(table) or i in added) else table[i]
                for i in range(vocab_size)]
        lens = np.array([len(t) for t in toks], np.int64)
        self.order = np.argsort(-lens, kind="stable")  # longest first: the tokens with a j-th byte lead
        self.lens = lens[self.order]
        self.flat = np.frombuffer(b"".join(toks[i] for i in self.order), np.uint8)
        self.offsets = np.concatenate([[0], np.cumsum(self.lens)[:-1]]).astype(np.int64)
        # other tokens that hold a reserved byte (no UTF-8 text's): a schema's automaton reads none of them
        high = np.zeros(len(self.flat) + 1, np.int64)
        high[1:] = np.cumsum(self.flat >= RESERVED)
        clash = self.order[high[self.offsets + self.lens] > high[self.offsets]]
        self.clash = np.setdiff1d(clash, self.markup).astype(np.int64)
        self.closes = 1 + max((t.count(b"}") + t.count(b"]") for t in toks), default=0)  # levels a token may close
        self.opens = max((t.count(b"{") + t.count(b"[") for t in toks), default=0)
        self.ws_run = min(MAX_WS, max((len(t) - len(t.lstrip(b" \t\n\r")) for t in toks), default=0))  # leading runs
        n = int(np.count_nonzero(self.lens))
        self.first = self.flat[self.offsets[:n]]  # each token's first byte, in `order`
        # tokens that are string content through and through (no quote, backslash or control byte): inside a string
        # they are allowed from any state, with no step to take
        plain_byte = np.ones(256, bool)
        plain_byte[:0x20] = False
        plain_byte[RESERVED:] = False
        plain_byte[[ord('"'), ord("\\")]] = False
        bad = np.zeros(len(self.flat) + 1, np.int64)
        bad[1:] = np.cumsum(~plain_byte[self.flat])
        self.plain = (bad[self.offsets[:n] + self.lens[:n]] - bad[self.offsets[:n]]) == 0
        self.masks = MaskCache(vocab_size, self.CACHE)  # canonical state -> its mask

    def _canonical(self, state: _States) -> _States:
        """`state` with what no single token can see made plain: the levels below the last `closes` (while no
        token could open past `MAX_DEPTH`), and a whitespace run no token can overrun."""
        depth, ws = int(state.depth[0]), int(state.ws[0])
        deep = depth > self.closes and depth + self.opens < MAX_DEPTH
        short = int(state.mode[0]) != TOP and ws + self.ws_run <= MAX_WS
        if not deep and not (short and ws):
            return state
        s = state.take(np.zeros(1, np.int64))
        if deep:
            s.stack, s.depth = s.stack >> (depth - self.closes), np.full(1, self.closes, np.int64)
        if short:
            s.ws = np.zeros(1, np.int16)
        return s

    def allowed(self, state: _States) -> np.ndarray:
        """The tokens allowed after `state` (one state): bool [vocab_size]."""
        state = self._canonical(state)
        key = state.key_of()
        got = self.masks.get(key)
        if got is not None:
            return got
        allowed = np.zeros(self.vocab_size, bool)
        if int(state.mode[0]) == DONE:
            allowed[self.eos] = True
        else:
            # only tokens whose first byte the state takes are read on (the state's step over all 256 bytes once)
            takes = _step(state.repeat(256), np.arange(256, dtype=np.uint8)).mode != DEAD
            alive = np.flatnonzero(takes[self.first])  # positions in `order` of the tokens still read whole so far
            if int(state.mode[0]) == STR:  # string content through and through: allowed, nothing to read
                plain = self.plain[alive]
                allowed[self.order[alive[plain]]] = True
                alive = alive[~plain]
            states = state.repeat(len(alive))
            j = 0
            while alive.size:
                ended = self.lens[alive] == j
                if ended.any():  # read whole: allowed
                    allowed[self.order[alive[ended]]] = True
                    alive, states = alive[~ended], states.take(np.flatnonzero(~ended))
                    if not alive.size:
                        break
                states = _step(states, self.flat[self.offsets[alive] + j])
                ok = states.mode != DEAD
                alive, states = alive[ok], states.take(np.flatnonzero(ok))
                j += 1
        allowed[self.markup] = False  # JSON mode's answer holds no tool-call markup
        self.masks.put(key, allowed)
        return allowed


_NEXT: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}  # (state, byte) -> the state after it
_NEXT_MAX = 1 << 16


class JsonState:
    """One answer's automaton: `advance` with each token it takes, `allowed` for the next sampling step. `think`:
    a token id (the model's `<think>`) also allowed while nothing of the answer has been read."""

    free = False  # never: every token of the answer is constrained

    def __init__(self, vocab: JsonVocab, think: int | None = None) -> None:
        self.vocab, self.state, self.think = vocab, _States.start(), think
        self.started = False  # a byte of the answer read

    def advance(self, token_bytes: bytes, token: int = -1) -> None:
        """Read a sampled token's bytes (an end-of-sequence token is not read; `token`, its id, unread here):
        each byte's step from a state seen before is looked up (`_NEXT`), not stepped again."""
        key = self.state.key_of()
        self.started |= bool(token_bytes)
        for b in token_bytes:
            nxt = _NEXT.get((key, b))
            if nxt is None:
                nxt = _step(_States.of_key(key), np.array([b], np.uint8)).key_of()
                if len(_NEXT) >= _NEXT_MAX:
                    _NEXT.clear()
                _NEXT[(key, b)] = nxt
            key = nxt
        self.state = _States.of_key(key)

    @property
    def done(self) -> bool:
        return int(self.state.mode[0]) == DONE

    @property
    def dead(self) -> bool:
        """The answer is no JSON prefix (a token the constraint did not choose, e.g. the LoopGuard's)."""
        return int(self.state.mode[0]) == DEAD

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the tokens the next sampling step may take."""
        mask = self.vocab.allowed(self.state)
        if self.think is not None and not self.started and self.think < len(mask):
            mask[self.think] = True
        return mask

    def banned(self) -> np.ndarray:
        return np.flatnonzero(~self.allowed()).astype(np.int64)
