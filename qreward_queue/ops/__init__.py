"""Operations: `qrq status` (`status`), the worker's Prometheus counters (`metrics`), the Redis
state exporter (`exporter`), the pool planner (`plan`), worker liveness (`liveness`) and the
dead-letter checks of incoming messages and queue items (`dead_letter`)."""
