"""``p2ptrain bench --crowd M``: M newcomers join at once while T workers train, and what the crowd costs.

A ``bootstrap`` peer and T trainers (``join``, the tiny model, one torch thread, loopback) train until each has
committed ``warmup_rounds`` rounds. Then one newcomer joins alone: it takes the swarm's state (chunked, from the
declared donors: ``averaging/state_transfer.py``), averages ``newcomer_rounds`` rounds with the trainers and is
stopped; its wait is the yardstick. Then M newcomers start in the same moment and do the same. The trainers are
stopped last. ``summarize_crowd`` reads the reports: each newcomer's start-up and state download seconds against the
lone one's, which peers served the crowd's chunks (trainers, and newcomers that already held the state) and the
largest share of them one peer served, and whether the trainers' rounds went on while the crowd came (their rounds
in that window, against their median round before it).

The figures are pure functions of the reports, tested on hand-made ones; the processes are handled as in
``bench/scale.py``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from p2ptrain.bench.local import (LOOPBACK, interrupts_raised, leftover_processes, loopback_join, read_json,
                                  stop_swarm)
from p2ptrain.daemons import DaemonError, spawn, stop_daemons, wait_for_address

DELAYED_FACTOR = 2.0
"""a trainer's round during the crowd counts as delayed when it took over this many times its median before"""


@dataclass(frozen=True)
class CrowdConfig:
    trainers: int = 8
    newcomers: int = 16
    local_steps: int = 10
    """--local-steps of every worker"""
    warmup_rounds: int = 2
    """rounds every trainer commits before the lone newcomer comes"""
    newcomer_rounds: int = 1
    """averaged rounds a newcomer takes part in (after taking the state) before it is stopped"""
    timeout_s: float = 900.0
    """each wait (trainers' warm-up, the lone newcomer, the crowd); past it the run stops and counts as failed"""
    model: str = "tiny"

    @property
    def num_shards(self) -> int:
        return max(16, self.trainers + self.newcomers + 1)


def join_args(cfg: CrowdConfig, initial_peer: str, run_id: str, report: Path) -> List[str]:
    """A worker's arguments: a user's defaults but for the model, the phase and the shards; it runs until stopped."""
    return loopback_join(initial_peer, run_id, report, model=cfg.model, local_steps=cfg.local_steps,
                         num_shards=cfg.num_shards)


# ------------------------------------------------------------------------------------------------ pure figures


def averaged_rounds(report: Dict[str, Any]) -> int:
    return sum(1 for r in report.get("rounds", []) if r.get("averaged") and not r.get("caught_up"))


def newcomer_done(report: Dict[str, Any], rounds: int) -> bool:
    """It took the state, and its last ``rounds`` rounds were averaged ones: not a state taken again (two newcomers
    that fell behind together can average a round of their own, then find the swarm ahead and take its state)."""
    last = report.get("rounds", [])[-rounds:]
    return report.get("state_download") is not None and len(last) == rounds and \
        all(r.get("averaged") and not r.get("caught_up") for r in last)


def newcomer_figures(report: Dict[str, Any]) -> Dict[str, Any]:
    download = report.get("state_download") or {}
    return {"peer_id": report.get("peer_id", ""), "startup_s": report.get("startup_s"),
            "download_s": download.get("seconds"), "bytes": download.get("bytes"),
            "chunks_by_donor": dict(download.get("chunks_by_donor") or {}),
            "failed_donors": list(download.get("failed_donors") or []), "averaged_rounds": averaged_rounds(report)}


def _ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    return value / base if value is not None and base else None


def trainer_rounds(report: Dict[str, Any], window: Sequence[float]) -> Dict[str, Any]:
    """One trainer's rounds before ``window`` (wall-clock start, end: the crowd's arrival until its last newcomer
    held the state) and inside it: the median round before, the rounds in it, how many of those were delayed (over
    ``DELAYED_FACTOR`` x the median before) or ended behind the swarm (its state taken, its phase lost)."""
    start, end = window
    before = [r["seconds"] for r in report.get("rounds", []) if r.get("finished_at", 0) < start]
    during = [r for r in report.get("rounds", []) if start <= r.get("finished_at", 0) <= end]
    median_before = statistics.median(before) if before else None
    delayed = [r for r in during if median_before is not None and r["seconds"] > DELAYED_FACTOR * median_before]
    return {"peer_id": report.get("peer_id", ""), "median_round_s_before": median_before,
            "rounds_during": len(during), "committed_during": sum(1 for r in during if r.get("averaged")),
            "behind_during": sum(1 for r in during if r.get("caught_up")), "delayed_during": len(delayed),
            "max_round_s_during": max((r["seconds"] for r in during), default=None)}


def summarize_crowd(cfg: CrowdConfig, trainers: Sequence[Dict[str, Any]], lone: Dict[str, Any],
                    crowd: Sequence[Dict[str, Any]], window: Sequence[float], *, status: str = "ok",
                    problems: Sequence[str] = ()) -> Dict[str, Any]:
    """Every figure of one run: ``trainers``, ``lone`` and ``crowd`` are the workers' reports ({} for none), ``window``
    the crowd's (arrival, last newcomer holding the state) in wall-clock seconds."""
    problems = list(problems)
    alone = newcomer_figures(lone)
    arrivals = [newcomer_figures(r) for r in crowd]
    missing = [i for i, r in enumerate(crowd) if r.get("state_download") is None]
    if missing:
        problems.append(f"{len(missing)} newcomer(s) never took the state, e.g. newcomer {missing[0]}")
    served: Counter = Counter()
    for a in arrivals:
        served.update(a["chunks_by_donor"])
    roles = {r.get("peer_id"): "trainer" for r in trainers}
    roles.update({r.get("peer_id"): "newcomer" for r in [lone, *crowd] if r.get("peer_id")})
    by_role: Counter = Counter()
    for peer, chunks in served.items():
        by_role[roles.get(peer, "other")] += chunks
    total = sum(served.values())
    downloads = [a["download_s"] for a in arrivals if a["download_s"] is not None]
    startups = [a["startup_s"] for a in arrivals if a["startup_s"] is not None]
    rounds = [trainer_rounds(r, window) for r in trainers]
    return {
        "config": asdict(cfg), "status": status, "problems": problems,
        "lone": alone,
        "crowd": arrivals,
        "download_s": {"median": statistics.median(downloads) if downloads else None,
                       "max": max(downloads, default=None)},
        "startup_s": {"median": statistics.median(startups) if startups else None, "max": max(startups, default=None)},
        "download_vs_lone_max": _ratio(max(downloads, default=None), alone["download_s"]),
        "startup_vs_lone_max": _ratio(max(startups, default=None), alone["startup_s"]),
        "donors": {"peers": len(served), "chunks": total,
                   "by_role": dict(by_role),
                   "max_share": max(served.values()) / total if total else None,
                   "fair_share_of_trainers": 1.0 / max(len(trainers), 1),
                   "newcomers_from_one_donor": sum(1 for a in arrivals if len(a["chunks_by_donor"]) == 1)},
        "trainers": rounds,
        "trainer_rounds_delayed_max": max((t["delayed_during"] for t in rounds), default=None),
        "trainer_rounds_behind": sum(t["behind_during"] for t in rounds),
        "window_s": window[1] - window[0],
    }


def _f(value: Optional[float], spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def crowd_markdown(r: Dict[str, Any]) -> str:
    cfg, donors = r["config"], r["donors"]
    lines = [
        "# p2ptrain bench --crowd",
        "",
        f"{cfg['trainers']} trainers, then 1 newcomer alone, then {cfg['newcomers']} newcomers at once (tiny model, "
        f"loopback, --local-steps {cfg['local_steps']}). Start-up: from the process's start to its first inner step "
        "(imports, DHT, taking the state); download: taking the state alone. Status: "
        f"**{r['status']}**{'; ' + '; '.join(r['problems']) if r['problems'] else ''}.",
        "",
        "| | start-up s (median, max) | download s (median, max) | chunks from (peers) |",
        "|---|---|---|---|",
        f"| lone newcomer | {_f(r['lone']['startup_s'])} | {_f(r['lone']['download_s'])} | "
        f"{len(r['lone']['chunks_by_donor'])} |",
        f"| crowd of {len(r['crowd'])} | {_f(r['startup_s']['median'])}, {_f(r['startup_s']['max'])} | "
        f"{_f(r['download_s']['median'])}, {_f(r['download_s']['max'])} | "
        f"{', '.join(str(len(a['chunks_by_donor'])) for a in r['crowd'])} |",
        "",
        f"- Slowest crowd newcomer against the lone one: download x{_f(r['download_vs_lone_max'])}, start-up "
        f"x{_f(r['startup_vs_lone_max'])}.",
        f"- The crowd's {donors['chunks']} chunks came from {donors['peers']} peers ({donors['by_role']}); the "
        f"busiest served {_f(100 * donors['max_share'] if donors['max_share'] is not None else None, '.0f')}% "
        f"(one trainer's fair share: {100 * donors['fair_share_of_trainers']:.0f}%); newcomers served by one peer "
        f"only: {donors['newcomers_from_one_donor']}.",
        f"- Trainers while the crowd came ({r['window_s']:.0f} s): at most {r['trainer_rounds_delayed_max']} "
        f"round(s) of one trainer over {DELAYED_FACTOR:g}x its median before; rounds that ended behind the swarm: "
        f"{r['trainer_rounds_behind']}.",
        "",
        "| trainer | median round s before | rounds during | committed | behind | delayed | max round s during |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in r["trainers"]:
        lines.append(f"| {t['peer_id'][-8:]} | {_f(t['median_round_s_before'])} | {t['rounds_during']} | "
                     f"{t['committed_during']} | {t['behind_during']} | {t['delayed_during']} | "
                     f"{_f(t['max_round_s_during'])} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ the processes


class CrowdTimeout(Exception):
    """A wait of the crowd run went past ``timeout_s``; the message says which."""


def _wait(what: str, done: Callable[[], bool], procs: Sequence[subprocess.Popen], timeout_s: float,
          echo: Callable[[str], None], progress: Callable[[], str]) -> None:
    started, last_line = time.monotonic(), time.monotonic()
    while not done():
        if time.monotonic() - started > timeout_s:
            raise CrowdTimeout(f"{what}: not after {timeout_s:.0f}s ({progress()})")
        exited = [p for p in procs if p.poll() is not None]
        if exited:
            raise CrowdTimeout(f"{what}: a worker exited with code {exited[0].returncode} first ({progress()})")
        if time.monotonic() - last_line >= 10:
            echo(f"  waiting for {what}: {progress()}, {time.monotonic() - started:.0f}s")
            last_line = time.monotonic()
        time.sleep(0.5)


def run_crowd(cfg: CrowdConfig, out: Path, echo: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run the three acts (trainers, a lone newcomer, the crowd); writes crowd.json and crowd.md in ``out`` and
    returns ``summarize_crowd``'s figures. A SIGTERM or Ctrl-C stops every daemon and keeps what was measured."""
    out.mkdir(parents=True, exist_ok=True)
    run_id = f"crowd-{uuid.uuid4().hex[:8]}"
    procs: List[subprocess.Popen] = []
    trainer_reports = [out / f"trainer{i}.json" for i in range(cfg.trainers)]
    lone_report = out / "lone.json"
    crowd_reports = [out / f"newcomer{i}.json" for i in range(cfg.newcomers)]
    for path in [*trainer_reports, lone_report, *crowd_reports]:
        path.unlink(missing_ok=True)
    status, problems, window = "ok", [], (0.0, 0.0)

    def start(report: Path) -> subprocess.Popen:
        procs.append(spawn(join_args(cfg, initial_peer, run_id, report), report.with_suffix(".log")))
        return procs[-1]

    with interrupts_raised():  # a Ctrl-C or SIGTERM stops every daemon and keeps what was measured
        try:
            maddrs = out / "bootstrap.maddrs"
            maddrs.unlink(missing_ok=True)
            procs.append(spawn(["bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs)],
                               out / "bootstrap.log"))
            initial_peer = wait_for_address(maddrs, procs[0])
            trainers = [start(path) for path in trainer_reports]
            echo(f"crowd: {cfg.trainers} trainers started (run {run_id}; logs in {out})")
            warm = lambda: [min(read_json(p).get("outer_steps", 0), cfg.warmup_rounds) for p in trainer_reports]  # noqa
            _wait(f"every trainer to commit {cfg.warmup_rounds} rounds", lambda: sum(warm()) == cfg.trainers *
                  cfg.warmup_rounds, trainers, cfg.timeout_s, echo, lambda: f"{sum(warm())} rounds")

            lone = start(lone_report)
            echo("crowd: one newcomer joins alone")
            _wait("the lone newcomer to take the state and average", lambda: newcomer_done(
                read_json(lone_report), cfg.newcomer_rounds), [*trainers, lone], cfg.timeout_s, echo,
                lambda: "state taken" if read_json(lone_report).get("state_download") else "no state yet")
            stop_daemons([lone], timeout_s=60)

            arrived = time.time()
            crowd = [start(path) for path in crowd_reports]
            echo(f"crowd: {cfg.newcomers} newcomers join at once")
            holding = lambda: sum(1 for p in crowd_reports if read_json(p).get("state_download") is not None)  # noqa
            _wait("every newcomer to take the state", lambda: holding() == cfg.newcomers, [*trainers, *crowd],
                  cfg.timeout_s, echo, lambda: f"{holding()}/{cfg.newcomers} hold it")
            window = (arrived, time.time())
            done = lambda: sum(1 for p in crowd_reports if newcomer_done(read_json(p), cfg.newcomer_rounds))  # noqa
            _wait(f"every newcomer to average {cfg.newcomer_rounds} round(s)", lambda: done() == cfg.newcomers,
                  [*trainers, *crowd], cfg.timeout_s, echo, lambda: f"{done()}/{cfg.newcomers} did")
        except (CrowdTimeout, DaemonError) as e:
            status = "failed"
            problems.append(str(e))
        except KeyboardInterrupt:
            status = "interrupted"
            problems.append("interrupted")
        finally:
            stop_swarm(procs)
            problems += leftover_processes(procs)
    if window == (0.0, 0.0):  # the crowd never held the state: its rounds are measured to the end
        window = (time.time(), time.time())
    result = summarize_crowd(cfg, [read_json(p) for p in trainer_reports], read_json(lone_report),
                             [read_json(p) for p in crowd_reports], window, status=status, problems=problems)
    (out / "crowd.json").write_text(json.dumps(result, indent=1))
    (out / "crowd.md").write_text(crowd_markdown(result))
    return result
