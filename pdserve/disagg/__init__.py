"""PD disaggregation: the KV transfer interface (base.py), what every backend shares
(leasing_connector.py, lease_table.py, stats.py, layout.py, staging.py), the same-host copy
(cuda_ipc.py), the nixl backend (the nixl/ package, built by factory.make_connector) and the
in-process fake for unit tests (fake_connector.py).

Nothing is imported here: the router reads KVHandle without loading torch or UCX."""
