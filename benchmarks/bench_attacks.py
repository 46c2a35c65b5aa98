"""What each attack of a rogue peer costs the honest peers of a private swarm: runs tests/swarm/test_rogue.py (two
honest DiLoCo peers, a plain-hivemind rogue; every test also asserts the honest parameters end bit-identical to a
run without the rogue) and prints, per attack, the honest peers' sync seconds and payload bytes against the same
run without it; for plausible poison (within the norm check), how far it moved the honest peers' parameters under the
plain mean and under --aggregation clip.

    python benchmarks/bench_attacks.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "attacks.json"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               str(ROOT / "tests/swarm/test_rogue.py")], cwd=ROOT,
                              env=dict(os.environ, P2PTRAIN_ATTACK_REPORT=str(report)))
        if done.returncode != 0:
            sys.exit(f"the rogue-peer tests failed (exit {done.returncode}); no figures")
        costs = json.loads(report.read_text())
    poisons = {attack: c for attack, c in costs.items() if "distance_from_honest_run" in c}
    costs = {attack: c for attack, c in costs.items() if attack not in poisons}
    print(f"\n{'attack':<52} {'outcome':<30} {'sync s (alone)':>16} {'extra s':>8} {'payload kB (alone)':>19} "
          f"{'extra kB':>9}")
    for attack, c in costs.items():
        print(f"{attack:<52} {c['outcome']:<30} {c['sync_s']:>7.2f} ({c['sync_s_alone']:>5.2f}) {c['extra_s']:>8.2f} "
              f"{c['payload_bytes'] / 1e3:>9.1f} ({c['payload_bytes_alone'] / 1e3:>6.1f}) "
              f"{c['extra_bytes'] / 1e3:>9.1f}")
    print("per honest peer, summed over its 3 syncs; payload = all-reduce bytes sent + received")
    for attack, c in costs.items():
        print(f"{attack}: each sync's seconds per honest peer {c['rounds_s']}, without the rogue "
              f"{c['rounds_s_alone']}")
    if poisons:
        print("\nplausible poison (3 honest peers + 1, groups of 4): how far the honest peers' parameters end from "
              "where the 3 of them end alone")
        for attack, c in poisons.items():
            distances = ", ".join(f"{name} {d:.4f}" for name, d in c["distance_from_honest_run"].items())
            print(f"{attack:<64} {distances}")
    if args.json:
        Path(args.json).write_text(json.dumps({**costs, **poisons}, indent=1))


if __name__ == "__main__":
    main()
