"""Session 18, the Mamba-3 decode step's launch as CUDA graphs, in one process. Run on a GPU from the repository
root: python3 THIS_FILE OUT.json [--sweep]. Without --sweep (call 6): main's old launch (BLOCK_P 16, a loop over
ranks, 4 warps) against step_config, A B A B. With --sweep (call 5; run before step_config chose, with the old
launch first): tile choices, each set as step.step_config for its launches."""
import json, sys, time, torch, triton
from mambalab.kernels.mamba3 import step as S
from mambalab.ops import mamba3_step
from mambalab.ref.mamba3 import Mamba3State

NEW = S.step_config
SWEEP = [(16, False, 4), (16, False, 2), (32, False, 4), (64, False, 8), (16, True, 2), (16, True, 4), (32, True, 4),
         (32, True, 8), (64, True, 4), (64, True, 8), (8, True, 2)]
CONFIGS = ([("sweep", *c) for c in SWEEP] if "--sweep" in sys.argv
           else [("old", 16, False, 4), ("new", None, None, None)] * 2)
CASES = [(64, 64, 1), (64, 64, 4), (16, 32, 1), (16, 32, 2), (16, 32, 4), (16, 32, 8)]   # (batch, heads, r)
p, n, a, g = 64, 128, 32, 1
dev, bf = "cuda", torch.bfloat16
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "p": p, "n": n, "a": a, "g": g, "results": []}
gen = torch.Generator(device=dev).manual_seed(0)
rnd = lambda *s, dtype=torch.float32: torch.randn(*s, device=dev, generator=gen).to(dtype)
for b, h, r in CASES:
    state = Mamba3State(rnd(b, h, a), rnd(b, h, p, n) * 0.1, rnd(b, h, r, n), rnd(b, h, p))
    tok = dict(q=rnd(b, r, g, n, dtype=bf), k=rnd(b, r, g, n, dtype=bf), v=rnd(b, h, p, dtype=bf),
               adt=-torch.rand(b, h, device=dev, generator=gen), dt=torch.rand(b, h, device=dev, generator=gen),
               trap=torch.rand(b, h, device=dev, generator=gen), q_bias=rnd(h, r, n), k_bias=rnd(h, r, n),
               angles=rnd(b, h, a), D=rnd(h), z=rnd(b, h, p, dtype=bf))
    if r > 1:
        tok.update(mimo_v=rnd(h, r, p), mimo_z=rnd(h, r, p), mimo_o=rnd(h, r, p))
    base = None
    for name, bp, tile, w in CONFIGS:
        S.step_config = (NEW if name == "new" else
                         lambda *_, bp=bp, tile=tile, w=w: dict(BLOCK_P=bp, RANK_TILE=tile, num_warps=w))
        with torch.no_grad():
            try:
                y, s = mamba3_step(state, **tok)
                torch.cuda.synchronize()
                ms = triton.testing.do_bench_cudagraph(lambda: mamba3_step(state, **tok), rep=200)
            except Exception as e:
                print(b, h, r, name, "ERR", str(e)[:300], flush=True)
                continue
        if base is None:
            base = (y.float(), [t.clone() for t in s])
        dy = ((y.float() - base[0]).abs().max() / base[0].abs().max()).item()
        ds = max(((t - u).abs().max() / u.abs().max().clamp_min(1e-30)).item() for t, u in zip(s, base[1]))
        rec = dict(launch=name, config=S.step_config(b, h, p, r), batch=b, heads=h, r=r, us=1e3 * ms,
                   out_rel_diff=dy, state_rel_diff=ds, bit_equal_state=all(torch.equal(t, u) for t, u in zip(s, base[1])))
        out["results"].append(rec)
        print(json.dumps(rec), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
