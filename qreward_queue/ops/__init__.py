"""Operations: `qrq status` (`status`), the worker's Prometheus counters (`metrics`), the Redis
state exporter (`exporter`), spend per job (`job_spend`), the pool planner (`plan`), worker
liveness (`liveness`), the audit lane (`audit`), the dead-letter checks of incoming messages
and queue items (`dead_letter`) and the app Celery's own commands load (`celery_app`)."""
