"""Where a timed run's wall time went, from the engine process's step trace (engine_worker.StepTrace).

A trace row is one iteration of the engine process's loop (all times `perf_counter`, shared by the
processes of one host):

    recv[0] .. recv[-1] ... t_wake ... commands applied ... t_step [ engine.step() ] t_done ... t_sent

`recv`, where a row has it, lists the pipe messages the iteration took, each `[t_recv, n_cmds,
n_submits]`: a coalesced-submit worker (tried, not landed) wrote it; the landed worker's rows lack
it.

`breakdown(rows, t0, t1)` takes the rows that woke within [t0, t1] and splits the window into:
- the engine's steps: all (count, mean ms), decode steps (count, mean and median ms) and prefill steps
  (count, total ms); kinds come from the engine's `num_steps` (None for an engine without it);
- `around_ms`: the loop's own work beside the steps (applying submits and aborts, building, pickling
  and sending the step message): (t_sent - t_wake) minus the step;
- `idle_ms`: the time between iterations (blocked in `recv` while the engine had no work, or reading
  the pipe), including the window's edges before the first and after the last row.
It also reports when the first and last submits reached the engine and when the first decode step
started, in ms from t0, and how the window's submits arrived: `submit_rows`, the loop iterations that
applied them (each then steps: 1 when a burst is admitted at once), `submit_msgs`, the pipe messages
that carried them (None for a trace without `recv`), and `submit_spread_ms`, from the first to the
last of those messages' receipt (for a trace without `recv`: of the submit rows' t_wake). The load
test times `Engine.generate`'s own steps into rows of the same shape (no commands, nothing sent), so
both columns read alike.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

__all__ = ["read_trace", "breakdown"]


def read_trace(path: Path) -> list[dict]:
    """The rows of a trace file (JSON lines), in order; a missing file is an error."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no engine trace (was NANOQWEN_ENGINE_TRACE set for the server?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def breakdown(rows: list[dict], t0: float, t1: float) -> dict:
    """Split the window [t0, t1] (seconds, perf_counter) by the rows that woke within it (see header)."""
    win = [r for r in rows if t0 <= r["t_wake"] <= t1]
    decode = [r["t_done"] - r["t_step"] for r in win if r["kind"] == "decode"]
    prefill = [r["t_done"] - r["t_step"] for r in win if r["kind"] == "prefill"]
    stepped = [r["t_done"] - r["t_step"] for r in win if r["t_step"] is not None]
    around = sum(r["t_sent"] - r["t_wake"] for r in win) - sum(stepped)
    busy = sum(r["t_sent"] - r["t_wake"] for r in win)
    submits = [r for r in win if r["n_submits"]]
    msgs, spread = _submit_arrival(submits)

    def ms(x: float | None) -> float | None:
        return None if x is None else round(1000 * x, 3)

    return {
        "rows": len(win),
        "steps": len(stepped),
        "step_ms": ms(statistics.mean(stepped)) if stepped else None,
        "decode_steps": len(decode),
        "decode_step_ms": ms(statistics.mean(decode)) if decode else None,
        "decode_step_p50_ms": ms(statistics.median(decode)) if decode else None,
        "prefill_steps": len(prefill),
        "prefill_ms": ms(sum(prefill)),
        "around_ms": ms(around),
        "idle_ms": ms(max(0.0, (t1 - t0) - busy)),
        "submit_rows": len(submits),
        "first_submit_ms": ms(submits[0]["t_wake"] - t0) if submits else None,
        "last_submit_ms": ms(submits[-1]["t_wake"] - t0) if submits else None,
        "first_decode_ms": ms(next((r["t_step"] - t0 for r in win if r["kind"] == "decode"), None)),
        "submit_msgs": msgs,
        "submit_spread_ms": ms(spread),
    }


def _submit_arrival(submits: list[dict]) -> tuple[int | None, float | None]:
    """The pipe messages with a submit among the rows `submits` (None without `recv`), and the seconds
    from the first to the last one's receipt (None without submits)."""
    if not submits:
        return 0, None
    if all("recv" in r for r in submits):
        times = [t for r in submits for t, _, n_submits in r["recv"] if n_submits]
        return len(times), max(times) - min(times)
    return None, submits[-1]["t_wake"] - submits[0]["t_wake"]
