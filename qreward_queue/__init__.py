"""qreward-queue: score RL rewards fast under the rate limits of the services that compute them."""

from .config.loader import load_config
from .config.model import Config
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
from .samples import Outcome
from .trainer.batcher import MicroBatcher, score_one, score_one_sync
from .trainer.client import RewardBatch, score, submit_batch
from .trainer.runtime import configure, get_app

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
