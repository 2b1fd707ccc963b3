import pytest

torch = pytest.importorskip("torch")

from kvtui.gpu.kernels import MATVEC_KERNELS, Linear  # noqa: E402
from kvtui.gpu.model import ModelArgs, Transformer  # noqa: E402

SMALL = ModelArgs(
    n_layer=2, n_head=4, n_kv_head=2, dim=64, intermediate_size=128, max_positions=1024
)


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def small_model() -> Transformer:
    """The tiny model's architecture at a size that decodes 512 tokens uncached in seconds."""
    model = Transformer(SMALL)
    model.init_weights(seed=7)
    return model.eval()


@pytest.fixture(params=["as trained", *(f"transposed, {name}" for name in MATVEC_KERNELS)])
def either_layout(request) -> Transformer:
    """The small model with its weights as trained (rows, `F.linear`) and as `ready_to_decode`
    lays them out on a CPU (transposed), once with each kernel `choose_matvec` may pick for a
    one-vector product: it picks by timing, so the cached loop must be right with any of them."""
    model = Transformer(SMALL)
    model.init_weights(seed=7)
    if request.param != "as trained":
        model.store_weights_transposed()
        kernel = MATVEC_KERNELS[request.param.removeprefix("transposed, ")]
        for module in model.modules():
            if isinstance(module, Linear):
                module.matvec = kernel
    return model.eval()
