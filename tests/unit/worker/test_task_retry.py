"""A chunk task's retry (`worker/tasks.py` `_retry`): published, it is Celery's Retry; when its
message cannot be published, the task's own message goes back to its queue."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import Reject, Retry

from qreward_queue.worker import tasks


class Task:
    """Stands in for the bound task: its `retry` publishes (raises Retry) or cannot."""

    def __init__(self, published: bool):
        self.published = published

    def retry(self, **options: Any) -> Retry:
        if self.published:
            raise Retry(when=options["countdown"])
        # what Celery's Task.retry raises when S.apply_async() fails
        raise Reject(ConnectionError("the broker channel was closed"), requeue=False)


def test_a_published_retry_is_celerys_retry():
    with pytest.raises(Retry):
        tasks._retry(Task(published=True), countdown=1.0)


def test_a_retry_that_cannot_be_published_puts_the_task_back_instead_of_dropping_it():
    with pytest.raises(Reject) as raised:
        tasks._retry(Task(published=False), countdown=1.0)
    assert raised.value.requeue is True
    assert isinstance(raised.value.reason, ConnectionError)
