"""What integrations refuse to pretend: shared limits in embedded mode, a score that is none.

Embedded mode gives every process its own in-memory limiter, so verl's 8 reward workers (or
N TRL ranks) would each drive the judge at its full limit. Integrations call
`require_shared_limits` once per process: with embedded mode it raises a ConfigError saying
that QRQ_REDIS_URL is needed, unless QRQ_ALLOW_EMBEDDED=1 (one process, demos, the examples)
says the user knows: then one calm line per process says what the mode means, nothing more.
"""

from __future__ import annotations

import os
import sys

from ..errors import ConfigError, ScoringError
from ..samples import Outcome
from ..trainer.runtime import get_app

ALLOW_ENV = "QRQ_ALLOW_EMBEDDED"
_noted: set[int] = set()  # the processes that said it already (a forked child says it again)


def require_shared_limits(trainer: str) -> None:
    """Raise when qrq runs embedded under `trainer`; with QRQ_ALLOW_EMBEDDED=1, say once per
    process that its limits hold within this process only."""
    if not get_app().qrq_config.embedded:
        return
    message = (
        f"qrq: {trainer} scores rewards from several processes, but qrq runs in embedded mode "
        "(no Redis URL), so each process would hold its own limiter and together over-drive "
        "the judge. Set QRQ_REDIS_URL (and QRQ_CONFIG) in every trainer process, e.g. for "
        "verl: +ray_kwargs.ray_init.runtime_env.env_vars.QRQ_REDIS_URL=redis://host:6379/0"
    )
    if os.environ.get(ALLOW_ENV) != "1":
        raise ConfigError(message + f" (or {ALLOW_ENV}=1 if this really is one process)")
    if os.getpid() not in _noted:
        _noted.add(os.getpid())
        print(f"qrq: embedded mode under {trainer} ({ALLOW_ENV}=1): the judge's limits hold "
              "within this process", file=sys.stderr)


def unscored_error(outcome: Outcome) -> ScoringError:
    """The error to raise for trainers that drop a sample on an exception (verl V1, AReaL)."""
    return ScoringError(
        f"qrq could not score the sample ({outcome.status}): {outcome.error}", outcome.detail
    )
