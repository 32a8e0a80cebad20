import pytest

# The V1 / V2 tiny checkpoints and trainer models of the weight-transfer tests.
from tests.weight_transfer.conftest import v2_trainer  # noqa: F401


@pytest.fixture(scope="module")
def local_ray():  # noqa: ANN201
    """A local Ray of two CPUs for the module's tests (ray.init(num_cpus=2))."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, namespace="hotswap-tests",
                 log_to_driver=False)  # fmt: skip
    yield ray
    if started:
        ray.shutdown()
