"""Runner options written flat in tests, grouped as the runners take them."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import graphguard as gg

CAPTURE_OPTIONS = {f.name for f in fields(gg.CaptureConfig)}
VERIFY_OPTIONS = {"rtol", "atol", "reverify_every"}


def grouped(kwargs: dict[str, Any]) -> dict[str, Any]:
    """GraphRunner's arguments with capture and verify options written flat, as tests find
    shortest, grouped into the CaptureConfig and VerifyConfig the runner takes."""
    capture = {k: kwargs.pop(k) for k in CAPTURE_OPTIONS & kwargs.keys()}
    verify = {k: kwargs.pop(k) for k in VERIFY_OPTIONS & kwargs.keys()}
    if capture:
        kwargs["capture"] = gg.CaptureConfig(**capture)
    if verify:
        kwargs["verify"] = gg.VerifyConfig(kwargs.pop("verify", "exact"), **verify)
    return kwargs
