"""The one-line refusal every layer raises, at the bottom so that any may: no torch, no UI."""

from __future__ import annotations


class EngineError(ValueError):
    """The engine cannot run these settings: one line for a person to read."""
