"""Runs some conditions of `bench --convergence 600 --peers P --attack ... --aggregation mean+check` (the same code path:
run_robust's per-condition body), one process per call, for splitting the suite over cores."""
import json, sys, time
from p2ptrain.bench.convergence import Setup, run_diloco
from p2ptrain.bench.convergence_robust import ATTACKS, SenderScores, acting_check
from p2ptrain.sender_check import SenderCheck
peers, attackers, out, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
setup = Setup(model="tiny", peers=peers, batch_size=16, steps=600, seed=0, eval_batches=8)
bad = list(range(peers - attackers, peers)); good = list(range(peers - attackers))
results = {}
for name in names:
    attack = ATTACKS[name]; started = time.perf_counter()
    check, seen = SenderCheck(), SenderScores()
    sends = {i: attack.sends() for i in bad} if attack.sends is not None else {}
    data = {i: attack.data for i in bad} if attack.data is not None else {}
    loss = run_diloco(setup, 15, aggregation="mean", attacks=sends, data_attacks=data, observe=seen,
                      admit=acting_check(check))
    results[name] = {"loss": loss, "attackers": [check.first_conviction(str(i)) for i in bad] if name != "none" else [],
                     "honest": {str(i): check.first_conviction(str(i)) for i in (good + bad if name == "none" else good)
                                if check.first_conviction(str(i)) is not None}, "flags": check.flags,
                     "seconds": time.perf_counter() - started}
    print(name, results[name], flush=True)
    json.dump({"setup": setup.__dict__, "local_steps": 15, "attackers": attackers, "results": results},
              open(out, "w"), indent=1)
