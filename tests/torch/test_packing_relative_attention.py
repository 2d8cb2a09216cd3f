"""DeBERTa's disentangled attention (content-to-position and position-to-content scores from relative embeddings,
gathered by relative position) does not fold into the heads: its scores are (B*heads, L, L), the heads merged into
the batch, where the members' heads would have to be. It runs as the dense model runs it, on the member-stacked
batch, equal to ``predict``, and ``packed.macs["fallback"]`` counts every one of its products. Before, ``pack``
raised on DeBERTa with relative attention (the published configs): ``FlopCounterMode``'s module tracker failed on
the relative embeddings sliced without gradients (a view of a parameter that requires grad with no gradient function)
on their way into a masked position projection. (MPNet's relative position bias folds:
``tests/torch/test_transformers_zoo.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import masksembles_torch as mt
from tests.backends import requested_backends
from tests.rounding import assert_rounding_close

if "transformers" not in requested_backends():
    pytest.skip("backend 'transformers' not requested", allow_module_level=True)

import transformers

N, LENGTH, VOCAB = 4, 8, 64
SMALL = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 32, "max_position_embeddings": 32, "relative_attention": True,
         "pos_att_type": ["p2c", "c2p"], "max_relative_positions": 8, "num_labels": 2}  # fmt: skip
MODELS = {
    "deberta-v2": lambda: transformers.DebertaV2ForSequenceClassification(
        transformers.DebertaV2Config(**SMALL, position_buckets=4)
    ),
    "deberta": lambda: transformers.DebertaForSequenceClassification(transformers.DebertaConfig(**SMALL)),
}


def batch_of(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, right-padded after a random length of 2 to LENGTH."""
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.arange(LENGTH) < torch.randint(2, LENGTH + 1, (size, 1), generator=generator)).long()
    return {"input_ids": torch.randint(1, VOCAB, (size, LENGTH), generator=generator) * mask, "attention_mask": mask}


def attention_products(model: nn.Module) -> int:
    """Multiply-adds per sample of the single model's batched matmuls (DeBERTa's attention products: its Linear
    layers run ``addmm``/``mm``), counted by ``FlopCounterMode`` as the sample a batch of 5 adds to one of 4."""
    counts = []
    for size in (4, 5):
        with FlopCounterMode(display=False) as counter:  # gradients on: its module tracker hooks the inputs
            model(**batch_of(size))
        counts.append(counter.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0) // 2)
    return counts[1] - counts[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_disentangled_attention_falls_back_counted_and_equal_to_predict(name: str) -> None:
    torch.manual_seed(0)
    single = MODELS[name]().eval()
    products = attention_products(single)
    model = mt.insert(single, N, 2.0, seed=0, example_input=batch_of(4)).eval()
    packed = mt.pack(model, batch_of(4), program="packed")
    assert [row for row in packed.fallbacks if "attention.self" in row], packed.fallbacks
    assert products > 0 and packed.macs["fallback"] == N * products, (packed.macs, products)
    assert packed.macs["packed"] < packed.macs["dense"]
    for size in (3, 6):
        batch: dict[str, Any] = batch_of(size, seed=size)
        assert_rounding_close(packed(**batch).logits, mt.predict(model, batch).logits)
