"""The app Celery's own commands use, built from the configuration:
`celery --app qreward_queue.ops.celery_app flower` (or `inspect ...`, `purge`, ...)."""

from ..broker.app import QrqCelery
from ..config.loader import load_config

app = QrqCelery(load_config())
