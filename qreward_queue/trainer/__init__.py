"""The trainer's side: submit a batch (`client`), wait for it from asyncio (`aio`), gather
single samples into batches (`batcher`), and the process-wide app (`runtime`).

Importing it loads no worker module (see tests/unit/test_imports.py)."""
