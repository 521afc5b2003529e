"""The deploy/ files: valid Ray Serve configs whose app args are valid serve configs; the GB300
deployment plans onto its topology without stranding a GPU; the KubeRay manifest carries a valid app."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from rackserve.config import ConfigError, EngineConfig
from rackserve.placement import InstanceGroup, PlacementSpec, Topology, plan
from rackserve.serve.config import BUILDER, ServeConfig
from rackserve.serve.ingress import check_direct_ingress, direct_ingress_env

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "gb300-nvl72.yaml"])
def test_serve_configs_are_valid_for_ray_serve_and_for_us(name):
    raw = yaml.safe_load((DEPLOY / name).read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(raw)
    assert [app.import_path for app in schema.applications] == [BUILDER]
    config = ServeConfig.from_yaml(DEPLOY / name)
    assert config.port == raw["http_options"]["port"]


def test_the_gb300_deployment_plans_onto_four_nvl72_racks():
    config = ServeConfig.from_yaml(DEPLOY / "gb300-nvl72.yaml")
    topology = Topology.from_yaml(DEPLOY.parent / config.topology)
    roles = (InstanceGroup.parse(config.prefill, "prefill"), InstanceGroup.parse(config.decode, "decode"))
    placed = plan(topology, PlacementSpec(roles, kv_stores=config.kv_stores))
    assert placed.summary() == {"racks_used": 4, "gpus_used": 288, "gpus_total": 288, "stranded_gpus": 0,
                                "instances": 54, "kv_stores": 72}
    assert all(len({(g.rack, g.tray) for g in i.gpus}) == 1 for i in placed.instances if i.role == "prefill")
    from rackserve.models import read_config
    from rackserve.models.deepseek_v41 import FLASH_CONFIG

    flash = read_config(FLASH_CONFIG)  # the model it serves: DeepSeek-V4.1-Flash
    for role in (config.prefill_engine, config.decode_engine):
        engine = EngineConfig(**{**config.engine, **role}).resolve(flash)
        assert engine.block_size == 16 and engine.max_model_len == 131072 and engine.state_dtype == "fp4"
    assert EngineConfig(**{**config.engine, **config.decode_engine}).eplb_interval == 3000
    assert config.decode_redundant_slots == 32


def test_the_kuberay_service_carries_a_valid_app():
    service = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    [app] = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == BUILDER
    assert ServeConfig.from_dict(app["args"]).model == "tiny"


def test_direct_ingress_is_checked_against_the_cluster(monkeypatch):
    with pytest.raises(ConfigError, match="ingress='fast'"):
        ServeConfig(ingress="fast")
    for key in direct_ingress_env(8000):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match="RAY_SERVE_ENABLE_DIRECT_INGRESS=1.*or set ingress: proxy"):
        check_direct_ingress(8000)  # a replica on a cluster not started for it fails, naming the fix
    for key, value in direct_ingress_env(8000, apps=2).items():
        monkeypatch.setenv(key, value)
    check_direct_ingress(8000)
    with pytest.raises(ConfigError, match="on port 9000"):
        check_direct_ingress(9000)  # started for another port
    assert direct_ingress_env(8000, apps=2)["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "8002"
    # a stopping replica stays reachable for a load balancer unless nothing is in front
    drain = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
    assert drain not in direct_ingress_env(8000) and direct_ingress_env(8000, load_balanced=False)[drain] == "0"
