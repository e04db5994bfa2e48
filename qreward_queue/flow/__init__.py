"""Flow control: the global limiter (`limiter`, its Lua in `lua/`), the circuit breaker
(`breaker`), what rate-limit headers say (`ratelimit_headers`), token spend and budgets
(`spend`), and the process's registry of them (`registry`). Flow sits below the
configuration: it is handed each backend's settings."""
