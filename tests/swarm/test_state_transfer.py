"""State transfer to newcomers: chunks from several donors, resumed past a donor that dies part way.

Real `p2ptrain join` processes on 127.0.0.1: two donors train; two newcomers start at the same moment; one donor
is told (P2PTRAIN_FAULT) to die after serving one chunk of its state: a newcomer that chooses it asks it for
FETCHES_PER_DONOR (2) chunks at once, so it dies part way whichever newcomer asks it (at "after two chunks", a donor
asked for 2 chunks in all never died, and the test waited for its death in vain, in CI). Both newcomers must finish the transfer
from the other donor, take the same state, and then average with the swarm on the same parameters.
"""

from __future__ import annotations


import pytest

from tests.helpers import exit_code, report, start_bootstrap, start_worker, stop_all, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

# the newcomers take part in this many syncs; the donors train until the test stops them, so the faulty donor is
# still there to be asked however slowly the newcomers start (with a fixed last outer step, the donors had reached
# it and left before two loaded newcomers asked anybody)
NEWCOMER_SYNCS = 3
ARGS = ["--local-steps", "20", "--num-shards", "4", "--matchmaking-time", "2", "--averaging-timeout", "10",
        "--no-group-policy", "wait", "--log-interval", "2"]


@pytest.mark.slow  # over 15 s on 2 cores: `make test-slow` (CI runs it)
def test_two_simultaneous_newcomers_resume_past_a_dying_donor(tmp_path):
    boot, maddr = start_bootstrap(tmp_path)
    procs = {
        0: start_worker(tmp_path, 0, maddr, "transfer", *ARGS, "--shard-index", "0"),
        1: start_worker(tmp_path, 1, maddr, "transfer", *ARGS, "--shard-index", "1",
                        env={"P2PTRAIN_FAULT": "kill-mid-state-transfer:1"}),
    }
    try:
        wait_until(lambda: report(tmp_path, 0).get("outer_steps", 0) >= 2, "the donors reach outer step 2", 120,
                   procs=[(f"worker {i}", proc) for i, proc in procs.items()])
        for i in (2, 3):  # at the same moment
            procs[i] = start_worker(tmp_path, i, maddr, "transfer", *ARGS, "--shard-index", str(i),
                                    "--max-outer-steps", str(NEWCOMER_SYNCS))
        assert procs[1].wait(timeout=60) < 0, "the faulty donor should have died while serving its state"
        assert "fault injection: dying after serving 1 state chunks" in (tmp_path / "w1.log").read_text()
        del procs[1]
        for i in (2, 3):
            assert exit_code(procs[i], 200, tmp_path / f"w{i}.log") == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
        stop_all([procs[0]])  # SIGINT: the surviving donor leaves cleanly
        assert procs[0].returncode == 0, (tmp_path / "w0.log").read_text()[-3000:]
    finally:
        stop_all([*procs.values(), boot])

    donor, newcomers = report(tmp_path, 0), [report(tmp_path, i) for i in (2, 3)]
    dead_donor = report(tmp_path, 1)["peer_id"]
    served_by_dead = 0
    for newcomer, other in zip(newcomers, reversed(newcomers)):
        transfer = newcomer["state_download"]
        print(f"newcomer {newcomer['peer_id'][-8:]}: {transfer}")
        assert transfer["bytes"] == 4 * 4 * newcomer["num_parameters"]  # params, momentum, 2 AdamW moments; fp32
        # every chunk (7 of 1 MiB for the tiny model) came from a peer of the run: a donor, or the other newcomer
        # once it held the state itself
        assert sum(transfer["chunks_by_donor"].values()) == 7
        assert set(transfer["chunks_by_donor"]) <= {donor["peer_id"], dead_donor, other["peer_id"]}
        served_by_dead += transfer["chunks_by_donor"].get(dead_donor, 0)
    # the dead donor served 1 chunk before dying, so at least one newcomer had to resume past it
    assert served_by_dead <= 1
    assert any(dead_donor in n["state_download"]["failed_donors"] for n in newcomers)

    # both newcomers took the same state and then committed the same rounds as the donor
    by_step = {r["outer_step"]: r["digest"] for r in donor["rounds"]}
    for newcomer in newcomers:
        assert newcomer["stopped_by"] == "max_outer_steps" and newcomer["syncs"] == NEWCOMER_SYNCS, newcomer["rounds"]
        assert any(r["averaged"] and r["group_size"] >= 2 for r in newcomer["rounds"])
        for record in newcomer["rounds"]:
            assert record["digest"] == by_step[record["outer_step"]], f"newcomer diverged at {record}"
