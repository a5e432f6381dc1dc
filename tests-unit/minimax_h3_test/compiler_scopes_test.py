"""Issue 19 item 5: ComfyUI's model-compiler scopes (allocation graph per forward, "block" prefetch
scope per DiT block), feature-detected: the pinned base has none, newer cores have one of two forms.

Newer cores are stood in for by recording fakes with their signatures (malloc_graph_begin(device) as in
zoidypuh/ComfyUI@f737b1d5's core, malloc_graph_begin(module, device) as in Comfy-Org's); the outputs must
stay those of the newer upstream's stored reference.
"""

import pytest
import torch

import comfy.model_prefetch
import upstream_newer as un
from comfy.ldm.minimax_h3.model import SEQUENCE_PARALLEL_OPTION

pytestmark = pytest.mark.comfyui


def _step(model, options=None):
    x, timestep, context, payload, _, opts = un.case_inputs("t2va")
    return model(x, timestep, context, dict(opts, **(options or {})), minimax_payload=payload)


class NewerCore:
    """Records what H3 asks of a core with compiled allocations (begin takes `begin_args` names)."""

    def __init__(self, monkeypatch, module_first, enabled=True):
        self.events = []
        real_pop = comfy.model_prefetch.prefetch_queue_pop

        def pop(queue, device, module, dtype=None, core=None, enable_graph=False, generator=None, malloc_scope=None):
            self.events.append(("pop", None if module is None else type(module).__name__, malloc_scope))
            return real_pop(queue, device, module, dtype, core, enable_graph, generator)

        def begin_module(module, device):
            self.events.append(("begin", type(module).__name__, str(device)))

        def begin_device(device):
            self.events.append(("begin", None, str(device)))

        def end():
            self.events.append(("end",))
        monkeypatch.setattr(comfy.model_prefetch, "prefetch_queue_pop", pop)
        monkeypatch.setattr(comfy.model_prefetch, "malloc_graph_enabled", lambda device: enabled, raising=False)
        monkeypatch.setattr(comfy.model_prefetch, "malloc_graph_begin", begin_module if module_first else begin_device, raising=False)
        monkeypatch.setattr(comfy.model_prefetch, "malloc_graph_end", end, raising=False)


def test_the_pinned_base_gets_its_own_calls(comfyui_dir, reference, monkeypatch):
    assert not hasattr(comfy.model_prefetch, "malloc_graph_enabled")
    calls, real_pop = [], comfy.model_prefetch.prefetch_queue_pop

    def pop(queue, device, module, dtype=None, core=None, enable_graph=False, generator=None):  # the base's signature
        calls.append(None if module is None else type(module).__name__)
        return real_pop(queue, device, module, dtype, core, enable_graph, generator)
    monkeypatch.setattr(comfy.model_prefetch, "prefetch_queue_pop", pop)
    model, _ = un.build_model(un.ours(), {})
    video, audio = _step(model)
    # one pop per block; without a prefetch queue the base needs no closing pop
    assert calls == ["DiTBlock"] * un.TINY["num_layers"]
    un.assert_case_outputs(video, audio, reference[0], "t2va")


@pytest.mark.parametrize("module_first", [False, True])
def test_a_compiling_core_gets_one_graph_per_forward_and_block_scopes(comfyui_dir, reference, monkeypatch, module_first):
    core = NewerCore(monkeypatch, module_first)
    model, _ = un.build_model(un.ours(), {})
    video, audio = _step(model)
    blocks = [("pop", "DiTBlock", "block")] * un.TINY["num_layers"]
    begin = ("begin", "MiniMaxH3Model" if module_first else None, "cpu")
    # the last block's scope is closed (pop of None) inside the graph, which ends after the forward
    assert core.events == [begin, *blocks, ("pop", None, "block"), ("end",)]
    un.assert_case_outputs(video, audio, reference[0], "t2va")


def test_the_graph_ends_when_the_forward_fails(comfyui_dir, monkeypatch):
    core = NewerCore(monkeypatch, module_first=False)
    model, _ = un.build_model(un.ours(), {})
    x, timestep, context, payload, _, _ = un.case_inputs("t2va")
    with pytest.raises(ValueError, match="batch size 1"):
        model([x[0].expand(2, -1, -1, -1, -1), x[1]], timestep, context, {}, minimax_payload=payload)
    assert core.events == [("begin", None, "cpu"), ("end",)]


def test_no_graph_where_the_core_disables_it_or_with_a_sequence_parallel_runner(comfyui_dir, monkeypatch):
    core = NewerCore(monkeypatch, module_first=False, enabled=False)
    model, _ = un.build_model(un.ours(), {})
    _step(model)
    assert not [e for e in core.events if e[0] in ("begin", "end")]
    core = NewerCore(monkeypatch, module_first=False)

    def runner(plan, inputs):  # rank 0's collectives are not run inside a recorded allocation graph
        (va, vb), (aa, ab) = plan.layout.segment("video"), plan.layout.segment("audio")
        return torch.zeros(vb - va, 96), torch.zeros(ab - aa, 32)
    _step(model, {SEQUENCE_PARALLEL_OPTION: runner})
    assert core.events == []
