"""What the trainer shows of a job's settings to others: its errors become the RayJob's message, and
so the RLHFJob's status.message and Events, and its spec becomes the trackers' run config. A URL's
user:password and query (where tokens ride: ?api_key=...) and literal environment values stay out."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

HIDDEN = "REDACTED"


def url(text: str) -> str:
    """text with a URL's userinfo and query replaced by REDACTED (and its fragment dropped); not a URL: as it is."""
    parts = urlsplit(text)
    if not (parts.scheme and parts.netloc):
        return text
    _, at, host = parts.netloc.rpartition("@")
    return urlunsplit((parts.scheme, f"{HIDDEN}@{host}" if at else host, parts.path,
                       HIDDEN if parts.query else "", ""))


def config(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec (model_dump by alias) with every URL redacted and resources.env values replaced by REDACTED
    (valueFrom is a reference and stays)."""
    shown = _urls(spec)
    for variable in shown.get("resources", {}).get("env", []):
        if "value" in variable:
            variable["value"] = HIDDEN
    return shown


def _urls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _urls(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_urls(item) for item in value]
    return url(value) if isinstance(value, str) and "://" in value else value
