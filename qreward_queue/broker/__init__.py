"""What travels through Redis between the two sides: the Celery app and its settings (`app`),
the result stores (`results`), per-sample records of finished work (`records`), batch leases
(`lease`), the score cache (`cache`), bounded waits on Redis (`redis_wait`) and the kombu fix
that keeps a worker alive through a Redis restart (`kombu_fix`)."""
