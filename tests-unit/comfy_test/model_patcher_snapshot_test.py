"""Patch snapshots against ComfyUI's own patch path: a tiny MiniMax H3 model wrapped as ComfyUI wraps it, LoRAs through
comfy.lora and add_patches, and every merged weight compared bit for bit with rank 0's own patch_model()."""

import json

import pytest
import torch

from comfy.cli_args import args as cli_args

if not torch.cuda.is_available():
    cli_args.cpu = True

import comfy.hooks  # noqa: E402
import comfy.lora  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.supported_models  # noqa: E402
import comfy.weight_adapter  # noqa: E402
from comfy import model_patcher_snapshot as snapshots  # noqa: E402
from comfy.model_patcher_snapshot import PatchSnapshot, SnapshotRefused, UnsupportedPatchState  # noqa: E402

P = "diffusion_model."
TINY = dict(image_model="minimax_h3", hidden_size=16, num_layers=2, token_refiner_num_layers=1, num_attention_heads=2,
            attention_head_dim=8, ffn_hidden_size=32, latents_dim=2, audio_latents_dim=3, text_dim=5, timestep_input_dim=8,
            time_embed_hidden_size=16, time_embed_dim=8)
LINEARS = {"attn.qkv_proj": (48, 16), "attn.out_proj": (16, 16), "mlp.fc1": (64, 16), "mlp.fc2": (16, 32)}
CPU = torch.device("cpu")


def make_patcher(dtype=torch.float32, seed=0):
    config = comfy.supported_models.MiniMaxH3(dict(TINY))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    g = torch.Generator().manual_seed(seed)
    model.diffusion_model.load_state_dict({k: torch.randn(v.shape, generator=g) for k, v in model.diffusion_model.state_dict().items()})
    model.diffusion_model.to(dtype)
    model.requires_grad_(False)
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


def lora_files(seed=1):
    """A LoRA of every adapter family ComfyUI loads, and a second one on the attention linears, in on-disk key formats."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(s, generator=g) * 0.1).to(torch.bfloat16)
    main, turbo = {}, {}
    for i in range(2):
        for lin, (o, n) in LINEARS.items():
            k = f"{P}blocks.{i}.{lin}"
            main.update({f"{k}.lora_up.weight": r(o, 4), f"{k}.lora_down.weight": r(4, n), f"{k}.alpha": torch.tensor(2.0)})
            if lin.startswith("attn"):
                turbo.update({f"{k}.lora_B.weight": r(o, 2), f"{k}.lora_A.weight": r(2, n)})
    ref = f"{P}token_refiner.blocks.0"
    main.update({
        f"{P}blocks.1.mlp.fc1.dora_scale": r(64, 1).abs() + 1,
        f"{ref}.attn.qkv_proj.lora_B.weight": r(48, 2), f"{ref}.attn.qkv_proj.lora_A.weight": r(2, 16),
        f"{ref}.attn.out_proj.oft_blocks": r(4, 4, 4),
        f"{ref}.mlp.fc1.hada_w1_a": r(64, 2), f"{ref}.mlp.fc1.hada_w1_b": r(2, 16),
        f"{ref}.mlp.fc1.hada_w2_a": r(64, 2), f"{ref}.mlp.fc1.hada_w2_b": r(2, 16), f"{ref}.mlp.fc1.alpha": torch.tensor(2.0),
        f"{ref}.mlp.fc2.lokr_w1": r(4, 4), f"{ref}.mlp.fc2.lokr_w2": r(4, 8),
        f"{P}blocks.0.norm1.diff": r(16), f"{P}final_layer.video_out.diff_b": r(8), f"{P}blocks.1.norm2.set_weight": r(16),
    })
    return main, turbo


def load(patcher, lora):
    return comfy.lora.load_lora(lora, comfy.lora.model_lora_keys_unet(patcher.model, {}))


def hand_patches():
    """Patch forms no LoRA file gives, as add_patches calls: offsets into the fused qkv weight, the bare (tensor,) diff,
    a padding diff, strength_model != 1 and a negative strength."""
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(s, generator=g) * 0.1
    qkv0, qkv1 = f"{P}blocks.0.attn.qkv_proj.weight", f"{P}blocks.1.attn.qkv_proj.weight"
    return [({(qkv0, (0, 16, 16)): ("diff", (r(16, 16),))}, 0.5, 1.0),
            ({f"{P}blocks.1.attn.q_norm.weight": (r(8).half(),)}, 1.0, 1.0),
            ({f"{P}blocks.1.attn.k_norm.weight": ("diff", (r(10), {"pad_weight": True}))}, 1.0, 1.0),
            ({(qkv1, (0, 32, 16)): ("set", (r(16, 16).to(torch.bfloat16),))}, 1.0, 1.0),
            ({qkv1: ("diff", (r(48, 16),))}, -0.5, 0.75)]


def stack(base, main, turbo, strength=1.0, with_turbo=True):
    p = base.clone()
    p.add_patches(main, strength)
    if with_turbo:
        p.add_patches(turbo, 1.0, strength_model=0.9)
    for patches, strength_patch, strength_model in hand_patches():
        p.add_patches(patches, strength_patch, strength_model)
    return p


def merged(patcher):
    """The diffusion model's weights after ComfyUI's patch_model(); the model is unpatched again afterwards."""
    patcher.patch_model(device_to=CPU)
    out = {k: v.clone() for k, v in patcher.model.diffusion_model.state_dict().items()}
    patcher.unpatch_model(device_to=CPU)
    return out


def bits(t):
    return t.reshape(-1).view(torch.uint8)


def assert_bitwise(got, expected):
    assert got.keys() == expected.keys()
    bad = [k for k in expected if got[k].dtype != expected[k].dtype or got[k].shape != expected[k].shape
           or not torch.equal(bits(got[k]), bits(expected[k]))]
    assert not bad, f"{len(bad)} weights differ from ComfyUI's patch_model(): {bad[:4]}"


def weights(patcher):
    return {k: v.clone() for k, v in patcher.model.diffusion_model.state_dict().items()}


def send(update):
    """What a worker receives: the manifest through JSON, the tensors as tensors (copies, as a collective gives them)."""
    return snapshots.read(json.loads(json.dumps(update.manifest)), {n: t.clone() for n, t in update.tensors.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_worker_merges_bit_for_bit_as_comfyui(dtype):
    rank0, worker = make_patcher(dtype), make_patcher(dtype)
    main, turbo = (load(rank0, f) for f in lora_files())
    assert len(main) == 8 + 4 + 3  # the LoRA linears of 2 blocks, 4 refiner adapters, diff, diff_b, set
    patched = stack(rank0, main, turbo)
    expected = merged(patched)
    base_weights = weights(worker)
    assert any(not torch.equal(bits(expected[k]), bits(base_weights[k])) for k in expected)

    snap = PatchSnapshot.capture(patched)
    kinds = {next(iter(e[1])) for entries in snap.patches.values() for e in entries}
    assert kinds == {"lora", "loha", "lokr", "oft", "diff", "set"}
    got = send(snap).apply_to(PatchSnapshot.empty())
    assert got.version == snap.version
    clone = got.to_patcher(worker, snap.digest)
    assert worker.patches == {}
    assert_bitwise(merged(clone), expected)
    assert_bitwise(weights(worker), base_weights)


def test_load_models_gpu_merges_as_patch_model():
    rank0, worker = make_patcher(), make_patcher()
    main, turbo = (load(rank0, f) for f in lora_files())
    patched = stack(rank0, main, turbo)
    expected = merged(patched)
    snap = PatchSnapshot.capture(patched)
    clone = send(snap).to_patcher(worker, snap.digest)
    comfy.model_management.load_models_gpu([clone])
    try:
        assert_bitwise(weights(worker), expected)
    finally:
        comfy.model_management.unload_all_models()


def test_deltas_send_only_what_changed():
    rank0, worker = make_patcher(), make_patcher()
    main, turbo = (load(rank0, f) for f in lora_files())
    first = PatchSnapshot.capture(stack(rank0, main, turbo, with_turbo=False))
    held = send(first)

    # a strength change: numbers only
    weaker = stack(rank0, main, turbo, 0.5, with_turbo=False)
    second = PatchSnapshot.capture(weaker, previous=first)
    delta = second.diff(first)
    assert delta.tensors == {} and delta.removed == []
    assert sorted(delta.patches) == sorted(main)
    assert len(json.dumps(delta.manifest)) < len(json.dumps(first.manifest))
    held = send(delta).apply_to(held)
    assert held.version == second.version == (2, second.digest)
    assert_bitwise(merged(held.to_patcher(worker, second.digest)), merged(weaker))

    # a second LoRA: exactly its tensors
    both = stack(rank0, main, turbo, 0.5)
    third = PatchSnapshot.capture(both, previous=second)
    delta = third.diff(second)
    turbo_names = {snapshots.tensor_name(t) for v in turbo.values() for t in v.weights if isinstance(t, torch.Tensor)}
    assert set(delta.tensors) == turbo_names and sorted(delta.patches) == sorted(turbo)
    assert delta.describe()["tensor_bytes"] == sum(t.nbytes for v in turbo.values() for t in v.weights if isinstance(t, torch.Tensor))
    held = send(delta).apply_to(held)
    assert_bitwise(merged(held.to_patcher(worker, third.digest)), merged(both))

    # everything removed: key names only
    delta = PatchSnapshot.capture(rank0, previous=third).diff(third)
    assert delta.tensors == {} and delta.patches == {} and delta.removed == sorted(third.patches)
    held = send(delta).apply_to(held)
    assert held.patches == {} and held.lineage == 4
    assert_bitwise(merged(held.to_patcher(worker, held.digest)), weights(rank0))


def test_capture_hashes_each_tensor_once_and_lineage_follows_content(monkeypatch):
    rank0 = make_patcher()
    main, turbo = (load(rank0, f) for f in lora_files())
    patched = stack(rank0, main, turbo)
    hashed = []
    name = snapshots.tensor_name
    monkeypatch.setattr(snapshots, "tensor_name", lambda t: hashed.append(t) or name(t))
    first = PatchSnapshot.capture(patched)
    assert len(hashed) == len(first.tensors) > 0
    again = PatchSnapshot.capture(patched.clone(), previous=first)
    assert len(hashed) == len(first.tensors)
    assert again.version == first.version == (1, first.digest)
    assert PatchSnapshot.capture(stack(rank0, main, turbo, 0.5), previous=again).lineage == 2


def test_compute_dtype_and_outside_object_patches():
    rank0, worker = make_patcher(), make_patcher()
    patched = rank0.clone()
    patched.set_model_compute_dtype(torch.float16)
    patched.add_object_patch("model_sampling", rank0.get_model_object("model_sampling"))
    snap = PatchSnapshot.capture(patched)
    assert (snap.compute_dtype, snap.force_cast_weights, snap.patches) == ("float16", True, {})
    clone = send(snap).to_patcher(worker, snap.digest)
    assert (clone.get_model_object("manual_cast_dtype"), clone.force_cast_weights) == (torch.float16, True)
    assert (worker.get_model_object("manual_cast_dtype"), worker.force_cast_weights) == (None, False)


def test_capture_refuses_what_cannot_be_replicated_by_name():
    rank0 = make_patcher()
    main, _ = (load(rank0, f) for f in lora_files())
    fc2, qkv, norm = f"{P}blocks.0.mlp.fc2.weight", f"{P}blocks.0.attn.qkv_proj.weight", f"{P}blocks.0.norm1.weight"

    hooked = rank0.clone()
    hooked.add_hook_patches(comfy.hooks.WeightHook(), {fc2: ("diff", (torch.ones(16, 32),))})
    hooked.add_weight_wrapper(norm, lambda w: w)
    hooked.add_object_patch(f"{P}final_layer", torch.nn.Identity())
    with pytest.raises(ValueError, match=f"hook patch {fc2}, weight wrapper {norm}, object patch {P}final_layer"):
        PatchSnapshot.capture(hooked)

    bypass = rank0.clone()
    manager = comfy.weight_adapter.BypassInjectionManager()
    manager.add_adapter(fc2, main[fc2], strength=1.0)
    bypass.set_injections("bypass_lora", manager.create_injections(bypass.model))
    with pytest.raises(ValueError, match="injections bypass_lora"):
        PatchSnapshot.capture(bypass)

    class TweakedLoRA(comfy.weight_adapter.LoRAAdapter):
        pass

    other = make_patcher(seed=5)
    bad = rank0.clone()
    bad.add_patches({fc2: TweakedLoRA(set(), main[fc2].weights)})
    bad.add_patches({(qkv, (0, 0, 16), lambda w: w * 2): ("diff", (torch.ones(16, 16),))})
    bad.add_patches({f"{P}blocks.1.mlp.fc1.weight": ("model_as_lora", (torch.ones(64, 16),))})
    bad.add_patches({k: v for k, v in other.get_key_patches(P).items() if k == f"{P}blocks.1.mlp.fc2.weight"})
    bad.add_patches({f"{P}blocks.1.norm1.weight": ("set", (torch.ones(1, 16),))})
    bad.add_patches({f"{P}blocks.1.norm2.weight": ("diff", (torch.ones(8),))})
    with pytest.raises(UnsupportedPatchState) as e:
        PatchSnapshot.capture(bad)
    problems = dict(e.value.problems)
    assert sorted(problems) == sorted([fc2, qkv, f"{P}blocks.1.mlp.fc1.weight", f"{P}blocks.1.mlp.fc2.weight",
                                       f"{P}blocks.1.norm1.weight", f"{P}blocks.1.norm2.weight"])
    assert "TweakedLoRA" in problems[fc2] and "weight function" in problems[qkv]
    assert "'model_as_lora'" in problems[f"{P}blocks.1.mlp.fc1.weight"] and "merged model" in problems[f"{P}blocks.1.mlp.fc2.weight"]
    assert problems[f"{P}blocks.1.norm1.weight"] == "set of shape [1, 16] on a weight of shape [16]"
    assert problems[f"{P}blocks.1.norm2.weight"] == "diff of shape [8] on a weight of shape [16]"


def forged(update, edit):
    """``update``'s manifest changed by ``edit`` as a worker would receive it: a snapshot whose own digest is consistent."""
    manifest = json.loads(json.dumps(update.manifest))
    edit(manifest)
    return snapshots.read(manifest, dict(update.tensors))


def move_key(manifest, new):
    manifest["patches"][new] = manifest["patches"].pop(f"{P}blocks.1.mlp.fc1.weight")


@pytest.mark.parametrize("case, announced, match", [
    ("unknown key", "forged", f"patch of {P}blocks.7.mlp.fc1.weight refused: not a weight of this model"),
    ("key outside the model", "forged", "patch of first_stage_model.decoder.weight refused: not a weight of this model"),
    ("wrong-shape set", "forged", rf"patch of {P}blocks.1.norm2.weight refused: set of shape \[8\] on a weight of shape \[16\]"),
    ("strength changed, digest recomputed", "rank 0", "received patch state [0-9a-f]{12}, rank 0 announced [0-9a-f]{12}"),
    ("tensor changed in transit", "rank 0", f"tensor [0-9a-f]{{12}} of {P}blocks.0.mlp.fc2.weight does not match its content hash"),
    ("delta on another version", "rank 0", "the patch delta updates version 2/"),
])
def test_worker_refuses_a_bad_snapshot_before_any_write(case, announced, match):
    rank0, worker = make_patcher(), make_patcher()
    main, turbo = (load(rank0, f) for f in lora_files())
    good = stack(rank0, main, turbo)
    first = PatchSnapshot.capture(good)
    held = send(first)
    loaded = held.to_patcher(worker, first.digest)
    loaded.patch_model(device_to=CPU)
    in_effect = weights(worker)
    assert_bitwise(in_effect, merged(good))

    weaker = stack(rank0, main, turbo, 0.5)
    second = PatchSnapshot.capture(weaker, previous=first)
    fc2 = f"{P}blocks.0.mlp.fc2.weight"
    small = next(n for n, t in second.tensors.items() if list(t.shape) == [8])  # q_norm's diff
    with pytest.raises(SnapshotRefused, match=match):
        if case == "unknown key":
            update = forged(second, lambda m: move_key(m, f"{P}blocks.7.mlp.fc1.weight"))
        elif case == "key outside the model":
            update = forged(second, lambda m: move_key(m, "first_stage_model.decoder.weight"))
        elif case == "wrong-shape set":
            update = forged(second, lambda m: m["patches"].update({f"{P}blocks.1.norm2.weight": [[1.0, {"set": small}, 1.0, None]]}))
        elif case == "strength changed, digest recomputed":
            update = forged(second, lambda m: m["patches"][fc2][0].__setitem__(0, 0.25))
            assert update.digest != second.digest
        elif case == "tensor changed in transit":
            tensors = {n: t.clone() for n, t in second.tensors.items()}
            tensors[second.patches[fc2][0][1]["lora"][0]["tensor"]][0, 0] += 1
            update = snapshots.read(json.loads(json.dumps(second.manifest)), tensors)
        else:
            third = PatchSnapshot.capture(stack(rank0, main, turbo, 0.25), previous=second)
            update = send(third.diff(second))
        snap = update.apply_to(held)
        snap.to_patcher(worker, snap.digest if announced == "forged" else second.digest)
    assert worker.patches == {} and loaded.patches.keys() == first.patches.keys()
    assert_bitwise(weights(worker), in_effect)

    # the next good sync works
    loaded.unpatch_model(device_to=CPU)
    held = send(second.diff(first)).apply_to(held)
    assert_bitwise(merged(held.to_patcher(worker, second.digest)), merged(weaker))
