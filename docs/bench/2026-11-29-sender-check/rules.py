"""The sender check's rule (a cosine floor, rounds in a row) replayed on every recorded run's per-round scores.

Until a run's first conviction its trajectory does not depend on the rule (the check acts only by leaving a sender
out), so the round a stricter rule first convicts in is exact up to the recorded conviction; the runs with nobody
attacking are exact over all 40 rounds. Prints, per rule, the honest senders it would convict and the median round
each attack is convicted in, then the longest run of flags of an honest sender per floor.

    python docs/bench/2026-11-29-sender-check/rules.py
"""
from pathlib import Path
import json, statistics, itertools
HERE = Path(__file__).resolve().parent
files = {
 'suite4': HERE.parent / '2026-11-29-attack-suite' / 'robust-4.json',
 'suite6x2': HERE.parent / '2026-11-29-attack-suite' / 'robust-6x2.json',
 'check4': HERE / 'robust-4-check.json',
 'trimcheck4x5': HERE / 'robust-4-trim-check-x5.json',
 'trimcheck4': HERE / 'robust-4-trim-check.json',
 'check6x2': HERE / 'robust-6x2-check.json',
}
def rel(c):
    out=[]
    for i,ci in enumerate(c):
        t=statistics.median([x for j,x in enumerate(c) if j!=i])
        out.append(ci/t if t>0 else 1.0)
    return out
def first_conv(cos, norms, i, floor, rounds, bound=2.0):
    streak=0
    for r,(c,n) in enumerate(zip(cos,norms)):
        f = rel(c)[i] < floor or not 1/bound <= n[i] <= bound
        streak = streak+1 if f else 0
        if streak>=rounds: return r+1
    return None
runs=[]
for name,f in files.items():
    d=json.load(open(f)); k=d.get('attackers',1)
    for agg, by in d['sender_scores'].items():
        for attack, s in by.items():
            cos, norms = s['cosines'], s['norm_ratios']
            n=len(cos[0]); bad=list(range(n-k,n)) if attack!='none' else []
            runs.append((name,agg,attack,cos,norms,bad))
print(len(runs),'runs')
for floor, rounds in itertools.product([0.6,0.5,0.4],[3,4,5]):
    fp=[]; att={}
    for name,agg,attack,cos,norms,bad in runs:
        n=len(cos[0])
        for i in range(n):
            r=first_conv(cos,norms,i,floor,rounds)
            if i in bad: att.setdefault(attack,[]).append(r)
            elif r is not None: fp.append(f'{name}/{agg}/{attack}#{i}@{r}')
    summary={a:(sorted([x for x in v if x is not None])[len([x for x in v if x is not None])//2] if any(x is not None for x in v) else None, sum(x is None for x in v), len(v)) for a,v in att.items()}
    print(f'floor {floor} rounds {rounds}: honest convicted {len(fp)} {fp[:4]}')
    print('   attackers median round/missed/total:', summary)
print('longest honest streak of flags')
for floor in [0.6,0.5,0.4]:
    longest=0; where=None; flags=0; total=0
    for name,agg,attack,cos,norms,bad in runs:
        n=len(cos[0])
        for i in range(n):
            if i in bad: continue
            streak=0
            for r,(c,nn) in enumerate(zip(cos,norms)):
                f = rel(c)[i] < floor or not 0.5 <= nn[i] <= 2
                total+=1; flags+=f
                streak = streak+1 if f else 0
                if streak>longest: longest, where = streak, f'{name}/{agg}/{attack}#{i}@{r+1}'
    print(floor, longest, where, f'{flags} flags of {total} honest sender-rounds')
