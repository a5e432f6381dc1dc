"""MiniMax H3 audio-video DiT as one model package with a public, versioned extension interface.

``H3_EXTENSION_API`` versions what custom nodes and the sequence-parallel runner may rely on:
the layout (PackedLayout), conditioning (timestep plan, tag runs, curve lookup), modulation ops,
ForwardPlan / ShardPlan and ``MiniMaxH3Model.run(plan, shard, ...)``. Additive changes bump the
minor number, anything else the major.

``run``'s ``seq_parallel`` object provides ``world_size`` and ``attention(qkv, transformer_options,
prepare=None)``: qkv is this rank's [rows, 3, heads, head_dim] q|k|v; with ``prepare`` its q and k
heads [a, b) are ready only once ``prepare(a, b)`` has run (H3 norms and ropes them in place), which
the runner calls for every head before sending it. It may provide ``adaln_projections(projections,
t_emb)`` (every block's ``AdalnProj.project(t_emb)``, shared across ranks; ``DiTBlock`` takes one as
``adaln=``).
"""

H3_EXTENSION_API = (1, 0)
