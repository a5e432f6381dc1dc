"""PatchSnapshot against the pinned ComfyUI (COMFYUI_DIR): real ModelPatchers around a tiny H3 model.

Rank 0 is a ModelPatcher holding patches as ComfyUI's LoRA loader and ``add_patches`` leave them; its
own ``patch_model()`` gives the reference weights. The worker is a second, identically built model
behind its own unpatched ModelPatcher: it receives the snapshot (or a delta) through
``encode``/``decode``, builds its patcher with ``snap.to_patcher(base)`` and ComfyUI's
``patch_model()`` (or ``load_models_gpu``) merges. Every comparison is bit for bit over the whole
state dict against ComfyUI's result, for float32, bfloat16 and float8_e4m3fn weights (the last one
goes through ComfyUI's seeded stochastic rounding).
"""

import hashlib
import json
import types

import pytest
import torch

from comfy.cli_args import args

if not torch.cuda.is_available():
    args.cpu = True

from comfy.model_patcher_snapshot import codec
from comfy.model_patcher_snapshot import (PatchSnapshot, SnapshotApplyError, SnapshotFormatError, UnsupportedPatchState,
                                          decode)

pytestmark = pytest.mark.comfyui

PREFIX = "diffusion_model."
TINY_H3 = dict(hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4, attention_head_dim=16,
               ffn_hidden_size=96, text_dim=32, timestep_input_dim=32, time_embed_hidden_size=64, time_embed_dim=32,
               rope_inv_freq_len=4)
LINEARS = {"attn.qkv_proj": (192, 64), "attn.out_proj": (64, 64), "mlp.fc1": (192, 64), "mlp.fc2": (64, 96)}
CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]


@pytest.fixture
def comfy(comfyui_models):
    import comfy.hooks
    import comfy.ldm.minimax.model
    import comfy.lora
    import comfy.model_management
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
        # what patch_model swaps object patches into (and back out of)
        self.manual_cast_dtype = None
        self.model_sampling = None
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


def _hand_patches(seed=3):
    """Patch forms no LoRA file produces, as (patches dict, strength, strength_model) add_patches calls;
    the same content on every call, so a snapshot of them does not change between captures."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, dt=torch.float32: torch.randn(s, generator=g).to(dt)
    qkv1 = f"{PREFIX}blocks.1.attn.qkv_proj.weight"
    return [
        # an offset into the fused qkv weight: the K rows only
        ({(f"{PREFIX}blocks.0.attn.qkv_proj.weight", (0, 64, 64)): ("diff", (torch.full((64, 64), 0.01),))}, 0.5, 1.0),
        # the bare (tensor,) diff form, in float16
        ({f"{PREFIX}blocks.1.attn.q_norm.weight": (r(16, dt=torch.float16),)}, 1.0, 1.0),
        # a diff larger than its weight with pad_weight: ComfyUI grows the weight to the diff's shape
        ({f"{PREFIX}blocks.1.attn.k_norm.weight": ("diff", (r(20), {"pad_weight": True}))}, 1.0, 1.0),
        # the V rows of a LoRA-patched weight replaced (set through an offset), after the LoRA in the chain
        ({(qkv1, (0, 128, 64)): ("set", (r(64, 64, dt=torch.bfloat16),))}, 1.0, 1.0),
        # negative strength and strength_model != 1 on the same chain
        ({qkv1: ("diff", (r(192, 64),))}, -0.5, 0.75),
    ]


def _stack(patcher, loaded_main, loaded_turbo, main_strength, with_turbo=True):
    p = patcher.clone()
    p.add_patches(loaded_main, main_strength)
    if with_turbo:
        p.add_patches(loaded_turbo, 1.0, strength_model=0.9)
    for patches, strength, strength_model in _hand_patches():
        p.add_patches(patches, strength, strength_model)
    return p


def _patched_state(patcher):
    """The diffusion model's weights after ComfyUI's ``patch_model()``; leaves the model unpatched again."""
    patcher.patch_model(device_to=CPU)
    out = {k: v.clone() for k, v in patcher.model.diffusion_model.state_dict().items()}
    patcher.unpatch_model(device_to=CPU)
    return out


def _name(t):
    """A tensor's schema name: sha256 of its canonical {dtype, shape, sha256} JSON (hashlib and json only)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    meta = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": hashlib.sha256(raw).hexdigest()}
    return hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def _differing(got, expected):
    assert set(got) == set(expected)
    return [k for k in expected if got[k].dtype != expected[k].dtype or got[k].shape != expected[k].shape
            or not torch.equal(_bits(got[k]), _bits(expected[k]))]


def _assert_same_weights(got, expected):
    bad = _differing(got, expected)
    assert not bad, f"{len(bad)} weights differ from ComfyUI's patch_model(): {bad[:5]}"


class Setup:
    """Rank 0's ModelPatcher with the LoRAs loaded, and a worker: an identical model behind an unpatched ModelPatcher."""

    def __init__(self, comfy, dtype, full_family=True):
        self.base = TinyH3Base(comfy, dtype)
        self.base_sd = {k: v.clone() for k, v in self.base.diffusion_model.state_dict().items()}
        self.patcher = comfy.model_patcher.ModelPatcher(self.base, load_device=CPU, offload_device=CPU)
        self.main, self.turbo = (_load(comfy, self.base, sd) for sd in _lora_files(full_family))
        self.worker_model = TinyH3Base(comfy, dtype)
        self.worker = comfy.model_patcher.ModelPatcher(self.worker_model, load_device=CPU, offload_device=CPU)

    def stack(self, main_strength, with_turbo=True):
        return _stack(self.patcher, self.main, self.turbo, main_strength, with_turbo)

    def worker_state(self, snap):
        """What the worker's weights are once ComfyUI merged ``snap`` (the worker's base is left unpatched)."""
        out = _patched_state(snap.to_patcher(self.worker))
        assert self.worker.patches == {}, "to_patcher changed the base ModelPatcher's patches"
        _assert_same_weights(self.worker_model.diffusion_model.state_dict(), self.base_sd)
        return out


# ---------------------------------------------------------------------------------------------
# to_patcher parity with ComfyUI


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_patcher_merges_bit_identical_to_the_original_patch_model(comfy, dtype):
    s = Setup(comfy, dtype)
    assert {type(v).__name__ for v in s.main.values()} >= {"LoRAAdapter", "OFTAdapter", "LoHaAdapter", "LoKrAdapter", "tuple"}
    first = s.stack(0.8)
    ref = _patched_state(first)
    _assert_same_weights(s.base.diffusion_model.state_dict(), s.base_sd)
    patched = [k[len(PREFIX):] for k in first.patches]
    # every key did change its weight, so a silently skipped entry cannot pass as parity
    assert not set(patched) - set(_differing(ref, s.base_sd))
    assert ref["blocks.1.attn.k_norm.weight"].shape == (20,)  # pad_weight reached ComfyUI

    snap = PatchSnapshot.capture(first)
    # the chains survive as ComfyUI holds them: per key, the same (strength, strength_model, offset) in order
    for key, entries in first.patches.items():
        assert [(e["strength"], e["strength_model"], e["offset"]) for e in snap.entries(key)] == \
            [(sp, sm, list(off) if off is not None else None) for sp, _, sm, off, _ in entries], key
    # in this process, straight from the capture
    _assert_same_weights(s.worker_state(snap), ref)
    # on the worker: after the bytes went through encode/decode
    worker_snap = decode(snap.encode())
    assert worker_snap.digest == snap.digest
    _assert_same_weights(s.worker_state(worker_snap), ref)
    # the rebuilt patcher holds ComfyUI's own adapter classes and patch tuples, key for key
    rebuilt = worker_snap.to_patcher(s.worker)
    assert sorted(rebuilt.patches) == sorted(first.patches)
    for key, entries in first.patches.items():
        assert [(type(e[1]).__name__, e[0], e[2], e[3]) for e in rebuilt.patches[key]] == \
            [(type(e[1]).__name__, e[0], e[2], e[3]) for e in entries], key


@pytest.mark.parametrize("dtype", DTYPES)
def test_deltas_rebuild_comfyui_weights_through_strength_change_and_removal(comfy, dtype):
    s = Setup(comfy, dtype)
    first, second, third = s.stack(0.8), s.stack(0.3), s.stack(0.3, with_turbo=False)
    refs = [_patched_state(p) for p in (first, second, third)]
    main_keys = sorted(k[len(PREFIX):] for k in s.main)
    # each step changes the weights it touches (a set ignores strength): a delta that kept the old state would be caught
    assert set(_differing(refs[1], refs[0])) >= set(main_keys) - {"blocks.1.norm2.weight"}
    assert set(_differing(refs[2], refs[1])) == {k[len(PREFIX):] for k in s.turbo}

    snap1 = PatchSnapshot.capture(first)
    held = decode(snap1.encode())
    _assert_same_weights(s.worker_state(held), refs[0])

    # (b) a strength change: no tensor bytes travel, the delta rebuilds the digest capture gives
    snap2 = PatchSnapshot.capture(second, previous=snap1)
    delta = snap2.diff(snap1)
    assert delta.describe()["tensor_bytes"] == 0 and delta.tensors == {}
    assert sorted(delta.patches) == sorted(s.main) and delta.removed == []
    blob = delta.encode()
    assert len(blob) < 64 * 1024 < len(snap1.encode())
    update = decode(blob)
    assert update.kind == "delta" and update.describe()["tensor_bytes"] == 0
    held = update.apply_to(held)
    assert held.version == snap2.version == (2, snap2.digest)
    _assert_same_weights(s.worker_state(held), refs[1])

    # a LoRA removed: its keys' chains shrink, and the hand patches behind turbo on the two qkv weights
    # move to a lower entry index. Tensors are named by content: none travels again
    snap3 = PatchSnapshot.capture(third, previous=snap2)
    delta = snap3.diff(snap2)
    assert sorted(delta.patches) == sorted(s.turbo) and delta.removed == []
    assert delta.tensors == {} and delta.describe()["tensor_bytes"] == 0
    held = decode(delta.encode()).apply_to(held)
    assert held.digest == snap3.digest
    _assert_same_weights(s.worker_state(held), refs[2])

    # everything removed: the worker is back on the base weights
    cleared = PatchSnapshot.capture(s.patcher, previous=snap3)
    assert (cleared.lineage, cleared.key_count) == (4, 0)
    delta = cleared.diff(snap3)
    assert delta.removed == sorted(third.patches) and delta.patches == {}
    held = decode(delta.encode()).apply_to(held)
    assert held.digest == cleared.digest
    _assert_same_weights(s.worker_state(held), s.base_sd)


def test_load_models_gpu_on_the_worker_merges_as_patch_model(comfy):
    """The worker's own path: ComfyUI's load_models_gpu of the to_patcher clone."""
    s = Setup(comfy, torch.bfloat16)
    first = s.stack(0.8)
    ref = _patched_state(first)
    worker = decode(PatchSnapshot.capture(first).encode()).to_patcher(s.worker)
    try:
        comfy.model_management.load_models_gpu([worker])
        _assert_same_weights(worker.model.diffusion_model.state_dict(), ref)
    finally:
        comfy.model_management.unload_all_models()
    _assert_same_weights(s.worker_model.diffusion_model.state_dict(), s.base_sd)


@pytest.mark.parametrize("case", ["float16 compute", "compute dtype reset", "no flags"])
def test_to_patcher_carries_compute_dtype_and_force_cast(comfy, case):
    s = Setup(comfy, torch.bfloat16, full_family=False)
    original = s.stack(0.6)
    if case != "no flags":
        original.set_model_compute_dtype(torch.float16)
    if case == "compute dtype reset":
        original.set_model_compute_dtype(None)  # ComfyUI leaves force_cast_weights on
    original.add_object_patch("model_sampling", object())  # acts on rank 0 only; not carried
    carried = {k: v for k, v in original.object_patches.items() if k != "model_sampling"}
    rebuilt = decode(PatchSnapshot.capture(original).encode()).to_patcher(s.worker)
    assert rebuilt.object_patches == carried
    assert rebuilt.force_cast_weights is original.force_cast_weights is (case != "no flags")
    assert "manual_cast_dtype" not in s.worker.object_patches and s.worker.force_cast_weights is False
    ref = _patched_state(original)
    _assert_same_weights(_patched_state(rebuilt), ref)


# ---------------------------------------------------------------------------------------------
# deltas that do not fit


def _retensor(blob, drop=(), add=None):
    """Re-pack a delta with tensors dropped from / added to its manifest and payload (digest kept valid)."""
    envelope, manifest_raw, payload = codec.unpack(blob)
    manifest = json.loads(manifest_raw)
    tensors = codec.read_payload(payload, manifest["tensors"])
    for name in drop:
        del tensors[name], manifest["tensors"][name]
    for name, t in (add or {}).items():
        tensors[name] = t
        manifest["tensors"][name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                     "sha256": hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()}
    raw = codec.canonical_json(manifest)
    return codec.pack({**envelope, "digest": hashlib.sha256(raw).hexdigest()}, raw, codec.write_payload(tensors, manifest["tensors"]))


def _lora_then_turbo(comfy):
    """(setup, snapshot with the main LoRA, its decoded copy, delta blob adding the turbo LoRA)."""
    s = Setup(comfy, torch.float32, full_family=False)
    one = s.patcher.clone()
    one.add_patches(s.main, 0.8)
    two = one.clone()
    two.add_patches(s.turbo, 1.0, strength_model=0.9)
    snap1 = PatchSnapshot.capture(one)
    snap2 = PatchSnapshot.capture(two, previous=snap1)
    return s, two, snap1, decode(snap1.encode()), snap2, snap2.diff(snap1).encode()


def test_delta_missing_a_referenced_tensor_is_refused_by_apply(comfy):
    s, two, snap1, held, snap2, blob = _lora_then_turbo(comfy)
    delta = decode(blob)
    # the turbo entries are new: their factors travel, and only theirs
    assert sorted(delta.tensor_metas) == sorted(_name(s.turbo[k].weights[j]) for k in s.turbo for j in (0, 1))
    # control: the delta as sent rebuilds what ComfyUI merges
    _assert_same_weights(s.worker_state(delta.apply_to(held)), _patched_state(two))

    name = _name(s.turbo[f"{PREFIX}blocks.0.attn.qkv_proj.weight"].weights[0])
    assert name not in held.tensors
    broken = decode(_retensor(blob, drop=[name]))  # a subset is valid for a delta: the base may hold the rest
    with pytest.raises(SnapshotApplyError, match=r"references tensors that neither it nor version 1/.*blocks\.0\.attn\.qkv_proj"):
        broken.apply_to(held)


@pytest.mark.parametrize("extra", ["tensor of an unchanged key", "name of no patch"])
def test_delta_carrying_an_unreferenced_tensor_is_refused_by_decode(comfy, extra):
    s, _, snap1, held, snap2, blob = _lora_then_turbo(comfy)
    if extra == "tensor of an unchanged key":
        t = s.main[f"{PREFIX}blocks.0.mlp.fc1.weight"].weights[0]
        assert _name(t) in snap1.tensors and f"{PREFIX}blocks.0.mlp.fc1.weight" not in decode(blob).patches
    else:
        t = torch.ones(3, dtype=torch.bfloat16)
    name = _name(t)
    with pytest.raises(SnapshotFormatError, match=r"expected a subset of the \d+ tensors the patches reference"):
        decode(_retensor(blob, add={name: t}))


# ---------------------------------------------------------------------------------------------
# refusals


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
