"""The worker's side: the Celery task (`tasks`), its process's call pool (`call_pool`), the
chunk runner (`chunk_runner`), one call's layers (`call_path`) and the retry policy (`retry`).
The backend kinds it calls live in `qreward_queue.backends`, which a trainer reads too."""
