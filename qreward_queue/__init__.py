"""qreward-queue: score RL rewards fast under the rate limits of the services that compute them."""

from .config import Config, load_config
from .errors import (
    ConfigError,
    InvalidSamples,
    PermanentError,
    QrqError,
    RateLimited,
    RedisUnreachable,
    RetryableError,
    ScoringError,
    TransientError,
    UnknownRoute,
)
from .runtime import configure, get_app
from .samples import Outcome
from .trainer.batcher import MicroBatcher, score_one, score_one_sync
from .trainer.client import RewardBatch, score, submit_batch

__all__ = [
    "Config",
    "ConfigError",
    "InvalidSamples",
    "MicroBatcher",
    "Outcome",
    "PermanentError",
    "QrqError",
    "RateLimited",
    "RedisUnreachable",
    "RetryableError",
    "RewardBatch",
    "ScoringError",
    "TransientError",
    "UnknownRoute",
    "configure",
    "get_app",
    "load_config",
    "score",
    "score_one",
    "score_one_sync",
    "submit_batch",
]
