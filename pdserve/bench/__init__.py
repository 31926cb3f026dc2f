"""Benchmark client, plots and PD advisor: `pdserve bench` (pdserve/bench/cli.py `main`; the
advisor: advisor.py `advise`). The package imports none of its modules: they import each other."""
