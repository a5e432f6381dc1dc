"""PatchSnapshot without ComfyUI: capture, canonical encoding, tamper rejection, lineage, deltas, acks.

The patcher and adapters here are stand-ins with the attributes ComfyUI's expose; what the worker
does with a snapshot (``to_patcher`` and ComfyUI's own merge) is tested against the real
ModelPatcher in model_patcher_snapshot_overlay_test.py. Expected values come from the stand-in's
own tensors, the json and hashlib modules and hand-written numbers, never from the code under test.
"""

import hashlib
import json
import math
import struct
import uuid

import pytest
import torch

from comfy.cli_args import args

if not torch.cuda.is_available():
    args.cpu = True

from comfy.model_patcher_snapshot import codec, snapshot
from comfy.model_patcher_snapshot import (PatchSnapshot, SnapshotAck, SnapshotApplyError, SnapshotFormatError,
                                          SnapshotNotAcked, UnsupportedPatchState, decode, require_acks)

PREFIX = "diffusion_model."


@pytest.fixture(autouse=True)
def _as_without_comfyui(monkeypatch):
    """Run as a process without ComfyUI: once the overlay tests loaded comfy.weight_adapter, capture
    would (rightly) refuse the stand-in adapters below as not being ComfyUI's registered classes."""
    monkeypatch.setattr(snapshot, "_registered_adapters", lambda: None)


class Adapter:
    """Stand-in for a ComfyUI WeightAdapterBase: what capture reads is ``name`` and ``weights``."""

    def __init__(self, name, weights):
        self.name = name
        self.weights = weights
        self.loaded_keys = set()


class Patcher:
    """Stand-in for ModelPatcher with the same public attributes and add_patches semantics."""

    def __init__(self, model):
        self.model = model
        self.patches = {}
        self.patches_uuid = uuid.uuid4()
        self.object_patches = {}
        self.force_cast_weights = False
        self.hook_patches = {}
        self.weight_wrapper_patches = {}
        self.injections = {}

    def model_state_dict(self):
        return {PREFIX + k: v for k, v in self.model.state_dict().items()}

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        for k, v in patches.items():
            key, offset, function = (k, None, None) if isinstance(k, str) else (k[0], k[1], k[2] if len(k) > 2 else None)
            self.patches.setdefault(key, []).append((strength_patch, v, strength_model, offset, function))
        self.patches_uuid = uuid.uuid4()


def h3_linear_shapes(blocks=50, refiner=2, hidden=64, heads=4, head_dim=16, ffn=96):
    """The 4 linears of every H3 DiT block and token-refiner block: 50 * 4 + 2 * 4 = 208 weights."""
    inner = heads * head_dim
    per_block = {"attn.qkv_proj": (3 * inner, hidden), "attn.out_proj": (hidden, inner),
                 "mlp.fc1": (2 * ffn, hidden), "mlp.fc2": (hidden, ffn)}
    return {f"{stack}.{i}.{lin}.weight": shape
            for stack, n in (("blocks", blocks), ("token_refiner.blocks", refiner))
            for i in range(n) for lin, shape in per_block.items()}


def module_from_shapes(shapes, dtype, seed=0):
    root = torch.nn.Module()
    g = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype), requires_grad=False))
    return root


def h3_lora(shapes, rank=4, seed=1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return {PREFIX + k: Adapter("lora", (torch.randn(o, rank, generator=g).to(dtype), torch.randn(rank, i, generator=g).to(dtype),
                                         float(rank * 2), None, None, None))
            for k, (o, i) in shapes.items()}


def every_form_patcher(order=1):
    """One patcher holding every patch value form the schema carries; ``order`` reverses dict insertion."""
    shapes = {"a.weight": (12, 8), "b.weight": (8, 8), "c.weight": (12, 8), "d.bias": (12,)}
    model = module_from_shapes(shapes, torch.float32)
    g = torch.Generator().manual_seed(7)
    r = lambda *s, dt=torch.float32: torch.randn(s, generator=g).to(dt)
    w = PREFIX + "a.weight"
    patches = [  # (key or (key, offset), value, strength, strength_model)
        (w, Adapter("lora", (r(12, 2, dt=torch.bfloat16), r(2, 8, dt=torch.bfloat16), 1.0, None, None, None)), 0.75, 1.0),
        (w, Adapter("lora", (r(12, 2), r(2, 8), None, r(2, 2, 1, 1), r(12, 1), [12, 8])), 1.0, 0.5),
        (w, ("diff", (r(12, 8, dt=torch.float16),)), -0.25, 1.0),
        ((w, (0, 4, 4)), ("set", (r(4, 8),)), 1.0, 1.0),
        (PREFIX + "b.weight", Adapter("loha", (r(8, 2), r(2, 8), 2, r(8, 2), r(2, 8), None, None, None)), 1.0, 1.0),
        (PREFIX + "b.weight", Adapter("lokr", (r(2, 2), r(4, 4), 4.0, None, None, None, None, None, None)), 0.5, 1.0),
        (PREFIX + "c.weight", Adapter("glora", (r(2, 8), r(12, 2), r(2, 8), r(12, 2), 3.0, None)), 1.0, 1.0),
        (PREFIX + "c.weight", Adapter("oft", (r(3, 4, 4), r(12, 1, dt=torch.float8_e4m3fn), 1e-3, None)), 1.0, 1.0),
        (PREFIX + "c.weight", Adapter("boft", (r(2, 3, 4, 4), None, 0, None)), 1.0, 1.0),
        (PREFIX + "c.weight", ("diff", (r(16, 8), {"pad_weight": True})), 1.0, 1.0),
        (PREFIX + "d.bias", (r(12, dt=torch.float64),), 2.0, 1.0),
        (PREFIX + "d.bias", ("diff", (torch.zeros(0, 3),)), 0.0, 1.0),
        (PREFIX + "d.bias", Adapter("lora", (r(12, 1), r(1, 1), torch.tensor(0.5), None, None, None)), 1.0, 1.0),
    ]
    by_key = {}
    for k, v, s, sm in patches:
        by_key.setdefault(k if isinstance(k, str) else k[0], []).append(({k: v}, s, sm))
    p = Patcher(model)
    for key in list(by_key)[::order]:
        for d, s, sm in by_key[key]:
            p.add_patches(d, s, sm)
    p.object_patches = {"model_sampling": object(), "manual_cast_dtype": torch.bfloat16}
    p.force_cast_weights = True
    return p


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _raw_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _meta(t):
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": hashlib.sha256(_raw_bytes(t)).hexdigest()}


def _name(t):
    """A tensor's schema name as documented: sha256 of its canonical {dtype, shape, sha256} JSON."""
    return hashlib.sha256(json.dumps(_meta(t), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _slot_tensors(patcher):
    """{(key, entry, slot): the patcher's own tensor} (slot 0 for diff/set)."""
    out = {}
    for key, entries in patcher.patches.items():
        for i, (_, v, _, _, _) in enumerate(entries):
            if isinstance(v, Adapter):
                out.update({(key, i, j): w for j, w in enumerate(v.weights) if isinstance(w, torch.Tensor)})
            else:
                out[(key, i, 0)] = v[0] if len(v) == 1 else v[1][0]
    return out


def _source_tensors(patcher):
    """{schema tensor name: the patcher's own tensor}"""
    return {_name(t): t for t in _slot_tensors(patcher).values()}


def _repack(blob, edit):
    """Decode the framing, let ``edit`` change the manifest object, re-pack with a matching digest."""
    envelope, manifest_raw, payload = codec.unpack(blob)
    manifest = json.loads(manifest_raw)
    edit(manifest)
    raw = codec.canonical_json(manifest)
    return codec.pack({**envelope, "digest": hashlib.sha256(raw).hexdigest()}, raw, bytes(payload))


# ---------------------------------------------------------------------------------------------
# encoding


def test_round_trip_is_bit_exact_for_every_form():
    patcher = every_form_patcher()
    snap = PatchSnapshot.capture(patcher)
    blob = snap.encode()
    # the bytes, read with this test's own framing parser, json and hashlib: the envelope claims
    # lineage 1 and the sha256 of the manifest, which is canonical JSON committing to every tensor
    m0, m1 = _manifest_span(blob)
    raw = blob[m0:m1]
    digest = hashlib.sha256(raw).hexdigest()
    assert json.loads(blob[16:m0 - 8]) == {"digest": digest, "lineage": 1}
    manifest = json.loads(raw)
    assert raw == json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    source = _source_tensors(patcher)
    assert len(_slot_tensors(patcher)) == len(source) == 27 and sorted(manifest["tensors"]) == sorted(source)
    for name, t in source.items():
        assert manifest["tensors"][name] == _meta(t), name

    back = PatchSnapshot.decode(blob)
    assert back.version == snap.version == (1, digest)
    assert back.encode() == blob
    assert back.patches == manifest["patches"]
    assert sorted(back.tensors) == sorted(source)
    for name, t in source.items():
        assert _same_bits(back.tensors[name], t), name
    # the forms survive as the worker needs them: order, strengths, offsets, scalar types, flags
    a = back.entries(PREFIX + "a.weight")
    assert [(e["strength"], e["strength_model"], e["offset"]) for e in a] == \
        [(0.75, 1.0, None), (1.0, 0.5, None), (-0.25, 1.0, None), (1.0, 1.0, [0, 4, 4])]
    assert a[1]["value"]["weights"][2] is None and a[1]["value"]["weights"][5] == {"ints": [12, 8]}
    assert back.entries(PREFIX + "b.weight")[0]["value"]["weights"][2] == {"int": 2}
    pad_diff = _slot_tensors(patcher)[(PREFIX + "c.weight", 3, 0)]
    assert back.entries(PREFIX + "c.weight")[3]["value"] == {"type": "diff", "tensor": _name(pad_diff), "pad_weight": True}
    assert back.entries(PREFIX + "d.bias")[0]["value"]["type"] == "diff"
    assert back.object_patches == {"manual_cast_dtype": "bfloat16"} and back.force_cast_weights is True
    assert json.loads(json.dumps(back.describe()))["entries"] == {"lora": 3, "diff": 4, "set": 1, "loha": 1, "lokr": 1,
                                                                   "glora": 1, "oft": 1, "boft": 1}


def test_digest_ignores_dict_order():
    a = PatchSnapshot.capture(every_form_patcher(order=1))
    b = PatchSnapshot.capture(every_form_patcher(order=-1))
    assert list(every_form_patcher(order=1).patches) == list(every_form_patcher(order=-1).patches)[::-1]
    assert a.digest == b.digest and a.encode() == b.encode()


def _digest_in_child(rank, world):
    snap = PatchSnapshot.capture(every_form_patcher(order=1 if rank == 0 else -1))
    return {"digest": snap.digest, "blob_sha256": hashlib.sha256(snap.encode()).hexdigest()}


def test_digest_stable_across_processes(run_ranks):
    here = PatchSnapshot.capture(every_form_patcher())
    out = run_ranks(_digest_in_child, 2, process_group=False, timeout=120)
    assert [o["digest"] for o in out] == [here.digest] * 2
    assert [o["blob_sha256"] for o in out] == [hashlib.sha256(here.encode()).hexdigest()] * 2


def _flip(blob, pos):
    b = bytearray(blob)
    b[pos] ^= 0x01
    return bytes(b)


def _manifest_span(blob):
    (n_env,) = struct.unpack("<Q", blob[8:16])
    start = 16 + n_env + 8
    (n_man,) = struct.unpack("<Q", blob[16 + n_env:start])
    return start, start + n_man


def _first_name(manifest):
    return manifest["patches"][PREFIX + "a.weight"][0]["value"]["weights"][0]["tensor"]


def _rename_diff_tensor(manifest):
    """The diff on a.weight renamed consistently in patches and tensors: a name that is not its content's."""
    value = manifest["patches"][PREFIX + "a.weight"][2]["value"]
    manifest["tensors"]["0" * 64] = manifest["tensors"].pop(value["tensor"])
    value["tensor"] = "0" * 64


@pytest.mark.parametrize("case, match", [
    ("payload byte", "does not match its sha256"),
    ("manifest byte", "does not match the digest"),
    ("envelope digest", "does not match the digest"),
    ("magic", "not a patch snapshot"),
    ("truncated payload", "truncated or has trailing bytes"),
    ("truncated manifest", "truncated inside the manifest"),
    ("truncated header", "truncated before the envelope length"),
    ("trailing bytes", "truncated or has trailing bytes"),
    ("schema version", "schema version is 1, this ComfyUI reads version 2"),
    ("unknown field", "expected an object with the fields"),
    ("non-canonical json", "not in canonical form"),
    ("payload dtype", "safetensors header does not match"),
    ("manifest dtype", "expected the canonical tensor name '[0-9a-f]{64}' of its content"),
    ("tensor name", r"a tensor name \(64 lowercase hex digits\), found 'x'"),
    ("renamed tensor", "expected the canonical tensor name '[0-9a-f]{64}' of its content"),
    ("unknown adapter", "expected one of"),
    ("lineage", "envelope.lineage"),
    ("not bytes", "expected bytes"),
])
def test_decode_rejects(case, match):
    blob = PatchSnapshot.capture(every_form_patcher()).encode()
    m0, m1 = _manifest_span(blob)
    bad = {
        "payload byte": lambda: _flip(blob, len(blob) - 3),
        "manifest byte": lambda: _flip(blob, m0 + 40),
        "envelope digest": lambda: codec.pack({"digest": "0" * 64, "lineage": 1}, blob[m0:m1], blob[m1:]),
        "magic": lambda: b"PK\x03\x04" + blob[4:],
        "truncated payload": lambda: blob[:-5],
        "truncated manifest": lambda: blob[:m0 + 10],
        "truncated header": lambda: blob[:12],
        "trailing bytes": lambda: blob + b"\x00",
        "schema version": lambda: _repack(blob, lambda m: m.update(schema=1)),
        "unknown field": lambda: _repack(blob, lambda m: m.update(hooks=[])),
        "non-canonical json": lambda: codec.pack({"digest": hashlib.sha256(blob[m0:m1] + b" ").hexdigest(), "lineage": 1},
                                                 blob[m0:m1] + b" ", blob[m1:]),
        # same length: the header's JSON stays valid, its bytes differ from the ones the manifest implies
        "payload dtype": lambda: blob[:m1] + blob[m1:].replace(b'"BF16"', b'"F16" ', 1),
        # the name commits to the dtype
        "manifest dtype": lambda: _repack(blob, lambda m: m["tensors"][_first_name(m)].update(dtype="float16")),
        "tensor name": lambda: _repack(blob, lambda m: m["patches"][PREFIX + "a.weight"][2]["value"].update(tensor="x")),
        "renamed tensor": lambda: _repack(blob, _rename_diff_tensor),
        "unknown adapter": lambda: _repack(blob, lambda m: m["patches"][PREFIX + "b.weight"][0]["value"].update(adapter="ia3")),
        "lineage": lambda: codec.pack({"digest": hashlib.sha256(blob[m0:m1]).hexdigest(), "lineage": -1}, blob[m0:m1], blob[m1:]),
        "not bytes": lambda: blob.decode("latin-1"),
    }[case]()
    with pytest.raises(SnapshotFormatError, match=match):
        decode(bad)


def test_decode_respects_size_limit_and_kind():
    blob = PatchSnapshot.capture(every_form_patcher()).encode()
    with pytest.raises(SnapshotFormatError, match="over the limit"):
        decode(blob, max_bytes=len(blob) - 1)
    empty = PatchSnapshot.empty()
    delta = PatchSnapshot.capture(every_form_patcher()).diff(empty).encode()
    with pytest.raises(SnapshotFormatError, match="expected a full snapshot, got a delta"):
        PatchSnapshot.decode(delta)
    assert decode(empty.encode()).digest == empty.digest


# ---------------------------------------------------------------------------------------------
# lineage / delta


def _h3_setup(dtype=torch.bfloat16):
    shapes = h3_linear_shapes()
    model = module_from_shapes(shapes, dtype)
    patcher = Patcher(model)
    patcher.add_patches(h3_lora(shapes), 0.8)
    return shapes, model, patcher


def test_delta_carries_changed_keys_and_only_the_tensors_the_base_lacks():
    shapes, _, patcher = _h3_setup()
    assert len(shapes) == 208
    first = PatchSnapshot.capture(patcher)
    keys = sorted(patcher.patches)
    changed, removed, extended = keys[:3], keys[3], PREFIX + "blocks.7.mlp.fc2.weight"
    for k in changed:
        s, v, sm, off, fn = patcher.patches[k][0]
        patcher.patches[k] = [(0.3, v, sm, off, fn)]
    del patcher.patches[removed]
    patcher.add_patches({extended: ("diff", (torch.full(shapes["blocks.7.mlp.fc2.weight"], 0.5),))})
    second = PatchSnapshot.capture(patcher, previous=first)
    assert second.lineage == 2
    delta = second.diff(first)
    blob = delta.encode()
    assert sorted(delta.patches) == sorted(changed + [extended]) and delta.removed == [removed]
    # the strength changes send numbers only; the one new entry sends its fp32 (64, 96) diff
    assert sorted(delta.tensor_metas) == [_name(torch.full(shapes["blocks.7.mlp.fc2.weight"], 0.5))]
    assert delta.describe()["tensor_bytes"] == 64 * 96 * 4
    assert len(blob) < len(second.encode()) / 10

    back = decode(blob).apply_to(first)
    # the patcher as it is now, read independently of the delta: same digest, strengths, tensors
    assert back.version == (2, second.digest) and back.key_count == 207
    assert [back.entries(k)[0]["strength"] for k in changed] == [0.3] * 3 and removed not in back.keys()
    assert [e["strength"] for e in back.entries(extended)] == [0.8, 1.0]
    source = _source_tensors(patcher)
    assert sorted(back.tensors) == sorted(source)
    for name, t in source.items():
        assert _same_bits(back.tensors[name], t), name
    with pytest.raises(SnapshotApplyError, match="send the full snapshot"):
        decode(blob).apply_to(second)
    with pytest.raises(SnapshotApplyError, match="holds nothing applied; send the full snapshot"):
        decode(blob).apply_to(None)


def _slot_of(snap, key, i, j):
    v = snap.entries(key)[i]["value"]
    return snap.tensors[v["weights"][j]["tensor"] if v["type"] == "adapter" else v["tensor"]]


def test_removed_or_reordered_entries_send_no_tensor_bytes():
    shapes = h3_linear_shapes()
    model = module_from_shapes(shapes, torch.bfloat16)
    lora_a, lora_b, lora_c = (h3_lora(shapes, seed=s) for s in (1, 2, 3))
    factor_bytes = sum((o * 4 + 4 * i) * 2 for o, i in shapes.values())  # rank 4, bfloat16 up + down

    def stack(*loras):
        p = Patcher(model)
        for lora, strength in loras:
            p.add_patches(lora, strength)
        return p

    both = stack((lora_a, 0.8), (lora_b, 0.5))
    first = PatchSnapshot.capture(both)
    held = decode(first.encode())
    # the same LoRA twice on a chain: its factors are one content and travel once
    twice = PatchSnapshot.capture(stack((lora_a, 0.8), (lora_a, 0.3)))
    assert len(twice.tensors) == 416 and twice.describe()["tensor_bytes"] == factor_bytes
    cases = {"first entry removed": stack((lora_b, 0.5)), "entries swapped": stack((lora_b, 0.5), (lora_a, 0.8)),
             "a third LoRA added": stack((lora_a, 0.8), (lora_b, 0.5), (lora_c, 1.0))}
    for case, target in cases.items():
        snap = PatchSnapshot.capture(target, previous=first)
        delta = snap.diff(first)
        # every key's chain changed, so every key travels; of the tensors only the third LoRA's are new
        assert sorted(delta.patches) == sorted(target.patches) and delta.removed == [], case
        expected = factor_bytes if case == "a third LoRA added" else 0
        assert delta.describe()["tensor_bytes"] == expected and len(delta.tensors) == (416 if expected else 0), case
        back = decode(delta.encode()).apply_to(held)
        assert back.version == snap.version, case
        for (key, i, j), t in _slot_tensors(target).items():
            assert _same_bits(_slot_of(back, key, i, j), t), (case, key, i, j)
        assert [e["strength"] for e in back.entries(PREFIX + "blocks.0.mlp.fc1.weight")] == \
            [strength for strength, *_ in target.patches[PREFIX + "blocks.0.mlp.fc1.weight"]], case


def test_capture_lineage_follows_content():
    _, _, patcher = _h3_setup()
    a = PatchSnapshot.capture(patcher)
    assert PatchSnapshot.capture(patcher, previous=a).version == a.version
    # patches_uuid is the cache key, as for ComfyUI's own re-patching: same uuid, entries not re-read
    stash = patcher.patches
    patcher.patches = {}
    assert PatchSnapshot.capture(patcher, previous=a).version == a.version
    patcher.patches = stash
    patcher.object_patches["manual_cast_dtype"] = torch.float16
    b = PatchSnapshot.capture(patcher, previous=a)
    assert b.lineage == 2 and b.digest != a.digest and b.diff(a).patches == {}
    patcher.patches.clear()
    patcher.object_patches.clear()
    patcher.patches_uuid = uuid.uuid4()
    c = PatchSnapshot.capture(patcher, previous=b)
    assert (c.lineage, c.digest, c.key_count) == (3, PatchSnapshot.empty().digest, 0)


# ---------------------------------------------------------------------------------------------
# refusals


def test_every_unsupported_state_is_named():
    model = module_from_shapes({f"k{i}.weight": (4, 4) for i in range(11)}, torch.float32)
    p = Patcher(model)
    t = torch.ones(4, 4)

    class Quantized(torch.Tensor):
        pass

    p.add_patches({(PREFIX + "k0.weight", None, torch.relu): ("diff", (t,))})
    p.add_patches({PREFIX + "missing.weight": ("diff", (t,))})
    p.add_patches({PREFIX + "k1.weight": ("model_as_lora", (t,))})
    p.add_patches({PREFIX + "k2.weight": [(t, lambda a, **kw: a)]})
    p.add_patches({PREFIX + "k3.weight": Adapter("ia3", (t,))})
    p.add_patches({PREFIX + "k4.weight": ("diff", (t,))}, strength_patch=math.nan)
    p.add_patches({PREFIX + "k5.weight": ("diff", (t.as_subclass(Quantized),))})
    p.add_patches({PREFIX + "k6.weight": ("diff", (t.to(torch.int32),))})
    p.add_patches({PREFIX + "k7.weight": ("diff", (t, "pad"))})
    p.add_patches({PREFIX + "k9.weight": ("diff", (t,))})
    p.add_patches({PREFIX + "k10.weight": (t, t)})
    p.hook_patches = {object(): {PREFIX + "k8.weight": [(1.0, ("diff", (t,)), 1.0, None, None)]}}
    p.weight_wrapper_patches = {PREFIX + "k9.weight": [torch.relu]}
    p.injections = {"bypass_lora": [object()], "unused": []}
    p.object_patches = {"diffusion_model.blocks": torch.nn.Identity(), "model_sampling": object(), "manual_cast_dtype": torch.int8}
    with pytest.raises(UnsupportedPatchState) as ei:
        PatchSnapshot.capture(p)
    reasons = dict(ei.value.problems)
    expected = {
        PREFIX + "k0.weight": "custom function relu",
        PREFIX + "missing.weight": "the model has no such weight",
        PREFIX + "k1.weight": "'model_as_lora' needs the original weights",
        PREFIX + "k2.weight": "nested patch list",
        PREFIX + "k3.weight": "adapter 'ia3' is not one this schema carries",
        PREFIX + "k4.weight": "entry 0: strengths (nan, 1.0) are not finite Python numbers",
        PREFIX + "k5.weight": "tensor of type Quantized",
        PREFIX + "k6.weight": "dtype torch.int32",
        PREFIX + "k7.weight": "lack a bool 'pad_weight'",
        PREFIX + "k8.weight": "weight hook patch",
        PREFIX + "k9.weight": "weight wrapper function",
        PREFIX + "k10.weight": "pair whose first item is Tensor",
        "injections[bypass_lora]": "patcher injection",
        "diffusion_model.blocks": "object patch replaces Identity inside the diffusion model",
        "manual_cast_dtype": "compute dtype torch.int8",
    }
    assert ei.value.keys == sorted(expected)
    for key, why in expected.items():
        assert why in reasons[key], (key, reasons[key])
        assert key in str(ei.value)


# ---------------------------------------------------------------------------------------------
# acks


def test_acks_gate_on_every_rank_and_version():
    _, _, patcher = _h3_setup()
    snap = PatchSnapshot.capture(patcher)
    # what each rank sends once its ModelPatcher holds snap, through JSON
    sent = [SnapshotAck(r, snap.lineage, snap.digest, snap.key_count).to_json() for r in range(3)]
    assert sent[1] == {"rank": 1, "lineage": 1, "digest": snap.digest, "key_count": 208}
    acks = [SnapshotAck.from_json(json.loads(json.dumps(a))) for a in sent]
    assert acks[1] == SnapshotAck(1, 1, snap.digest, 208)
    require_acks(snap, acks, 3)
    with pytest.raises(SnapshotNotAcked, match="rank 2: no ack"):
        require_acks(snap, acks[:2], 3)
    stale = SnapshotAck(2, 0, PatchSnapshot.empty().digest, 0)
    with pytest.raises(SnapshotNotAcked, match="rank 2: acked version 0/"):
        require_acks(snap, acks[:2] + [stale], 3)
    with pytest.raises(SnapshotNotAcked, match="acked 207 patched keys"):
        require_acks(snap, acks[:2] + [SnapshotAck(2, snap.lineage, snap.digest, 207)], 3)
    with pytest.raises(SnapshotNotAcked, match=r"ranks \[3\] outside a world of 3"):
        require_acks(snap, acks + [SnapshotAck(3, snap.lineage, snap.digest, 208)], 3)
    for bad in ({"rank": 0}, {**acks[0].to_json(), "rank": True}, {**acks[0].to_json(), "digest": "abc"}):
        with pytest.raises(ValueError, match="snapshot ack"):
            SnapshotAck.from_json(bad)
