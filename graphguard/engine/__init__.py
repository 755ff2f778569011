"""The serving engine: decoder LLMs over paged KV, with graph-backed decode.

Submodules are imported where they are used; this package stays free of heavy imports.
"""
