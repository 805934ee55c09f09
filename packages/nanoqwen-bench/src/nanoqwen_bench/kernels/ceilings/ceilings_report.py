"""Pure-Python half of nanoqwen_bench.kernels.decode_ceilings: parsers and tables, no torch, no GPU.

- `parse_ncu_csv(text)`: Nsight Compute's `--csv` output of the details page (one row per metric per
  kernel: "ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value", ...) -> one dict per
  profiled kernel, in launch order, values as floats in base units (durations in ns).
- `parse_ncu_raw_csv(text)`: `ncu -i X.ncu-rep --page raw --csv` (one column per metric, a units row,
  one row per kernel) -> one dict per kernel.
- `stall_breakdown(row)`: the warp-stall reasons of one raw row (`smsp__average_warps_issue_stalled_
  <reason>_per_issue_active.ratio`: cycles a warp spends stalled for that reason per issued
  instruction), largest first, with each one's share of the total.
- `timeline_gaps(kernels)`: start/end of the kernels of one graph replay -> busy time, gaps between
  consecutive kernels (next start - previous end), and the gaps grouped by kernel transition.
- `parse_sass(text)` / `hot_loop_counts(instrs)`: nvdisasm / cuobjdump SASS -> per function the
  instruction list; the opcodes of the innermost backward-branch loop that holds the most `marker`
  instructions (HMMA for the GEMV), for counting instructions per weight byte.
- `md_table(headers, rows)`: a markdown table.

Every parser raises `ValueError` naming what it did not find: a report built from half-parsed text
would be wrong without saying so.
"""

from __future__ import annotations

import csv
import io
import re
import statistics
from collections import Counter, defaultdict

# Nsight Compute unit names (auto-scaled in its details page) -> factor to the base unit (ns, byte, ...)
_UNIT_SCALE = {
    "nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9,
    "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Kibyte": 1024.0, "Mibyte": 1024.0**2,
    "cycle": 1.0, "Kcycle": 1e3, "Mcycle": 1e6, "hz": 1.0, "Khz": 1e3, "Mhz": 1e6, "Ghz": 1e9,
}  # fmt: skip
STALL_RE = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def ncu_number(text: str) -> float:
    """'13,396' -> 13396.0, '9.50' -> 9.5; 'n/a' and '' raise ValueError."""
    t = text.strip().replace(",", "")
    if not t or t.lower() in ("n/a", "no data"):
        raise ValueError(f"not a number: {text!r}")
    return float(t)


def _csv_rows(text: str, first_col: str) -> list[list[str]]:
    """The CSV part of ncu output: from the header line whose first cell is `first_col` on (==PROF== lines
    and the application's own output before it are skipped)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f'"{first_col}"'):
            return list(csv.reader(io.StringIO("\n".join(lines[i:]))))
    raise ValueError(f'no CSV header starting with "{first_col}" in the ncu output')


def parse_ncu_csv(text: str) -> list[dict]:
    """Details-page CSV -> [{"id", "kernel", "grid", "block", "metrics": {name: value in base units}}]
    in launch (ID) order. Metrics whose value is not a number are left out."""
    rows = _csv_rows(text, "ID")
    head = rows[0]
    need = ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")
    missing = [c for c in need if c not in head]
    if missing:
        raise ValueError(f"ncu CSV lacks columns {missing}; header: {head}")
    col = {c: head.index(c) for c in head}
    kernels: dict[int, dict] = {}
    for r in rows[1:]:
        if len(r) < len(head):
            continue
        kid = int(r[col["ID"]])
        k = kernels.setdefault(
            kid,
            {
                "id": kid,
                "kernel": r[col["Kernel Name"]],
                "grid": r[col["Grid Size"]] if "Grid Size" in col else "",
                "block": r[col["Block Size"]] if "Block Size" in col else "",
                "metrics": {},
            },
        )
        try:
            v = ncu_number(r[col["Metric Value"]])
        except ValueError:
            continue
        k["metrics"][r[col["Metric Name"]]] = v * _UNIT_SCALE.get(r[col["Metric Unit"]], 1.0)
    if not kernels:
        raise ValueError("the ncu CSV has a header but no kernel rows")
    return [kernels[i] for i in sorted(kernels)]


def parse_ncu_raw_csv(text: str) -> list[dict]:
    """Raw-page CSV -> one dict per kernel: the identity columns as strings ("Kernel Name", ...) and every
    numeric metric as a float, scaled to the base unit from the units row (usecond -> ns, Kbyte -> byte;
    '%' and unknown units unchanged)."""
    rows = _csv_rows(text, "ID")
    head = rows[0]
    body = rows[1:]
    units = [""] * len(head)
    if body and not body[0][0].strip():  # the units row: no ID
        units, body = body[0] + [""] * (len(head) - len(body[0])), body[1:]
    out = []
    for r in body:
        if len(r) < len(head) or not r[0].strip():
            continue
        d: dict = {}
        for name, unit, cell in zip(head, units, r, strict=False):
            try:
                d[name] = ncu_number(cell) * _UNIT_SCALE.get(unit, 1.0)
            except ValueError:
                d[name] = cell
        d["ID"] = int(r[0])
        out.append(d)
    if not out:
        raise ValueError("the ncu raw CSV has no kernel rows")
    return out


def stall_breakdown(row: dict) -> list[tuple[str, float, float]]:
    """(reason, cycles per issued instruction, share of the sum) for each stall metric of a raw row,
    largest first. 'selected' (the warp issuing) is kept: it is the one cycle of useful issue."""
    stalls = [
        (m.group(1), float(v)) for k, v in row.items() if (m := STALL_RE.match(k)) and isinstance(v, float)
    ]
    if not stalls:
        raise ValueError(
            "no smsp__average_warps_issue_stalled_*_per_issue_active.ratio metric in the row: "
            "profile with --section WarpStateStats (or --metrics with that regex)"
        )
    total = sum(v for _, v in stalls) or 1.0
    return sorted(((r, v, v / total) for r, v in stalls), key=lambda t: -t[1])


def short_kernel_name(name: str) -> str:
    """A kernel's name without its argument list and template/namespace decoration, cuBLAS's nvjet_*
    kernels folded into 'nvjet'."""
    base = name.split("(")[0].strip()
    base = re.sub(r"<.*>", "", base)
    base = base.split("::")[-1].split()[-1] if base else name
    return "nvjet" if base.startswith("nvjet") else base


def timeline_gaps(kernels: list[tuple[str, float, float]]) -> dict:
    """kernels: (name, start_ns, end_ns) of one replay, any order. Returns n, span_ns (first start to
    last end), busy_ns (sum of durations), gap_ns (sum of next start - previous end over consecutive
    kernels in start order; overlaps count negative), gaps (the list), median/max gap, and by_transition:
    {"a -> b": {"n", "total_ns", "median_ns"}} sorted by total."""
    if len(kernels) < 1:
        raise ValueError("timeline_gaps needs at least one kernel")
    ks = sorted(kernels, key=lambda k: k[1])
    for name, s, e in ks:
        if e < s:
            raise ValueError(f"kernel {name} ends ({e}) before it starts ({s})")
    gaps = [b[1] - a[2] for a, b in zip(ks, ks[1:], strict=False)]
    by: dict[str, list[float]] = defaultdict(list)
    for a, b, gap in zip(ks, ks[1:], gaps, strict=False):
        by[f"{short_kernel_name(a[0])} -> {short_kernel_name(b[0])}"].append(gap)
    trans = {
        k: {"n": len(v), "total_ns": sum(v), "median_ns": statistics.median(v)}
        for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1]))
    }
    return {
        "n": len(ks),
        "span_ns": ks[-1][2] - ks[0][1],
        "busy_ns": sum(e - s for _, s, e in ks),
        "gap_ns": sum(gaps),
        "gaps": gaps,
        "median_gap_ns": statistics.median(gaps) if gaps else 0.0,
        "max_gap_ns": max(gaps, default=0.0),
        "overlaps": sum(1 for g in gaps if g < 0),
        "by_transition": trans,
    }


GPU_EVENT_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def chrome_trace_kernels(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start_ns, end_ns) of every GPU work event (kernels, memcpy and memset nodes: `GPU_EVENT_CATS`)
    of a torch.profiler chrome trace (ts and dur in microseconds)."""
    evs = trace.get("traceEvents")
    if evs is None:
        raise ValueError("not a chrome trace: no 'traceEvents'")
    out = [
        (e["name"], float(e["ts"]) * 1e3, (float(e["ts"]) + float(e.get("dur", 0.0))) * 1e3)
        for e in evs
        if str(e.get("cat", "")).lower() in GPU_EVENT_CATS
    ]
    return out


# ---------------------------------------------------------------------------------------------------
# SASS
# ---------------------------------------------------------------------------------------------------

_FUNC_RE = re.compile(r"^\s*(?:\.text\.(\S+?):|Function : (\S+))\s*$")
_LABEL_RE = re.compile(r"^\s*(\.L\w+):")
_INSTR_RE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:\{\s*)?(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_BRA_TARGET_RE = re.compile(r"`\((\.L\w+)\)")


def parse_sass(text: str) -> dict[str, list[tuple[str, str]]]:
    """Per function (nvdisasm `-c` sections `.text.NAME:` or cuobjdump `Function : NAME`), its lines as
    ("label", name) or ("instr", "OPCODE.MODS operands")."""
    funcs: dict[str, list[tuple[str, str]]] = {}
    cur: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        m = _FUNC_RE.match(line)
        if m:
            cur = funcs.setdefault(m.group(1) or m.group(2), [])
            continue
        if cur is None:
            continue
        m = _LABEL_RE.match(line)
        if m:
            cur.append(("label", m.group(1)))
            continue
        m = _INSTR_RE.search(line)
        if m:
            cur.append(("instr", (m.group(2) + m.group(3)).strip()))
    if not funcs:
        raise ValueError("no SASS function found (expected nvdisasm -c or cuobjdump -sass output)")
    return funcs


def opcode(instr: str) -> str:
    """'HMMA.16816.F32.BF16 R32, ...' -> 'HMMA'."""
    return instr.split()[0].split(".")[0]


def hot_loop_counts(lines: list[tuple[str, str]], marker: str = "HMMA") -> tuple[Counter, int]:
    """Opcode counts of the loop body (label .. backward branch to it) holding the most `marker`
    instructions, and that marker count. Forward branches inside the body are counted as if taken
    through (every instruction of the span once): right for the GEMV's steady state, where the
    tail guards (`tc < tc_end`) all pass."""
    pos = {name: i for i, (kind, name) in enumerate(lines) if kind == "label"}
    best: tuple[int, int, int] | None = None  # (markers, start, end)
    for i, (kind, text) in enumerate(lines):
        if kind != "instr" or opcode(text) != "BRA":
            continue
        m = _BRA_TARGET_RE.search(text)
        if not m or m.group(1) not in pos or pos[m.group(1)] >= i:
            continue
        start = pos[m.group(1)]
        n = sum(1 for k, t in lines[start : i + 1] if k == "instr" and opcode(t) == marker)
        if best is None or n > best[0] or (n == best[0] and i - start < best[2] - best[1]):
            best = (n, start, i)
    if best is None or best[0] == 0:
        raise ValueError(f"no backward-branch loop containing {marker} found")
    body = Counter(opcode(t) for k, t in lines[best[1] : best[2] + 1] if k == "instr")
    return body, best[0]


# ---------------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------------


def _cell(v) -> str:
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def md_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; floats printed with 3 significant digits (thousands separated from 100 up),
    None and NaN as '-'. Every row must have len(headers) cells."""
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row {r} has {len(r)} cells for {len(headers)} headers")
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"
