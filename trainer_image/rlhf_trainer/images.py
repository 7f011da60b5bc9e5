"""Images in records, for vision-language models: where a record's images are, reading them, and a prompt's
model inputs (the processor's).

A prompt's images are written in its chat messages, a content part {"type": "image", "image": REF} each
(the convention of transformers' processors and of OpenAI's messages, whose {"type": "image_url",
"image_url": {"url": REF}} is read too), or listed under data.<dataset>.imageKey (a REF or a list of
them), which puts them before the text of the first user message. A REF is a path relative to the
data file's directory (or absolute), an http(s) URL (read only with data.<dataset>.fetchImageUrls), or
the image's bytes in base64, as a data: URI (data:image/png;base64,...) or bare.

A reference is resolved once (resolve): a path (one that names a file) made absolute, the rest as it is. Rewards and
environments get the resolved references, never the pixels; the rollout engines read the images
from them (load).
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

DATA_URI = "data:"
URL_SCHEMES = ("http://", "https://")
FETCH_TIMEOUT_S = 30
IMAGE_PART = "image"
IMAGE_MARKER = "<image>"  # where a text's image goes, for data.<dataset>.imageKey's images


def is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value)


def _part_ref(part: Any) -> Any:
    """The image reference of a message content part, or None for a part that is not an image."""
    if not isinstance(part, dict):
        return None
    if part.get("type") == IMAGE_PART:
        return part.get("image", part.get("url", part.get("path")))
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return None


def message_refs(prompt: Any) -> list[Any]:
    """The image references of a prompt's chat messages, in order (none for a text prompt)."""
    if not is_chat(prompt):
        return []
    return [ref for message in prompt if isinstance(message["content"], list)
            for part in message["content"] if (ref := _part_ref(part)) is not None or _is_image(part)]


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in (IMAGE_PART, "image_url")


def with_images(prompt: Any, refs: list[Any]) -> list[dict]:
    """The prompt as chat messages whose first user message starts with an image part per ref (data.imageKey's
    images); every content a list of parts, each image part in the convention the chat templates read:
    {"type": "image", "image": ref}."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    for message in messages:  # every content a list of parts, as processors' chat templates read them
        content = message["content"]
        message["content"] = ([{"type": "text", "text": content}] if isinstance(content, str) else
                              [{"type": IMAGE_PART, "image": _part_ref(part)} if _is_image(part) else part for part in content])
    if refs:
        first = next((m for m in messages if m.get("role") == "user"), None)
        if first is None:
            raise ValueError("has images (data imageKey) but no user message to put them in")
        first["content"] = _placed(first["content"], refs)
    return messages


def _placed(parts: list[dict], refs: list[Any]) -> list[dict]:
    """A message's parts with an image part per ref: at the text's IMAGE_MARKERs when it has one per image (the
    convention of datasets such as geometry3k: "<image>Find x."), else all before it."""
    text = "".join(part.get("text", "") for part in parts if part.get("type") == "text")
    if len(parts) == 1 and text.count(IMAGE_MARKER) == len(refs):
        pieces = text.split(IMAGE_MARKER)
        placed = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
        for ref, piece in zip(refs, pieces[1:]):
            placed += [{"type": IMAGE_PART, "image": ref}] + ([{"type": "text", "text": piece}] if piece else [])
        return placed
    return [{"type": IMAGE_PART, "image": ref} for ref in refs] + parts


def resolve(ref: Any, base_dir: Path, fetch_urls: bool) -> str:
    """The reference as rewards and engines get it: a path made absolute (and checked to exist), a URL
    (allowed by fetchImageUrls), base64 as given; an image a Hugging Face dataset holds (its Image feature: a
    PIL image, or {"bytes", "path"}) as a base64 data URI. Raises ValueError saying what is wrong and what to do."""
    if embedded := _embedded(ref):
        return DATA_URI + "image/png;base64," + base64.b64encode(embedded).decode()
    if isinstance(ref, dict) and ref.get("path"):
        ref = ref["path"]
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"an image reference must be a path, URL or base64 string, not {type(ref).__name__} {ref!r:.60}")
    if ref.startswith(URL_SCHEMES):
        if not fetch_urls:
            raise ValueError(f"image {ref[:80]} is a URL and this dataset may not fetch: set fetchImageUrls: true, "
                             "or store the images beside the data")
        return ref
    if ref.startswith(DATA_URI):
        return ref
    path = Path(ref) if Path(ref).is_absolute() else base_dir / ref
    if _is_file(path):
        return str(path.resolve())
    if _is_base64(ref):
        return ref
    raise ValueError(f"image {ref[:80]!r} not found ({path.resolve()}): paths are relative to the data file's directory")


def _embedded(ref: Any) -> bytes | None:
    """The bytes of an image held in the record itself (datasets' Image feature), or None."""
    if isinstance(ref, dict) and isinstance(ref.get("bytes"), bytes):
        return ref["bytes"]
    if hasattr(ref, "save") and hasattr(ref, "mode"):  # a PIL image
        buffer = io.BytesIO()
        ref.save(buffer, format="PNG")
        return buffer.getvalue()
    return None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for a file: base64
        return False


def _is_base64(ref: str) -> bool:
    """Bare base64 (no file of that name): what decodes as base64."""
    try:
        base64.b64decode(ref, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def read_bytes(ref: str) -> bytes:
    """The bytes a resolved reference names."""
    if ref.startswith(URL_SCHEMES):
        import urllib.request

        try:
            with urllib.request.urlopen(ref, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 - http(s) only
                return response.read()
        except OSError as error:
            raise ValueError(f"image {ref[:80]} could not be fetched: {error}") from None
    if ref.startswith(DATA_URI) or not _is_file(Path(ref)):
        encoded = ref.partition(",")[2] if ref.startswith(DATA_URI) else ref
        try:
            return base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"image base64 {ref[:40]}... is not valid base64 ({error})") from None
    return Path(ref).read_bytes()


def load(ref: str):
    """A resolved reference's image, RGB; ValueError naming the reference and why it is no image."""
    from PIL import Image, UnidentifiedImageError

    data = read_bytes(ref)
    shown = ref if len(ref) < 100 else ref[:60] + "..."
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # a truncated file fails here, not later in a rollout
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise ValueError(f"image {shown} is not a readable image ({error})") from None
    if min(image.size) < 1:
        raise ValueError(f"image {shown} is empty ({image.size[0]}x{image.size[1]})")
    return image.convert("RGB")


def images_check(value: Any) -> str | None:
    """data.imageKey's value: a reference or a list of them."""
    refs = value if isinstance(value, list) else [value]
    if all((isinstance(ref, str) and ref) or _embedded(ref) or (isinstance(ref, dict) and ref.get("path")) for ref in refs):
        return None
    return f"must be an image reference (path, URL or base64) or a list of them, not {type(value).__name__} {value!r:.60}"
