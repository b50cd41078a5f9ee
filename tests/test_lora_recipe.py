"""The LoRA causal-LM recipe: only the adapters train, exactly as the large
batch does. ``tests/test_docs.py`` runs the page itself."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip('transformers')
pytest.importorskip('peft')

DOCS = Path(__file__).resolve().parent.parent / 'docs'
sys.path.insert(0, str(DOCS))
import lora_causal_lm as recipe  # noqa: E402

sys.path.remove(str(DOCS))


def test_page_shows_the_module():
    page = (DOCS / 'lora_causal_lm.rst').read_text(encoding='utf-8')
    assert '.. literalinclude:: lora_causal_lm.py' in page


def test_padding_collate_shifts_labels_and_ignores_padding():
    X, labels = recipe.pad_for_lm([np.array([1, 2, 3]), np.array([4, 5])])
    assert X['input_ids'].tolist() == [[1, 2], [4, 5]]
    assert X['attention_mask'].tolist() == [[1, 1], [1, 1]]
    assert labels.tolist() == [[2, 3], [5, recipe.IGNORE]]


@pytest.mark.slow
def test_only_adapters_train_and_acc_steps_8_is_the_large_batch():
    texts = recipe.make_texts(64, seed=1)
    torch.manual_seed(0)
    initial = recipe.LoRAGPT2().state_dict()
    nets = []
    for net_cls, params in [(recipe.CausalLM, {'iterator_train__union': 8}),
                            (recipe.GradAccCausalLM, {'acc_steps': 8})]:
        torch.manual_seed(0)
        pipe = recipe.lm_pipeline(net_cls, batch_size=4, **params)
        nets.append(pipe.fit(texts)[-1])
    large, acc = nets
    changed = {name for name, value in acc.module_.state_dict().items()
               if not torch.equal(value, initial[name])}
    assert changed and all('lora_' in name for name in changed)
    assert acc.history[-1, 'train_batch_count'] == 2  # 16 micro-batches
    for name, value in large.module_.state_dict().items():
        torch.testing.assert_close(acc.module_.state_dict()[name], value,
                                   rtol=0, atol=1e-10)
    np.testing.assert_allclose(acc.history[:, 'train_loss'],
                               large.history[:, 'train_loss'], rtol=1e-10)
