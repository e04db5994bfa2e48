"""`python -m qreward_queue.testing.mock_judge`: how spawn() and the benchmarks start it."""

from . import mock_judge_cli

if __name__ == "__main__":
    mock_judge_cli()
