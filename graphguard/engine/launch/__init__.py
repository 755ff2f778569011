"""Serving over tensor-parallel ranks: spawning the ranks (spawn.py) and the followers' loop
(follower.py). It stands above the engine; the protocol is graphguard.engine.parallel."""
