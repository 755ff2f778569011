"""Tensor parallelism's protocol: how rank 0's step messages and graph decisions reach the other
ranks (ranks.py), and how the ranks agree on each capture (agreement.py: RankRunner). The
sharded model is graphguard.engine.models (shard.py, parallel_layers.py); launching the ranks
and the followers' loop stand at the top (graphguard.engine.launch)."""
