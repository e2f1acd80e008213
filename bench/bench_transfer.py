"""Gradient transfer and the engine on one device: the GPU half of the streamer and engine benchmarks.

    python bench/bench_transfer.py [--device cuda:0] [--params-m 50] [--rounds 10] [--batch 64 1024] [--out table.md]
                                   [--trace-dir D] [--grad-dtype float32 bfloat16]

Three measurements, interleaved per round, medians reported (``--device cpu`` runs the same code on CPU workers,
which is how the script itself is checked on machines without a GPU):

1. D2H bandwidth: the streamer's bucket copies (all buckets launched on its copy stream, then waited for) vs one raw
   copy of the same bytes into pinned memory (``pinned.copy_(src, non_blocking=True)``, a cudaMemcpyAsync).
   Target: >= 90 % of the raw pinned bandwidth.
2. Overlap: backward alone, the bucket copies alone, and backward with the streamer's hooks launching the copies,
   with its defaults (large gradients copied as soon as they are ready) and with whole-bucket copies only
   (``eager_mb=None``, the ``bucketed_*`` columns: the A/B of Note [Early copies of large gradients]).
   Target: streamed step <= 1.1 x max(backward, copy). Two readings, both reported: the step with its forward
   (``step_over_max``; "backward" then also holds zero_grad and the forward, which no copy can overlap: where the
   copy dominates, ``step_over_floor`` divides by max(forward + backward, forward + copy) instead), and backward
   with its copies alone, the forward run untimed before (``bwd_step_over_max`` = ``streamed_bwd_ms`` over
   max(``bwd_ms``, ``copy_ms``)).
   With ``--grad-dtype bfloat16`` the store's gradient slots are bfloat16 (``HostStore(grad_dtype=...)``): the copy
   converts on the device and moves half the bytes (the raw copy moves the same half). Measured on the H100
   (2026-11-26, RESULTS.md): copy_ms 2.3 ms at 0.79-0.82 of the raw copy (fp32: 0.96-0.98), the conversion kernels
   then ran on the copy stream between the copies. Prediction for the conversions on a stream of their own (Note
   [Gradients converted on a stream of their own], csrc/cuda/cuda_transfer.cpp): bfloat16 bandwidth_ratio 0.92-0.97
   (copy_ms 1.95-2.05: the copy engine waits only for the first bucket's conversions), step_over_floor at batch 64
   1.23 -> <= 1.10 and 1.02-1.07 at 256 and 1024; the float32 rows unchanged (no conversion, the same path).
3. Engine: hybrid with 4 workers on the one device vs plain single-replica training (torch.optim.AdamW, fused when
   the device is CUDA) on the same global batch: samples/s, the engine's overlap efficiency and its phases.
4. The trip back of a bfloat16 model's weights (``weights_back``): its replica refreshed from the fp32 master vs from
   the store's bfloat16 shadow (Note [The shadow follows the master weights], pyengine/store.py), and what writing
   the shadow adds to the update. Predictions in RESULTS.md (2026-11-26, later): speedup 1.4-1.8x on the 2-vCPU CPU
   VM, 1.8-2.0x on an H100 (half the bytes over PCIe); update_cost 1.04-1.10.

``--parts`` picks the measurements (default: all).

With ``--trace-dir D``, one streamed step and one hybrid step more run under ``torch.profiler`` (CUDA activity:
kernels and memcpys on every stream, as an Nsight timeline shows them): Chrome traces
``D/streamed_trace_<grads>.json`` (the first batch of each gradient dtype), ``D/hybrid_trace.json`` and the engine's
own phase trace ``D/hybrid_phases.json``, and a table of the streamed steps' copy timelines: when the first gradient
copy starts after backward's first kernel, how long the copy engine sits idle while backward still runs, and how
long copies go on after backward's last kernel.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pyengine  # noqa: E402

WIDTH = 2048


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def mlp(params_m: float) -> torch.nn.Module:
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _union(spans):
    """Total length of the union of (start, end) spans."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def copy_timeline(kernels, copies) -> dict:
    """The copy timeline of one streamed step from its device activity: ``kernels`` and ``copies`` (D2H memcpys) as
    (start, end) spans in microseconds on one clock."""
    if not kernels or not copies:
        return {"kernels": len(kernels), "copies": len(copies)}
    k0, k1 = min(s for s, _ in kernels), max(e for _, e in kernels)
    c0, c1 = min(s for s, _ in copies), max(e for _, e in copies)
    window = [(max(s, c0), min(e, k1)) for s, e in copies if min(e, k1) > max(s, c0)]
    return {"kernels": len(kernels), "copies": len(copies), "backward_ms": (k1 - k0) / 1e3,
            "copy_busy_ms": _union(copies) / 1e3, "first_copy_after_ms": (c0 - k0) / 1e3,
            "copy_idle_in_backward_ms": (max(0.0, k1 - c0) - _union(window)) / 1e3,
            "copies_after_backward_ms": max(0.0, c1 - k1) / 1e3, "step_ms": (max(k1, c1) - k0) / 1e3}


def profiled(fn, path):
    """Runs ``fn`` once under torch.profiler (CPU and, when available, CUDA activity), writes the Chrome trace to
    ``path`` and returns the (start, end) spans of the device kernels and of the D2H memcpys (empty without CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
    prof.export_chrome_trace(path)
    kernels, copies = [], []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end)
        if "Memcpy DtoH" in event.name:
            copies.append(span)
        elif "Memcpy" not in event.name and "Memset" not in event.name:
            kernels.append(span)
    return kernels, copies


def transfer_and_overlap(device, params_m, rounds, trace_dir=None, batch=64,
                         grad_dtype=torch.float32) -> tuple[dict, dict | None]:
    model = mlp(params_m).to(device)
    x = torch.randn(batch, WIDTH, device=device)
    store = pyengine.HostStore(model, workers=1, pin="auto", grad_dtype=grad_dtype)
    nbytes = store.numel * grad_dtype.itemsize
    src = torch.randn(store.numel, device=device).to(grad_dtype)
    raw_dst = torch.empty(store.numel, dtype=grad_dtype, pin_memory=device.type == "cuda")

    def forward():  # what of a step comes before the first gradient exists: no copy can start earlier
        model.zero_grad(set_to_none=False)
        model(x).square().mean()

    def backward():
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    backward()  # gradients exist: the copy-alone timing reads them
    with pyengine.GradientStreamer(model, store, worker=0) as streamer:
        buckets = streamer.buckets
    named = dict(model.named_parameters())
    transfer = pyengine._C.BucketTransfer(len(buckets), str(device), "bench")
    slot = store.grad_slot(0)
    entries = [[store.entry(n) for n in b.names] for b in buckets]
    jobs = [([named[e.name].grad for e in bucket], [slot[e.offset:e.offset + e.numel] for e in bucket])
            for bucket in entries]

    def raw():
        raw_dst.copy_(src, non_blocking=True)

    def copy_all():
        for k, (srcs, dsts) in enumerate(jobs):
            transfer.launch(0, k, srcs, dsts)
        transfer.wait_all(0, False)

    def after_forward(fn):  # backward alone (with its copies, under a streamer): the forward runs untimed first
        model.zero_grad(set_to_none=False)
        loss = model(x).square().mean()
        return timed(lambda: fn(loss), device)

    def delivered(streamer):
        streamer.wait_all()
        for k in range(len(streamer.buckets)):
            streamer._transfer.release(0, k)  # consumed: the next wait is for the next backward

    def streamed(streamer):
        backward()
        delivered(streamer)

    times = {"raw": [], "copy": [], "forward": [], "backward": [], "streamed": [], "bucketed": [], "bwd": [],
             "streamed_bwd": []}
    variants = [("streamed", {}), ("bucketed", {"eager_mb": None})]
    for r in range(rounds + 1):  # the first round warms up; hooks only in the streamed timings
        times["raw"].append(timed(raw, device))
        times["copy"].append(timed(copy_all, device))
        times["forward"].append(timed(forward, device))
        times["backward"].append(timed(backward, device))
        times["bwd"].append(after_forward(lambda loss: loss.backward()))
        for key, options in variants[r % 2:] + variants[:r % 2]:  # the order alternates
            with pyengine.GradientStreamer(model, store, worker=0, **options) as streamer:
                # A fresh streamer's first step creates its CUDA events (at::cuda::CUDAEvent makes its event at the
                # first record); training runs in the steady state after it, so one untimed step first (before
                # this, the timed step was each streamer's first: the H100 numbers of 2026-11-23 in RESULTS.md)
                streamed(streamer)
                times[key].append(timed(lambda: streamed(streamer), device))
                if key == "streamed":
                    times["streamed_bwd"].append(after_forward(lambda loss: (loss.backward(), delivered(streamer))))
    timeline = None
    if trace_dir:  # once, after the timed rounds: backward and its copies alone under the profiler (the forward
        # runs before it, so the timeline's first kernel is backward's)
        with pyengine.GradientStreamer(model, store, worker=0) as streamer:
            streamed(streamer)  # warm: the traced step below is like the timed ones
            model.zero_grad(set_to_none=False)
            loss = model(x).square().mean()
            sync(device)  # the forward's kernels end before the trace begins
            spans = profiled(lambda: timed(lambda: (loss.backward(), delivered(streamer)), device),
                             os.path.join(trace_dir, f"streamed_trace_{str(grad_dtype).split('.')[-1]}.json"))
        timeline = copy_timeline(*spans)
    transfer.close()
    for name, view in store.views(slot).items():  # the last streamed step's slot holds exactly the gradients
        assert torch.equal(view, named[name].grad.to(grad_dtype).cpu()), name
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    best = max(med["backward"], med["copy"])
    # No schedule beats max(forward + backward, forward + copy): the copies wait for gradients, which wait for the
    # forward. Where the copy dominates, step_over_max > 1.1 is this floor, not a lack of overlap.
    floor = max(med["backward"], med["forward"] + med["copy"])
    return {"params": store.numel, "buckets": len(jobs), "pinned": store.pinned,
            "raw_GBps": nbytes / med["raw"] / 1e9, "streamer_GBps": nbytes / med["copy"] / 1e9,
            "bandwidth_ratio": med["raw"] / med["copy"], "backward_ms": 1e3 * med["backward"],
            "copy_ms": 1e3 * med["copy"], "forward_ms": 1e3 * med["forward"], "streamed_ms": 1e3 * med["streamed"],
            "step_over_max": med["streamed"] / best, "step_over_floor": med["streamed"] / floor,
            "bwd_ms": 1e3 * med["bwd"], "streamed_bwd_ms": 1e3 * med["streamed_bwd"],
            "bwd_step_over_max": med["streamed_bwd"] / max(med["bwd"], med["copy"]),
            "bucketed_ms": 1e3 * med["bucketed"], "bucketed_over_max": med["bucketed"] / best,
            "eager_speedup": paired(times["bucketed"][1:], times["streamed"][1:])}, timeline


def weights_back(device, params_m, rounds, dtype=torch.bfloat16) -> dict:
    """The trip back of a low-precision model's weights: a ``dtype`` replica refreshed from the fp32 master (each
    copy converts, and moves 4 bytes an element) vs from the store's ``dtype`` shadow (2 bytes, no conversion), the
    copy back of every bucket and its wait timed; and what the shadow costs the update (G = 1, fp32 gradients,
    ``param_out=store.shadow`` or not), timed on the host. Interleaved per round, medians; ``speedup`` and
    ``update_cost`` are medians of the rounds' paired ratios."""
    model = mlp(params_m).to(device=device, dtype=dtype)
    store = pyengine.HostStore(model, workers=1, pin="auto", shadow_dtype=dtype)
    streamer = pyengine.GradientStreamer(model, store, worker=0)
    grad = torch.randn(store.numel).mul_(1e-3)
    hyper = dict(lr=1e-3, weight_decay=0.01)
    buckets = range(len(streamer.buckets))

    def back(source):
        streamer.copy_back(source=source)
        for k in buckets:
            streamer.wait_weights(k)

    def update(step, shadow):
        pyengine.ops.mean_grad_adamw_(store.param, store.exp_avg, store.exp_avg_sq, [grad], step=step,
                                      param_out=store.shadow if shadow else None, **hyper)

    times = {k: [] for k in ("fp32_source", "shadow_source", "update", "update_shadow")}
    try:
        for step in range(1, rounds + 2):  # the first round warms up (page faults, threads), not counted
            got = {"fp32_source": timed(lambda: back(store.param), device),
                   "shadow_source": timed(lambda: back(store.shadow), device),
                   "update": timed(lambda: update(2 * step - 1, False), torch.device("cpu")),
                   "update_shadow": timed(lambda: update(2 * step, True), torch.device("cpu"))}
            for k, v in got.items():
                if step > 1:
                    times[k].append(v)
        back(store.shadow)  # the replica holds the shadow's bits once copied from it
        sync(device)
        with torch.no_grad():
            bits = all(torch.equal(p.detach().cpu().view(-1), store.shadow[e.offset:e.offset + e.numel])
                       for e, p in zip(store.layout, reversed(list(model.parameters()))))
    finally:
        streamer.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"dtype": str(dtype).replace("torch.", ""), "params_m": store.numel / 1e6,
            "fp32_source_ms": 1e3 * med["fp32_source"], "shadow_source_ms": 1e3 * med["shadow_source"],
            "speedup": paired(times["fp32_source"], times["shadow_source"]),
            "update_ms": 1e3 * med["update"], "update_shadow_ms": 1e3 * med["update_shadow"],
            "update_cost": paired(times["update_shadow"], times["update"]), "replica_is_shadow": bits}


def engine_shadow_ab(device, rounds, workers=2, width=2048, batch=8) -> dict:
    """Measurement 4, end to end: hybrid steps of a bfloat16 model (3 x Linear(width, width)) with the store's shadow
    (the engine's default for such a model) and without (``replica_shadow_dtype`` patched to None for that engine's
    construction), two engines stepping in turn, the first 3 rounds dropped; medians and the median paired ratio."""
    from pyengine import engine as engine_mod

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)]).to(torch.bfloat16)

    def loss_fn(model, b):
        return model(b[0]).float().square().mean()

    data = (torch.randn(batch, width).to(torch.bfloat16),)
    real, engines = engine_mod.replica_shadow_dtype, {}
    try:
        for name, choose in (("shadow", real), ("fp32", lambda model: None)):
            engine_mod.replica_shadow_dtype = choose
            engines[name] = pyengine.Engine(make(), loss_fn, devices=[str(device)] * workers,
                                            optimizer=pyengine.AdamW(lr=1e-4))
            assert (engines[name].store.shadow is not None) == (name == "shadow")
    finally:
        engine_mod.replica_shadow_dtype = real
    times = {name: [] for name in engines}
    phases = {name: [] for name in engines}
    try:
        for _ in range(rounds + 3):
            for name, eng in engines.items():
                start = time.perf_counter()
                metrics = eng.step(data)
                sync(device)
                times[name].append(time.perf_counter() - start)
                phases[name].append(metrics["update_s"])
    finally:
        for eng in engines.values():
            eng.close()
    med = {k: 1e3 * statistics.median(v[3:]) for k, v in times.items()}
    return {"workers": workers, "step_ms_fp32_source": med["fp32"], "step_ms_shadow": med["shadow"],
            "step_speedup": paired(times["fp32"][3:], times["shadow"][3:]),
            "update_phase_ms_fp32_source": 1e3 * statistics.median(phases["fp32"][3:]),
            "update_phase_ms_shadow": 1e3 * statistics.median(phases["shadow"][3:])}


def paired(before, after) -> float:
    """Median of the rounds' before/after time ratios (> 1: after is faster)."""
    return statistics.median(b / a for b, a in zip(before, after))


def engine_vs_single(device, rounds, workers=4, trace_dir=None) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    batch = (torch.randn(256, 512), torch.randint(0, 10, (256,)))

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    single = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(single.parameters(), lr=1e-3, fused=device.type == "cuda")
    on_device = tuple(t.to(device) for t in batch)

    def single_step():
        opt.zero_grad(set_to_none=True)
        loss_fn(single, on_device).backward()
        opt.step()

    with pyengine.Engine(model, loss_fn, devices=[str(device)] * workers, optimizer=pyengine.AdamW(lr=1e-3)) as eng:
        first = eng.step(batch)["loss"]
        for _ in range(3):
            eng.step(batch)
        assert eng.step(batch)["loss"] < first, "the engine does not train: not timed"
        single_step()
        t_single, t_engine, overlap = [], [], []
        phases = {k: [] for k in ("compute_s", "transfer_wait_s", "update_s", "copy_back_s")}
        for _ in range(rounds):
            t_single.append(timed(single_step, device))
            start = time.perf_counter()
            metrics = eng.step(batch)
            sync(device)
            t_engine.append(time.perf_counter() - start)
            overlap.append(metrics["overlap_efficiency"])
            for k, v in phases.items():
                v.append(metrics[k])
        if trace_dir:
            profiled(lambda: (eng.step(batch), sync(device)), os.path.join(trace_dir, "hybrid_trace.json"))
            eng.trace(os.path.join(trace_dir, "hybrid_phases.json"))
    n = batch[0].shape[0]
    return {"workers": workers, "single_samples_per_s": n / statistics.median(t_single),
            "hybrid_samples_per_s": n / statistics.median(t_engine),
            "hybrid_over_single": statistics.median(t_single) / statistics.median(t_engine),
            "overlap_efficiency": statistics.median(overlap), "step_ms": 1e3 * statistics.median(t_engine),
            **{k.replace("_s", "_ms"): 1e3 * statistics.median(v) for k, v in phases.items()}}


def engine_rows(device, rounds, trace_dir, host_threads) -> list[dict]:
    """engine_vs_single with every intra-op thread (traced), then once for each of ``host_threads`` (GPU workers
    only: with CPU workers the engine divides the threads among them itself). Why: on the H100 machine's 16 cores
    the hybrid step's host phases (norm, update) varied 2-7x from step to step with 16 threads beside 4 worker
    threads (RESULTS.md, 2026-11-26); libgomp's team spins after each region."""
    default = torch.get_num_threads()
    rows = [{"host_threads": default, **engine_vs_single(device, rounds, trace_dir=trace_dir)}]
    for n in host_threads or []:
        if device.type != "cuda" or n == default:
            continue
        torch.set_num_threads(n)
        try:
            rows.append({"host_threads": n, **engine_vs_single(device, rounds)})
        finally:
            torch.set_num_threads(default)
    return rows


def table(title, *rows) -> str:
    keys = list(dict.fromkeys(k for row in rows for k in row))  # every row's columns, in order of appearance
    lines = [f"### {title}\n", f"| {' | '.join(keys)} |", f"|{'---|' * len(keys)}"]
    for row in rows:
        cells = (f"{row[k]:.3f}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k in keys)
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params-m", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 1024],
                        help="batch sizes of the overlap measurement: 64 makes it copy-bound, 1024 compute-bound "
                        "on an H100 (one row each; the traces are of the first)")
    parser.add_argument("--grad-dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"],
                        help="the store's gradient slot dtypes to measure (one row per dtype and batch)")
    parser.add_argument("--host-threads", type=int, nargs="+", default=None,
                        help="GPU workers: also run the hybrid comparison with the host's ops on this many intra-op "
                             "threads (torch.set_num_threads), one row each after the default's")
    parser.add_argument("--out", default=None, help="also write the markdown tables here")
    parser.add_argument("--parts", nargs="+", default=["overlap", "weights_back", "engine"],
                        choices=["overlap", "weights_back", "engine"],
                        help="which measurements to run: 1-2 (overlap), 4 (weights_back), 3 (engine)")
    parser.add_argument("--trace-dir", default=None, help="write profiler traces of one streamed and one hybrid step "
                        "here, and the streamed step's copy timeline to the tables")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    text = f"device: {name}, torch {torch.__version__}\n\n"
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    rows, timelines = [], []
    for dtype in args.grad_dtype if "overlap" in args.parts else []:
        for batch in args.batch:
            first = batch == args.batch[0]  # traced: the first batch of each gradient dtype
            row, spans = transfer_and_overlap(device, args.params_m, args.rounds, args.trace_dir if first else None,
                                              batch, getattr(torch, dtype))
            rows.append({"grads": dtype, "batch": batch, **row})
            if spans is not None:
                timelines.append({"grads": dtype, "batch": batch, **spans})
    if rows:
        text += table("D2H bandwidth and backward overlap (target: ratio >= 0.9, step <= 1.1 x max(backward, copy): "
                      "step_over_max with the forward, bwd_step_over_max without; step_over_floor: over "
                      "max(forward + backward, forward + copy))", *rows) + "\n"
    if timelines:
        text += table("copy timeline of one streamed step (device activity, torch.profiler)", *timelines) + "\n"
    if "weights_back" in args.parts:
        text += table("a bfloat16 model's weights back to its replica: from the fp32 master vs from the store's "
                      "shadow (speedup), and what the shadow adds to the update (update_cost)",
                      weights_back(device, args.params_m, args.rounds)) + "\n"
        text += table("hybrid steps of a bfloat16 model with and without the shadow (step_speedup: paired)",
                      engine_shadow_ab(device, args.rounds)) + "\n"
    if "engine" in args.parts:
        text += table("hybrid, 4 workers on one device, vs single-replica torch.optim.AdamW",
                      *engine_rows(device, args.rounds, args.trace_dir, args.host_threads))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
