"""How long one H3 step takes on one GPU, ours vs upstream, and where its kernel time goes.

Both models hold the same random bf16 weights at real size (upstream's tensors are assigned into
ours, so 62 GiB fit once). Sections: native (ours cuDNN-first and fused adaLN, each undone once, vs
upstream, interleaved; output differences), profile (torch profiler of one step of each).

  COMFYUI_DIR=/path/to/ComfyUI python bench/h3_native.py --out bench/results/h3_h200.json [--sections native,profile]
"""

import time

import torch

from h3_gpu_common import cudnn_first_priority, inputs, cuda_time, main


def section_native(res_list, theirs, ours, out, save=lambda: None):
    import comfy.ops
    from torch.nn.attention import SDPBackend
    import comfy.ldm.minimax.model as upstream
    from comfy.ldm.minimax_h3.step_io import StepInputs
    from comfy.ldm.minimax_h3.layout import PackedLayout
    rows = out["native"] = {}
    for res in res_list:
        x, t, c = inputs(res)
        sig = (c.shape[1], x[0].shape[2], x[0].shape[3], x[0].shape[4], x[1].shape[-1])
        pt = {"layout": upstream.PackedLayout(*sig), "seed": 0}
        po = {"layout": PackedLayout(*sig), "seed": 0}
        from comfy.ldm.minimax_h3 import kernels
        stock = list(comfy.ops.SDPA_BACKEND_PRIORITY)  # ComfyUI's order without patch 0005 (flash first)
        cudnn_first = cudnn_first_priority()
        flash_first = [SDPBackend.FLASH_ATTENTION] + [b for b in cudnn_first if b != SDPBackend.FLASH_ATTENTION]

        def rel(a, b):
            return max(float((u.float() - v.float()).abs().max() / v.float().abs().max()) for u, v in zip(a, b))

        with torch.no_grad():
            comfy.ops.SDPA_BACKEND_PRIORITY = stock
            a = theirs._forward(x, t, c, {}, minimax_payload=pt)
            a2 = theirs._forward(x, t, c, {}, minimax_payload=pt)
            comfy.ops.SDPA_BACKEND_PRIORITY = flash_first
            b_flash = ours._forward(x, t, c, {}, minimax_payload=po)
            comfy.ops.SDPA_BACKEND_PRIORITY = cudnn_first
            b = ours._forward(x, t, c, {}, minimax_payload=po)
            result = {"tokens": PackedLayout(*sig).seq_len,
                      "rel_diff_upstream_run_to_run": rel(a2, a),
                      "rel_diff_ours_flash_vs_upstream": rel(b_flash, a),
                      "rel_diff_ours_cudnn_vs_upstream": rel(b, a),
                      "output_max_abs": max(float(u.float().abs().max()) for u in a)}
            del a, a2, b, b_flash
            runs = (("upstream", theirs, pt, stock), ("ours", ours, po, cudnn_first), ("ours_flash", ours, po, flash_first),
                    ("ours_unfused_adaln", ours, po, cudnn_first), ("upstream_2", theirs, pt, stock),
                    ("ours_2", ours, po, cudnn_first))
            fused = kernels.fused_adaln
            for name, model, p, prio in runs:
                comfy.ops.SDPA_BACKEND_PRIORITY = prio
                kernels.fused_adaln = (lambda x: False) if name == "ours_unfused_adaln" else fused
                torch.cuda.reset_peak_memory_stats()
                result[name] = cuda_time(lambda: model._forward(x, t, c, {}, minimax_payload=p))
                result[name]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            comfy.ops.SDPA_BACKEND_PRIORITY = cudnn_first
            kernels.fused_adaln = fused
            # the plan is pure CPU work done once per step on every rank
            plan_t = time.perf_counter()
            for _ in range(20):
                ours.plan(StepInputs(x[0], x[1], t, c, po, {}))
            result["plan_build_ms"] = (time.perf_counter() - plan_t) / 20 * 1000
        up = min(result["upstream"]["median_s"], result["upstream_2"]["median_s"])
        us = min(result["ours"]["median_s"], result["ours_2"]["median_s"])
        result["ratio_ours_over_upstream"] = us / up
        rows[res] = result
        result["ratio_ours_flash_over_upstream"] = result["ours_flash"]["median_s"] / up
        save()
        print(f"native {res}: S={result['tokens']} upstream {up:.3f}s ours {us:.3f}s ratio {us / up:.3f} "
              f"(flash-first {result['ours_flash']['median_s']:.3f}s, unfused adaLN {result['ours_unfused_adaln']['median_s']:.3f}s) peak {result['ours']['peak_gib']} GiB "
              f"rel diffs: run-to-run {result['rel_diff_upstream_run_to_run']:.2e} flash {result['rel_diff_ours_flash_vs_upstream']:.2e} "
              f"cudnn {result['rel_diff_ours_cudnn_vs_upstream']:.2e}", flush=True)


def section_profile(res, theirs, ours, out, top=25):
    from torch.profiler import ProfilerActivity, profile
    import comfy.ldm.minimax.model as upstream
    from comfy.ldm.minimax_h3.layout import PackedLayout
    x, t, c = inputs(res)
    sig = (c.shape[1], x[0].shape[2], x[0].shape[3], x[0].shape[4], x[1].shape[-1])
    prof_out = {}
    for name, model, p in (("upstream", theirs, {"layout": upstream.PackedLayout(*sig)}), ("ours", ours, {"layout": PackedLayout(*sig)})):
        with torch.no_grad():
            model._forward(x, t, c, {}, minimax_payload=p)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                model._forward(x, t, c, {}, minimax_payload=p)
                torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.self_device_time_total for e in prof.key_averages())
        prof_out[name] = {"total_device_ms": total / 1000,
                          "top": [{"name": e.key[:120], "device_ms": e.self_device_time_total / 1000, "count": e.count}
                                  for e in sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:top]]}
        del events
        print(f"profile {name}: total device {total / 1000:.1f} ms; top: " +
              "; ".join(f"{r['name'][:50]} {r['device_ms']:.1f}ms x{r['count']}" for r in prof_out[name]["top"][:8]), flush=True)
    out["profile"] = {"resolution": res, **prof_out}


SECTIONS = {
    "native": lambda run: section_native(run.resolutions, run.theirs, run.ours, run.out, run.save),
    "profile": lambda run: section_profile(run.resolutions[0], run.theirs, run.ours, run.out),
}

if __name__ == "__main__":
    main(__doc__, SECTIONS)
