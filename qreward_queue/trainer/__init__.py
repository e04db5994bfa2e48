"""The trainer's side: submit a batch (`client`), wait for it from asyncio (`aio`), plan it over
a route's backends (`routing`), and gather single samples into batches (`batcher`).

Importing it loads no worker module (see tests/test_imports.py)."""
