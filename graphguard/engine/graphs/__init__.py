"""The engine's graphs: the capability proof, the three runners a step replays (decode, prefill
as rows, segmented prefill), warm-up, capture pacing, and EngineGraphs, the one component the
engine builds (component.py `build_graphs`)."""
