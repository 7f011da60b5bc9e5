"""The error every part of the control plane raises for its own failures."""

from __future__ import annotations


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached."""
