"""LoRA fine-tuning of a causal language model with gradient accumulation.

The building blocks of docs/lora_causal_lm.rst, which shows the marked
region; tests/test_lora_recipe.py imports them.
"""

# --- begin: the code of docs/lora_causal_lm.rst ---
import numpy as np
import torch
from fine_tuning_transformers import BucketBatchSampler, UnionBatchSampler
from peft import LoraConfig, get_peft_model
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer
from skorch import NeuralNet
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from skorch_gradacc import GradAccMixin

IGNORE = -100  # labels of padding; 0 is the padding token


def make_texts(n, seed=0):
    """Return ``n`` runs of the alphabet, of 3 to 24 letters: easy to learn."""
    rng = np.random.default_rng(seed)
    return [''.join(chr(97 + (start + i) % 26) for i in range(length))
            for start, length in zip(rng.integers(0, 26, n),
                                     rng.integers(3, 25, n))]


def tokenize(texts):
    """Turn letters into ids 1 to 26: the pipeline's tokenizer step."""
    return [np.array([ord(c) - 96 for c in text]) for text in texts]


class LoRAGPT2(torch.nn.Module):
    """A tiny GPT-2 built from a config, with LoRA adapters: only they train.

    Nothing is downloaded; for a real model, use ``from_pretrained``.
    Returns the logits, ``(batch, tokens, vocabulary)``.
    """

    def __init__(self, r=4, dtype=torch.float64):
        super().__init__()
        config = GPT2Config(vocab_size=27, n_positions=64, n_embd=32,
                            n_layer=2, n_head=2, bos_token_id=0,
                            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0)
        base = GPT2LMHeadModel(config).to(dtype)
        self.lm = get_peft_model(base, LoraConfig(
            r=r, target_modules=['c_attn'], fan_in_fan_out=True))

    def forward(self, input_ids, attention_mask):
        """Return the logits of the next token."""
        return self.lm(input_ids=input_ids,
                       attention_mask=attention_mask).logits


class Sequences(Dataset):
    """The token ids of each text; the labels are made by ``pad_for_lm``."""

    def __init__(self, X, y=None):
        self.X = X

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return self.X[i]


def pad_for_lm(sequences):
    """Pad to the longest sequence; the labels are the next tokens."""
    ids = torch.nn.utils.rnn.pad_sequence(
        [torch.as_tensor(s) for s in sequences], batch_first=True)
    lengths = torch.tensor([len(s) for s in sequences])
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)
    return {'input_ids': ids[:, :-1], 'attention_mask': mask[:, :-1]}, labels


def bucketed(dataset, batch_size, union=1, seed=0, **kwargs):
    """Micro-batches of similar lengths; with ``union=k``, the large batch."""
    sampler = BucketBatchSampler([len(s) for s in dataset.X], batch_size, seed)
    if union > 1:
        sampler = UnionBatchSampler(sampler, union)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_for_lm)


class CausalLM(NeuralNet):
    """Plain skorch: the cross-entropy of the next token, over all tokens."""

    def get_loss(self, y_pred, y_true, *args, **kwargs):
        """Return the mean cross-entropy over the labeled tokens."""
        return super().get_loss(y_pred.flatten(0, 1), y_true.flatten(),
                                *args, **kwargs)


class GradAccCausalLM(GradAccMixin, CausalLM):
    """With accumulation; the default count is the labels not IGNORE."""


def lm_pipeline(net_cls, **params):
    """Tokenizer and language model; ``params`` go to the net."""
    return Pipeline([('tokenize', FunctionTransformer(tokenize)),
                     ('lm', net_cls(
                         LoRAGPT2, criterion=torch.nn.CrossEntropyLoss,
                         criterion__ignore_index=IGNORE, dataset=Sequences,
                         iterator_train=bucketed,
                         iterator_valid__collate_fn=pad_for_lm,
                         optimizer=torch.optim.SGD, lr=0.2, max_epochs=2,
                         train_split=None, verbose=0, **params))])


def neg_token_loss(pipe, X, y=None):
    """Score: minus the mean loss per held-out token."""
    net, losses, counts = pipe[-1], [], []
    for batch in net.get_iterator(net.get_dataset(pipe[:-1].transform(X))):
        losses.append(net.validation_step(batch)['loss'].item())
        counts.append(float(net.count_loss_items(batch)))
    return -np.average(losses, weights=counts)
# --- end: the code of docs/lora_causal_lm.rst ---
