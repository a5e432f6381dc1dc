"""comfy.ldm.minimax.model stays a drop-in for upstream's module after H3 moves to comfy.ldm.minimax_h3.

The patch series replaces upstream's comfy/ldm/minimax/model.py with a re-export of this package
(kept in this repository as patches/overlay/comfy/ldm/minimax/model.py, so that it never shadows
upstream's module in overlay runs). data/upstream_minimax_model_names.json lists every name
upstream's module defined at top level (patches/upstream_names.py derives it from the pinned base).

* inside a patched ComfyUI tree: every listed name imports from comfy.ldm.minimax.model;
* in this repository: the re-export's source, loaded by path, defines every listed name;
* with upstream's module importable (COMFYUI_DIR): the list is current, and each re-exported
  object is call-compatible with upstream's and computes the same results.
"""

import ast
import importlib
import importlib.util
import inspect
import json
import os
import sys

import pytest
import torch

from comfy.ldm.minimax_h3 import layout
from comfy.ldm.minimax_h3.model import MiniMaxH3Model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
REEXPORT_SOURCE = os.path.join(ROOT, "patches", "overlay", "comfy", "ldm", "minimax", "model.py")
UPSTREAM = "comfy.ldm.minimax.model"

with open(os.path.join(HERE, "data", "upstream_minimax_model_names.json"), encoding="utf-8") as f:
    NAMES = json.load(f)
ALL_NAMES = NAMES["public"] + NAMES["private"]


def _installed_module():
    """comfy.ldm.minimax.model as this interpreter resolves it, or None when there is none."""
    try:
        spec = importlib.util.find_spec(UPSTREAM)
    except ModuleNotFoundError:
        spec = None
    return importlib.import_module(UPSTREAM) if spec is not None else None


def _is_reexport(module):
    return getattr(module, "MiniMaxH3Model", None) is MiniMaxH3Model


def _upstream_module():
    module = _installed_module()
    if module is None:
        pytest.skip(f"{UPSTREAM} is not importable: set COMFYUI_DIR to a checkout of ComfyUI 0f1fa67 to compare with upstream")
    if _is_reexport(module):
        pytest.skip(f"{UPSTREAM} is the re-export (patched tree): upstream's module is not there to compare with")
    return module


def _reexport_source():
    if not os.path.exists(REEXPORT_SOURCE):
        pytest.skip("patches/overlay is not in this tree (a patched ComfyUI tree): the installed re-export is checked instead")
    spec = importlib.util.spec_from_file_location("_minimax_model_reexport", REEXPORT_SOURCE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does while the module runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def _check_names(module):
    missing = [n for n in ALL_NAMES if not hasattr(module, n)]
    assert not missing, f"names upstream's {UPSTREAM} defined that the re-export lost: {missing}"
    assert sorted(module.__all__) == sorted(NAMES["public"])
    assert module.MiniMaxH3Model is MiniMaxH3Model and module.PackedLayout is layout.PackedLayout
    assert module._frame_grid is layout.frame_grid and module._audio_grid is layout.audio_positions


def test_patched_tree_module_exports_every_upstream_name():
    module = _installed_module()
    if module is None:
        pytest.skip(f"{UPSTREAM} is not importable here (no ComfyUI tree): the re-export's source is checked instead")
    if not _is_reexport(module):
        pytest.skip(f"{UPSTREAM} is upstream's own module (overlay on COMFYUI_DIR), not the patch series' re-export")
    _check_names(module)


def test_reexport_source_defines_every_upstream_name():
    _check_names(_reexport_source())


def test_upstream_name_list_is_current():
    upstream = _upstream_module()
    with open(upstream.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    defined = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.append(node.name)
        elif isinstance(node, ast.Assign):
            defined.extend(t.id for t in node.targets if isinstance(t, ast.Name))
    assert sorted(defined) == sorted(ALL_NAMES), (
        "upstream's module changed: rerun patches/upstream_names.py $COMFYUI_DIR and extend the re-export")


def _call_compatible(theirs, ours):
    """Every call valid against upstream's signature binds the same way against ours."""
    a, b = list(inspect.signature(theirs).parameters.values()), list(inspect.signature(ours).parameters.values())
    same = [(p.name, p.kind, p.default) for p in a] == [(p.name, p.kind, p.default) for p in b[:len(a)]]
    return same and all(p.default is not inspect.Parameter.empty for p in b[len(a):])


def test_reexport_is_call_compatible_with_upstream():
    upstream, ours = _upstream_module(), _reexport_source()
    for name in ALL_NAMES:
        theirs, mine = getattr(upstream, name), getattr(ours, name)
        if not callable(theirs):
            assert mine == theirs, name
            continue
        assert _call_compatible(theirs, mine), f"{name}: {inspect.signature(theirs)} vs {inspect.signature(mine)}"
        if inspect.isclass(theirs) and hasattr(theirs, "forward"):
            assert _call_compatible(theirs.forward, mine.forward), f"{name}.forward"


def _helper_calls():
    g = torch.Generator().manual_seed(0)
    frame, _ = layout.frame_grid(4, 6)
    h, shift, scale = torch.randn(7, 5, generator=g), torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    return [
        ("_axis_from_sqrt_area", (10, 2, 7.5)),
        ("_frame_grid", (6, 10)),
        ("_video_t_spans", (7,)),
        ("_video_t_grid", (7, 3.5)),
        ("_ref_t_span", ({"kind": "image"},)),
        ("_ref_t_span", ({"kind": "audio", "ref_audio_t": 3},)),
        ("_ref_t_span", ({"kind": "video_audio", "latent_t": 6, "ref_audio_t": 4},)),
        ("_audio_grid", (2.0, 5, -3.25, 7.5)),
        ("_video_grid", (3, frame, 4.0)),
        ("_mod_scale_shift", (h.clone(), shift, scale, [(0, 3, 0), (3, 7, 1)])),
        ("_mod_gate", (h.clone(), shift, torch.randn(7, 5, generator=g), [(0, 4, 1), (4, 7, 0)])),
        ("time_shift_sigma", (torch.tensor([0.1, 0.5, 0.93]), 12.0, 3.0)),
        ("patchify_video", (torch.randn(1, 24, 2, 4, 6, generator=g),)),
        ("unpatchify_video", (torch.randn(12, 96, generator=g), 2, 2, 3)),
        ("pack_audio", (torch.randn(1, 32, 2, 5, generator=g),)),
        ("unpack_audio", (torch.randn(10, 32, generator=g),)),
        ("rope_rotation_table", (torch.randn(6, 12, generator=g), torch.float32)),
    ]


def _equal(a, b):
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_reexported_helpers_compute_what_upstream_computes():
    upstream, ours = _upstream_module(), _reexport_source()
    for name, args in _helper_calls():
        # in-place helpers get their own copy of the first argument
        theirs = getattr(upstream, name)(*((args[0].clone(),) + args[1:] if isinstance(args[0], torch.Tensor) else args))
        mine = getattr(ours, name)(*((args[0].clone(),) + args[1:] if isinstance(args[0], torch.Tensor) else args))
        assert _equal(theirs, mine), name


def _reexport():
    """The re-export as custom nodes see it: the installed module in a patched tree, else its source."""
    module = _installed_module()
    return module if module is not None and _is_reexport(module) else _reexport_source()


def _models(upstream):
    """(upstream's model, ours) with the same tiny random weights, through ComfyUI's ops."""
    import comfy.ops
    from h3_files import TINY_CONFIG, random_state_dict
    ops = comfy.ops.disable_weight_init
    theirs = upstream.MiniMaxH3Model(**TINY_CONFIG, operations=ops).requires_grad_(False)
    ours = MiniMaxH3Model(**TINY_CONFIG, operations=ops).requires_grad_(False)
    sd = random_state_dict(theirs, seed=2)
    theirs.load_state_dict(sd)
    ours.load_state_dict(sd)
    return theirs, ours


@pytest.mark.parametrize("kind", ["t2va", "keyframes", "refs_all"])
def test_cond_rows_methods_compute_what_upstream_computes(kind):
    from h3_files import TINY_CONFIG, step_inputs
    upstream = _upstream_module()
    theirs, ours = _models(upstream)
    _, _, _, p = step_inputs(TINY_CONFIG, kind)
    for name in ("_cond_video_rows", "_cond_audio_rows"):
        assert _call_compatible(getattr(theirs, name), getattr(ours, name)), name
        a, b = getattr(theirs, name)(p, "cpu"), getattr(ours, name)(p, "cpu")
        assert (a is None and b is None) if kind == "t2va" else _equal(a, b), name
    if kind == "keyframes":  # augmentation levels below 1 and a seed: the noise is there and the same
        assert p["visual_cond_noise_aug"] < 1.0 and p["audio_cond_noise_aug"] < 1.0


def _counting_attention(module, calls):
    """Replace module.optimized_attention, as custom nodes do, by one that doubles the output; -> the original."""
    original = module.optimized_attention

    def doubled(q, k, v, heads, **kwargs):
        calls.append(heads)
        return 2.0 * original(q, k, v, heads, **kwargs)
    module.optimized_attention = doubled
    return original


def test_setting_optimized_attention_on_the_module_swaps_h3s_attention(comfyui_models):
    import comfy.ldm.modules.attention
    from h3_files import TINY_CONFIG, step_inputs
    from h3_cases import tiny_model
    module = _reexport()
    assert module.optimized_attention is comfy.ldm.modules.attention.optimized_attention  # as upstream's import bound it
    model, cfg = tiny_model()
    x, t, c, p = step_inputs(cfg, "keyframes")
    before = model(x, t, c, {}, minimax_payload=p)
    calls = []
    original = _counting_attention(module, calls)
    try:
        swapped = model(x, t, c, {}, minimax_payload=p)
    finally:
        module.optimized_attention = original
    # every DiT block and every token-refiner block calls it once, with all heads
    assert calls == [TINY_CONFIG["num_attention_heads"]] * (TINY_CONFIG["num_layers"] + TINY_CONFIG["token_refiner_num_layers"])
    assert all(not torch.allclose(s, b) for s, b in zip(swapped, before))
    assert all(torch.equal(a, b) for a, b in zip(model(x, t, c, {}, minimax_payload=p), before))


def test_swapped_optimized_attention_gives_what_upstream_gives(comfyui_models):
    from h3_files import TINY_CONFIG, step_inputs
    upstream, module = _upstream_module(), _reexport()
    theirs, ours = _models(upstream)
    x, t, c, p = step_inputs(TINY_CONFIG, "refs_all")
    out, calls = [], ([], [])
    for mod, model, seen in ((upstream, theirs, calls[0]), (module, ours, calls[1])):
        original = _counting_attention(mod, seen)
        try:
            out.append(model(x, t, c, {}, minimax_payload=dict(p)))
        finally:
            mod.optimized_attention = original
    assert calls[0] == calls[1] and len(calls[0]) == TINY_CONFIG["num_layers"] + TINY_CONFIG["token_refiner_num_layers"]
    for a, b in zip(*out):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()
