"""bench/ncu_source.py reads Nsight Compute's source-page exports: per instruction (SASS) and per source line."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ncu_source", ROOT / "bench" / "ncu_source.py")
ncu_source = sys.modules.setdefault("ncu_source", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(ncu_source)  # registered first: its dataclasses look their module up

STALLS = ["stall_barrier", "stall_long_sb", "stall_wait"]
COUNTS = ["Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)", "# Samples",
          "Instructions Executed", *STALLS, *(f"{s} (Not Issued)" for s in STALLS)]


def _instr(address: str, text: str, samples: int, executed: int, stalls: tuple[int, int, int]) -> list[str]:
    return [address, text, str(samples), "0", str(samples), f"{executed:,}", *map(str, stalls), "0", "0", "0"]


def _write(path: Path, rows: list[list[str]]) -> str:
    with open(path, "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return str(path)


def test_sass_export_summary(tmp_path):
    """Opcodes without predicates or modifiers, the stall mix, instructions grouped by execution count."""
    path = _write(tmp_path / "sass.csv", [
        ["Kernel Name", "k", ""],
        ["Address", "Source", *COUNTS],
        _instr("0x10", "      LDG.E.128 R4, [R2.64]", 30, 100, (0, 30, 0)),
        _instr("0x20", "@P0   FFMA R1, R4, R5, R1", 10, 1000, (0, 0, 10)),
        _instr("0x30", "      FFMA R2, R4, R6, R2", 0, 1000, (0, 0, 0)),
        _instr("0x40", "      BAR.SYNC.DEFER_BLOCKING 0x0", 60, 100, (60, 0, 0)),
    ])
    instrs = ncu_source.read(path)
    assert [i.opcode for i in instrs] == ["LDG", "FFMA", "FFMA", "BAR"]
    text = ncu_source.summarize(instrs, None)
    assert "instructions executed 2,200; stall samples 100" in text
    assert "stalls: barrier 60.0%, long_sb 30.0%, wait 10.0%" in text
    assert "N      1,000:    2 instructions,  90.9% of executed; FFMA 2" in text


def test_source_line_export_summary(tmp_path):
    """Per file and line: the line rows' totals (the SASS rows under them skipped), shares of both totals,
    ranked by stall samples and by instructions."""
    head = ["Line No", "Source", "Address", "Source", *COUNTS]
    path = _write(tmp_path / "lines.csv", [
        ["File Path", "/src/kernels/deltanet_prefill.cu"],
        ["Function Name", "gdn_decode"],
        head,
        ["513", "  v_head = v_head + cv * w;", "-", "-", "60", "50", "60", "1,000", "0", "60", "0", "0", "0", "0"],
        ["", "", "0x10", "FMUL R0, R7, R24", "60", "50", "60", "1,000", "0", "60", "0", "0", "0", "0"],
        ["474", "  cp_async16(dst, src, 16);", "-", "-", "10", "10", "10", "7,000", "0", "0", "10", "0", "0", "0"],
        ["File Path", "C:\\cuda\\include\\silu.cuh"],
        ["Function Name", "gdn_decode"],
        head,
        ["6", "float silu_f(float x)", "-", "-", "30", "30", "30", "2,000", "0", "0", "30", "0", "0", "0"],
    ])
    lines = ncu_source.read_lines(path)
    assert [(x.path, x.line, x.executed, x.samples) for x in lines] == [
        ("deltanet_prefill.cu", 513, 1000, 60), ("deltanet_prefill.cu", 474, 7000, 10), ("silu.cuh", 6, 2000, 30)]
    text = ncu_source.summarize_lines(lines, top=2).splitlines()
    assert text[0] == "instructions executed 10,000; stall samples 100; 3 source lines"
    assert text[2].split() == ["60.0", "/", "10.0", "deltanet_prefill.cu:513", "v_head", "=", "v_head", "+", "cv",
                               "*", "w;"]
    assert text[3].split()[3] == "silu.cuh:6"
    assert text[5].split()[:4] == ["10.0", "/", "70.0", "deltanet_prefill.cu:474"]
