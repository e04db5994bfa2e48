"""Every trainer adapter treats a `cancelled` sample exactly as a `timeout` one (unit test: the
micro-batcher is replaced by one that answers a fixed outcome; the real path is in
test_integrations.py and test_cancel.py)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from qreward_queue.errors import ScoringError
from qreward_queue.integrations import areal, openrlhf, slime, trl, verl
from qreward_queue.samples import Outcome

FALLBACK = -1.0


class FixedBatcher:
    """Answers every sample with `outcome` (as the client places it: fallback score)."""

    def __init__(self, outcome: Outcome):
        self.outcome = outcome

    async def score(self, *_args, **_kwargs) -> Outcome:
        return self.outcome

    async def score_many(self, samples, *_args, **_kwargs) -> list[Outcome]:
        return [self.outcome] * len(samples)

    def submit(self, *_args, **_kwargs) -> Future:
        future: Future = Future()
        future.set_result(self.outcome)
        return future


def adapters_answer() -> dict:
    """What each adapter hands its trainer for one sample (answered by the FixedBatcher)."""
    async def run() -> dict:
        sample = SimpleNamespace(prompt="p", response="r", label="4", metadata=None,
                                 remove_sample=False)
        slime_score = await slime.rm(SimpleNamespace(), sample)
        try:
            await areal.score_episode("p", "r", {"answer": "4"})
            areal_result = "scored"
        except ScoringError as exc:
            areal_result = type(exc).__name__
        logged: dict = {}
        return {
            "verl": await verl.compute_score(solution_str="r", extra_info={"question": "p"}),
            "trl": await trl.qrq_reward()(prompts=["p"], completions=["r"],
                                          log_extra=logged.__setitem__),
            "trl_log": logged,
            "slime": (slime_score, sample.remove_sample, sample.metadata),
            "openrlhf": openrlhf.reward_func(["pr"], ["p"], ["4"]),
            "areal": areal_result,
            "areal_fallback": await areal.score_episode("p", "r", {}, on_unscored="fallback"),
        }

    return asyncio.run(run())


@pytest.fixture
def fixed(monkeypatch):
    def use(outcome: Outcome) -> None:
        for module in (verl, trl, slime, openrlhf, areal):
            monkeypatch.setattr(module, "default_batcher", lambda: FixedBatcher(outcome))
            if hasattr(module, "require_shared_limits"):
                monkeypatch.setattr(module, "require_shared_limits", lambda _trainer: None)
    return use


def test_cancelled_maps_like_timeout_in_every_adapter(fixed):
    answers = {}
    for status in ("timeout", "cancelled"):
        fixed(Outcome(FALLBACK, status, error=f"{status} for the test"))
        answers[status] = adapters_answer()
    timeout, cancelled = answers["timeout"], answers["cancelled"]
    # the status itself is passed on where the trainer logs it; all else is identical
    assert cancelled["verl"] == {**timeout["verl"], "qrq_status": "cancelled"}
    assert cancelled["trl_log"] == {"qrq_status": ["cancelled"]}
    assert cancelled["slime"][2] == {"qrq_status": "cancelled"}
    for name in ("trl", "openrlhf", "areal", "areal_fallback"):
        assert cancelled[name] == timeout[name], name
    assert cancelled["slime"][:2] == timeout["slime"][:2] == (FALLBACK, True)
    assert cancelled["trl"] == [None] and cancelled["areal"] == "ScoringError"
    assert cancelled["verl"]["qrq_ok"] == 0.0 and cancelled["verl"]["score"] == FALLBACK
