"""PatchSnapshot against the pinned ComfyUI (COMFYUI_DIR): a real ModelPatcher around a tiny H3 model.

Reference weights come from ``patcher.patch_model()``; a second, identically built model plays the
worker and receives the snapshot through ``encode``/``decode``. Every comparison is bit for bit over
the whole state dict, for float32, bfloat16 and float8_e4m3fn weights (the last one goes through
ComfyUI's seeded stochastic rounding).
"""


import types

import pytest
import torch

from comfy.model_patcher_snapshot import (PatchSnapshot, SnapshotApplier, UnsupportedPatchState, decode)

pytestmark = pytest.mark.comfyui

PREFIX = "diffusion_model."
TINY_H3 = dict(hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4, attention_head_dim=16,
               ffn_hidden_size=96, text_dim=32, timestep_input_dim=32, time_embed_hidden_size=64, time_embed_dim=32,
               rope_inv_freq_len=4)
LINEARS = {"attn.qkv_proj": (192, 64), "attn.out_proj": (64, 64), "mlp.fc1": (192, 64), "mlp.fc2": (64, 96)}
CPU = torch.device("cpu")


@pytest.fixture
def comfy(comfyui_models):
    import comfy.hooks
    import comfy.ldm.minimax.model
    import comfy.lora
    import comfy.model_patcher
    import comfy.ops
    import comfy.weight_adapter
    return comfy


class TinyH3Base(torch.nn.Module):
    """The parts of model_base.BaseModel that ModelPatcher and comfy.lora read."""

    def __init__(self, comfy, dtype, seed=0):
        super().__init__()
        self.diffusion_model = comfy.ldm.minimax.model.MiniMaxH3Model(**TINY_H3, dtype=dtype, operations=comfy.ops.disable_weight_init)
        self.model_config = types.SimpleNamespace(unet_config={})
        g = torch.Generator().manual_seed(seed)
        self.load_state_dict({k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in self.state_dict().items()})
        # as ComfyUI's loaders leave models; float8 stochastic rounding refuses tensors that require grad
        self.requires_grad_(False)


def _lora_files(full_family=True, seed=1):
    """Two LoRA state dicts in on-disk key formats: a main one and a 'turbo' one on the attention linears."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(s, generator=g).to(torch.bfloat16)
    main, turbo = {}, {}
    for i in range(2):
        for lin, (o, n) in LINEARS.items():
            k = f"{PREFIX}blocks.{i}.{lin}"
            main.update({f"{k}.lora_up.weight": r(o, 4), f"{k}.lora_down.weight": r(4, n), f"{k}.alpha": torch.tensor(2.0)})
            if lin.startswith("attn"):
                turbo.update({f"{k}.lora_B.weight": r(o, 8), f"{k}.lora_A.weight": r(8, n)})
    ref = f"{PREFIX}token_refiner.blocks.0"
    main.update({f"{ref}.attn.qkv_proj.lora_B.weight": r(192, 2), f"{ref}.attn.qkv_proj.lora_A.weight": r(2, 64),
                 f"{PREFIX}blocks.0.norm1.diff": r(64), f"{PREFIX}final_layer.video_out.diff_b": r(96),
                 f"{PREFIX}blocks.1.norm2.set_weight": r(64)})
    if full_family:
        main.update({
            f"{PREFIX}blocks.1.mlp.fc1.dora_scale": r(192, 1).abs(),
            f"{ref}.attn.out_proj.oft_blocks": r(4, 16, 16) * 0.1,
            f"{ref}.mlp.fc1.hada_w1_a": r(192, 2), f"{ref}.mlp.fc1.hada_w1_b": r(2, 64),
            f"{ref}.mlp.fc1.hada_w2_a": r(192, 2), f"{ref}.mlp.fc1.hada_w2_b": r(2, 64), f"{ref}.mlp.fc1.alpha": torch.tensor(2.0),
            f"{ref}.mlp.fc2.lokr_w1": r(4, 4), f"{ref}.mlp.fc2.lokr_w2": r(16, 24),
        })
    return main, turbo


def _load(comfy, base, lora_sd):
    return comfy.lora.load_lora(lora_sd, comfy.lora.model_lora_keys_unet(base, {}))


def _patched_state(patcher):
    """The diffusion model's weights after ``patch_model()``; leaves the model unpatched again."""
    patcher.patch_model(device_to=CPU)
    out = {k: v.clone() for k, v in patcher.model.diffusion_model.state_dict().items()}
    patcher.unpatch_model(device_to=CPU)
    return out


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def _assert_same_weights(model, expected):
    got = model.state_dict()
    assert set(got) == set(expected)
    bad = [k for k in expected if got[k].dtype != expected[k].dtype or not torch.equal(_bits(got[k]), _bits(expected[k]))]
    assert not bad, f"{len(bad)} weights differ from patch_model(): {bad[:5]}"


def _stack(patcher, loaded_main, loaded_turbo, main_strength, with_turbo=True):
    p = patcher.clone()
    p.add_patches(loaded_main, main_strength)
    if with_turbo:
        p.add_patches(loaded_turbo, 1.0, strength_model=0.9)
    # an offset into the fused qkv weight: the K rows only
    p.add_patches({(f"{PREFIX}blocks.0.attn.qkv_proj.weight", (0, 64, 64)): ("diff", (torch.full((64, 64), 0.01),))}, 0.5)
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_apply_matches_patch_model_through_strength_change_and_removal(comfy, dtype):
    base = TinyH3Base(comfy, dtype)
    base_sd = {k: v.clone() for k, v in base.diffusion_model.state_dict().items()}
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU)
    main, turbo = (_load(comfy, base, sd) for sd in _lora_files())
    assert {type(v).__name__ for v in main.values()} >= {"LoRAAdapter", "OFTAdapter", "LoHaAdapter", "LoKrAdapter", "tuple"}

    first = _stack(patcher, main, turbo, 0.8)
    ref = _patched_state(first)
    _assert_same_weights(base.diffusion_model, base_sd)
    patched = [k[len(PREFIX):] for k in first.patches]
    # every entry did change its weight, so a silently skipped adapter cannot pass as parity
    assert all(not torch.equal(_bits(ref[k]), _bits(base_sd[k])) for k in patched)

    worker = TinyH3Base(comfy, dtype).diffusion_model
    applier = SnapshotApplier(worker, PREFIX, arithmetic="comfyui")
    snap1 = PatchSnapshot.capture(first)
    applier.apply(decode(snap1.encode()))
    _assert_same_weights(worker, ref)

    second = _stack(patcher, main, turbo, 0.3)
    snap2 = PatchSnapshot.capture(second, previous=snap1)
    assert applier.apply(decode(snap2.diff(snap1).encode())) == sorted(first.patches)
    _assert_same_weights(worker, _patched_state(second))

    third = _stack(patcher, main, turbo, 0.3, with_turbo=False)
    snap3 = PatchSnapshot.capture(third, previous=snap2)
    turbo_keys = sorted(turbo)
    assert applier.apply(decode(snap3.diff(snap2).encode())) == turbo_keys
    _assert_same_weights(worker, _patched_state(third))

    cleared = PatchSnapshot.capture(patcher, previous=snap3)
    assert (cleared.lineage, cleared.key_count) == (4, 0)
    applier.apply(decode(cleared.diff(snap3).encode()))
    _assert_same_weights(worker, base_sd)
    assert applier.backup_bytes == 0

    if dtype == torch.float8_e4m3fn:
        # control: plain round-to-nearest is not what ComfyUI does for float8, and this test would see it
        from comfy.model_patcher_snapshot_merge import comfy_patches
        key = f"{PREFIX}blocks.0.mlp.fc2.weight"
        merged = comfy.lora.calculate_weight(comfy_patches(snap1.entries(key), snap1.tensors), base_sd[key[len(PREFIX):]].float(), key)
        assert not torch.equal(_bits(merged.to(dtype)), _bits(ref[key[len(PREFIX):]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_builtin_arithmetic_is_bit_identical_to_comfyui(comfy, dtype):
    base = TinyH3Base(comfy, dtype)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU)
    main, turbo = (_load(comfy, base, sd) for sd in _lora_files(full_family=False))
    stacked = _stack(patcher, main, turbo, 0.7)
    ref = _patched_state(stacked)
    worker = TinyH3Base(comfy, dtype).diffusion_model
    SnapshotApplier(worker, PREFIX, arithmetic="builtin").apply(decode(PatchSnapshot.capture(stacked).encode()))
    _assert_same_weights(worker, ref)


def test_real_patcher_state_is_captured_or_refused_by_name(comfy):
    base = TinyH3Base(comfy, torch.bfloat16)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU)
    main, _ = (_load(comfy, base, sd) for sd in _lora_files(full_family=False))

    flags = patcher.clone()
    flags.set_model_compute_dtype(torch.float16)
    flags.add_object_patch("model_sampling", object())
    snap = PatchSnapshot.capture(flags)
    assert (snap.object_patches, snap.force_cast_weights, snap.key_count) == ({"manual_cast_dtype": "float16"}, True, 0)

    class TweakedLoRA(comfy.weight_adapter.LoRAAdapter):
        pass

    lora_key, hook_key, wrapped = f"{PREFIX}blocks.0.mlp.fc2.weight", f"{PREFIX}blocks.1.mlp.fc2.weight", f"{PREFIX}blocks.0.norm1.weight"
    bad = patcher.clone()
    bad.add_patches({lora_key: TweakedLoRA(set(), main[lora_key].weights)})
    bad.add_hook_patches(comfy.hooks.WeightHook(), {hook_key: ("diff", (torch.ones(64, 96),))})
    bad.add_weight_wrapper(wrapped, lambda w: w)
    bad.add_object_patch("diffusion_model.final_layer", torch.nn.Identity())
    with pytest.raises(UnsupportedPatchState) as ei:
        PatchSnapshot.capture(bad)
    assert ei.value.keys == sorted([lora_key, hook_key, wrapped, "diffusion_model.final_layer"])
    assert "TweakedLoRA" in dict(ei.value.problems)[lora_key]

    # what comfy.sd.load_bypass_lora_for_models does (comfy.sd itself needs torchaudio to import)
    bypass = patcher.clone()
    manager = comfy.weight_adapter.BypassInjectionManager()
    manager.add_adapter(lora_key, main[lora_key], strength=1.0)
    bypass.set_injections("bypass_lora", manager.create_injections(bypass.model))
    with pytest.raises(UnsupportedPatchState, match=r"injections\[bypass_lora\]: patcher injection"):
        PatchSnapshot.capture(bypass)
