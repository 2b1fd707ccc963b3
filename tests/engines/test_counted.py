"""What a step computed is observed, and the observation can disagree with the lesson.

The loops read the positions off the model (the rows of keys its layers produced) and, on sampled
steps, count FLOPs with torch's FlopCounterMode. A well-behaved model agrees with the formula to
the FLOP; a "cached" model that secretly recomputes its history is caught by both counts.
"""

from dataclasses import dataclass

import pytest
import torch

from kvtui.engines.generate import encode_text, generate, recompute_all
from kvtui.engines.loops import Sampling, cached_loop, counts_flops
from kvtui.gpu.counting import PositionCounter, count_flops
from kvtui.gpu.load import spec_from_args
from kvtui.gpu.model import Transformer
from kvtui.sim.work import cached_step_positions, naive_step_positions, step_cost

from .conftest import SMALL

GREEDY = Sampling(greedy=True)


def _prompt(batch: int = 1) -> torch.Tensor:
    return encode_text("It is a truth").expand(batch, -1)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_counted_positions_and_flops_are_the_formulas_exactly(either_layout, batch):
    """Every sampled step's FLOPs, as torch counts them, equal kvtui.sim.work's price of it, and
    the positions the layers produced are the lesson's staircase and flat line."""
    prompt, n = _prompt(batch), 20
    P = prompt.shape[1]
    spec = spec_from_args("small", either_layout.args)
    for cached in (True, False):
        steps = list(generate(either_layout, prompt, n, GREEDY, cache=cached))
        rule = cached_step_positions if cached else naive_step_positions
        assert [s.positions_computed for s in steps] == [
            batch * rule(t, P) for t in range(1, n + 1)
        ]
        sampled = [s for s in steps if counts_flops(s.index)]
        assert [s.index for s in sampled] == [0, 1, 2, 4, 8, 16]
        assert all(s.flops_counted is None for s in steps if not counts_flops(s.index))
        for s in sampled:
            assert s.flops_counted == step_cost(spec, cached, s.index, P, batch).flops, s.index


@dataclass
class SecretlyRecomputes:
    """A cached model that, behind the cache's interface, runs the whole history again at every
    step: the cheat the loop's own bookkeeping could never see."""

    model: Transformer
    prompt: torch.Tensor

    def __post_init__(self) -> None:
        self.ids = self.prompt.clone()

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        return recompute_all(self.model, prompt)

    def decode_one_token(self, token: torch.Tensor, position: int) -> torch.Tensor:
        self.ids = torch.cat([self.ids[:, :position], token], dim=1)
        return recompute_all(self.model, self.ids)

    def kv_bytes_filled(self, positions: int) -> int:
        return 0

    def kv_bytes_allocated(self) -> int:
        return 0

    def replay_flops(self, call, start: int) -> int | None:
        return count_flops(call)


def test_a_cached_model_that_recomputes_everything_is_caught_by_both_counts(small_model):
    prompt, n = _prompt(), 12
    P = prompt.shape[1]
    spec = spec_from_args("small", SMALL)
    cheat = SecretlyRecomputes(small_model, prompt)
    steps = list(cached_loop(cheat, prompt, n, GREEDY, PositionCounter(small_model)))
    honest = list(generate(small_model, prompt, n, GREEDY, cache=True))
    assert [s.token_id for s in steps] == [s.token_id for s in honest]  # the same answer...
    # ...at the uncached loop's cost: the lesson's "1 a step" fails
    assert [s.positions_computed for s in steps] == [P + i for i in range(n)]
    assert [s.positions_computed for s in honest] == [P] + [1] * (n - 1)
    for s in steps:
        if s.flops_counted is not None and s.index > 0:
            assert s.flops_counted == step_cost(spec, False, s.index, P).flops
            assert s.flops_counted > (P + s.index) * step_cost(spec, True, s.index, P).flops / 2


def test_counting_flops_leaves_the_cache_and_the_tokens_as_they_were(small_model):
    """The sampled steps run their call once more, outside their timing: the tokens are those of
    a run that counts nothing, and the cache holds the same keys and values."""
    prompt = _prompt(2)
    counted = [s.token_ids for s in generate(small_model, prompt, 40, GREEDY, cache=True)]
    plain = [
        s.token_ids
        for s in generate(small_model, prompt, 40, GREEDY, cache=True, flops_at=lambda i: False)
    ]
    assert counted == plain


def test_a_transformers_model_is_counted_by_hooks_on_its_key_projections():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    counter = PositionCounter(model)
    assert counter.watched == "rows out of 2 key projections"
    with torch.inference_mode():
        model(torch.zeros(3, 5, dtype=torch.long))
    assert counter() == 15
    counter.close()
    with torch.inference_mode():
        model(torch.zeros(1, 5, dtype=torch.long))
    assert counter() == 15  # the hooks are gone
