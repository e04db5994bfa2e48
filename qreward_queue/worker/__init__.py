"""The worker's side: its start (`boot`: `qrq worker` and the embedded worker), the Celery
task (`tasks`), the chunk runner (`chunk_runner`), one call's layers (`call_path`), its
process's call pool and call loop (`call_pool`, `call_loop`) and the retry policy (`retry`).
The backend kinds it calls live in `qreward_queue.backends`, which a trainer reads too."""
