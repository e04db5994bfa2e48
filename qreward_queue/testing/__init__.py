"""Test doubles shipped with the package: the mock judge (`mock_judge`), which `qrq demo`,
the examples, the benchmarks and the tests run over real HTTP."""
