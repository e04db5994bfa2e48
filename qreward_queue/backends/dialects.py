"""The shapes a judge's provider speaks: where the call goes, how it authenticates by default,
the request body and where the reply's text is.

The judge builds one OpenAI chat body (`judge.JudgeBackend.request`); a dialect turns it into
its provider's and reads the text back out of the reply, so prompt templating and score
parsing never see the difference. Usage (`usage` of either shape) is read by `base.usage_split`,
rate-limit headers and overload statuses by `flow/ratelimit_headers.py` and the transport:
every dialect feeds the same flow control.

- `openai`: `POST {url}/chat/completions`, `Authorization: Bearer <key>`; OpenAI, vLLM, SGLang,
  Gemini's OpenAI-compatible endpoint and most gateways. A gateway's legacy text completion
  (passthrough.py) goes to `{url}/completions`.
- `anthropic`: the Messages API, `POST {url}/messages` with `x-api-key` and
  `anthropic-version`; the system prompt apart, `max_tokens` required, no `seed`; the reply's
  text in `content[*].text`, its usage as `input_tokens`/`output_tokens`.
- `azure`: Azure OpenAI, the OpenAI body at `{url}/chat/completions?api-version=...` with an
  `api-key` header; `url` is `https://<resource>.openai.azure.com/openai/deployments/<name>`.
  A text completion goes to `{url}/completions`; the anthropic dialect has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import PermanentError

AUTH_SCHEMES = ("bearer", "api-key", "x-api-key", "none")
ANTHROPIC_VERSION = "2023-06-01"
AZURE_API_VERSION = "2024-10-21"


@dataclass(frozen=True)
class Dialect:
    """One provider's shape; see the module's docstring."""

    name: str
    path: str  # appended to `[backend] url`
    auth: str  # the scheme when the file sets none
    headers: tuple[tuple[str, str], ...] = ()  # sent unless the file sets the same header
    query: tuple[tuple[str, str], ...] = ()  # sent unless the file sets the same parameter
    text_path: str | None = None  # a legacy text completion's, appended to `[backend] url`

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The request body for an OpenAI chat body `chat`."""
        return chat

    def text(self, body: Any) -> str:
        """The reply's text, or a PermanentError naming what the reply lacks."""
        try:
            content = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise PermanentError("reply has no choices[0].message.content",
                                 str(body)[:500]) from None
        if not isinstance(content, str):
            raise PermanentError("choices[0].message.content is not text", str(content)[:500])
        return content


class _Anthropic(Dialect):
    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        system = [m["content"] for m in chat["messages"] if m["role"] == "system"]
        body = {k: v for k, v in chat.items() if k not in ("messages", "seed")}
        body["messages"] = [m for m in chat["messages"] if m["role"] != "system"]
        if system:
            body["system"] = "\n\n".join(system)
        return body

    def text(self, body: Any) -> str:
        blocks = body.get("content") if isinstance(body, dict) else None
        texts = [b.get("text") for b in blocks if isinstance(b, dict)
                 and b.get("type") == "text"] if isinstance(blocks, list) else []
        if not texts:
            raise PermanentError("reply has no content[].text block", str(body)[:500])
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) < len(texts):
            raise PermanentError("content[].text is not text", str(texts)[:500])
        return "".join(strings)


DIALECTS: dict[str, Dialect] = {
    "openai": Dialect("openai", "/chat/completions", "bearer", text_path="/completions"),
    "anthropic": _Anthropic("anthropic", "/messages", "x-api-key",
                            headers=(("anthropic-version", ANTHROPIC_VERSION),)),
    "azure": Dialect("azure", "/chat/completions", "api-key",
                     query=(("api-version", AZURE_API_VERSION),), text_path="/completions"),
}
