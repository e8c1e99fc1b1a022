"""Builds, evaluates and pads the embedded demo model pair (see models/demo/MODEL_CARD.md)."""
