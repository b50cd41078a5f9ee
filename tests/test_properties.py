"""Property-based tests over dataset size, batch size, acc_steps, shuffle
and split."""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from skorch.callbacks import Callback

from conftest import PARAM_ATOL, classification_data, fit_pair, max_param_diff


class RecordSampleIds(Callback):
    """Record which samples each optimizer step used (column 0 holds ids)."""

    train_batch_reads = ('X',)

    def initialize(self):
        self.steps_ = []
        return self

    def on_epoch_begin(self, net, **kwargs):
        self.steps_.append([])

    def on_batch_end(self, net, batch=None, training=False, **kwargs):
        if training:
            self.steps_[-1].append(batch[0][:, 0].long().tolist())


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    n_samples=st.integers(1, 90),
    batch_size=st.integers(1, 12),
    acc_steps=st.integers(1, 9),
    shuffle=st.booleans(),
    split=st.booleans(),
)
def test_steps_samples_and_parameters(n_samples, batch_size, acc_steps,
                                      shuffle, split):
    X, y = classification_data(max(n_samples, 10))
    X, y = X[:n_samples].copy(), y[:n_samples]
    X[:, 0] = np.arange(n_samples)  # sample ids, used as a feature as well
    use_split = split and n_samples >= 10
    kwargs = {} if use_split else {'train_split': None}
    if use_split:
        from skorch.dataset import ValidSplit
        kwargs['train_split'] = ValidSplit(5, stratified=False)
    acc_net, plain_net = fit_pair(
        acc_steps, X, y, batch_size=batch_size, max_epochs=2, lr=0.01,
        iterator_train__shuffle=shuffle,
        callbacks=[('ids', RecordSampleIds())], **kwargs)

    ids = dict(acc_net.callbacks_)['ids'].steps_
    for epoch, steps in enumerate(ids):
        n_train = sum(len(step) for step in steps)
        n_micro_batches = -(-n_train // batch_size)
        assert len(steps) == -(-n_micro_batches // acc_steps)
        assert acc_net.history[epoch, 'train_batch_count'] == len(steps)
        used = sorted(i for step in steps for i in step)
        assert used == sorted(set(used))  # each sample once per epoch
        if not use_split:
            assert used == list(range(n_samples))  # and every sample
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    torch.testing.assert_close(
        torch.tensor(acc_net.history[:, 'train_loss']),
        torch.tensor(plain_net.history[:, 'train_loss']), rtol=1e-10, atol=0)
