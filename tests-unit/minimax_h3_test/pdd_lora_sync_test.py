"""Issue 19 item 2, LoRA side: a PDD LoRA sets the output layers to a bank of another shape; the patch
snapshot carries those "set" patches and the sequence-parallel workers apply them through ComfyUI's
patch path, so every rank runs the same heads.

The model comes from ComfyUI's loader (a safetensors file with the newer-upstream harness's seeded
weights), the LoRA through ComfyUI's LoRA loader; with the bank applied the outputs must equal the newer
upstream's stored PDD reference, natively and on 2 ranks. The pinned base cannot resize a weight with a
"set" patch: ``newer_lora`` stands in for the newer comfy/lora.py on rank 0 and in every worker.
"""

import importlib

import pytest
import torch
from safetensors.torch import save_file

import upstream_newer as un
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("linux_workers")]
HEADS = un.PDD_HEADS
BANK_KEYS = [f"final_layer.{s}_out.{p}" for s in ("video", "audio") for p in ("weight", "bias")]


@pytest.fixture
def newer_lora():
    import newer_lora
    newer_lora.install()
    try:
        yield newer_lora
    finally:
        newer_lora.uninstall()


@pytest.fixture
def pdd_files(comfyui_patched, tmp_path):
    """(model file, PDD LoRA state dict): the harness's plain tiny model and its 16-head bank."""
    _, plain = un.build_model(un.ours(), {})
    _, bank = un.build_model(un.ours(), {"pdd_heads": HEADS})
    path = str(tmp_path / "h3_tiny.safetensors")
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in plain.items()}, path)
    lora = {}
    for key in BANK_KEYS:
        layer, param = key.rsplit(".", 1)
        lora[f"diffusion_model.{layer}.set_{param}"] = bank[key]
    return path, lora


def _step(model, name, options=None):
    x, timestep, context, payload, kwargs, opts = un.case_inputs(name)
    return model(x, timestep, context, dict(opts, **(options or {})), minimax_payload=payload, **kwargs)


def test_a_pdd_lora_reaches_every_rank_through_comfyuis_patch_path(pdd_files, newer_lora):
    import comfy.model_management
    import comfy.sd
    from comfy.ldm.minimax_h3.sequence_parallel import SequenceParallel
    from comfy.parallel import Timeouts, headless
    tensors, _ = un.load_reference()
    path, lora = pdd_files
    base = comfy.sd.load_diffusion_model(path)
    model = base.model.diffusion_model
    assert model.dtype in (None, torch.float32)
    sp = SequenceParallel(["cpu"] * 2, headless.loader_call(base), headless.execution_settings(),
                          timeouts=Timeouts(startup=120, op=60, cancel=10))
    sp.spec["imports"].append(newer_lora.__name__)  # the workers' ComfyUI gets the same comfy/lora.py
    try:
        sp.ensure_started(base)
        patched = comfy.sd.load_lora_for_models(base, None, lora, 1.0, 0)[0]
        assert {k: v[0][1][0] for k, v in patched.patches.items()} == {"diffusion_model." + k: "set" for k in BANK_KEYS}
        for run, strength in ((0, 1.0), (1, 0.5)):
            if run:  # a strength change: a "set" ignores strength, the delta carries numbers only
                patched = comfy.sd.load_lora_for_models(base, None, lora, strength, 0)[0]
            comfy.model_management.load_models_gpu([patched])
            sp.prepare(patched)
            assert model.final_layer.video_out.weight.shape == (HEADS * 96, un.TINY["hidden_size"])
            if run:
                assert sp.last_sent["kind"] == "delta" and sp.last_sent["tensor_bytes"] == 0
            # the preflight compares every rank's plan digest: it names the bank size and the heads picked
            for name in ("pdd_mid", "pdd_last"):
                sharded, native = _step(model, name, {SEQUENCE_PARALLEL_OPTION: sp}), _step(model, name)
                for i, stream in enumerate(("video", "audio")):
                    un.assert_matches(native[i], tensors[f"{name}.{stream}"], name)
                    un.assert_matches(sharded[i], tensors[f"{name}.{stream}"], name)
        # the LoRA removed: every rank is back on the plain heads
        comfy.model_management.load_models_gpu([base])
        sp.prepare(base)
        assert sp.last_sent["kind"] == "delta" and sp.last_sent["removed"] == len(BANK_KEYS)
        assert model.final_layer.video_out.weight.shape == (96, un.TINY["hidden_size"])
        sharded, native = _step(model, "pdd_mid", {SEQUENCE_PARALLEL_OPTION: sp}), _step(model, "pdd_mid")
        for s, n, banked in zip(sharded, native, ("pdd_mid.video", "pdd_mid.audio")):
            assert (s - n).abs().max() <= 1e-5 * n.abs().max()
            assert not torch.allclose(n, tensors[banked], atol=1e-3)
    finally:
        sp.close()
        importlib.import_module("comfy.model_management").unload_all_models()


def test_a_comfyui_that_cannot_resize_weights_refuses_the_bank_before_sending(pdd_files):
    # the pinned base's comfy/lora.py: its patch path would fail on every worker and break the group, so the
    # snapshot capture (the first thing prepare() does) refuses, naming each bank key and the fix
    import comfy.sd
    from comfy import model_patcher_snapshot as snapshots
    path, lora = pdd_files
    base = comfy.sd.load_diffusion_model(path)
    patched = comfy.sd.load_lora_for_models(base, None, lora, 1.0, 0)[0]  # this loader reads set_weight only
    with pytest.raises(snapshots.UnsupportedPatchState, match=r"set of shape \[1536, 64\] on a weight of shape \[96, 64\]: "
                                                             r"this ComfyUI's comfy.lora.calculate_weight cannot change") as e:
        snapshots.PatchSnapshot.capture(patched)
    assert e.value.keys == ["diffusion_model.final_layer.audio_out.weight", "diffusion_model.final_layer.video_out.weight"]
    # a "set" of the weight's own shape stays a plain set
    same = base.clone()
    same.add_patches({"diffusion_model.final_layer.video_out.weight": ("set", (torch.zeros(96, 64),))})
    assert snapshots.PatchSnapshot.capture(same).describe()["entries"] == {"set": 1}
