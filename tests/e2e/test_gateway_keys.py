"""The gateway's keys: where qrq.toml says they are, what a wrong entry says (never the key),
and what each key's job may ask for."""

from __future__ import annotations

import json

import pytest
from support import write_config

from qreward_queue.backends import JudgeOptions
from qreward_queue.config.loader import load_config
from qreward_queue.config.model import Backend, GatewaySettings
from qreward_queue.errors import ConfigError
from qreward_queue.flow.spend import Ledger, Usage
from qreward_queue.integrations.gateway_keys import Job, Keys
from qreward_queue.ops.job_spend import JobLedger, job_rows
from qreward_queue.priority import Priority

SECRET = "k-very-secret-0123456789"


def test_keys_from_a_toml_file_named_in_qrq_toml(tmp_path):
    config = write_config(tmp_path, {})
    (tmp_path / "keys.toml").write_text(
        f'[[keys]]\nkey = "{SECRET}"\njob = "team-a"\npriorities = ["bulk", "train"]\n')
    with config.open("a") as fh:
        fh.write('[gateway]\nkeys_file = "keys.toml"\n[gateway.budget.team-a]\n'
                 "tokens_total = 1000\n")
    settings = load_config(config).gateway
    assert settings.budgets["team-a"].tokens_total == 1000
    keys = Keys.load(settings)
    job = keys.job(f"Bearer {SECRET}")
    assert job == Job("team-a", (Priority.BULK, Priority.TRAIN))
    assert keys.job("Bearer wrong") is None and keys.job(None) is None
    assert job.priority(None) is Priority.TRAIN  # train when allowed
    with pytest.raises(PermissionError, match=r"'val' is not allowed for job 'team-a' "
                                              r"\(allowed: bulk, train\)"):
        job.priority("val")
    with pytest.raises(ValueError, match="priority must be one of"):
        job.priority("urgent")


def test_keys_from_an_environment_variable(monkeypatch):
    monkeypatch.setenv("GW_KEYS", json.dumps([{"key": SECRET, "job": "eval",
                                               "priorities": ["val"]}]))
    keys = Keys.load(GatewaySettings(keys_env="GW_KEYS"))
    job = keys.job(f"bearer {SECRET}")
    assert job is not None and job.priority(None) is Priority.VAL
    monkeypatch.delenv("GW_KEYS")
    with pytest.raises(ConfigError, match="GW_KEYS is not set"):
        Keys.load(GatewaySettings(keys_env="GW_KEYS"))


def test_no_keys_is_one_open_job():
    keys = Keys.load(GatewaySettings())
    assert keys.open and keys.job(None) == Job("default")


@pytest.mark.parametrize(("entry", "says"), [
    ({"key": SECRET}, "job: expected"),
    ({"key": SECRET, "job": "a b"}, "job: expected"),
    ({"key": "short", "job": "a"}, "8 characters or more"),
    ({"key": SECRET, "job": "a", "priorities": ["urgent"]}, "priorities: priority must be"),
    ({"key": SECRET, "job": "a", "priorities": []}, "non-empty list"),
    ({"key": SECRET, "job": "a", "team": "x"}, "unknown field(s) team"),
])
def test_a_wrong_entry_names_itself_never_the_key(monkeypatch, entry, says):
    monkeypatch.setenv("GW_KEYS", json.dumps([entry]))
    with pytest.raises(ConfigError) as error:
        Keys.load(GatewaySettings(keys_env="GW_KEYS"))
    assert says in str(error.value) and "key #1" in str(error.value)
    assert SECRET not in str(error.value)


def test_keys_that_are_not_json_are_not_quoted(monkeypatch):
    monkeypatch.setenv("GW_KEYS", f"{SECRET} team-a")
    with pytest.raises(ConfigError, match="not valid JSON") as error:
        Keys.load(GatewaySettings(keys_env="GW_KEYS"))
    assert SECRET not in str(error.value)


def test_a_pasted_key_in_keys_env_is_refused(tmp_path):
    config = write_config(tmp_path, {})
    with config.open("a") as fh:
        fh.write(f'[gateway]\nkeys_env = "{SECRET}"\n')
    with pytest.raises(ConfigError, match=r"gateway\.keys_env: expected the NAME"):
        load_config(config)


@pytest.mark.parametrize("budget", ["", "[gateway.budget.team-a]\ntokens_total = 1000\n"])
def test_a_jobs_spend_reaches_redis_with_or_without_a_budget(tmp_path, redis_client, redis_url,
                                                             budget):
    config = write_config(tmp_path, {}, redis_url)
    with config.open("a") as fh:
        fh.write(budget)
    loaded = load_config(config)
    # the workers book each call's usage to its job (the gateway's key names the job)
    spend = Ledger(redis_client, Backend("j", "judge", options=JudgeOptions(url="http://judge/v1",
                                         model="m")))
    spend.spent(Usage(30, 5), None, None, job="team-a")
    spend.spent(Usage(10, 5), None, None, job="team-a")
    spend.flush()
    ledger = JobLedger(redis_client, loaded)
    ledger.flush()
    [row] = [r for r in job_rows(redis_client, loaded) if r["job"] == "team-a"]
    assert row["total"]["calls"] == 2
    assert (row["total"]["tokens_in"], row["total"]["tokens_out"]) == (40, 10)
    assert ledger.refusal("team-a") is None
