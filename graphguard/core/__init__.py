"""The graph lifecycle: keys, backends, entries, cache, admission, parity, metrics, runner."""
