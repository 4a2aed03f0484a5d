"""Kernel sources for the host emulator: local headers inlined, inline PTX lowered to emulator calls, dynamic
shared memory declarations turned into pointers to the launch's buffer.

g++ cannot compile CUDA inline assembly, so each `asm(...)` / `asm volatile(...)` statement becomes a call
`emu_ptx::<handler>(outputs..., inputs...)` (emu.h), the handler chosen by the instruction's first token; the
operands keep their order (outputs by reference). A `wgmma.mma_async` statement becomes `emu_ptx::wgmma(text,
{&accumulators...}, {inputs...})`. An instruction without a handler becomes a call that aborts
when reached, naming it: code under `#if` that the emulator does not compile (sm_90 launch control) costs nothing.
"""

from __future__ import annotations

import itertools
import os
import re

HANDLERS = {
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": "mma_m16n8k16_bf16",
    "ld.global.nc.L1::no_allocate.L2::256B.v4.u32": "ld_v4",
    "ld.global.cs.v4.u32": "ld_v4",
    "st.global.cs.v4.u32": "st_v4",
    "ld.global.cg.f32": "ld_f32",
    "atom.acq_rel.gpu.global.add.s32": "atom_add_s32",
    "ld.acquire.gpu.global.u32": "ld_u32",
    "red.release.gpu.global.add.u32": "red_add_u32",
    "cvt.f32.f16": "cvt_f32_f16",
    "cvt.rn.f16.f32": "cvt_rn_f16_f32",
    "cvt.rn.bf16.f32": "cvt_rn_bf16_f32",
    "cvt.rn.bf16x2.f32": "cvt_rn_bf16x2_f32",
    "fma.rn.bf16x2": "fma_rn_bf16x2",
    "mul.rn.ftz.f32": "mul_rn_ftz_f32",
    "griddepcontrol.wait": "nop",
    "griddepcontrol.launch_dependents": "nop",
    "prefetch.global.L2": "nop",  # a cache hint: no effect on results
    "ld.shared.v4.u32": "ld_shared_v4",
    "ld.shared.v2.u32": "ld_shared_v2",
    "ld.shared.u32": "ld_shared_u32",
    "ld.shared.u8": "ld_shared_u8",
    "cp.async.cg.shared.global": "cp_async",
    "cp.async.ca.shared.global": "cp_async",
    "cp.async.commit_group": "nop",
    "cp.async.wait_group": "nop",
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16": "ldmatrix_x4",
    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16": "ldmatrix_x4_trans",
    "cvt.rn.satfinite.e4m3x2.f32": "cvt_rn_satfinite_e4m3x2_f32",
    "wgmma.fence.sync.aligned": "nop",  # wgmma runs at issue (emu.h `wgmma`): its fences and groups are no-ops
    "wgmma.commit_group.sync.aligned": "nop",
    "wgmma.wait_group.sync.aligned": "nop",
    "fence.proxy.async.shared::cta": "nop",
    "": "nop",  # an empty asm: a compiler barrier on its operands (decapybara/kernels/wgmma.cuh `wg_pin`)
}
WGMMA = "wgmma.mma_async"  # a template holding it (after its predicate set-up) lowers to emu_ptx::wgmma
TEMPLATE_FIRST = {"cp_async"}  # handlers that also take the instruction text (its size operand is a literal)
_ASM = re.compile(r"\basm\b\s*(?:volatile\b\s*)?\(")
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


def inline_includes(code: str, dirs: list[str], seen: set[str] | None = None) -> str:
    """`#include "x"` lines replaced by the file (searched in `dirs`), recursively; a `#pragma once` file once."""
    seen = set() if seen is None else seen

    def one(m: re.Match) -> str:
        for d in dirs:
            path = os.path.realpath(os.path.join(d, m.group(1)))
            if os.path.isfile(path):
                break
        else:
            return m.group(0)  # left to the compiler (e.g. a system header)
        if path in seen:
            return ""
        with open(path) as f:
            text = f.read()
        if re.search(r"^\s*#\s*pragma\s+once", text, re.MULTILINE):
            seen.add(path)
            text = re.sub(r"^\s*#\s*pragma\s+once[ \t]*$", "", text, flags=re.MULTILINE)
        return inline_includes(text, dirs, seen)

    return _INCLUDE.sub(one, code)


def _scan(text: str, i: int = 0):
    """(index, character, parenthesis depth before it) of each character of `text` from `i`, string literals
    skipped."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            continue
        yield i, c, depth
        depth += (c == "(") - (c == ")")
        i += 1


def _close(code: str, i: int) -> int:
    """Index just past the parenthesis closing the one before `i`."""
    return next(j for j, c, depth in _scan(code, i) if c == ")" and depth == 0) + 1


def _split(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside parentheses and string literals."""
    cuts = [-1, *(j for j, c, depth in _scan(text) if c == sep and depth == 0), len(text)]
    return [text[a + 1:b] for a, b in itertools.pairwise(cuts)]


def _operands(text: str) -> list[str]:
    """'"=r"(a), "l"(p)' -> ['a', 'p'] (the expressions, in order)."""
    out = []
    for op in _split(text, ","):
        op = op.strip()
        if not op:
            continue
        m = re.fullmatch(r'"[^"]*"\s*\((.*)\)', op, re.DOTALL)
        if not m:
            raise ValueError(f"cannot read asm operand {op!r}")
        out.append(m.group(1).strip())
    return out


_DYN_SMEM = re.compile(r"\bextern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([A-Za-z_][\w\s]*?)\s+(\w+)\s*\[\s*\]\s*;")


def lower_dynamic_shared(code: str) -> str:
    """`extern __shared__ T name[];` -> a pointer to the launch's dynamic shared memory (emu::dyn_smem)."""
    return _DYN_SMEM.sub(lambda m: f"{m.group(1)}* {m.group(2)} = ({m.group(1)}*)emu::dyn_smem;", code)


_STATIC_SMEM = re.compile(r"(?<![\w])(?<!extern )__shared__\b([^;{}]*);")


def _brace_depths(code: str) -> list[int]:
    """The brace depth before each character of `code`, -1 inside comments and string literals (whose braces do
    not count)."""
    depths, depth, i, n = [0] * (len(code) + 1), 0, 0, len(code)
    while i < n:
        two = code[i:i + 2]
        end = code.find("\n", i) if two == "//" else code.find("*/", i) + 1 if two == "/*" else \
            code.find('"', i + 1) if code[i] == '"' else -2
        if end != -2:
            end = n - 1 if end < 0 else end
            depths[i:end + 1] = [-1] * (end + 1 - i)
            i = end + 1
            continue
        depths[i] = depth
        depth += (code[i] == "{") - (code[i] == "}")
        i += 1
    depths[n] = depth
    return depths


def register_static_shared(code: str) -> str:
    """Each function-scope `__shared__ T a[..], b;` followed by emu::reg_shared(&a, sizeof(a)) for each name, so
    that the emulator knows the static variables it stands for and can give each resident block its own bytes
    (emu.cpp: with more than one slot). Declarations at file scope (one copy for all) and in comments are left as
    they are."""
    depths = _brace_depths(code)
    out, pos = [], 0
    for m in _STATIC_SMEM.finditer(code):
        if depths[m.start()] <= 0:  # file scope, a comment or a string
            continue
        names = []
        for decl in _split(re.sub(r"\[[^\]]*\]", "", m.group(1)).split("=")[0], ","):
            ids = re.findall(r"[A-Za-z_]\w*", re.sub(r"\([^)]*\)", "", decl))
            if ids:
                names.append(ids[-1])
        out.append(code[pos:m.end()])
        out.append("".join(f" emu::reg_shared(&{n}, sizeof({n}));" for n in names))
        pos = m.end()
    out.append(code[pos:])
    return "".join(out)


def lower_asm(code: str) -> str:
    """Every inline-assembly statement of `code` as an emu_ptx call (see the module docstring)."""
    out, pos = [], 0
    while m := _ASM.search(code, pos):
        end = _close(code, m.end())
        parts = _split(code[m.end():end - 1], ":")
        template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', parts[0]))
        first = template.strip().split()[0].rstrip(";") if template.strip() else ""
        args = [a for p in parts[1:3] for a in _operands(p)]
        handler = HANDLERS.get(first)
        if WGMMA in template:  # accumulators by address, inputs as 64-bit words: emu.h `wgmma`
            outs = ", ".join(f"&({a})" for a in _operands(parts[1]))
            ins = ", ".join(f"(unsigned long long)({a})" for a in _operands(parts[2]))
            call = f'emu_ptx::wgmma("{template.strip()}", {{{outs}}}, {{{ins}}})'
        elif handler is None:
            call = f'emu_ptx::unsupported("{first}")'
        else:
            lead = [f'"{template.strip()}"'] if handler in TEMPLATE_FIRST else []
            call = f"emu_ptx::{handler}({', '.join(lead + args)})"
        out += [code[pos:m.start()], call]
        pos = end
    out.append(code[pos:])
    return "".join(out)
