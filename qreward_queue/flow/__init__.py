"""Flow control: the global limiter (`limiter`, its Lua in `lua/`), the circuit breaker
(`breaker`), what rate-limit headers say (`ratelimit_headers`), what each backend can take now
(`capacity`) and token spend and budgets (`spend`)."""
