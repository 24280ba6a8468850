"""`serve --ray-replicas N`: the server's aiohttp app (server/app.py) in this process, its engine a
proxy (proxy.py) to N Ray Serve replicas of EngineReplica (deployment.py), routed by prefix
affinity (router.py).

Without a Ray address this process starts a local Ray instance declaring as many `webgpu`
devices as replicas may run, and stops it on SIGTERM; with one it joins that cluster (whose
nodes declare their devices with `ray start --resources '{"webgpu": 1}'`) and on SIGTERM removes
only its deployment. Ray Serve's own HTTP proxy is not started: this process is the endpoint.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from ..server.app import ServerOptions, run_server
from .host import RESOURCE, EngineSpec, connect
from .proxy import REPLICA_HEADER, RayEngineProxy, answered_by

log = logging.getLogger("webgpu_engine.ray")


@dataclass
class RayOptions:
    replicas: int = 1
    address: str | None = None
    min_replicas: int | None = None      # autoscaling when min or max is given
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int = 16       # per replica; past it the router picks another replica
    app_name: str = "webgpu_engine"
    health_check_period_s: float = 10.0

    def devices_needed(self) -> int:
        return max(self.replicas, self.max_replicas or 0, self.min_replicas or 0)

    def scaling(self) -> dict:
        if self.min_replicas is None and self.max_replicas is None:
            return {"num_replicas": self.replicas}
        auto = {"min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                "max_replicas": self.max_replicas or max(self.replicas, self.min_replicas or 1),
                "initial_replicas": self.replicas}
        if self.target_ongoing_requests is not None:
            auto["target_ongoing_requests"] = self.target_ongoing_requests
        return {"autoscaling_config": auto}


def deployer(spec: EngineSpec, ray_opts: RayOptions):
    """(deploy, undeploy): deploy() runs the replicas and returns their DeploymentHandle, blocking
    until every replica loaded its models; undeploy() deletes the application."""
    def deploy():
        from ray import serve
        from ray.serve.config import RequestRouterConfig
        from .deployment import EngineReplica
        from .router import PrefixAffinityRouter
        serve.start(proxy_location="Disabled")
        dep = serve.deployment(
            EngineReplica, name="engine",
            ray_actor_options={"num_cpus": 0, "resources": {RESOURCE: 1}},
            max_ongoing_requests=ray_opts.max_ongoing_requests,
            health_check_period_s=ray_opts.health_check_period_s,
            request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
            **ray_opts.scaling())
        return serve.run(dep.bind(spec), name=ray_opts.app_name, route_prefix=None)

    def undeploy():
        from ray import serve
        try:
            serve.delete(ray_opts.app_name)
        except Exception:  # noqa: BLE001 - shutting down: Ray may be gone already
            log.warning("could not delete the Ray Serve application %s", ray_opts.app_name, exc_info=True)
    return deploy, undeploy


async def _replica_header(request, response) -> None:
    name = answered_by.get()
    if name is not None:
        response.headers[REPLICA_HEADER] = name
        answered_by.set(None)


def ray_server_options(opts: ServerOptions, spec: EngineSpec, ray_opts: RayOptions) -> ServerOptions:
    """`opts` serving from Ray Serve replicas (Ray must be initialised before the app starts)."""
    deploy, undeploy = deployer(spec, ray_opts)

    def factory(cfg, app):
        app.on_response_prepare.append(_replica_header)
        return RayEngineProxy(deploy, undeploy, cfg)
    return dataclasses.replace(opts, engine_factory=factory)


def serve_on_ray(opts: ServerOptions, spec: EngineSpec, ray_opts: RayOptions) -> int:
    """Serve until SIGTERM / SIGINT; returns the exit status. A Ray instance this started is stopped
    before returning (a cluster it joined keeps running, without our deployment)."""
    import ray
    started = connect(ray_opts.address, num_devices=ray_opts.devices_needed())
    try:
        return run_server(ray_server_options(opts, spec, ray_opts))
    finally:
        if started:
            ray.shutdown()      # the deployment is deleted already (the app's cleanup unloads it)
