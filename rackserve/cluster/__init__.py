"""The control plane, plain Python over Ray: deployments and instances and their clients, gang
supervision and fault diagnosis, the request router and the output streams. It starts, watches and
restarts the thin actors of `rackserve.actors`; `rackserve.serve` puts it behind an HTTP endpoint."""
