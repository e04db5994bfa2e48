"""`python -m qreward_queue.cli` runs the `qrq` command."""

from .main import main

main()
