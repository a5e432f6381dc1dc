"""MiniMax H3 audio-video DiT as one model package with a public, versioned extension interface.

``H3_EXTENSION_API`` versions what custom nodes and the sequence-parallel runner may rely on:
the layout (PackedLayout), conditioning (timestep plan, tag runs, curve lookup), modulation ops,
ForwardPlan / ShardPlan and ``MiniMaxH3Model.run(plan, shard, ...)``. Additive changes bump the
minor number, anything else the major.
"""

H3_EXTENSION_API = (1, 0)
