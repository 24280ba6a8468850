"""A chat request's image parts, before the model's lock: checked against the model (a text-only
model, or more images than it takes: a 400 naming the model and the part), then decoded (fetched,
for http(s) URLs natively) off the event loop. The protocol layer leaves image parts as
{"type": "image", "url", "detail", "where"}; this turns them into {"type": "image", "image":
ImageInput}, the form the chat template and the pipeline read."""
from __future__ import annotations

import asyncio

from ..errors import InvalidRequestError
from ..gpu import IN_BROWSER             # the page (Pyodide): no worker threads, no fetch from here
from .images import ImageInput, load_image


class ImageInputError(InvalidRequestError):
    """Images sent to a model that takes none, or more than it takes."""

    def __init__(self, message: str):
        super().__init__(message, param="messages")


def image_parts(messages: list[dict]) -> list[dict]:
    """The image parts of the messages, in prompt order."""
    return [p for m in messages or () if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]


def images_of(messages: list[dict]) -> list[ImageInput]:
    """The decoded images of resolved messages, in prompt order."""
    return [p["image"] for p in image_parts(messages) if "image" in p]


async def resolve_images(model_id: str, vision, messages: list[dict], *, allow_files: bool = False) -> list[dict]:
    """`messages` with each image part decoded; `vision` is the model's (pipeline.vision, None for a
    text-only model), whose `max_images` bounds a request."""
    parts = image_parts(messages)
    if not parts:
        return messages
    first = parts[0].get("where", "messages")
    if vision is None:
        raise ImageInputError(f"{first} is an image, but model {model_id} takes no images (it reads text "
                              f"only): load a vision-language model (e.g. Gemma 3 with its vision tower) "
                              f"or send text.")
    if len(parts) > vision.max_images:
        raise ImageInputError(f"The request has {len(parts)} images; model {model_id} takes at most "
                              f"{vision.max_images} per request ({parts[vision.max_images].get('where')} is "
                              f"one too many).")

    def decode(part: dict) -> dict:
        if "image" in part:
            return part
        img = load_image(part["url"], part.get("where", "image"), allow_files=allow_files,
                         allow_fetch=not IN_BROWSER)
        return {"type": "image", "image": img}
    decoded = {}
    for p in parts:
        decoded[id(p)] = decode(p) if IN_BROWSER else await asyncio.to_thread(decode, p)
    return [{**m, "content": [decoded.get(id(p), p) for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]
