"""``p2ptrain plot``: PNG plots of workers' reports (``join --report``). Registered on the group with
``cli.add_command(plot)``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Tuple

import click

# light on purpose: observe.plot imports matplotlib only when it draws, so --help stays fast
from p2ptrain.cli.options import BadInput
from p2ptrain.observe import MissingExtra
from p2ptrain.observe.plot import PLOT_FILES, ReportError, load_reports, plot_reports


@click.command()
@click.argument("reports", nargs=-1, required=True, type=click.Path(), metavar="REPORT.json...")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="plots", show_default=True,
              help="Folder to write the PNG files into (made if missing; files of the same name are replaced).")
def plot(reports: Tuple[str, ...], out_dir: str) -> None:
    """Plot workers' reports (the JSON of `join --report`, or a `demo --json` summary): eval loss by local step and
    by wall time, where each sync's seconds went, and the bytes of each round, one line or row per worker."""
    out = Path(out_dir)
    try:
        loaded = load_reports(reports)  # first: a bad file is reported before matplotlib's import
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        written = plot_reports(loaded, out)
    except (ReportError, MissingExtra) as e:
        raise BadInput(str(e)) from None
    except OSError as e:
        raise BadInput(f"cannot write the plots ({', '.join(PLOT_FILES)}) into {out}: {e.strerror or e}; give a "
                       "writable folder with --out") from None
    for path in written:
        click.echo(f"wrote {path}")
