"""`python -m rackserve.bench.sim`: the published-vs-predicted table (`rackserve sim validate`)."""

from rackserve.bench.sim.published import validate

validate()
