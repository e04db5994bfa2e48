"""The chunk results Celery stores for the client, on real Redis: a late duplicate run of a
task never overwrites its stored SUCCESS (as in Celery's own store), other states are
replaced, and a key holding something else is written over rather than failing the task."""

from __future__ import annotations

from celery import states
from support import write_config

import qreward_queue


def test_a_stored_success_stays_and_other_states_are_replaced(tmp_path, redis_url,
                                                                redis_client):
    app = qreward_queue.configure(qreward_queue.load_config(
        write_config(tmp_path, {}, redis_url=redis_url)))
    backend = app.backend
    key = backend.get_key_for_task("t-1")
    # a task that retried (its state written), then ended: the last state is read back
    backend.store_result("t-1", None, states.STARTED)
    assert backend.get_task_meta("t-1", cache=False)["status"] == states.STARTED
    backend.store_result("t-1", [{"score": 1.0}], states.SUCCESS)
    assert backend.get_task_meta("t-1", cache=False)["result"] == [{"score": 1.0}]
    assert 0 < redis_client.ttl(key) <= app.conf.result_expires  # kept as configured
    # a late duplicate run that failed does not overwrite the SUCCESS
    backend.store_result("t-1", ValueError("late"), states.FAILURE)
    meta = backend.get_task_meta("t-1", cache=False)
    assert meta["status"] == states.SUCCESS and meta["result"] == [{"score": 1.0}], meta
    # and a value that is not JSON in the key is replaced, not an error
    redis_client.set(key, b"\xff not json")
    backend.store_result("t-1", [{"score": 0.0}], states.SUCCESS)
    assert backend.get_task_meta("t-1", cache=False)["result"] == [{"score": 0.0}]
