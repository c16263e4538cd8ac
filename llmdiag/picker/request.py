"""What the picker reads from a request body: the model and a prompt-size estimate.

OpenAI-style bodies (``/v1/completions``, ``/v1/chat/completions``,
``/v1/embeddings``): ``model`` names the pool; the prompt size comes from an
explicit ``prompt_tokens`` (load generators replaying traces send it; the fake
engine honours it), else from the prompt's characters (``prompt`` as a string
or a list of strings, ``messages[].content`` as a string or a list of text
parts, ``input`` for embeddings) divided by ``chars_per_token``. The estimate
only weighs pending prefill in the balancer, so a rough count is enough.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["BadRequest", "RequestInfo", "parse_request_body"]


class BadRequest(ValueError):
    """A body the picker cannot route: not JSON, not an object, or a ``model`` that is not a string."""


@dataclass(frozen=True, slots=True)
class RequestInfo:
    model: str | None
    est_prompt_tokens: int


def parse_request_body(body: bytes, chars_per_token: float = 4.0) -> RequestInfo:
    """Model and prompt-token estimate of a JSON request body; raises :class:`BadRequest`."""
    if not body.strip():
        return RequestInfo(None, 0)  # a POST without a body: no model, any backend
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(doc).__name__}")
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, got {type(model).__name__}")
    explicit = doc.get("prompt_tokens")
    if isinstance(explicit, int) and not isinstance(explicit, bool) and explicit >= 0:
        return RequestInfo(model or None, explicit)
    chars = _text_chars(doc.get("prompt")) + _text_chars(doc.get("input"))
    messages = doc.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                chars += _text_chars(message.get("content"))
    return RequestInfo(model or None, int(chars / chars_per_token + 0.5) if chars else 0)


def _text_chars(value: Any) -> int:
    """Characters of a prompt-like value: a string, a list of strings, or a list of ``{"text": ...}`` parts."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for item in value:
            if isinstance(item, str):
                total += len(item)
            elif isinstance(item, dict) and isinstance(item.get("text"), str):
                total += len(item["text"])
        return total
    return 0
