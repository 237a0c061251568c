"""Probe (H100, 2026-11-23; tried, reverted): _ce_cols_fused_kernel against the three passes, in isolation over
configs (`kernels`) and through the op against torch.compile (`ab ROUNDS [CONFIG]`). Writes $OUT/fused_*.json."""
import json, os, sys, time, statistics
import torch, triton
from triton.testing import do_bench
from torch._library.triton import set_wrap_triton_enabled
from torch_flash.kernels.triton import cross_entropy as K
from torch_flash.reference.cross_entropy import LossOptions

OUT = os.environ["OUT"]
part = sys.argv[1]
V = 128256
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
torch.manual_seed(0)
opts = LossOptions(-100, 0.0, 0.0, 0.0)
kw = K._loss_kwargs(opts, "mean")


real_rp, last = K._resident_programs, {}


def rp(kernel, per_sm, device):
    n = real_rp(kernel, per_sm, device)
    last.update(n_progs=n, regs=kernel.n_regs, spills=kernel.n_spills, shared=kernel.metadata.shared)
    return n


K._resident_programs = rp


def case(name):
    if name == "chunk1024":
        rows = 1024
        shards = [((torch.randn(V, rows, device="cuda") * 2).bfloat16(), 0, None)]
    else:
        rows, head = 5120, 100960
        shards = [((torch.randn(head, rows, device="cuda") * 2).bfloat16(), 0, None),
                  ((torch.randn(V - head, rows, device="cuda") * 2).bfloat16(), head, None)]
    t = torch.randint(0, V, (rows,), device="cuda")
    return shards, t


def run(shards, t, cfg):
    nv = K._n_valid(t, -100)
    if cfg is None:
        return K._passes_chunk_losses(shards, t, nv, V, kw, True, None)
    return K._fused_chunk_losses(shards, t, nv, V, kw, None, config=cfg)


def save():
    with open(f"{OUT}/fused_{part}.json", "w") as f:
        json.dump(res, f, indent=1)


if part == "kernels":
    configs = [(g, bv, w, ps) for g in (16, 32, 64) for bv in (128, 256, 512) for w in (4, 8) for ps in (1, 2, 4)]
    with set_wrap_triton_enabled(False):
        for name in ("chunk1024", "resident5120"):
            shards, t = case(name)
            # correctness: fused default vs passes vs float64
            a = [(x.clone(), v, b) for x, v, b in shards]
            b_ = [(x.clone(), v, b) for x, v, b in shards]
            lp = run(a, t, None)
            lf = run(b_, t, K.LCE_COLS_FUSED)
            x64 = torch.cat([x for x, _, _ in shards]).t()
            lse_err = []
            for r0 in range(0, t.shape[0], 1024):
                z = x64[r0:r0 + 1024].double()
                ref = z.logsumexp(1) - z.gather(1, t[r0:r0 + 1024, None])[:, 0]
                lse_err.append(((lf[r0:r0 + 1024].double() - ref).abs().max() / ref.abs().max()).item())
            gp = torch.cat([x for x, _, _ in a]).float()
            gf = torch.cat([x for x, _, _ in b_]).float()
            del a, b_, x64
            res[name] = {"loss_fused_vs_passes": (lf - lp).abs().max().item(), "loss_rel_err_fp64": max(lse_err),
                         "grad_maxdiff": (gf - gp).abs().max().item(), "grad_max": gp.abs().max().item(),
                         "grad_neq_frac": (gf != gp).float().mean().item(), "times": []}
            del gp, gf
            print(name, {k: v for k, v in res[name].items() if k != "times"}, flush=True)
            base = []
            for i, cfg in enumerate([None] + configs):
                if i % 9 == 0:
                    base.append(do_bench(lambda: run(shards, t, None), warmup=10, rep=60, return_mode="median"))
                if cfg is None:
                    continue
                t0 = time.time()
                try:
                    run(shards, t, cfg)
                    torch.cuda.synchronize()
                    ms = do_bench(lambda: run(shards, t, cfg), warmup=10, rep=60, return_mode="median")
                    err = None
                except Exception as e:
                    ms, err = None, repr(e)[:200]
                res[name]["times"].append({"cfg": cfg, "ms": ms, "err": err, **last})
                print(name, cfg, ms, err, last, f"{time.time() - t0:.1f}s", flush=True)
                save()
            base.append(do_bench(lambda: run(shards, t, None), warmup=10, rep=60, return_mode="median"))
            res[name]["passes_ms"] = base
            ok = [r for r in res[name]["times"] if r["ms"]]
            best = min(ok, key=lambda r: r["ms"])
            print(name, "passes", base, "best", best, flush=True)
            del shards
            torch.cuda.empty_cache()
            save()
else:
    from torch_flash.bench._common import compile_fresh, time_rounds, peak_memory, median_or_none
    from torch_flash.bench.cross_entropy import with_grad
    from torch_flash.bench.linear_cross_entropy import _eager, _inputs
    from torch_flash.ops.linear_cross_entropy import linear_cross_entropy as op
    rounds = int(sys.argv[2])
    cfg = tuple(int(v) for v in sys.argv[3].split(",")) if len(sys.argv) > 3 else None
    if cfg:
        K.LCE_COLS_FUSED = cfg
    real = K._fused_chunk_losses
    passes = lambda shards, t, n_valid, n_classes, kw_, block: K._passes_chunk_losses(shards, t, n_valid, n_classes, kw_, True, block)

    def with_passes(fn):
        def call():
            K._fused_chunk_losses = passes
            try:
                return fn()
            finally:
                K._fused_chunk_losses = real
        return call

    h, w, t = _inputs(8192, 4096, V, "cuda")
    compiled = compile_fresh(_eager)
    fns = {"fused": with_grad(op, h, w, t), "passes": with_passes(with_grad(op, h, w, t)),
           "compile": with_grad(compiled, h, w, t)}
    with set_wrap_triton_enabled(False):
        # errors against fp32
        hh, ww = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        lref = torch.nn.functional.cross_entropy(hh @ ww.t(), t)
        dh_ref, dw_ref = torch.autograd.grad(lref, [hh, ww])
        del hh, ww
        errs = {}
        for k in ("fused", "passes"):
            hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
            f = op if k == "fused" else None
            if k == "fused":
                loss = op(hl, wl, t)
                dh, dw = torch.autograd.grad(loss, [hl, wl])
            else:
                K._fused_chunk_losses = passes
                loss = op(hl, wl, t)
                dh, dw = torch.autograd.grad(loss, [hl, wl])
                K._fused_chunk_losses = real
            rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
            errs[k] = {"loss": abs(loss.item() - lref.item()) / abs(lref.item()), "dh": rel(dh, dh_ref), "dw": rel(dw, dw_ref)}
            del dh, dw
        del dh_ref, dw_ref
        torch.cuda.empty_cache()
        res["errors_vs_fp32"] = errs
        print(errs, flush=True)
        times = time_rounds(fns, rounds=rounds)
        peaks = {k: peak_memory(f) / 2**20 for k, f in fns.items()}
    res["config"] = K.LCE_COLS_FUSED
    res["times_ms"] = times
    res["median_ms"] = {k: median_or_none(v) for k, v in times.items()}
    res["peak_mib"] = peaks
    for a, b in (("passes", "fused"), ("compile", "fused"), ("compile", "passes")):
        r = [x / y for x, y in zip(times[a], times[b])]
        res[f"{a}/{b}"] = {"median": statistics.median(r), "faster_rounds": sum(v > 1 for v in r), "of": len(r)}
    print(json.dumps({k: v for k, v in res.items() if k != "times_ms"}, indent=1), flush=True)
    save()
