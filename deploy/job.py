"""Deploy the endpoint from a Ray job:

    ray job submit --working-dir . -- python deploy/job.py --config deploy/tiny-cpu.yaml

It joins the cluster the job runs on, starts Ray Serve's HTTP proxy where the config says, deploys
the app, waits until it answers, prints the URL and returns; the app keeps serving after the job
ends (`serve shutdown` stops it).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

import ray
from ray import serve

from rackserve.serve.app import build
from rackserve.serve.config import ServeConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/tiny-cpu.yaml", help="a serve config (deploy/*.yaml)")
    parser.add_argument("--port", type=int, help="override the config's HTTP port")
    args = parser.parse_args()
    config = ServeConfig.from_yaml(args.config)
    if args.port is not None:
        config = ServeConfig.from_dict({**config.to_dict(), "port": args.port})
    ray.init(address="auto")
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build(config.to_dict()), name="rackserve", route_prefix="/")
    url = f"http://{'127.0.0.1' if config.host == '0.0.0.0' else config.host}:{config.port}"
    deadline = time.monotonic() + 120
    while True:  # the replica is up; wait for its deployment's ranks to answer
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                print(json.dumps(json.load(r)))
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    print(f"rackserve is serving {config.model_name!r} at {url}/v1")


if __name__ == "__main__":
    main()
