"""The planner both sides use: chunk sizes, spreading and failover (`routing`, pure), what each
backend can take now, read from Redis (`capacity`), and judge ensembles (`ensemble`)."""
