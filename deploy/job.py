"""Deploy the endpoint from a Ray job:

    export RAY_AUTH_MODE=token   # with the token Ray's head was started with (README: the whole sequence)
    ray job submit --working-dir . -- python deploy/job.py --config deploy/tiny-cpu.yaml

It joins the cluster the job runs on, starts Ray Serve for the config's ingress (its HTTP proxy, or
none when the replica serves directly: see `rackserve.serve.ingress`), deploys the app, waits until
it answers, prints the URL and returns; the app keeps serving after the job ends (`serve shutdown`
stops it).
"""

from __future__ import annotations

import argparse
import json

import ray
from ray import serve

from rackserve.serve import ingress
from rackserve.serve.app import build
from rackserve.serve.config import INGRESS_KINDS, ServeConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/tiny-cpu.yaml", help="a serve config (deploy/*.yaml)")
    parser.add_argument("--port", type=int, help="override the config's HTTP port")
    parser.add_argument("--ingress", choices=INGRESS_KINDS,
                        help="override the config's ingress ('direct' needs a cluster started for it)")
    args = parser.parse_args()
    config = ServeConfig.from_yaml(args.config)
    overrides = {k: v for k, v in (("port", args.port), ("ingress", args.ingress)) if v is not None}
    config = ServeConfig.from_dict({**config.to_dict(), **overrides})
    ray.init(address="auto")
    url = ingress.start(config)
    serve.run(build(config.to_dict()), name="rackserve", route_prefix="/")
    print(json.dumps(ingress.wait_until_serving(url)))  # the replica is up; its deployment's ranks answer
    print(f"rackserve is serving {config.model_name!r} at {url}/v1")


if __name__ == "__main__":
    main()
