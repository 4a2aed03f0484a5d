"""What a kernel's instructions are: a summary of Nsight Compute's per-instruction source page (SASS).

    ncu --clock-control none -k regex:mx_gemm_ --launch-skip 3 --launch-count 1 --section WarpStateStats \\
        --section SourceCounters --section InstructionStats -o rep python3 bench/gemv_ncu.py mxfp4 34816 5120 12
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep_sass.csv
    python3 bench/ncu_source.py rep_sass.csv [--weights 178257920]   # per 256 weights: the gate|up's N x K

(DECAPYBARA_KERNEL_LINEINFO=1 builds the kernels with -lineinfo, so that Nsight Compute can also show CUDA source
lines beside the SASS.) An export with the source lines (`--print-source cuda,sass`, a report taken with
`--import-source yes`) gives instead each line's share of the instructions executed and of the stall samples, the
lines with the most of either first (`read_lines`, `summarize_lines`). A SASS export prints, per file: the
instructions executed (warp level) and, with --weights, per 256 weights (one warp-word of an m16n8k16 A fragment:
8 codes a lane); the opcode mix by execution and by stall samples; the stall reasons; the instructions grouped by
execution count (a loop's body executes as often as the loop turns: its group's size is the body's length, its
share the loop's) with each group's opcodes; and the instructions with the most stall samples.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter
from dataclasses import dataclass


@dataclass
class Instr:
    text: str
    executed: float
    samples: float
    stalls: dict[str, float]

    @property
    def opcode(self) -> str:
        """The mnemonic without predicate or modifiers, e.g. `@P0 LDG.E.128 R4, [R2]` -> LDG."""
        return re.sub(r"^@!?U?P\w+\s+", "", self.text.strip()).split(" ")[0].split(".")[0]


def _number(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> list[Instr]:
    """The SASS rows of an `ncu --page source --csv --print-source sass` export."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = {name: i for i, name in enumerate(rows[head])}
    stall_cols = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    out = []
    for r in rows[head + 1:]:
        if len(r) < len(cols):
            continue
        out.append(Instr(r[cols["Source"]], _number(r[cols["Instructions Executed"]]),
                         _number(r[cols["Warp Stall Sampling (All Samples)"]]),
                         {c[len("stall_"):]: _number(r[cols[c]]) for c in stall_cols}))
    return out


@dataclass
class Line:
    path: str  # the source file's name
    line: int
    text: str
    executed: float
    samples: float


def read_lines(path: str) -> list[Line]:
    """The CUDA source lines of an `ncu --page source --csv --print-source cuda,sass` export: per file a "File
    Path" row, then under a "Line No" header each line's row (its instructions' totals) followed by those
    instructions' rows (no line number), which are skipped here."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    out, file, cols = [], "", None
    for r in rows:
        if r and r[0] == "File Path":
            file = r[1].replace("\\", "/").split("/")[-1]
        elif r and r[0] == "Line No":
            cols = {name: i for i, name in enumerate(r) if name not in ("Source", "Line No")}
        elif cols and len(r) > max(cols.values()) and r[0].strip():
            out.append(Line(file, int(r[0]), r[1].strip(), _number(r[cols["Instructions Executed"]]),
                            _number(r[cols["Warp Stall Sampling (All Samples)"]])))
    return out


def summarize_lines(lines: list[Line], top: int = 16) -> str:
    """Totals, then the `top` lines by stall samples and by instructions executed, each with both shares."""
    executed = sum(x.executed for x in lines) or 1.0
    samples = sum(x.samples for x in lines) or 1.0
    out = [f"instructions executed {executed:,.0f}; stall samples {samples:,.0f}; {len(lines)} source lines"]
    for title, key in (("most stall samples", lambda x: -x.samples), ("most instructions", lambda x: -x.executed)):
        out.append(f"{title} (% of samples / % executed):")
        for x in sorted(lines, key=key)[:top]:
            out.append(f"  {x.samples / samples * 100:5.1f} / {x.executed / executed * 100:5.1f}  "
                       f"{x.path}:{x.line}  {x.text[:80]}")
    return "\n".join(out)


def summarize(instrs: list[Instr], weights: int | None, groups: int = 8, top: int = 12) -> str:
    total = sum(i.executed for i in instrs) or 1.0
    samples = sum(i.samples for i in instrs) or 1.0
    lines = [f"instructions executed {total:,.0f}" + (f", {total / (weights / 256):.1f} per 256 weights"
                                                      if weights else "") + f"; stall samples {samples:,.0f}"]
    mix, mix_s = Counter(), Counter()
    for i in instrs:
        mix[i.opcode] += i.executed
        mix_s[i.opcode] += i.samples
    lines.append("opcodes (% executed / % of samples): " + ", ".join(
        f"{op} {v / total * 100:.1f}/{mix_s[op] / samples * 100:.1f}" for op, v in mix.most_common(14)))
    stalls = Counter()
    for i in instrs:
        stalls.update(i.stalls)
    st = sum(stalls.values()) or 1.0
    lines.append("stalls: " + ", ".join(f"{k} {v / st * 100:.1f}%" for k, v in stalls.most_common(10)))
    # instructions that execute equally often (to 1%): a loop body, a set-up block, an epilogue
    by_count: dict[float, list[Instr]] = {}
    for i in sorted((i for i in instrs if i.executed > 0), key=lambda i: -i.executed):
        key = next((k for k in by_count if abs(k - i.executed) <= 0.01 * k), i.executed)
        by_count.setdefault(key, []).append(i)
    lines.append("groups by execution count (each instruction executed ~N times):")
    ranked = sorted(by_count.items(), key=lambda kv: -sum(i.executed for i in kv[1]))
    for count, members in ranked[:groups]:
        share = sum(i.executed for i in members) / total * 100
        ops = Counter(i.opcode for i in members)
        lines.append(f"  N {count:>10,.0f}: {len(members):4d} instructions, {share:5.1f}% of executed; "
                     + ", ".join(f"{op} {n}" for op, n in ops.most_common(10)))
    lines.append("most stall samples:")
    for i in sorted(instrs, key=lambda i: -i.samples)[:top]:
        why = max(i.stalls, key=i.stalls.get) if i.stalls else ""
        lines.append(f"  {i.samples / samples * 100:5.1f}%  {why:<14} {i.text.strip()[:90]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="ncu --page source --csv --print-source sass (or cuda,sass) exports")
    ap.add_argument("--weights", type=int, help="weights the profiled product streams (N x K)")
    args = ap.parse_args()
    for path in args.csv:
        print(f"== {path}")
        lines = read_lines(path)  # none in a SASS export
        print(summarize_lines(lines) if lines else summarize(read(path), args.weights))


if __name__ == "__main__":
    main()
