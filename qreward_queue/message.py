"""The score_chunk task's message contract: its name and the kwargs the client sends and the
worker reads (one module both import, so the two cannot drift apart).

The client sends `backend, samples, route, deadline, batch, indices`; a task that retries
itself adds `done` (outcomes settled so far), `attempt` and `tried` (backends failed over
from). See `tasks.score_chunk` for what each means.
"""

from __future__ import annotations

TASK_NAME = "qrq.score_chunk"


def chunk_kwargs(backend: str, samples: list[dict], route: list[str], deadline: float,
                 batch: str, indices: list[int]) -> dict:
    """The kwargs of a new chunk's task (JSON-serializable)."""
    return {"backend": backend, "samples": samples, "route": route, "deadline": deadline,
            "batch": batch, "indices": indices}


def summary(backend: str, samples: list) -> dict[str, str]:
    """How a task's arguments show in Flower and logs: never the prompts themselves."""
    return {"argsrepr": f"({backend!r}, <{len(samples)} samples>)", "kwargsrepr": "{}"}
