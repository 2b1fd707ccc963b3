import pytest

torch = pytest.importorskip("torch")

from kvtui.decoder import ModelArgs, Transformer  # noqa: E402

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


@pytest.fixture(params=["rows", "transposed"])
def either_layout(request) -> Transformer:
    """The small model with its weights stored as trained (rows) and as `ready_to_decode` stores
    them on a CPU (transposed, matrix-vector products through `matvec`)."""
    model = Transformer(SMALL)
    model.init_weights(seed=7)
    if request.param == "transposed":
        model.store_weights_transposed()
    return model.eval()
