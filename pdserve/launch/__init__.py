"""`pdserve launch`: run a cluster config's workers and router as supervised child processes.

planning.py    the cluster config -> one ProcSpec per process (ports, NUMA, GPUs, ServeConfig)
supervisor.py  start, wait for /health, restart by policy (backoff, crash loop), stop
run.py         `launch()`: plan -> check ports -> workers -> router -> supervise -> stop
flags.py       the cluster YAML merged with the defaults, and the serve flags over it (`pdserve launch`)
"""

from pdserve.launch.planning import ProcSpec, plan, port_free, router_spec, worker_spec, write_serve_config
from pdserve.launch.run import launch, new_log_dir
from pdserve.launch.supervisor import Child, Cluster, LaunchError, Restarts, log_tail

__all__ = [
    "Child", "Cluster", "LaunchError", "ProcSpec", "Restarts", "launch", "log_tail", "new_log_dir", "plan", "port_free",
    "router_spec", "worker_spec", "write_serve_config",
]  # fmt: skip
