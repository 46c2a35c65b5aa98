"""How far a replay of one replica's phase lands from the phase itself when only the thread count differs (2 when
trained, 1 when replayed): tiny model, after 30 warm-up steps, for phases of H = 15, 60 and 240 inner steps."""
import copy, torch
from p2ptrain.bench.replicas import Setup, inner_optimizer, replica_data
from p2ptrain.config import DiLoCoConfig
from p2ptrain.model import build_model
setup = Setup(); cfg = DiLoCoConfig()
def run(model, opt, shard, steps):
    for _ in range(steps):
        x, y = next(shard); model(x, y)[1].backward(); opt.step(); opt.zero_grad()
for H in (15, 60, 240):
    torch.set_num_threads(2)
    sh = replica_data(setup)[0][1]
    model = build_model("tiny", seed=0); opt = inner_optimizer(model.parameters(), cfg)
    run(model, opt, sh, 30)
    theta0 = [p.detach().clone() for p in model.parameters()]
    ost = copy.deepcopy(opt.state_dict()); dst = sh.state_dict()
    run(model, opt, sh, H)
    d1 = [a - p.detach() for a, p in zip(theta0, model.parameters())]
    torch.set_num_threads(1)
    m2 = build_model("tiny", seed=0)
    with torch.no_grad():
        for p, a in zip(m2.parameters(), theta0): p.copy_(a)
    o2 = inner_optimizer(m2.parameters(), cfg); o2.load_state_dict(copy.deepcopy(ost))
    s2 = replica_data(setup)[0][1]; s2.load_state_dict(dst)
    run(m2, o2, s2, H)
    d2 = [a - p.detach() for a, p in zip(theta0, m2.parameters())]
    num = sum(((x-y)**2).sum() for x,y in zip(d1,d2))**.5; den = sum((x**2).sum() for x in d1)**.5
    h1 = [x.half().float() for x in d1]; h2=[x.half().float() for x in d2]
    numh = sum(((x-y)**2).sum() for x,y in zip(h1,h2))**.5
    print(H, "rel fp32", float(num/den), "rel fp16", float(numh/den))
