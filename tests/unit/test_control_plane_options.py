"""The coordinator's Serve options (coordinator/launch.py): it does not log every internal call it
answers (the ingress's observations four times a second under traffic, long polls, scrapes),
while the ingress keeps Serve's access lines, the HTTP requests where Serve's proxy is the way in."""

from coordinator.config import CoordinatorConfig
from coordinator.launch import coordinator_app


def test_the_coordinator_logs_no_access_lines_and_the_ingress_keeps_them():
    app = coordinator_app(CoordinatorConfig.model_construct(model_dir="unused"))  # builds, deploys nothing
    ingress = app._bound_deployment
    coordinator = ingress.init_args[1]._bound_deployment
    assert (ingress.name, coordinator.name) == ("ingress", "coordinator")
    assert coordinator._deployment_config.logging_config["enable_access_log"] is False
    assert coordinator.ray_actor_options["num_cpus"] == 0  # the other options stay
    ingress_logging = ingress._deployment_config.logging_config
    assert ingress_logging is None or ingress_logging.get("enable_access_log", True) is True
