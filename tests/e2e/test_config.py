"""qrq.toml and workers/*.toml: what loads; each mistake is one ConfigError naming file and key."""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import pytest

from qreward_queue.config.loader import load_backend, load_config
from qreward_queue.config.model import Config
from qreward_queue.errors import ConfigError, UnknownRoute

ROOT = Path(__file__).resolve().parents[2]

JUDGE = """
[backend]
kind = "judge"
url = "http://127.0.0.1:9/v1"
model = "m"
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """The user's QRQ_* variables must not leak into these tests."""
    monkeypatch.delenv("QRQ_CONFIG", raising=False)
    monkeypatch.delenv("QRQ_REDIS_URL", raising=False)


def write_backend(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(textwrap.dedent(text))
    return path


def write_tree(tmp_path: Path, qrq: str, backends: dict[str, str] | None = None) -> Path:
    """qrq.toml (text) plus workers/<name>.toml (text); returns the qrq.toml path."""
    workers = tmp_path / "workers"
    workers.mkdir(exist_ok=True)
    for name, text in (backends if backends is not None else {"j": JUDGE}).items():
        write_backend(workers, name, text)
    path = tmp_path / "qrq.toml"
    path.write_text(textwrap.dedent(qrq))
    return path


def config_error(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return str(info.value)


# --- what ships -----------------------------------------------------------------------------


def test_shipped_qrq_toml_and_workers_load():
    config = load_config(ROOT / "qrq.toml")
    assert config.embedded and config.redis_url is None
    assert {"mock-a", "mock-b", "mock-rm", "exact-match"} <= set(config.backends)
    assert config.default_route == "demo"
    assert config.routes["demo"].backends == ("mock-a", "mock-b")
    assert config.routes["demo"].weights == (1.0, 1.0)
    assert config.routes["rm"].backends == ("mock-rm",)
    mock_a = config.backends["mock-a"]
    assert (mock_a.kind, mock_a.queue, mock_a.limits.rpm) == ("judge", "qrq.mock-a", 6000.0)
    assert mock_a.pool.sized and mock_a.pool.rate_limit is None  # README: sizing a pool
    assert mock_a.source.endswith("mock-a.toml")
    rm = config.backends["mock-rm"]
    assert (rm.kind, rm.options.batch_size, rm.chunk_size) == ("reward_model", 16, None)
    exact = config.backends["exact-match"]
    assert (exact.kind, exact.pool.type, exact.chunk_size) == ("function", "prefork", 64)


@pytest.mark.parametrize("template", sorted((ROOT / "workers").glob("*.toml.example")))
def test_worker_templates_parse_when_copied(tmp_path, template):
    copy = tmp_path / template.name.removesuffix(".example")
    shutil.copy(template, copy)
    backend = load_backend(copy)
    assert backend.name == copy.stem
    assert backend.kind == "judge"
    assert backend.options.url.startswith(("http://", "https://"))
    if backend.api_key_env is not None:  # the NAME of a variable, never a key
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", backend.api_key_env), backend.api_key_env
        assert not backend.api_key_env.lower().startswith("sk-")


# --- lookup and modes -----------------------------------------------------------------------


def test_qrq_config_env_is_honoured(tmp_path, monkeypatch):
    path = write_tree(tmp_path, "[routes.r]\nbackends = ['j']\n")
    monkeypatch.setenv("QRQ_CONFIG", str(path))
    monkeypatch.chdir(ROOT)  # ./qrq.toml exists here and must lose to $QRQ_CONFIG
    config = load_config()
    assert config.source == str(path)
    assert set(config.backends) == {"j"}


def test_qrq_config_pointing_at_missing_file_names_it(tmp_path, monkeypatch):
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("QRQ_CONFIG", str(missing))
    message = config_error(load_config)
    assert str(missing) in message and "not found" in message


def test_dot_qrq_toml_is_found_in_cwd(tmp_path, monkeypatch):
    write_tree(tmp_path, "")
    monkeypatch.chdir(tmp_path)
    assert set(load_config().backends) == {"j"}


def test_no_file_at_all_means_embedded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config()
    assert config.embedded
    assert config.backends == {} and config.routes == {}


def test_qrq_redis_url_overrides_the_file(tmp_path, monkeypatch):
    path = write_tree(tmp_path, '[redis]\nurl = "redis://file-host:6379/0"\n')
    assert load_config(path).redis_url == "redis://file-host:6379/0"
    monkeypatch.setenv("QRQ_REDIS_URL", "redis://env-host:6380/1")
    config = load_config(path)
    assert config.redis_url == "redis://env-host:6380/1"
    assert not config.embedded


def test_qrq_redis_url_alone_gives_distributed_mode(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QRQ_REDIS_URL", "redis://h:6379/0")
    assert not load_config().embedded


def test_bad_qrq_redis_url_names_the_variable(tmp_path, monkeypatch):
    path = write_tree(tmp_path, "")
    monkeypatch.setenv("QRQ_REDIS_URL", "http://localhost:6379")
    message = config_error(load_config, path)
    assert "QRQ_REDIS_URL" in message and "redis://" in message and "http://localhost" in message


def test_bad_redis_url_in_file_names_file_and_key(tmp_path):
    path = write_tree(tmp_path, '[redis]\nurl = "localhost:6379"\n')
    message = config_error(load_config, path)
    assert str(path) in message and "redis.url" in message and "localhost:6379" in message


def test_route_lookup_bare_backend_default_and_unknown(tmp_path):
    path = write_tree(
        tmp_path,
        """
        [defaults]
        route = "both"
        [routes.both]
        backends = ["a", "b"]
        [routes.both.weights]
        a = 3
        """,
        {"a": JUDGE, "b": JUDGE},
    )
    config = load_config(path)
    assert config.route(None) is config.routes["both"]
    assert config.route("both").weights == (3.0, 1.0)
    bare = config.route("a")  # a bare backend name is a one-backend route
    assert (bare.name, bare.backends, bare.weights) == ("a", ("a",), (1.0,))
    with pytest.raises(UnknownRoute) as info:
        config.route("nope")
    assert "'nope'" in str(info.value)
    assert "known: a, b, both" in str(info.value)


def test_no_route_and_no_default_route_says_so():
    config = Config(redis_url=None, backends={}, routes={}, source="x.toml")
    with pytest.raises(UnknownRoute, match=r"no route given.*x\.toml.*\[defaults\] route"):
        config.route(None)


# --- qrq.toml mistakes ----------------------------------------------------------------------


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "qrq.toml"
    path.write_text("[defaults\nroute = 1\n")
    message = config_error(load_config, path)
    assert str(path) in message and "not valid TOML" in message and "line 1" in message


def test_missing_file_names_the_file(tmp_path):
    message = config_error(load_config, tmp_path / "absent.toml")
    assert str(tmp_path / "absent.toml") in message and "file not found" in message


def test_missing_workers_dir(tmp_path):
    path = tmp_path / "qrq.toml"
    path.write_text('workers_dir = "pools"\n')
    message = config_error(load_config, path)
    assert str(path) in message and "workers_dir" in message and "pools" in message


def test_route_naming_a_missing_backend(tmp_path):
    path = write_tree(tmp_path, '[routes.r]\nbackends = ["j", "ghost"]\n')
    message = config_error(load_config, path)
    assert str(path) in message and "routes.r.backends" in message
    assert "'ghost'" in message and "known: j" in message


@pytest.mark.parametrize(
    ("route_toml", "key", "expected"),
    [
        ("[routes.r]\n", "routes.r.backends", "missing"),
        ("[routes.r]\nbackends = []\n", "routes.r.backends", "non-empty list"),
        ('[routes.r]\nbackends = "j"\n', "routes.r.backends", "a list of backend names"),
        ("[routes.r]\nbackends = [1]\n", "routes.r.backends", "backend names"),
        ('[routes.r]\nbackends = ["j"]\ncache = "yes"\n', "routes.r.cache", "bool"),
        ('[routes.r]\nbackends = ["j"]\n[routes.r.weights]\nj = -1\n', "routes.r.weights.j", ""),
        ('[routes.r]\nbackends = ["j"]\n[routes.r.weights]\nk = 1\n', "routes.r.weights.k", ""),
        ('[routes.r]\nbackends = ["j"]\nbackend = ["j"]\n', "routes.r.backend", "unknown key"),
        ("routes = 5\n", "[routes]", "must be a table"),
    ],
)
def test_route_mistakes_name_file_and_key(tmp_path, route_toml, key, expected):
    path = write_tree(tmp_path, route_toml)
    message = config_error(load_config, path)
    assert str(path) in message and key in message and expected in message


def test_unknown_default_route(tmp_path):
    path = write_tree(tmp_path, '[defaults]\nroute = "missing"\n')
    message = config_error(load_config, path)
    assert str(path) in message and "defaults.route" in message and "'missing'" in message
    assert "known: j" in message


@pytest.mark.parametrize(
    ("toml", "key", "expected"),
    [
        ("[defaults]\ndeadline_s = -5\n", "defaults.deadline_s", "a positive number"),
        ('[defaults]\ndeadline_s = "10"\n', "defaults.deadline_s", "a number"),
        ("[defaults]\ndeadline_s = true\n", "defaults.deadline_s", "a number"),
        ("[defaults]\nmax_sample_bytes = 0\n", "defaults.max_sample_bytes", "an integer >= 1"),
        ("[defaults]\nmax_sample_bytes = 1.5\n", "defaults.max_sample_bytes", "an integer"),
        ("[defaults]\nroute = 3\n", "defaults.route", "str"),
        ("[defaults]\ndeadline = 10\n", "defaults.deadline", "unknown key"),
        ('[redis]\nuri = "redis://h"\n', "redis.uri", "unknown key"),
        ("[default]\nroute = 'j'\n", "default: unknown key", ""),
        ("workers_dir = 3\n", "workers_dir", "str"),
    ],
)
def test_qrq_toml_mistakes_name_file_and_key(tmp_path, toml, key, expected):
    path = write_tree(tmp_path, toml)
    message = config_error(load_config, path)
    assert str(path) in message and key in message and expected in message


def test_unknown_key_message_lists_the_known_keys(tmp_path):
    path = write_tree(tmp_path, "[defaults]\ndeadline = 10\n")
    message = config_error(load_config, path)
    assert "known:" in message and "deadline_s" in message and "fallback_score" in message


def test_duplicate_backend_names_name_both_files(tmp_path):
    path = write_tree(
        tmp_path,
        "",
        {"one": JUDGE + 'name = "same"\n', "two": JUDGE + 'name = "same"\n'},
    )
    message = config_error(load_config, path)
    assert "'same'" in message and "one.toml" in message and "two.toml" in message
    assert "backend.name" in message


def test_broken_backend_file_is_named_by_load_config(tmp_path):
    path = write_tree(tmp_path, "", {"ok": JUDGE, "bad": JUDGE + "\n[limits]\nrpm = -1\n"})
    message = config_error(load_config, path)
    assert str(tmp_path / "workers" / "bad.toml") in message and "limits.rpm" in message


# --- workers/<backend>.toml mistakes --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ('[backend]\nurl = "http://h/v1"\n', "backend.kind", "missing"),
        ("", "backend.kind", "one of judge, reward_model, function"),
        ('[backend]\nkind = "llm"\n', "backend.kind", "one of judge, reward_model, function"),
        ("[backend]\nkind = 1\n", "backend.kind", "one of judge"),
        ("backend = 5\n", "[backend]", "must be a table"),
        ('[backend]\nkind = "judge"\nmodel = "m"\n', "backend.url", "missing"),
        ('[backend]\nkind = "judge"\nurl = "ftp://h"\nmodel = "m"\n', "backend.url", "http(s)"),
        ('[backend]\nkind = "judge"\nurl = "http://h"\n', "backend.model", "missing"),
        (JUDGE + "timeout_s = -1\n", "backend.timeout_s", "a positive number"),
        (JUDGE + "timeout_s = 0\n", "backend.timeout_s", "a positive number"),
        (JUDGE + 'timeout_s = "30"\n', "backend.timeout_s", "a number"),
        (JUDGE + "max_tokens = 0\n", "backend.max_tokens", "an integer >= 1"),
        (JUDGE + "max_tokens = true\n", "backend.max_tokens", "an integer"),
        (JUDGE + "chunk_size = 2.5\n", "backend.chunk_size", "an integer"),
        (JUDGE + "api_key_env = 12\n", "backend.api_key_env", "the NAME of an environment"),
        (JUDGE + 'name = "has space"\n', "backend.name", "letters, digits"),
        (JUDGE + 'modle = "x"\n', "backend.modle", "unknown key"),
        (JUDGE + 'score_pattern = "Score: ("\n', "backend.score_pattern", "a valid regex"),
        (JUDGE + "score_pattern = 'Score: \\d+'\n", "backend.score_pattern", "capture group"),
        (JUDGE + 'prompt_template = "{answer}"\n', "backend.prompt_template", "placeholders"),
        (JUDGE + 'prompt_template = "{prompt"\n', "backend.prompt_template", "placeholders"),
        (JUDGE + 'prompt_template = "{0}"\n', "backend.prompt_template", "placeholders"),
        (JUDGE + "score_range = [1, 0]\n", "backend.score_range", "low <= high"),
        (JUDGE + "score_range = [0]\n", "backend.score_range", "two finite numbers"),
        (JUDGE + 'score_range = [0, "1"]\n', "backend.score_range", "two finite numbers"),
        (JUDGE + "score_range = [0, inf]\n", "backend.score_range", "two finite numbers"),
        (JUDGE + 'score_match = "max"\n', "backend.score_match", "one of unique, first, last"),
        ('[backend]\nkind = "function"\n', "backend.function", "missing"),
        ('[backend]\nkind = "function"\nfunction = "os.path"\n', "backend.function", "import"),
        (
            '[backend]\nkind = "reward_model"\nurl = "http://h"\nbatch_size = 0\n',
            "backend.batch_size",
            "an integer >= 1",
        ),
        (JUDGE + "[limits]\nrpm = -5\n", "limits.rpm", "a number >= 0"),
        (JUDGE + '[limits]\nrpm = "100"\n', "limits.rpm", "a number"),
        (JUDGE + "[limits]\ntpm = -1\n", "limits.tpm", "a number >= 0"),
        (JUDGE + "[limits]\nmax_concurrent = -1\n", "limits.max_concurrent", "an integer >= 0"),
        (JUDGE + "[limits]\nmax_concurrent = 1.5\n", "limits.max_concurrent", "an integer"),
        (JUDGE + "[limits]\nburst_s = 0\n", "limits.burst_s", "a positive number"),
        (JUDGE + "[limits]\nrmp = 10\n", "limits.rmp", "unknown key"),
        (JUDGE + '[pool]\nrate_limit = "fast"\n', "pool.rate_limit", "a Celery rate"),
        (JUDGE + '[pool]\nrate_limit = "10/d"\n', "pool.rate_limit", "a Celery rate"),
        (JUDGE + "[pool]\nrate_limit = 50\n", "pool.rate_limit", "a Celery rate"),
        (JUDGE + '[pool]\ntype = "gevent"\n', "pool.type", "one of threads, prefork, solo"),
        (JUDGE + "[pool]\nconcurrency = 0\n", "pool.concurrency", "an integer >= 1"),
        (JUDGE + '[pool]\nconcurrency = "8"\n', "pool.concurrency", "an integer"),
        (JUDGE + "[retry]\nattempts = 0\n", "retry.attempts", "an integer >= 1"),
        (JUDGE + "[retry]\njitter = 1\n", "retry.jitter", "bool"),
        (JUDGE + "[retry]\nrate_limited_per_attempt = -1\n", "retry.rate_limited_per_attempt",
         "an integer >= 0"),
        (JUDGE + "[retry]\nbackoff_base_s = -1\n", "retry.backoff_base_s", "a number >= 0"),
        (JUDGE + "[retry]\nbreaker_threshold = 0\n", "retry.breaker_threshold", "an integer >= 1"),
        (JUDGE + "[limit]\nrpm = 10\n", "limit", "unknown key"),
        (JUDGE + "limits = 3\n", "backend.limits", "unknown key"),
        ("limits = 3\n" + JUDGE, "[limits]", "must be a table"),
    ],
)
def test_backend_mistakes_name_file_key_and_expectation(tmp_path, text, key, expected):
    path = write_backend(tmp_path, "b", text)
    message = config_error(load_backend, path)
    assert message.startswith(str(path)), message
    assert key in message, message
    assert expected in message, message


def test_url_reads_env_references(tmp_path, monkeypatch):
    url = "http://${QRQ_T_HOST}:${QRQ_T_PORT:-8000}/v1"
    text = f'[backend]\nkind = "judge"\nurl = "{url}"\nmodel = "m"\n'
    path = write_backend(tmp_path, "b", text)
    monkeypatch.setenv("QRQ_T_HOST", "judge-7")
    monkeypatch.delenv("QRQ_T_PORT", raising=False)
    assert load_backend(path).options.url == "http://judge-7:8000/v1"  # the default
    monkeypatch.setenv("QRQ_T_PORT", "9001")
    assert load_backend(path).options.url == "http://judge-7:9001/v1"
    monkeypatch.delenv("QRQ_T_HOST")
    message = config_error(load_backend, path)
    assert str(path) in message and "backend.url" in message and "QRQ_T_HOST" in message


def test_shipped_mock_judge_hosts_follow_the_env(monkeypatch):
    monkeypatch.setenv("QRQ_MOCK_A_HOST", "mock-a.internal")
    assert load_backend(ROOT / "workers" / "mock-a.toml").options.url == "http://mock-a.internal:8101/v1"


def test_wrong_value_is_quoted_in_the_message(tmp_path):
    path = write_backend(tmp_path, "b", JUDGE + '[pool]\nrate_limit = "fast"\n')
    assert "got 'fast'" in config_error(load_backend, path)


def test_backend_invalid_toml_and_missing_file(tmp_path):
    broken = write_backend(tmp_path, "broken", "[backend\nkind = 'judge'\n")
    message = config_error(load_backend, broken)
    assert str(broken) in message and "not valid TOML" in message
    message = config_error(load_backend, tmp_path / "gone.toml")
    assert str(tmp_path / "gone.toml") in message and "file not found" in message


def test_backend_defaults_and_explicit_values(tmp_path):
    judge = load_backend(write_backend(tmp_path, "j", JUDGE))
    pool = judge.pool
    assert (judge.name, judge.chunk_size, pool.type, pool.concurrency, pool.calls) == (
        "j",
        None,  # sized by the planner
        "threads",
        4,  # chunk tasks at once: while one waits for its slowest call, three keep calls busy
        64,  # no `calls`: the most the pool sizes itself to (no limits: an asyncio client's 64)
    )
    assert pool.sized
    assert judge.limits.rpm is None and judge.limits.max_concurrent is None
    rm = load_backend(
        write_backend(
            tmp_path,
            "rm",
            """
            [backend]
            kind = "reward_model"
            url = "https://rm/v1/rewards"
            batch_size = 32
            [limits]
            rpm = 0
            max_concurrent = 0
            """,
        )
    )
    assert (rm.options.batch_size, rm.chunk_size) == (32, None)
    assert rm.limits.rpm is None and rm.limits.max_concurrent is None  # 0 means no limit
    fn = load_backend(
        write_backend(
            tmp_path, "fn", '[backend]\nkind = "function"\nfunction = "pkg.mod:fn"\nname = "f1"\n'
        )
    )
    assert (fn.name, fn.queue, fn.chunk_size, fn.pool.type) == ("f1", "qrq.f1", 16, "prefork")


def test_template_with_known_placeholders_and_format_specs_loads(tmp_path):
    template = "{prompt!r} {response:>5} {reference} {data_source} {extra}"
    text = JUDGE + f'prompt_template = "{template}"\n'
    backend = load_backend(write_backend(tmp_path, "b", text))
    assert "{response:>5}" in backend.options.prompt_template


# --- bugs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["{prompt.foo}", "{extra:>10}"])
def test_template_errors_of_every_kind_are_config_errors(tmp_path, template):
    path = write_backend(tmp_path, "b", JUDGE + f'prompt_template = "{template}"\n')
    message = config_error(load_backend, path)
    assert "backend.prompt_template" in message


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[defaults]\nfallback_score = nan\n", "defaults.fallback_score"),
        ("[defaults]\ndeadline_s = nan\n", "defaults.deadline_s"),
        ("[defaults]\ndeadline_s = inf\n", "defaults.deadline_s"),
    ],
)
def test_non_finite_numbers_are_rejected(tmp_path, toml, key):
    path = write_tree(tmp_path, toml)
    message = config_error(load_config, path)
    assert key in message


def test_api_key_env_must_look_like_a_variable_name(tmp_path):
    secret = "sk-proj-abcdefghijklmnop1234567890"
    path = write_backend(tmp_path, "b", JUDGE + f'api_key_env = "{secret}"\n')
    message = config_error(load_backend, path)
    assert "backend.api_key_env" in message
    assert secret not in message


def test_every_problem_of_a_file_is_reported_at_once(tmp_path):
    file = tmp_path / "j.toml"
    file.write_text('[backend]\nkind = "judge"\nurl = "http://h/v1"\nmodel = "m"\ntimeout_s = "x"\n'
                    '[limits]\nrpm = "fast"\nmax_concurrnt = 4\n[pool]\ncalls = 0\n')
    with pytest.raises(ConfigError) as info:
        load_backend(file)
    message = str(info.value)
    assert message.startswith(f"{file}: backend.timeout_s: expected a number, got 'x'; ")
    for part in ("limits.rpm: expected a number, got 'fast'", "limits.max_concurrnt: unknown key",
                 "pool.calls: expected an integer >= 1, got 0"):
        assert part in message
    assert message.count(str(file)) == 1 and "\n" not in message


@pytest.mark.parametrize("tables, expected", [
    ("[budget]\n", "budget: expected at least one of tokens_per_hour"),
    ("[budget]\ncost_total = 5\n", "budget: a cost budget needs a [price] table"),
    ("[budget]\ntokens_total = -1\n", "budget.tokens_total: expected a positive number"),
    ("[price]\ninput_per_million = 1\nper_call = 2\n", "price.per_call"),
])
def test_price_and_budget_mistakes_name_file_and_key(tmp_path, tables, expected):
    path = write_backend(tmp_path, "j", JUDGE + tables)
    message = config_error(load_backend, path)
    assert str(path) in message and expected in message, message


def test_price_and_budget_load(tmp_path):
    from qreward_queue.config.model import Budget, Price

    backend = load_backend(write_backend(tmp_path, "j", JUDGE + (
        "[price]\ninput_per_million = 0.15\noutput_per_million = 0.6\n"
        "[budget]\ntokens_per_hour = 1000000\ncost_total = 25\n")))
    assert backend.price == Price(0.15, 0.6)
    assert backend.budget == Budget(tokens_per_hour=1e6, cost_total=25.0)
    assert backend.budget.limits() == {"tokens_per_hour": 1e6, "cost_total": 25.0}
