"""qreward-queue: score RL rewards fast under the rate limits of the services that compute them."""

from .client import RewardBatch, score, submit_batch
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
from .integrations.batcher import MicroBatcher, score_one, score_one_sync
from .runtime import configure, get_app
from .samples import Outcome

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
