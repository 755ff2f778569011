"""Tensor parallelism: each rank holds a shard of the model (graphguard.engine.parallel.shard),
rank 0 leads the steps and every graph decision, the others follow (ranks.py, follower.py).
Submodules are imported by name; this package imports nothing, so models can use layers.py."""
