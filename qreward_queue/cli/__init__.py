"""The `qrq` command (`main`): init (`init_config`), demo (`demo`, `demo_clients`), score,
worker, status, plan, exporter, gateway, dead-letters, audit, mock-judge."""
