"""What every benchmark script (`python -m rackserve.bench.<name>`) shares: its parser, the Ray cluster
and Serve proxy it runs on, and its last line.

    def main(argv: list[str] | None = None) -> dict:
        ap = script.parser(__doc__)
        ap.add_argument("--sizes", type=script.int_list, default="1,4,8")
        args = ap.parse_args(argv)
        with script.ray_cluster():
            measured = measure(args.sizes)
        print(table(measured))
        return script.headline(figures(measured))

Ray is imported only by the functions that start it, so a benchmark without Ray does not load it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator


def parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose --help is the benchmark module's docstring `doc`, line breaks kept."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def int_list(text: str) -> list[int]:
    """An argparse `type`: "1,2,4" -> [1, 2, 4] (a string default is parsed the same way)."""
    return [int(item) for item in text.split(",")]


@contextlib.contextmanager
def ray_cluster(address: str | None = None, **init_kwargs) -> Iterator[None]:
    """Ray for the block: the cluster this process has joined already (a test's) as it is; else the
    one at `address`, or a private local one (`local_ray(**init_kwargs)`: workers at normal priority),
    left again on exit."""
    import ray

    from rackserve.cluster.ray_env import local_ray

    if ray.is_initialized():  # not ours to shut down
        yield
        return
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    else:
        local_ray(**init_kwargs)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def serve_proxy(port: int) -> Iterator[None]:
    """Serve's HTTP proxy, one for the cluster (HeadOnly), on 127.0.0.1:`port` for the block: a
    running Serve's (then `port` must be its port), else one started here and shut down on exit."""
    from ray import serve

    started = not serve.status().proxies
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:
        if started:
            serve.shutdown()


def headline(figures: dict) -> dict:
    """Print `figures` as the benchmark's last line, one JSON object, and return them."""
    print(json.dumps(figures))
    return figures
