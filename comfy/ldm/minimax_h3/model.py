"""MiniMax H3 audio-video DiT: one forward for native and sequence-parallel runs.

``_forward`` builds the step's ForwardPlan from its StepInputs, then runs it as the single shard of
a one-rank ShardPlan, or hands (plan, inputs) to the sequence-parallel runner in
``transformer_options``, whose ranks each call ``run`` with their own shard.
"""
import contextlib
import dataclasses
import hashlib
import json
import math

import torch
import torch.nn as nn

import comfy.ldm.common_dit
import comfy.model_management
import comfy.model_prefetch
import comfy.ops
import comfy.patcher_extension

from . import kernels
from .conditioning import (AUDIO_COND_TIMESTEP, VISUAL_COND_TIMESTEP, audio_carry, carried_audio_velocity, curve_t_emb, sigma_shifts,
                           video_sigma)
from .embedding import (audio_mask_rows, check_condition_rows, condition_rows, mask_row_values, pack_audio, patchify_video, rope_angles,
                        rope_rotation_table, stream_rows, unpack_audio, unpatchify_video)
from .modules import DiTBlock, FinalLayer, TimeEmbedder, TokenRefiner
from .pdd import PddHeads, bank_size
from .plan import ForwardPlan
from .step_io import StepInputs

# transformer_options key under which a sequence-parallel runner is attached (comfy/parallel side)
SEQUENCE_PARALLEL_OPTION = "minimax_h3_sequence_parallel"


def _add_gates_of_state_dict(model, state_dict, prefix, *args):
    """Load pre-hook: a sparse-attention (VSA) checkpoint carries a gate per DiT block
    (``blocks.{i}.attn.to_gate_compress.weight``); a model built without them gets them before the
    weights load, whether or not ComfyUI's model detection passed ``gate_compress``."""
    if model.config["gate_compress"] or f"{prefix}blocks.0.attn.to_gate_compress.weight" not in state_dict:
        return
    for block in model.blocks:
        block.attn.add_gate_compress(model._operations, dtype=model.dtype, device=block.attn.qkv_proj.weight.device)
    model.config["gate_compress"] = True
    model._set_model_key()


def _rows_to(segment, device):
    """(start, stop, row) with a per-row LongTensor (masked rows) moved to `device` once per step."""
    a, b, row = segment
    return (a, b, row.to(device)) if isinstance(row, torch.Tensor) else segment


class MiniMaxH3Model(nn.Module):
    def __init__(self, hidden_size=5376, num_layers=50, token_refiner_num_layers=2,
                 num_attention_heads=56, attention_head_dim=128, ffn_hidden_size=14336,
                 latents_dim=24, audio_latents_dim=32, patch_size=(1, 2, 2), text_dim=5120,
                 timestep_input_dim=256, time_embed_hidden_size=5376, time_embed_dim=2688,
                 rope_inv_freq_len=16, norm_eps=1e-5, qk_norm_eps=1e-5, final_norm_eps=1e-5,
                 sigma_shift_video=12.0, sigma_shift_audio=3.0,
                 adaln_curve_grid=None,
                 image_model=None, dtype=None, device=None, operations=None, **kwargs):
        super().__init__()
        operations = operations or comfy.ops.disable_weight_init
        # VSA checkpoints' DiT blocks carry a sparse-attention gate; model detection passes it as a keyword
        gate_compress = bool(kwargs.get("gate_compress", False))
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.num_heads = num_attention_heads
        self.patch_size = tuple(patch_size)
        self.latents_dim = latents_dim
        self.audio_latents_dim = audio_latents_dim
        self.text_dim = text_dim
        self.sigma_shift_video = sigma_shift_video
        self.sigma_shift_audio = sigma_shift_audio
        self.use_adaln_curves = adaln_curve_grid is not None
        self.config = {"hidden_size": hidden_size, "num_layers": num_layers, "token_refiner_num_layers": token_refiner_num_layers,
                       "num_attention_heads": num_attention_heads, "attention_head_dim": attention_head_dim,
                       "ffn_hidden_size": ffn_hidden_size, "latents_dim": latents_dim, "audio_latents_dim": audio_latents_dim,
                       "patch_size": list(self.patch_size), "text_dim": text_dim, "timestep_input_dim": timestep_input_dim,
                       "time_embed_hidden_size": time_embed_hidden_size, "time_embed_dim": time_embed_dim,
                       "rope_inv_freq_len": rope_inv_freq_len, "norm_eps": norm_eps, "qk_norm_eps": qk_norm_eps,
                       "final_norm_eps": final_norm_eps, "sigma_shift_video": sigma_shift_video,
                       "sigma_shift_audio": sigma_shift_audio, "adaln_curve_grid": adaln_curve_grid,
                       "gate_compress": gate_compress}
        # curve-form checkpoints replace the time embedder and full-width adaln weights with a small
        # shared basis of the time-embedding curve
        curve = {"apply_silu": not self.use_adaln_curves,
                 "adaln_dtype": torch.float32 if self.use_adaln_curves else dtype}
        video_patch_dim = latents_dim * self.patch_size[0] * self.patch_size[1] * self.patch_size[2]

        self.video_patch_proj = operations.Linear(video_patch_dim, hidden_size, bias=True, dtype=torch.float32, device=device)
        self.audio_patch_proj = operations.Linear(audio_latents_dim, hidden_size, bias=True, dtype=torch.float32, device=device)
        self.condition_proj = operations.Linear(text_dim, hidden_size, bias=True, dtype=dtype, device=device)
        if self.use_adaln_curves:
            self.register_buffer("adaln_t_table", torch.empty(adaln_curve_grid, time_embed_dim, dtype=torch.float32, device=device))
        else:
            self.time_embedder = TimeEmbedder(timestep_input_dim, time_embed_hidden_size, time_embed_dim,
                                              dtype=torch.float32, device=device, operations=operations)
        self.rope = nn.Module()
        self.rope.register_buffer("inv_freq", torch.empty(rope_inv_freq_len, dtype=torch.float32, device=device))
        self.token_refiner = TokenRefiner(token_refiner_num_layers, hidden_size, num_attention_heads,
                                          attention_head_dim, ffn_hidden_size, norm_eps, qk_norm_eps,
                                          final_norm_eps, dtype=dtype, device=device, operations=operations)
        self.blocks = nn.ModuleList([
            DiTBlock(hidden_size, num_attention_heads, attention_head_dim, ffn_hidden_size,
                     time_embed_dim, norm_eps, qk_norm_eps, **curve, dtype=dtype, device=device, operations=operations,
                     gate_compress=gate_compress)
            for _ in range(num_layers)])
        self.final_layer = FinalLayer(hidden_size, time_embed_dim, video_patch_dim, audio_latents_dim,
                                      final_norm_eps, **curve, dtype=dtype, device=device, operations=operations)
        self._operations = operations
        self.register_load_state_dict_pre_hook(_add_gates_of_state_dict)
        self._set_model_key()

    def _set_model_key(self):
        self.model_key = hashlib.sha256(json.dumps([self.config, str(self.dtype)], sort_keys=True).encode()).hexdigest()[:16]

    # -- upstream's helpers, kept for its callers (model_base.extra_conds, custom nodes) ------------

    def preprocess_text_embeds(self, text_states):
        """[B, L, text_dim] Qwen states -> [B, L, hidden] refined text embeds."""
        if text_states.shape[-1] == self.hidden_size:
            return text_states
        return self.token_refiner(self.condition_proj(text_states[0])).unsqueeze(0)

    def rope_freqs(self, position_ids, device):
        """[S, 3] float64 -> [S, 96] fp32 rope angles."""
        return rope_angles(position_ids, comfy.model_management.cast_to(self.rope.inv_freq, dtype=torch.float32, device=device))

    def _cond_video_rows(self, payload, device):
        """[rows, C*4] fp32 noise-augmented rows of the payload's visual condition latents, or None."""
        return condition_rows(payload.get("cond_video_latents", []), self._patchify,
                              float(payload.get("visual_cond_noise_aug", VISUAL_COND_TIMESTEP)), int(payload.get("seed", 0)), device)

    def _cond_audio_rows(self, payload, device):
        """[rows, C] fp32 noise-augmented rows of the payload's audio condition latents, or None."""
        return condition_rows(payload.get("cond_audio_latents", []), pack_audio,
                              float(payload.get("audio_cond_noise_aug", AUDIO_COND_TIMESTEP)), int(payload.get("seed", 0)) + 1, device)

    def _patchify(self, latent):
        # condition latents of an odd size (an i2v keyframe of width 496 is 31 latents wide) are padded
        # as the target latent is, so their rows are the padded grid's the layout places
        return patchify_video(comfy.ldm.common_dit.pad_to_patch_size(latent, self.patch_size), self.patch_size)

    # -- forward -------------------------------------------------------------------------------------

    def forward(self, x, timestep, context, transformer_options={}, minimax_payload=None, **kwargs):
        # newer model_base passes denoise_mask / audio_denoise_mask (see _forward) as keywords; they stay in
        # kwargs so that the signature remains upstream's at the pinned base
        denoise_mask, audio_denoise_mask = kwargs.get("denoise_mask"), kwargs.get("audio_denoise_mask")
        # the sampler carries the audio as (sigma_v / sigma_a) * x_audio; undo it outside the
        # wrappers so they and the network see the stream's own latent and velocity
        scale = float((minimax_payload or {}).get("audio_scale", 1.0))
        audio_src = x[1]
        if scale != 1.0:
            sigma_v, sigma_a = audio_carry(timestep, *sigma_shifts(transformer_options, self.sigma_shift_video, self.sigma_shift_audio))
            carry = (sigma_a / sigma_v).to(audio_src.dtype)
            x = [x[0], audio_src * carry]
        # ComfyUI's compiled allocations where the core has them; not with a sequence-parallel runner, whose
        # collectives have not been tried inside a recorded allocation graph
        graph = contextlib.nullcontext(lambda outputs: outputs) if transformer_options.get(SEQUENCE_PARALLEL_OPTION) \
            else kernels.malloc_graph(self, x)
        with graph as keep:
            out = comfy.patcher_extension.WrapperExecutor.new_class_executor(
                self._forward, self,
                comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
            ).execute(x, timestep, context, transformer_options, minimax_payload=minimax_payload, **kwargs)
            out = keep(out)
        # a row run at m * sigma returns m * v, so the sampler's x0 = x - sigma * v holds for it (before the carry)
        if denoise_mask is not None:
            out[0] = out[0] * denoise_mask
        if audio_denoise_mask is not None:
            out[1] = out[1] * audio_denoise_mask
        if scale != 1.0:
            out[1] = carried_audio_velocity(out[1], audio_src * carry, scale, sigma_a)
        return out

    def _forward(self, x, timestep, context, transformer_options={}, minimax_payload=None, denoise_mask=None, audio_denoise_mask=None,
                 **kwargs):
        """denoise_mask [1, 1, T, H, W] / audio_denoise_mask [1, 1, 2, T]: per-pixel / per-frame strength
        (1 = generate); a kept row runs at mask * sigma."""
        inputs = StepInputs(x[0], x[1], timestep, context, minimax_payload or {}, transformer_options, denoise_mask, audio_denoise_mask)
        plan = self.plan(inputs)
        transformer_options["minimax_h3_layout"] = plan.layout  # segment spans, for attention patches
        runner = transformer_options.get(SEQUENCE_PARALLEL_OPTION)
        if runner is not None:
            v, a = runner(plan, inputs)
        else:
            v, a = self.run(plan, plan.shard(1, 0, self.num_heads), inputs)
        return self.unpack(plan, v, a, inputs.video.dtype, inputs.audio.dtype)

    def plan(self, inputs):
        """The step's ForwardPlan (pure; the same on every rank given the same inputs)."""
        self.check_inputs(inputs)
        video, audio, context = inputs.video, inputs.audio, inputs.context
        orig_thw = tuple(video.shape[2:])
        padded = tuple(n + (-n) % p for n, p in zip(orig_thw, self.patch_size))  # as pad_to_patch_size pads it
        shifts = sigma_shifts(inputs.options, self.sigma_shift_video, self.sigma_shift_audio)
        plan = ForwardPlan.build(video.shape[:2] + padded, orig_thw, audio.shape, context.shape, float(video_sigma(inputs.timestep)),
                                 shifts, inputs.payload, self.model_key, self.hidden_size, masks=self.mask_rows(inputs, padded))
        self.check_conditions(plan, inputs.payload)
        heads = bank_size(self.final_layer.video_out)
        if heads > 1:  # a PDD LoRA's head bank: the plan picks the heads of this step
            plan = dataclasses.replace(plan, pdd=PddHeads.select(heads, plan.sigma, inputs.options.get("sample_sigmas"), shifts))
        return plan

    def mask_rows(self, inputs, latent_thw):
        """(video, audio) [rows] fp32 CPU strengths of the target rows under the step's denoise masks, None
        for a stream without one (the plan is CPU data: one copy of each mask per step)."""
        video, audio = (None if m is None else m.to("cpu", torch.float32) for m in (inputs.denoise_mask, inputs.audio_denoise_mask))
        for name, mask in (("denoise_mask", video), ("audio_denoise_mask", audio)):
            if mask is not None and not bool(((mask >= 0.0) & (mask <= 1.0)).all()):
                raise ValueError(f"MiniMax H3 {name} values must lie in [0, 1] (1 = generate, 0 = keep); found "
                                 f"{float(mask.min())}..{float(mask.max())}: pass the sampler's denoise mask")
        return (None if video is None else mask_row_values(video[0, 0], *latent_thw),
                None if audio is None else audio_mask_rows(audio))

    def check_inputs(self, inputs):
        video_x, audio_x, context = inputs.video, inputs.audio, inputs.context
        if video_x.shape[0] != 1 or audio_x.shape[0] != 1 or context.shape[0] != 1:
            raise ValueError(f"MiniMax H3 supports batch size 1; got video {tuple(video_x.shape)}, audio "
                             f"{tuple(audio_x.shape)}, context {tuple(context.shape)}: run cond and uncond separately")
        if video_x.ndim != 5 or video_x.shape[1] != self.latents_dim:
            raise ValueError(f"MiniMax H3 expects a video latent [1, {self.latents_dim}, T, H, W]; got {tuple(video_x.shape)}")
        if audio_x.ndim != 4 or audio_x.shape[1] != self.audio_latents_dim or audio_x.shape[2] != 2:
            raise ValueError(f"MiniMax H3 expects a stereo audio latent [1, {self.audio_latents_dim}, 2, T]; got {tuple(audio_x.shape)}")
        if context.ndim != 3 or context.shape[-1] not in (self.text_dim, self.hidden_size):
            raise ValueError(f"MiniMax H3 expects context [1, L, {self.text_dim}] (Qwen states) or [1, L, {self.hidden_size}] "
                             f"(refined); got {tuple(context.shape)}")
        for name, mask, grid in (("denoise_mask", inputs.denoise_mask, video_x.shape[2:]),
                                 ("audio_denoise_mask", inputs.audio_denoise_mask, audio_x.shape[2:])):
            if mask is not None and tuple(mask.shape) != (1, 1, *grid):
                raise ValueError(f"MiniMax H3 expects {name} {[1, 1, *grid]} (one channel of the first batch entry at the "
                                 f"latent grid of x, as model_base passes it); got {tuple(mask.shape)}")

    def check_conditions(self, plan, payload):
        """Refuse what embed() could only fail on, while the plan is built: under sequence parallelism
        that is on rank 0 before anything is sent, so no rank fails inside a step."""
        streams = (("video", "cond_video_latents", 5, self.latents_dim, plan.vis_aug, plan.seed),
                   ("audio", "cond_audio_latents", 4, self.audio_latents_dim, plan.aud_aug, plan.seed + 1))
        for what, key, ndim, channels, aug, seed in streams:
            latents = payload.get(key, [])
            for i, z in enumerate(latents):
                if not isinstance(z, torch.Tensor) or z.ndim != ndim or z.shape[1] != channels:
                    shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
                    raise ValueError(f"MiniMax H3 minimax_payload['{key}'][{i}] must be a {ndim}-d latent with {channels} "
                                     f"channels; got {shape}: pass the {what} VAE's latent of the keyframe or reference")
            if what == "video":
                # _patchify's rows: each latent padded to the patch size
                found = sum(z.shape[0] * math.prod(-(-n // p) for n, p in zip(z.shape[2:], self.patch_size)) for z in latents)
            else:
                found = sum(z.shape[2] * z.shape[3] for z in latents)  # pack_audio's rows
            check_condition_rows(getattr(plan.layout, f"{what}_cond_rows"), found, what)
            # the noise augmentation seeds a torch.Generator with it, which takes [-2**63, 2**64 - 1]
            if latents and aug < 1.0 and not -2**63 <= seed < 2**64:
                raise ValueError(f"MiniMax H3 minimax_payload['seed'] {plan.seed} is out of range for the {what} condition "
                                 f"noise (it seeds a torch.Generator with {seed}): use a seed in [-2**63, 2**64 - 2]")

    def time_embedding(self, plan, device, dtype):
        """[n_unique_t, t_dim] embedding of the step's distinct timesteps."""
        t_vals = plan.timesteps.t_values(device)
        if self.use_adaln_curves:
            # adaln projections consume interpolated coordinates of the time-embedding curve
            # an fp32 buffer by construction; explicit, as the table meets fp32 activations whatever a loader stored
            return curve_t_emb(comfy.model_management.cast_to(self.adaln_t_table, dtype=torch.float32, device=device), t_vals)
        return self.time_embedder(t_vals).to(dtype)

    def embed(self, plan, shard, inputs):
        """[shard.rows, hidden] input embeddings of the rows a shard holds, at the compute dtype (fp32 for fp16)."""
        video_x, audio_x, context, payload = inputs.video, inputs.audio, inputs.context, inputs.payload
        video_x = comfy.ldm.common_dit.pad_to_patch_size(video_x, self.patch_size)
        device, dtype = video_x.device, context.dtype
        video = stream_rows(condition_rows(payload.get("cond_video_latents", []), self._patchify, plan.vis_aug, plan.seed, device),
                            patchify_video(video_x.to(torch.float32), self.patch_size), plan.layout.video_cond_rows, "video")
        audio = stream_rows(condition_rows(payload.get("cond_audio_latents", []), pack_audio, plan.aud_aug, plan.seed + 1, device),
                            pack_audio(audio_x.to(torch.float32)), plan.layout.audio_cond_rows, "audio")
        # fp16 compute keeps the residual stream in fp32: it outgrows fp16's range in the full-size model
        residual = torch.float32 if dtype == torch.float16 else dtype
        sources = {}
        for name, rows, proj in (("video", video, self.video_patch_proj), ("audio", audio, self.audio_patch_proj)):
            a, b = shard.source_range(name)
            sources[name] = (a, proj(rows[a:b]).to(residual))
        if any(s == "text" for _, _, s, _ in shard.pieces):
            text = context[0]
            if plan.refine_text:
                text = self.token_refiner(self.condition_proj(text), transformer_options=inputs.options)
            sources["text"] = (0, text)
        h = torch.empty(shard.rows, self.hidden_size, dtype=residual, device=device)
        for a, b, source, off in shard.pieces:
            first, rows = sources[source]
            h[a:b] = rows[off - first:off - first + b - a]
        return h

    def run(self, plan, shard, inputs, seq_parallel=None):
        """Run one step on the rows of `shard` -> (video, audio) fp32 velocity rows of its target rows.

        seq_parallel: a SequenceParallelRunner when the rows are one shard of several, else None.
        """
        device, dtype, transformer_options = inputs.video.device, inputs.context.dtype, inputs.options
        # every rank's own options: attention patches (the token refiner's too) read the global layout
        transformer_options["minimax_h3_layout"] = plan.layout
        t_emb = self.time_embedding(plan, device, dtype)
        h = self.embed(plan, shard, inputs)
        # rotation table computed once per forward, consumed by the fused split-half rope
        rope = rope_rotation_table(self.rope_freqs(shard.positions(plan), device), dtype)
        mod = [_rows_to(seg, device) for seg in shard.mod_segments]
        # sharded: a runner that offers it lets each rank project the adaLN modulation of 1/N of the
        # blocks and shares them (UlyssesAttention.adaln_projections); otherwise every block projects its own
        share = getattr(seq_parallel, "adaln_projections", None) if seq_parallel is not None and seq_parallel.world_size > 1 else None
        adaln = share([block.adaln_proj for block in self.blocks], t_emb) if share else [None] * len(self.blocks)

        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        prefetch_queue = comfy.model_prefetch.make_prefetch_queue(list(self.blocks), device, transformer_options)
        for i, block in enumerate(self.blocks):
            kernels.prefetch_pop(prefetch_queue, device, block)
            transformer_options["block_index"] = i
            if ("double_block", i) in blocks_replace:
                # args["layout"] is global: natively it indexes args["img"] (patches_replace never runs sharded)
                def block_wrap(args, block=block, i=i):
                    return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                         transformer_options=args["transformer_options"], attention=args.get("attention"),
                                         seq_parallel=seq_parallel, adaln=adaln[i], compute_dtype=dtype)}
                h = blocks_replace[("double_block", i)](
                    {"img": h, "t_emb": t_emb, "mod_segments": mod, "rope_freqs": rope, "layout": plan.layout,
                     "transformer_options": transformer_options},
                    {"original_block": block_wrap})["img"]
            else:
                h = block(h, t_emb, mod, rope, transformer_options=transformer_options, seq_parallel=seq_parallel,
                          adaln=adaln[i], compute_dtype=dtype)
        kernels.prefetch_pop(prefetch_queue, device, None)
        return self.final_layer(h, t_emb, _rows_to(shard.video_seg, device), _rows_to(shard.audio_seg, device), pdd=plan.pdd)

    def unpack(self, plan, video_rows, audio_rows, video_dtype, audio_dtype):
        """Full target velocity rows -> [video, audio] outputs in the sampler's sign convention."""
        lt, lh, lw = plan.latent_thw
        ot, oh, ow = plan.orig_thw
        video = unpatchify_video(video_rows, lt, lh // self.patch_size[1], lw // self.patch_size[2], self.latents_dim, self.patch_size)
        video = video[:, :, :ot, :oh, :ow]
        return [-video.to(video_dtype), -unpack_audio(audio_rows).to(audio_dtype)]
