"""qreward-queue: score RL rewards fast under the rate limits of the services that compute them."""

from .client import RewardBatch, score, submit_batch
from .config import Config, load_config
from .errors import (
    ConfigError,
    InvalidSamples,
    PermanentError,
    QrqError,
    RateLimited,
    RetryableError,
    ScoringError,
    TransientError,
    UnknownRoute,
)
from .runtime import configure, get_app
from .samples import Outcome

__all__ = [
    "Config",
    "ConfigError",
    "InvalidSamples",
    "Outcome",
    "PermanentError",
    "QrqError",
    "RateLimited",
    "RetryableError",
    "RewardBatch",
    "ScoringError",
    "TransientError",
    "UnknownRoute",
    "configure",
    "get_app",
    "load_config",
    "score",
    "submit_batch",
]
