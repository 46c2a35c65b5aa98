"""`p2ptrain plot` (observe/plot.py, cli/plot.py): PNGs from workers' reports built with the package's own
WorkerReport and SyncRecord, the data each plot draws, and bad reports as one-line errors with exit code 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from p2ptrain.cli.plot import plot
from p2ptrain.diloco.records import SyncRecord
from p2ptrain.observe.plot import PLOT_FILES, ReportError, build_figures, load_reports, plot_reports
from p2ptrain.worker_report import WorkerReport

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
H = 20  # local steps per round
STARTED_AT = 1_700_000_000.0


def worker_report(index: int, rounds: int, *, start_outer_step: int = 0, caught_up_first: bool = False) -> dict:
    """A worker's report as `join --report` writes it: a round every H local steps, losses going down, and an
    --eval-every eval half way through each phase."""
    report = WorkerReport(peer_id=f"12D3KooWPeer{index:04d}abcdefgh{index}", run_id="exp", model="tiny",
                          initial_eval_loss=5.5 + 0.01 * index, start_outer_step=start_outer_step,
                          train_started_at=STARTED_AT + 2.0 * index)
    batches = SimpleNamespace(shard_index=index, epoch=0, position=0)
    for step in range(1, rounds + 1):
        local_step = (start_outer_step + step) * H
        report.add_eval(local_step=local_step - H // 2, outer_step=step - 1, eval_loss=5.5 - 0.05 * step + 0.025)
        caught_up = caught_up_first and step == 1
        record = SyncRecord(
            outer_step=start_outer_step + step, averaged=not caught_up, group_size=1 if caught_up else 3,
            seconds=2.0 + 0.1 * step, bytes_sent=0 if caught_up else 1_500_000 + index,
            bytes_received=4_000_000 if caught_up else 1_400_000, caught_up=caught_up,
            finished_at=STARTED_AT + 2.0 * index + 30.0 * step,
            phases={} if caught_up else {"publish": 0.01, "matchmaking": 0.6, "allreduce": 1.2, "outer_step": 0.05})
        batches.position += 16 * H
        report.add_round(record, batches, eval_loss=5.5 - 0.05 * step, eval_s=0.3,
                         connections={"direct": 2, "relayed": 0},
                         schedule={"local_step": local_step, "inner_lr": 1e-3, "outer_lr": 0.7})
    report.final_eval_loss = report.rounds[-1]["eval_loss"] if report.rounds else math.nan
    return report.to_dict()


def write_reports(folder: Path, reports) -> list:
    paths = []
    for i, report in enumerate(reports):
        paths.append(folder / f"worker-{i}.json")
        paths[-1].write_text(json.dumps(report, indent=2))  # NaN as json.dumps writes it, as WorkerReport.write does
    return paths


def assert_pngs(paths, folder: Path) -> None:
    assert [p.name for p in paths] == list(PLOT_FILES)
    for path in paths:
        assert path.parent == folder
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE), path
        assert 5_000 < len(data) < 2_000_000, (path, len(data))


def lines_by_label(figure) -> dict:
    (ax,) = figure.axes
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_three_workers_every_plot_and_the_data_drawn(tmp_path):
    reports = [worker_report(0, 6), worker_report(1, 6),
               worker_report(2, 5, start_outer_step=1, caught_up_first=True)]  # joined a round late
    loaded = load_reports(write_reports(tmp_path, reports))
    assert [r["peer_id"] for r in loaded] == [r["peer_id"] for r in reports]

    figures = build_figures(loaded)
    by_step = lines_by_label(figures["loss_vs_step.png"])
    assert set(by_step) == {r["peer_id"][-8:] for r in reports}  # one line per worker, by its peer id's tail
    steps, losses = by_step[reports[0]["peer_id"][-8:]]
    # the start loss at step 0, then an --eval-every eval and a round's eval per phase, in step order
    assert steps[:3] == [0, H // 2, H] and losses[0] == pytest.approx(5.5)
    assert len(steps) == 1 + 2 * 6 and steps == sorted(steps)
    assert losses[2] == pytest.approx(reports[0]["rounds"][0]["eval_loss"])
    late_steps, _ = by_step[reports[2]["peer_id"][-8:]]
    assert late_steps[0] > 0  # its start was at a later local step than 0, which the report does not keep

    by_time = lines_by_label(figures["loss_vs_time.png"])
    assert set(by_time) == set(by_step)
    times, losses = by_time[reports[1]["peer_id"][-8:]]
    # counted from the first worker's training start: worker 1 started 2 s after it, its first round ends 30 s later
    assert times[:2] == [pytest.approx(2.0), pytest.approx(32.0)] and losses[0] == pytest.approx(5.51)

    sync_axes = figures["sync_split.png"].axes
    assert len(sync_axes) == 3  # a row per worker
    heights = [p.get_height() for p in sync_axes[0].patches]
    assert len(heights) == 3 * 6  # matchmaking, all-reduce, the rest: a stacked bar per round
    assert heights[0] == pytest.approx(0.6) and heights[6] == pytest.approx(1.2)
    assert heights[12] == pytest.approx(2.1 - 0.6 - 1.2)
    hatched = [p for p in sync_axes[2].patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_height() == pytest.approx(2.1)  # the round that took the state

    sent_ax, received_ax = figures["bytes_per_round.png"].axes
    assert len(sent_ax.get_lines()) == 3 and len(received_ax.get_lines()) == 3
    assert list(sent_ax.get_lines()[0].get_ydata())[0] == pytest.approx(1.5)  # MB

    out = tmp_path / "plots"
    assert_pngs(plot_reports(loaded, out), out)


def test_eight_workers_of_a_hundred_rounds(tmp_path):
    reports = [worker_report(i, 100) for i in range(8)]
    figures = build_figures(reports)
    assert len(lines_by_label(figures["loss_vs_step.png"])) == 8
    assert len(figures["sync_split.png"].axes) == 8
    assert_pngs(plot_reports(reports, tmp_path), tmp_path)


def test_reports_without_rounds_still_give_every_file(tmp_path):
    reports = [WorkerReport(peer_id="12D3KooWNoRoundsYet").to_dict(), worker_report(1, 0)]
    loaded = load_reports(write_reports(tmp_path, reports))
    figures = build_figures(loaded)
    # the second worker's start loss is a point; the first has no loss at all (NaN)
    assert list(lines_by_label(figures["loss_vs_step.png"])) == [reports[1]["peer_id"][-8:]]
    assert any("no rounds" in t.get_text() for ax in figures["sync_split.png"].axes for t in ax.texts)
    out = tmp_path / "plots"
    assert_pngs(plot_reports(loaded, out), out)
    assert_pngs(plot_reports([], tmp_path / "none"), tmp_path / "none")


def test_a_demo_summary_counts_as_its_workers(tmp_path):
    summary = tmp_path / "demo.json"
    summary.write_text(json.dumps({"run_id": "demo-1", "wall_s": 9.0, "workers": [worker_report(0, 2),
                                                                                   worker_report(1, 2)]}))
    assert len(load_reports([summary])) == 2


@pytest.mark.parametrize("name, content, problem", [
    ("missing.json", None, "cannot read"),
    ("garbage.json", "not json {", "is not JSON"),
    ("list.json", "[1, 2]", "JSON list"),
    ("no_rounds.json", json.dumps({"peer_id": "x", "outer_steps": 3}), "no rounds"),
    ("bad_rounds.json", json.dumps({"peer_id": "x", "rounds": [1]}), "rounds are not"),
])
def test_bad_reports_are_one_line_errors_naming_the_file(tmp_path, name, content, problem):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    good = write_reports(tmp_path, [worker_report(0, 1)])
    with pytest.raises(ReportError) as raised:
        load_reports([*good, path])
    message = str(raised.value)
    assert str(path) in message and problem in message and "\n" not in message
    assert "join --report" in message  # the fix

    result = CliRunner().invoke(plot, [*map(str, good), str(path), "--out", str(tmp_path / "plots")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and str(path) in lines[0], result.output
    assert not (tmp_path / "plots").exists()  # nothing drawn from half the reports


def test_the_command_prints_each_file_it_wrote(tmp_path):
    paths = write_reports(tmp_path, [worker_report(0, 3), worker_report(1, 3)])
    out = tmp_path / "plots"
    result = CliRunner().invoke(plot, [*map(str, paths), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"wrote {out / name}" for name in PLOT_FILES]
    assert_pngs([out / name for name in PLOT_FILES], out)


def test_an_unwritable_out_folder_is_exit_code_2(tmp_path):
    paths = write_reports(tmp_path, [worker_report(0, 1)])
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(plot, [*map(str, paths), "--out", str(blocker / "plots")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "cannot write the plots" in lines[0] and "--out" in lines[0], result.output


def test_no_report_is_a_usage_error():
    result = CliRunner().invoke(plot, [])
    assert result.exit_code == 2 and "REPORT.json" in result.output


def test_p2ptrain_plot_in_a_subprocess(tmp_path):
    from p2ptrain.cli import cli

    if "plot" not in cli.commands:
        pytest.skip("plot is not registered yet")
    paths = write_reports(tmp_path, [worker_report(0, 2), worker_report(1, 2)])
    result = subprocess.run([sys.executable, "-m", "p2ptrain", "plot", *map(str, paths), "--out", "plots"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [f"wrote {Path('plots') / name}" for name in PLOT_FILES]
    assert_pngs([tmp_path / "plots" / name for name in PLOT_FILES], tmp_path / "plots")

    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    result = subprocess.run([sys.executable, "-m", "p2ptrain", "plot", str(bad)], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("Error: ") and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "plots" / "bad").exists()
