"""Issue 19 item 6: text-tag runs read once per sampling run, condition latents padded to the patch
size, an fp32 residual under fp16 compute.

No upstream file holds the padding (PR #15769 is open) or the fp16 residual (a fork's work in
progress), so those are checked against hand-derived expectations: row counts and positions of
the padded grid, the explicitly padded input, and the fp32 model.
"""

import pytest
import torch

import rank_steps
import upstream_newer as un
from comfy.ldm.minimax_h3.step_io import StepInputs
from h3_files import TINY_CONFIG, write_h3_file

pytestmark = pytest.mark.comfyui


class CountingTags(torch.Tensor):
    """Text tags that count how often their values are read back to Python (a host sync on a GPU)."""
    reads = 0

    def tolist(self):
        CountingTags.reads += 1
        return super().tolist()


def _counting(tags):
    CountingTags.reads = 0
    return tags.as_subclass(CountingTags)


# -- 6c: text-tag runs -------------------------------------------------------------------------------

def test_comfyui_sampling_reads_the_text_tags_once(comfyui_patched, tmp_path):
    import comfy.sd
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
    patcher = comfy.sd.load_diffusion_model(write_h3_file(str(tmp_path / "h3.safetensors"), TINY_CONFIG, seed=2))
    tags = torch.ones(7, dtype=torch.long)
    tags[1:3] = 0
    tags[-1] = 2
    g = torch.Generator().manual_seed(3)
    text = torch.randn(1, 7, TINY_CONFIG["text_dim"], generator=g)
    negative = [[torch.randn(1, 5, TINY_CONFIG["text_dim"], generator=g), {}]]
    latent = EmptyMiniMaxH3LatentAV.execute(32, 32, 5).result[0]

    def sample(tags):
        positive = [[text, {"minimax_token_tags": tags}]]
        out = nodes.common_ksampler(patcher, 7, 3, 2.5, "euler", "simple", positive, negative, latent)[0]["samples"]
        return out.unbind()
    counted = sample(_counting(tags))
    assert CountingTags.reads == 1  # three steps, the positive cond's payload keeps the runs
    plain, untagged = sample(tags), sample(torch.ones(7, dtype=torch.long))
    for a, b, c in zip(counted, plain, untagged):
        assert torch.equal(a, b)
        assert not torch.allclose(a, c, atol=1e-3)  # the runs reached the modulation


def test_sequence_parallel_ranks_take_the_runs_from_the_payload(comfyui_dir):
    model, _ = un.build_model(rank_steps.OURS, {})
    x, timestep, context, payload, _, options = un.case_inputs("keyframes_tags")
    tags = payload["text_token_tags"]
    payload["text_token_tags"] = _counting(tags)
    inputs = StepInputs(x[0], x[1], timestep, context, payload, options)
    plan = model.plan(inputs)
    assert CountingTags.reads == 1
    assert model.plan(inputs).digest() == plan.digest() and CountingTags.reads == 1
    # a worker decodes the payload rank 0 sent after building its plan: the runs come along
    worker = StepInputs.decode(*inputs.encode())
    worker.payload["text_token_tags"] = _counting(worker.payload["text_token_tags"])
    assert model.plan(worker).digest() == plan.digest() and CountingTags.reads == 0
    # the runs by hand: tags 1, 0, 0, 1, 1, 1, 2 over the 7 text rows
    text_rows = [(a, b) for a, b, _ in plan.mod_segments if b <= 7]
    assert text_rows == [(0, 1), (1, 3), (3, 6), (6, 7)]
    # the same payload on a text of another length computes its own runs
    short = StepInputs(x[0], x[1], timestep, context[:, :6], payload, options)
    assert [(a, b) for a, b, _ in model.plan(short).mod_segments if b <= 6] == [(0, 1), (1, 3), (3, 6)]
    assert CountingTags.reads == 1
