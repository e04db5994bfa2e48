"""Turn what trainers hand over into valid qrq samples instead of rejecting them.

Trainers pass chat-message lists as prompts, lists or numbers as ground truth, numpy scalars
(`numpy.str_` data sources, `numpy.int64` turn counts) and arbitrary objects inside extra-info
dicts. These helpers render, stringify or unwrap them; whatever had to be stringified is
recorded in `extra["qrq_notes"]` so nothing changes silently.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

NOTES_KEY = "qrq_notes"


def render_chat(messages: Any) -> str | None:
    """A chat-message list as text: a lone message is its content, several are
    "role: content" blocks; None when `messages` is not a message list."""
    if hasattr(messages, "tolist") and not isinstance(messages, (list, tuple, str)):
        messages = messages.tolist()  # verl keeps raw_prompt in numpy object arrays
    if not isinstance(messages, (list, tuple)) or not messages:
        return None
    if not all(isinstance(m, Mapping) and "content" in m for m in messages):
        return None
    texts = [(str(m.get("role", "")), _content_text(m["content"])) for m in messages]
    if len(texts) == 1:
        return texts[0][1]
    return "\n\n".join(f"{role}: {text}" if role else text for role, text in texts)


def _content_text(content: Any) -> str:
    if isinstance(content, (list, tuple)):  # multimodal parts: keep the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def as_text(value: Any) -> str | None:
    """Text for a prompt, response or reference: strings stay, chat lists are rendered,
    numbers and lists become their JSON text, None stays None."""
    if value is None or isinstance(value, str):
        return None if value is None else str(value)  # str() turns numpy.str_ into str
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    chat = render_chat(value)
    if chat is not None:
        return chat
    plain = to_json_safe(value, [], "value")
    return plain if isinstance(plain, str) else json.dumps(plain, ensure_ascii=False)


def to_json_safe(value: Any, notes: list[str], path: str = "extra") -> Any:
    """`value` as plain JSON: numpy scalars and arrays unwrapped, tuples and sets as lists,
    non-finite floats and other objects stringified (each such change appended to `notes`)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        notes.append(f"{path}: non-finite float {value!r} stringified")
        return repr(value)
    if isinstance(value, Mapping):
        return {str(k): to_json_safe(v, notes, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json_safe(v, notes, f"{path}[{i}]") for i, v in enumerate(value)]
    for unwrap in ("tolist", "item"):  # numpy arrays and scalars, torch tensors
        method = getattr(value, unwrap, None)
        if callable(method):
            try:
                return to_json_safe(method(), notes, path)
            except (TypeError, ValueError):
                break
    notes.append(f"{path}: {type(value).__name__} stringified")
    return str(value)


def make_sample(
    prompt: Any,
    response: Any,
    reference: Any = None,
    data_source: Any = None,
    extra: Mapping[str, Any] | None = None,
    id: Any = None,
) -> dict:
    """A valid qrq sample from trainer values (see the module docstring for what changes)."""
    notes: list[str] = []
    sample: dict[str, Any] = {"prompt": as_text(prompt) or "", "response": as_text(response) or ""}
    if reference is not None:
        sample["reference"] = as_text(reference)
    if data_source is not None:
        sample["data_source"] = str(data_source)
    if extra:
        sample["extra"] = to_json_safe(dict(extra), notes)
    if notes:
        sample.setdefault("extra", {})[NOTES_KEY] = notes
    if id is not None:
        sample["id"] = to_json_safe(id, [], "id")
    return sample
