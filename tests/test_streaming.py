"""The training iterator is the user's own micro-batch iterator.

The reference is plain skorch whose batches are the unions of ``acc_steps``
consecutive micro-batches: a batch sampler of the unions, a pre-batched
dataset of the unions, an iterable of the unions. Each micro-batch reaches
the module padded to its own length, and only one micro-batch's inputs and
outputs are alive at a time.
"""

import weakref
from collections import Counter

import numpy as np
import pytest
import torch
from skorch import NeuralNet
from skorch.callbacks import BatchScoring, Callback, EpochScoring

from skorch_gradacc import GradAccNeuralNet

from conftest import DTYPE, PARAM_ATOL, RecordParams, fit_seeded, max_param_diff

VOCAB, PAD, IGNORE = 50, 0, -100


class TokenLM(torch.nn.Module):
    """Embedding -> Linear to the vocabulary, per token: the logits of a
    language model's head, shape (batch, tokens, vocabulary). Padding does
    not change the logits of real tokens."""

    def __init__(self, dim=8):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim, dtype=DTYPE)
        self.head = torch.nn.Linear(dim, VOCAB, dtype=DTYPE)
        self.lengths_ = []

    def forward(self, X):
        if self.training:
            self.lengths_.append(X.shape[1])
        return self.head(torch.tanh(self.embed(X)))


class TokenCrossEntropy(torch.nn.CrossEntropyLoss):
    """Cross-entropy over tokens of (batch, tokens, vocabulary) logits."""

    def __init__(self):
        super().__init__(ignore_index=IGNORE)

    def forward(self, logits, y):
        return super().forward(logits.reshape(-1, logits.shape[-1]),
                               y.reshape(-1))


class TokenMixin:
    def count_loss_items(self, batch):
        _, y = batch
        return int((y != IGNORE).sum())


class GradAccTokenNet(TokenMixin, GradAccNeuralNet):
    pass


def sequences(n=61, seed=0):
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, 13, size=n)
    return [torch.as_tensor(rng.randint(1, VOCAB, size=length))
            for length in lengths]


class SequenceDataset(torch.utils.data.Dataset):
    """Next-token targets; some sequences are all padding in their targets."""

    def __init__(self, seqs):
        self.seqs = seqs

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        seq = self.seqs[i]
        target = torch.cat([seq[1:], torch.tensor([IGNORE])])
        return seq, target


def pad(batch):
    """Dynamic padding: to the longest sequence of this batch."""
    X = torch.nn.utils.rnn.pad_sequence([x for x, _ in batch],
                                        batch_first=True, padding_value=PAD)
    y = torch.nn.utils.rnn.pad_sequence([y for _, y in batch],
                                        batch_first=True, padding_value=IGNORE)
    return X, y


class BucketSampler(torch.utils.data.Sampler):
    """Micro-batches of similar lengths, in a new order each epoch."""

    def __init__(self, seqs, batch_size, seed=0):
        self.order = np.argsort([len(seq) for seq in seqs], kind='stable')
        self.batch_size = batch_size
        self.rng = np.random.RandomState(seed)

    def __len__(self):
        return -(-len(self.order) // self.batch_size)

    def __iter__(self):
        buckets = [self.order[i:i + self.batch_size].tolist()
                   for i in range(0, len(self.order), self.batch_size)]
        for i in self.rng.permutation(len(buckets)):
            yield buckets[i]


class UnionSampler(torch.utils.data.Sampler):
    """The reference: the unions of k consecutive micro-batches."""

    def __init__(self, sampler, k):
        self.sampler, self.k = sampler, k

    def __len__(self):
        return -(-len(self.sampler) // self.k)

    def __iter__(self):
        batches = list(self.sampler)
        for i in range(0, len(batches), self.k):
            yield sum(batches[i:i + self.k], [])


COMMON = dict(criterion=TokenCrossEntropy, optimizer=torch.optim.Adam,
              lr=0.01, max_epochs=3, train_split=None, verbose=0)


def params_and_losses_match(acc_net, plain_net):
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    np.testing.assert_allclose(acc_net.history[:, 'train_loss'],
                               plain_net.history[:, 'train_loss'], rtol=1e-10)
    assert (acc_net.history[:, 'batches', :, 'train_batch_size']
            == plain_net.history[:, 'batches', :, 'train_batch_size'])


@pytest.mark.parametrize('acc_steps', [1, 3, 4])
def test_bucketing_batch_sampler_with_dynamic_padding(acc_steps):
    seqs = sequences()
    dataset = SequenceDataset(seqs)
    acc_net = GradAccTokenNet(
        TokenLM, acc_steps=acc_steps, iterator_train__batch_size=1,
        iterator_train__batch_sampler=BucketSampler(seqs, 4),
        iterator_train__collate_fn=pad,
        callbacks=[('record_params', RecordParams())], **COMMON)
    plain_net = NeuralNet(
        TokenLM, iterator_train__batch_size=1,
        iterator_train__batch_sampler=UnionSampler(BucketSampler(seqs, 4),
                                                   acc_steps),
        iterator_train__collate_fn=pad,
        callbacks=[('record_params', RecordParams())], **COMMON)
    fit_seeded(acc_net, dataset), fit_seeded(plain_net, dataset)
    params_and_losses_match(acc_net, plain_net)
    # 16 micro-batches an epoch, each padded to its own longest sequence
    micro_lengths = [max(len(seqs[i]) for i in batch)
                     for _ in range(3)
                     for batch in BucketSampler(seqs, 4).__iter__()]
    # (a micro-batch whose targets are all padding adds nothing to its
    # group's mean and may not reach the module)
    seen = Counter(acc_net.module_.lengths_)
    assert sum(seen.values()) >= 45
    assert not seen - Counter(micro_lengths)
    assert acc_net.history[:, 'train_batch_count'] == [-(-16 // acc_steps)] * 3


class PreBatched(torch.utils.data.Dataset):
    """A dataset whose items are ready (X, y) batches."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


class StreamedBatches(torch.utils.data.IterableDataset):
    """Ready (X, y) batches from a stream of unknown length."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def ready_batches(k=1):
    seqs = sequences()
    dataset = SequenceDataset(seqs)
    micro = [[dataset[i] for i in batch]
             for batch in BucketSampler(seqs, 4).__iter__()]
    return [pad(sum(micro[i:i + k], [])) for i in range(0, len(micro), k)]


@pytest.mark.parametrize('dataset_cls', [PreBatched, StreamedBatches])
@pytest.mark.parametrize('acc_steps', [1, 3])
def test_ready_made_micro_batches(dataset_cls, acc_steps):
    acc_net = GradAccTokenNet(
        TokenLM, acc_steps=acc_steps, iterator_train__batch_size=None,
        callbacks=[('record_params', RecordParams())], **COMMON)
    plain_net = NeuralNet(
        TokenLM, iterator_train__batch_size=None,
        callbacks=[('record_params', RecordParams())], **COMMON)
    fit_seeded(acc_net, dataset_cls(ready_batches())),
    fit_seeded(plain_net, dataset_cls(ready_batches(acc_steps)))
    params_and_losses_match(acc_net, plain_net)


class MixtureOfExperts(torch.nn.Module):
    """Returns (logits, auxiliary loss), the auxiliary loss 0-dim."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(10, 16, dtype=DTYPE)
        self.output = torch.nn.Linear(16, 3, dtype=DTYPE)

    def forward(self, X):
        hidden = torch.tanh(self.hidden(X))
        return self.output(hidden), (hidden ** 2).mean()


class AuxLossMixin:
    def get_loss(self, y_pred, y_true, *args, **kwargs):
        logits, aux = y_pred
        return super().get_loss(logits, y_true, *args, **kwargs) + 0.1 * aux


class AuxNet(AuxLossMixin, NeuralNet):
    pass


class GradAccAuxNet(AuxLossMixin, GradAccNeuralNet):
    pass


def test_module_with_auxiliary_loss_output(clf_data):
    X, y = clf_data
    common = dict(criterion=torch.nn.CrossEntropyLoss, max_epochs=3, lr=0.1,
                  verbose=0, train_split=None,
                  callbacks=[('record_params', RecordParams())])
    acc_net = fit_seeded(GradAccAuxNet(MixtureOfExperts, batch_size=8,
                                       acc_steps=4, **common), X, y)
    plain_net = fit_seeded(AuxNet(MixtureOfExperts, batch_size=32, **common),
                           X, y)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    np.testing.assert_allclose(acc_net.history[:, 'train_loss'],
                               plain_net.history[:, 'train_loss'], rtol=1e-10)


class Alive:
    """Weak references to what the module saw (X) and returned (logits) in
    training, and the most of earlier ones alive at a forward."""

    def __init__(self):
        self.refs = {'X': [], 'logits': []}
        self.most_alive = {'X': 0, 'logits': 0}

    def check_and_add(self, **tensors):
        for name, tensor in tensors.items():
            refs = [ref for ref in self.refs[name] if ref() is not None]
            self.most_alive[name] = max(self.most_alive[name], len(refs))
            self.refs[name] = refs + [weakref.ref(tensor)]


class WatchedLM(TokenLM):
    """Counts, at each training forward, the earlier inputs and outputs
    that are still alive."""

    def __init__(self):
        super().__init__()
        self.alive_ = Alive()

    def forward(self, X):
        logits = super().forward(X)
        if self.training:
            self.alive_.check_and_add(X=X, logits=logits)
        return logits


def pad_to_12(batch):
    X, y = pad(batch)
    return (torch.nn.functional.pad(X, (0, 12 - X.shape[1]), value=PAD),
            torch.nn.functional.pad(y, (0, 12 - y.shape[1]), value=IGNORE))


def fit_watched(acc_steps=4, callbacks=(), collate_fn=pad, **kwargs):
    seqs = sequences()
    net = GradAccTokenNet(
        WatchedLM, acc_steps=acc_steps, iterator_train__batch_size=1,
        iterator_train__batch_sampler=BucketSampler(seqs, 4),
        iterator_train__collate_fn=collate_fn, callbacks=list(callbacks),
        **{**COMMON, 'max_epochs': 1, **kwargs})
    return fit_seeded(net, SequenceDataset(seqs))


class TestOneMicroBatchAlive:
    def test_inputs_and_outputs_freed_after_each_backward(self):
        net = fit_watched()
        # at each forward, no earlier micro-batch's X or logits is alive
        assert net.module_.alive_.most_alive == {'X': 0, 'logits': 0}

    def test_callback_that_reads_outputs_keeps_no_inputs(self):
        class ReadsOutputs(Callback):
            train_batch_reads = ('y_pred',)

            def on_batch_end(self, net, training=False, y_pred=None, **kw):
                if training:
                    self.rows_ = getattr(self, 'rows_', 0) + len(y_pred)

        net = fit_watched(callbacks=[('reads', ReadsOutputs())],
                          collate_fn=pad_to_12)
        assert dict(net.callbacks_)['reads'].rows_ == 61
        assert net.module_.alive_.most_alive['X'] == 0

    def test_callback_that_reads_the_batch_keeps_the_group(self):
        class ReadsBatch(Callback):
            # its outputs, dynamically padded, could not be joined
            train_batch_reads = ('X',)

            def on_batch_begin(self, net, batch=None, training=False, **kw):
                if training:
                    self.sizes_ = getattr(self, 'sizes_', []) + [len(batch)]

        net = fit_watched(callbacks=[('reads', ReadsBatch())])
        # the whole group is pulled before its step: 4 micro-batches of 4
        # rows, the last group of 1 micro-batch of 1 row (61 rows)
        assert sorted(dict(net.callbacks_)['reads'].sizes_) == [13, 16, 16, 16]
        assert net.module_.alive_.most_alive['X'] == 3

    @pytest.mark.parametrize('scoring_cls, inputs_alive', [
        (EpochScoring, 0),  # caches targets and outputs, never inputs
        (BatchScoring, 3),  # scores (X, y): the group's inputs are kept
    ])
    def test_train_scoring_keeps_what_it_reads(self, scoring_cls,
                                               inputs_alive):
        # skorch's scorers, with their defaults, on training: what is alive
        # at each forward, and the scores of the large-batch net
        def token_accuracy(net, X, y):
            logits = net.forward(X)
            mask = torch.as_tensor(y) != IGNORE
            hits = (logits.argmax(-1) == torch.as_tensor(y))[mask]
            return hits.double().mean().item()

        scoring = scoring_cls(token_accuracy, on_train=True, name='tok_acc')
        net = fit_watched(callbacks=[('scoring', scoring)],
                          collate_fn=pad_to_12)
        assert net.module_.alive_.most_alive['X'] == inputs_alive
        seqs = sequences()
        plain = NeuralNet(
            TokenLM, iterator_train__batch_size=1,
            iterator_train__batch_sampler=UnionSampler(BucketSampler(seqs, 4), 4),
            iterator_train__collate_fn=pad_to_12,
            callbacks=[('scoring', scoring_cls(
                token_accuracy, on_train=True, name='tok_acc'))],
            **{**COMMON, 'max_epochs': 1})
        fit_seeded(plain, SequenceDataset(seqs))
        np.testing.assert_allclose(net.history[:, 'tok_acc'],
                                   plain.history[:, 'tok_acc'], rtol=1e-12)

    def test_reading_an_unkept_batch_says_how_to_keep_it(self):
        class ReadsBatch(Callback):
            train_batch_reads = ()  # wrong: it reads the batch

            def on_batch_end(self, net, batch=None, training=False, **kw):
                if training:
                    X, y = batch

        with pytest.raises(RuntimeError) as exc:
            fit_watched(callbacks=[('reads', ReadsBatch())])
        assert str(exc.value) == (
            "This training batch was released after its backward pass. A "
            "callback (or net) that reads it declares so in its class, e.g. "
            "train_batch_reads = ('X', 'y', 'y_pred'); a train_step of a GradAcc "
            "net trains a group with super().train_step.")


def test_all_padding_group_with_adam_equals_large_batch():
    # groups whose targets are all padding: the large-batch net steps on
    # them with a zero gradient, which still advances Adam's moments
    seqs = sequences(40)
    empty = [torch.tensor([5]) for _ in range(8)]  # one token: no target
    seqs = seqs[:16] + empty + seqs[16:]
    dataset = SequenceDataset(seqs)
    kwargs = dict(iterator_train__batch_size=4, iterator_train__collate_fn=pad,
                  callbacks=[('record_params', RecordParams())], **COMMON)
    acc_net = GradAccTokenNet(TokenLM, acc_steps=2, **kwargs)
    kwargs['iterator_train__batch_size'] = 8
    plain_net = NeuralNet(TokenLM, **kwargs)
    fit_seeded(acc_net, dataset), fit_seeded(plain_net, dataset)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    steps = [state['step'].item() for state in acc_net.optimizer_.state.values()]
    plain_steps = [state['step'].item()
                   for state in plain_net.optimizer_.state.values()]
    assert steps == plain_steps == [18.0] * 3  # 6 groups, 3 epochs
    losses = acc_net.history[:, 'batches', :, 'train_loss']
    assert np.isnan(losses[0][2])  # the group with no target, as in plain
    np.testing.assert_allclose(
        losses, plain_net.history[:, 'batches', :, 'train_loss'], rtol=1e-10)
