"""The honest-only baselines of the attack suite: the same 4 replicas (tiny, 600 steps, H = 15, seed 0), the last
one left out of every round from round K on (K = 1: the 3 honest replicas alone). Usage: python honest_only.py K..."""
import sys
from p2ptrain.bench.convergence import Setup, run_diloco
setup = Setup(model="tiny", peers=4, steps=600)
out = {}
for start in (int(a) for a in sys.argv[1:]):
    state = {"round": 0}
    def admit(sent, start=start):
        state["round"] += 1
        return [i != 3 or state["round"] < start for i in range(len(sent))]
    out[start] = run_diloco(setup, 15, admit=admit)
    print(start, out[start], flush=True)
