"""Plots of the workers' JSON reports (``join --report``, ``worker_report.WorkerReport``): eval loss against local
step and wall time, where each sync's seconds went, bytes per round. ``p2ptrain plot`` draws them, and ``demo`` and
``bench`` after their runs.

matplotlib is an optional extra (``bench``): it is imported when plotting, not with this module, so the CLI can
import this module before ``--help``. The figures are ``matplotlib.figure.Figure`` objects on an Agg canvas of their
own, never pyplot's: pyplot keeps every figure in a global registry until closed, and picks a backend that may want
a display.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from p2ptrain.observe import require

PLOT_FILES = ("loss_vs_step.png", "loss_vs_time.png", "sync_split.png", "bytes_per_round.png")
MB = 1e6
DPI = 110

_FIX = "give the JSON file a worker writes with `p2ptrain join --report` (demo --json summaries work too)"


class ReportError(ValueError):
    """A file given as a worker report cannot be used; the message names the file, what is wrong, and the fix."""


def load_reports(paths: Iterable[str | Path]) -> List[Dict[str, Any]]:
    """The worker reports in ``paths``, in order. A ``demo --json`` summary counts as its workers' reports (the demo
    removes its log folder, and the workers' files in it, when all went well). Raises ``ReportError``."""
    reports: List[Dict[str, Any]] = []
    for path in map(Path, paths):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ReportError(f"cannot read the report {path}: {why}; {_FIX}") from None
        try:
            data = json.loads(text)
        except ValueError as e:
            where = f" (line {e.lineno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
            raise ReportError(f"{path} is not JSON{where}; {_FIX}") from None
        if isinstance(data, dict) and "rounds" not in data and isinstance(data.get("workers"), list):
            reports.extend(_checked(worker, f"{path} (worker {i})") for i, worker in enumerate(data["workers"]))
        else:
            reports.append(_checked(data, str(path)))
    return reports


def _checked(data: Any, where: str) -> Dict[str, Any]:
    if not isinstance(data, dict):
        raise ReportError(f"{where} is not a worker report (a JSON object with peer_id and a rounds list), it holds a "
                          f"JSON {_json_type(data)}; {_FIX}")
    missing = [key for key in ("peer_id", "rounds") if key not in data]
    if missing:
        raise ReportError(f"{where} is not a worker report: it has no {' and no '.join(missing)} key; {_FIX}")
    if not isinstance(data["rounds"], list) or not all(isinstance(r, dict) for r in data["rounds"]):
        raise ReportError(f"{where} is not a worker report: its rounds are not a list of JSON objects; {_FIX}")
    return data


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def plot_reports(reports: List[Dict[str, Any]], out: Path) -> List[Path]:
    """Write PLOT_FILES into ``out`` (made if missing) for ``reports`` (``load_reports``) and return their paths.
    Reports without rounds still give every file, with a note on the empty axes. Raises ``MissingExtra`` without
    matplotlib, ``OSError`` where ``out`` cannot be written."""
    figures = build_figures(reports)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in figures.items():
        figure.savefig(out / name, dpi=DPI)
        written.append(out / name)
    return written


def build_figures(reports: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The figures ``plot_reports`` saves, by file name (``matplotlib.figure.Figure``, not saved): what a test reads
    the drawn data back from."""
    require("matplotlib", extra="bench", feature="p2ptrain plot")
    workers = [_Worker(i, report) for i, report in enumerate(reports)]
    return {
        "loss_vs_step.png": _loss_vs_step(workers),
        "loss_vs_time.png": _loss_vs_time(workers),
        "sync_split.png": _sync_split(workers),
        "bytes_per_round.png": _bytes_per_round(workers),
    }


# ------------------------------------------------------------------------------------------------ the data


def _number(value: Any) -> Optional[float]:
    """A finite float, else None: a report holds NaN for a loss never measured, and None for a time not reached."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class _Worker:
    """One report, as the plots read it: a label, a colour kept across the four files, its rounds in order."""

    def __init__(self, index: int, report: Dict[str, Any]):
        peer_id = str(report.get("peer_id") or "")
        self.label = peer_id[-8:] if peer_id else f"worker {index + 1}"
        self.color = f"C{index % 10}"
        self.report = report
        self.rounds: List[Dict[str, Any]] = list(report.get("rounds") or [])

    def losses_by_step(self) -> List[Tuple[float, float]]:
        """(local step, eval loss): the eval after each round and the --eval-every evals. The start loss is at step 0
        only for a peer that started the run (start_outer_step 0): one that joined later started at a local step
        the report does not keep."""
        points = []
        start = _number(self.report.get("start_outer_step"))
        initial = _number(self.report.get("initial_eval_loss"))
        if initial is not None and not start:
            points.append((0.0, initial))
        for entry in [*self.rounds, *(e for e in self.report.get("evals") or [] if isinstance(e, dict))]:
            step, loss = _number(entry.get("local_step")), _number(entry.get("eval_loss"))
            if step is not None and loss is not None:
                points.append((step, loss))
        return sorted(set(points))

    def losses_by_time(self) -> List[Tuple[float, float]]:
        """(wall-clock time, eval loss): the start loss when training started (it is measured on the state this
        peer starts from, whatever its outer step), then the eval after each round, at the round's end. --eval-every
        evals keep no time, so they are not here."""
        points = []
        started, initial = _number(self.report.get("train_started_at")), _number(self.report.get("initial_eval_loss"))
        if started is not None and initial is not None:
            points.append((started, initial))
        for r in self.rounds:
            finished, loss = _number(r.get("finished_at")), _number(r.get("eval_loss"))
            if finished is not None and loss is not None:
                points.append((finished, loss))
        return sorted(points)


def _time_zero(workers: List[_Worker]) -> Tuple[float, str]:
    """The earliest training start over all reports, and what the time axis is counted from."""
    starts = [t for w in workers for t in [_number(w.report.get("train_started_at"))] if t is not None]
    if starts:
        return min(starts), "the first worker's training start"
    ends = [t for w in workers for r in w.rounds for t in [_number(r.get("finished_at"))] if t is not None]
    return (min(ends), "the first round's end") if ends else (0.0, "training start")


# ------------------------------------------------------------------------------------------------ the figures


def _figure(width_in: float, height_in: float, rows: int = 1, sharex: bool = False):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, sharex=sharex, squeeze=False)[:, 0]
    return figure, list(axes)


def _outer_steps_axis(ax) -> None:
    """Whole outer steps on the x axis: a tick at 2.5 is no round."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("outer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _note(ax, text: str) -> None:
    """What an empty plot means, in place of the lines."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2 if len(ax.get_legend_handles_labels()[0]) > 4 else 1)


def _loss_vs_step(workers: List[_Worker]):
    figure, (ax,) = _figure(8, 5)
    drawn = 0
    for w in workers:
        points = w.losses_by_step()
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, color=w.color, label=w.label)
            drawn += 1
    if not drawn:
        _note(ax, "no eval losses in these reports (no rounds yet)")
    ax.set_title("Held-out eval loss by local step")
    ax.set_xlabel("local step (inner steps since the run began)")
    ax.set_ylabel("eval loss (nats per token)")
    ax.grid(alpha=0.3)
    _legend(ax)
    return figure


def _loss_vs_time(workers: List[_Worker]):
    figure, (ax,) = _figure(8, 5)
    zero, since = _time_zero(workers)
    drawn = 0
    for w in workers:
        points = w.losses_by_time()
        if points:
            ax.plot([t - zero for t, _ in points], [loss for _, loss in points], marker="o", markersize=3,
                    color=w.color, label=w.label)
            drawn += 1
    if not drawn:
        _note(ax, "no eval losses in these reports (no rounds yet)")
    ax.set_title("Held-out eval loss by wall time (at the start and after each round)")
    ax.set_xlabel(f"wall time since {since} (s)")
    ax.set_ylabel("eval loss (nats per token)")
    ax.grid(alpha=0.3)
    _legend(ax)
    return figure


def _sync_split(workers: List[_Worker]):
    """A row per worker, a stacked bar per round: matchmaking, all-reduce, the rest (publishing, the outer step, the
    digest; a streaming sync's phases have neither of the first two, so all of it is there). A round that took the
    swarm's state has no phases: its whole time, hatched."""
    figure, axes = _figure(9, 1.0 + 1.9 * max(len(workers), 1), rows=max(len(workers), 1), sharex=True)
    figure.suptitle("Where each sync's seconds went")
    for ax, w in zip(axes, workers):
        steps, matchmaking, allreduce, rest, caught_up = [], [], [], [], []
        for i, r in enumerate(w.rounds):
            step = _number(r.get("outer_step"))
            step = float(i + 1) if step is None else step
            seconds = _number(r.get("seconds")) or 0.0
            if r.get("caught_up"):
                caught_up.append((step, seconds))
                continue
            phases = r.get("phases") if isinstance(r.get("phases"), dict) else {}
            m, a = _number(phases.get("matchmaking")) or 0.0, _number(phases.get("allreduce")) or 0.0
            steps.append(step)
            matchmaking.append(m)
            allreduce.append(a)
            rest.append(max(seconds - m - a, 0.0))
        # with ~100 rounds the bars are a few pixels wide: edges would hide them
        ax.bar(steps, matchmaking, width=0.8, color="C1", label="matchmaking", linewidth=0)
        ax.bar(steps, allreduce, width=0.8, bottom=matchmaking, color="C0", label="all-reduce", linewidth=0)
        ax.bar(steps, rest, width=0.8, bottom=[m + a for m, a in zip(matchmaking, allreduce)], color="0.7",
               label="rest (publish, outer step, digest, ...)", linewidth=0)
        if caught_up:
            ax.bar(*zip(*caught_up), width=0.8, color="none", edgecolor="C3", hatch="///",
                   label="took the swarm's state (no phases)")
        if not w.rounds:
            _note(ax, "no rounds in this report")
        ax.set_title(f"worker {w.label}", fontsize=9, loc="left")
        ax.set_ylabel("sync (s)")
        ax.grid(axis="y", alpha=0.3)
    if not workers:
        _note(axes[0], "no reports")
    _outer_steps_axis(axes[-1])
    handles = {}
    for ax in axes:  # one legend for all rows: the same four colours in each
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:  # under the rows, where it hides no bar
        figure.legend(handles.values(), handles.keys(), fontsize=7, loc="outside lower center", ncol=len(handles))
    return figure


def _bytes_per_round(workers: List[_Worker]):
    figure, axes = _figure(8, 6.5, rows=2, sharex=True)
    figure.suptitle("Bytes per round (the sync's payload, counted by each worker)")
    drawn = 0
    for w in workers:
        steps = [_number(r.get("outer_step")) for r in w.rounds]
        rounds = [(s, r) for s, r in zip(steps, w.rounds) if s is not None]
        if not rounds:
            continue
        for ax, key in zip(axes, ("bytes_sent", "bytes_received")):
            ax.plot([s for s, _ in rounds], [(_number(r.get(key)) or 0.0) / MB for _, r in rounds], marker="o",
                    markersize=3, color=w.color, label=w.label)
        drawn += 1
    if not drawn:
        for ax in axes:
            _note(ax, "no rounds in these reports")
    axes[0].set_ylabel("sent (MB)")
    axes[1].set_ylabel("received (MB)")
    _outer_steps_axis(axes[1])
    for ax in axes:
        ax.grid(alpha=0.3)
        if drawn:  # from zero: a 1% change in bytes should look like one
            top = ax.dataLim.y1
            ax.set_ylim(0, 1.1 * top if top > 0 else 1.0)
    _legend(axes[0])
    return figure
