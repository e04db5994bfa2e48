"""The Redis configuration: plain URLs and Sentinel groups, from qrq.toml and QRQ_REDIS_URL."""

from __future__ import annotations

import pytest
from support import free_port

from qreward_queue.broker.app import celery_settings
from qreward_queue.config import redis_conn
from qreward_queue.config.loader import load_config
from qreward_queue.config.redis_conn import check_redis
from qreward_queue.errors import ConfigError, RedisUnreachable


def config_with(tmp_path, redis_table: str):
    (tmp_path / "workers").mkdir(exist_ok=True)
    path = tmp_path / "qrq.toml"
    path.write_text(f'workers_dir = "workers"\n[redis]\n{redis_table}\n')
    return load_config(path)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in ("QRQ_REDIS_URL", "QRQ_REDIS_SERVICE_NAME", "QRQ_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def test_sentinels_in_qrq_toml_become_celerys_sentinel_url_with_the_master_name(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("QRQ_TEST_REDIS_PW", "r-secret")
    monkeypatch.setenv("QRQ_TEST_SENTINEL_PW", "s-secret")
    config = config_with(tmp_path, '\n'.join([
        'sentinels = ["10.0.0.1:26379", "10.0.0.2:26380"]', 'service_name = "qrq"', "db = 2",
        'password_env = "QRQ_TEST_REDIS_PW"', 'sentinel_password_env = "QRQ_TEST_SENTINEL_PW"',
    ]))
    settings = celery_settings(config)
    url = "sentinel://:r-secret@10.0.0.1:26379/2;sentinel://:r-secret@10.0.0.2:26380/2"
    assert settings["broker_url"] == url
    assert settings["result_backend"] == f"qreward_queue.broker.results:QrqSentinelBackend+{url}"
    for options in (settings["broker_transport_options"],
                    settings["result_backend_transport_options"]):
        assert options["master_name"] == "qrq"
        assert options["sentinel_kwargs"]["password"] == "s-secret"
        assert options["global_keyprefix"] == "qrq:"
    # and no message shows a password
    described = redis_conn.describe(config)
    assert "secret" not in described and "10.0.0.2:26380" in described and "'qrq'" in described


def test_qrq_redis_url_in_celerys_form_takes_the_service_name_from_config_or_env(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("QRQ_REDIS_URL", "sentinel://h1:26379;sentinel://h2/0")
    config = config_with(tmp_path, 'url = "redis://elsewhere:6379/0"\nservice_name = "m1"')
    assert config.redis_service_name == "m1"
    assert redis_conn.sentinel_addresses(config.redis_url) == [("h1", 26379), ("h2", 26379)]
    assert celery_settings(config)["broker_url"] == "sentinel://h1:26379/0;sentinel://h2/0"
    monkeypatch.setenv("QRQ_REDIS_SERVICE_NAME", "m2")
    assert load_config(None).redis_service_name == "m2"  # no file at all: env only
    # a password written in the first sentinel's URL reaches the primary, as in Celery
    monkeypatch.setenv("QRQ_REDIS_URL", "sentinel://qrq:pw@h1:26379/0;sentinel://h2/0")
    master = redis_conn.connect(load_config(None)).connection_pool.connection_kwargs
    assert (master["username"], master["password"], master["db"]) == ("qrq", "pw", 0)


@pytest.mark.parametrize(("table", "message"), [
    ('sentinels = ["h:26379"]', "names sentinels but no service: set [redis] service_name"),
    ('sentinels = []\nservice_name = "m"', 'redis.sentinels: expected a non-empty list'),
    ('url = "redis://h/0"\nsentinels = ["h:1"]\nservice_name = "m"', "either url or sentinels"),
    ('url = "sentinel://h:1;redis://h:2"\nservice_name = "m"', "is not sentinel://host"),
    ('url = "http://h/0"', "expected a redis://, rediss:// or sentinel:// URL"),
])
def test_wrong_redis_settings_are_one_line_errors_naming_the_field(tmp_path, table, message):
    with pytest.raises(ConfigError) as err:
        config_with(tmp_path, table)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_plain_url_takes_its_password_from_the_named_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("QRQ_TEST_REDIS_PW", "p@ss")
    config = config_with(tmp_path, 'url = "redis://h:6379/1"\npassword_env = "QRQ_TEST_REDIS_PW"')
    assert celery_settings(config)["broker_url"] == "redis://:p%40ss@h:6379/1"
    assert redis_conn.connect(config).connection_pool.connection_kwargs["password"] == "p@ss"
    assert "p@ss" not in redis_conn.describe(config)


def test_no_sentinel_answering_and_an_unknown_service_are_one_line_errors(tmp_path):
    dead = [free_port(), free_port()]
    config = config_with(tmp_path, f'sentinels = ["127.0.0.1:{dead[0]}", "127.0.0.1:{dead[1]}"]'
                                   '\nservice_name = "m"')
    with pytest.raises(RedisUnreachable) as err:
        check_redis(config)
    message = str(err.value)
    assert message.startswith(f"no sentinel answered at 127.0.0.1:{dead[0]}, 127.0.0.1:{dead[1]}")
    assert "\n" not in message
