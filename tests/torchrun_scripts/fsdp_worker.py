"""One rank of fully sharded (FSDP2) fits; started by
tests/test_fully_sharded.py with ``torchrun --nproc_per_node 2``.

Usage: fsdp_worker.py OUT_DIR SCENARIOS, a comma-separated list of (run one
after another, see worker_common.py)

* ``samples``: a classifier on 195 rows, micro-batches of 8,
  ``acc_steps=3``; rank 1 has no micro-batch in each epoch's last step;
* ``samples_each``: the same with ``sync_each_batch=True``; ``samples``
  records what callbacks see of each step's batch;
* ``tokens``: a token-level loss whose item counts differ between ranks,
  shuffled, on 117 rows: in each epoch's last step rank 0 has two
  micro-batches and rank 1 one, and a zero-row pass;
* ``cuda``: ``samples`` on the GPUs, with NCCL (one rank per GPU);
* ``clip``: ``samples`` with skorch's GradientNormClipping;
* ``bf16``, ``fp16``: ``samples`` with ``mixed_precision='bf16'`` or
  ``'fp16'``, and ``predict_proba`` of 8 rows;
* ``resume``: ``samples`` for one epoch, ``save_params``, a new net that
  ``load_params`` and trains a second epoch;
* ``criterion``: ``resume`` with a criterion that has a parameter, a
  frozen one and a vector, and weight decay: the optimizer holds the
  criterion's parameters beside the shards;
* ``micro``: ``samples`` with ``micro_batch_size=3``: the ranks' micro-batches
  take different numbers of passes in the last step; its module refuses
  zero rows; and ``predict_proba`` of 8 rows (one batch);
* ``auto``: ``samples`` with ``micro_batch_size='auto'``, where only rank 1's
  module runs out of memory above 4 rows, armed after the plan (the first
  step's gradient): the plan was wrong;
* ``apart``: ``auto`` on 61 rows, armed on both ranks: rank 0's module
  runs out of memory above 6 rows, rank 1's above 3; in the second step
  rank 0 has a micro-batch of 8 rows and rank 1 one of 5, and both fail
  at once, wanting pieces of 4 and of 3: every rank takes the least;
* ``plan``: ``samples`` with ``micro_batch_size='auto'``, where only rank 1
  has a budget, of 1 byte: every rank raises the plan's ValueError before
  the first step, and saves it (nothing else);
* ``lbfgs``: ``samples`` with LBFGS, where the last layer's 3 rows are
  sharded unevenly: every rank refuses it as ``plan`` does;
* ``plan_fails``: ``plan`` without budgets, where only rank 1's module
  runs out of memory above 4 rows from the start, in the plan's passes;
* ``skip``: ``samples`` with ``skip_nonfinite=True``, where one step's
  gradient is infinite in rank 1's shard only;
* ``iterable``: ``samples`` from an ``IterableDataset`` of micro-batches,
  without a length;
* ``sampler``: a user's shuffling ``DistributedSampler``;
* ``masked``: a masked mean loss, ``(ce * mask).sum() / mask.sum()``, where
  rank 1's first micro-batch has rows but no item.
* ``fp16_tokens``: a float32 token model under ``'fp16'``, whose
  micro-batches count 384 tokens each; 12 steps of ``acc_steps=2``;
* ``fp16_spike``: ``skip``'s model and data under ``'fp16'``, without
  ``skip_nonfinite``: the scaler alone finds the infinite gradient, in
  rank 1's shard only;
* ``compile``: ``samples`` with skorch's ``compile=True``;
* ``batchnorm``: ``samples`` with a BatchNorm between the layers, whose
  running statistics each rank updates from its own rows, and
  ``predict_proba`` of every row.

Rank 0 saves the net's full checkpoint (``save_params``) and the history
to OUT_DIR/SCENARIO; each rank saves its counters to
OUT_DIR/SCENARIO/rank{r}.pt.
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from skorch.callbacks import Callback, GradientNormClipping
from skorch.dataset import Dataset
from torch.utils.data import DistributedSampler, IterableDataset
from worker_common import run_scenarios, save_rank  # puts tests/ on sys.path

# isort: split
from test_inputs import RecordsTraining, StateOutputMLP, output_loss
from test_normalization import IGNORE, TokenTagger, token_data

from skorch_gradacc import GradAccNeuralNet, GradAccNeuralNetClassifier
from skorch_gradacc.fully_sharded import FullyShardedGradAccMixin

from conftest import (
    COMPILED,
    DTYPE,
    RecordsStepBatches,
    RefusesZeroRows,
    ShiftedTemperedNLL,
    classification_data,
)

BATCH_SIZE, ACC_STEPS, N_SAMPLES, N_TOKEN_SAMPLES = 8, 3, 195, 117
# 'apart': a first step of 6 micro-batches of 8 rows, then one of 8 rows
# (rank 0's) and one of 5 (rank 1's)
N_APART_SAMPLES = 61
# the most rows each rank's module takes, per scenario
MAX_ROWS = {'auto': (1000, 4), 'apart': (6, 3), 'plan_fails': (1000, 4)}
FP16_VOCAB, FP16_ACC_STEPS, FP16_LR = 64, 2, 0.5
CLIP_NORM = 0.05


def sequential_classifier():
    """A plain Sequential: the default sharding shards each Linear apart."""
    return torch.nn.Sequential(
        torch.nn.Linear(10, 16, dtype=DTYPE), torch.nn.Tanh(),
        torch.nn.Linear(16, 16, dtype=DTYPE), torch.nn.Tanh(),
        torch.nn.Linear(16, 3, dtype=DTYPE), torch.nn.Softmax(dim=-1))


class RowsNeeded(RefusesZeroRows, torch.nn.Sequential):
    """A Sequential that refuses a batch of zero rows."""


def normalized_classifier():
    """``sequential_classifier`` with a BatchNorm after its first layer."""
    layers = list(sequential_classifier())
    return torch.nn.Sequential(
        layers[0], torch.nn.BatchNorm1d(16, dtype=DTYPE), *layers[1:])


class CappedClassifier(torch.nn.Sequential):
    """Raises torch.OutOfMemoryError above ``max_rows`` rows, like a GPU
    that cannot hold more, before any collective of the forward pass, once
    ``armed``; ``rows_``: the rows of each pass, ``failed_rows_``: of each
    that raised."""

    def __init__(self, max_rows=1000, armed=True):
        super().__init__(*sequential_classifier())
        self.max_rows, self.armed = max_rows, armed
        self.rows_, self.failed_rows_ = [], []

    def forward(self, X):
        self.rows_.append(len(X))
        if len(X) > self.max_rows and self.armed:
            self.failed_rows_.append(len(X))
            raise torch.OutOfMemoryError('CUDA out of memory (simulated)')
        return super().forward(X)


class ArmAfterThePlan(Callback):
    """Arms the module's error after the first step: the plan was wrong."""

    train_batch_reads = ()  # nothing of the batch

    def on_grad_computed(self, net, **kwargs):
        net.module_.armed = True  # fully_shard keeps the module itself


class InfiniteGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float('inf')


class SpikyClassifier(torch.nn.Sequential):
    """An infinite gradient for hidden unit 12 (on rank 1's shard of the
    first layer, sharded by rows) in a batch whose first feature is > 100;
    every other gradient, and the loss, stay finite."""

    def __init__(self):
        super().__init__(*sequential_classifier())

    def forward(self, X):
        hidden = self[0](X)
        if (X[:, 0] > 100).any():
            hidden = torch.cat([hidden[:, :12],
                                InfiniteGradient.apply(hidden[:, 12:13]),
                                hidden[:, 13:]], dim=1)
        for layer in list(self)[1:]:
            hidden = layer(hidden)
        return hidden


def spiky_data():
    X, y = classification_data(N_SAMPLES)
    X[60, 0] = 1000.0  # micro-batch 7: rank 1's in the second step
    return X, y


class MicroBatches(IterableDataset):
    """The micro-batches of 8 rows of (X, y), without a length."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __iter__(self):
        for start in range(0, len(self.X), BATCH_SIZE):
            yield (torch.as_tensor(self.X[start:start + BATCH_SIZE]),
                   torch.as_tensor(self.y[start:start + BATCH_SIZE]))


class MaskedMeanLoss(torch.nn.Module):
    """The mean token loss written by hand: NaN, with a NaN gradient, for
    a micro-batch without items."""

    def forward(self, y_pred, y):
        mask = y != IGNORE
        ce = torch.nn.functional.cross_entropy(
            y_pred, y.clamp(min=0), reduction='none')
        return (ce * mask).sum() / mask.sum()


class FP16TokenModel(torch.nn.Module):
    """A float32 token model: embedding 64x32, linear 32x64, logits shaped
    (batch, vocab, sequence) for a CrossEntropyLoss per token."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(FP16_VOCAB, 32)
        self.output = torch.nn.Linear(32, FP16_VOCAB)

    def forward(self, X):
        return self.output(torch.tanh(self.embedding(X))).permute(0, 2, 1)


def fp16_token_data():
    """12 steps of 32 rows of 48 tokens; each token predicts the next."""
    X = np.random.RandomState(0).randint(0, FP16_VOCAB, size=(12 * 32, 48))
    return X, np.roll(X, -1, axis=1)


def masked_data():
    X, y = token_data(N_TOKEN_SAMPLES)
    y[BATCH_SIZE:2 * BATCH_SIZE] = IGNORE  # micro-batch 1: rank 1's first
    return X, y


class RecordsEpoch(Callback):
    """Records the sampler's epoch and the first rows of every epoch."""

    def on_epoch_end(self, net, **kwargs):
        sampler = net.iterator_train__sampler
        net.sampler_epochs_ = getattr(net, 'sampler_epochs_', []) + [
            sampler.epoch]
        net.first_rows_ = getattr(net, 'first_rows_', []) + [
            list(sampler)[:BATCH_SIZE]]


class FSDPClassifier(FullyShardedGradAccMixin, GradAccNeuralNetClassifier):
    def get_loss(self, y_pred, y_true, X=None, training=False):
        """Records each piece's loss in the row, and aside with its rows."""
        loss = super().get_loss(y_pred, y_true, X=X, training=training)
        if training and len(y_true):
            self.history.record_batch('piece_loss', loss.item())
            step = (len(self.history), len(self.history[-1]['batches']))
            self.piece_losses_ = getattr(self, 'piece_losses_', {})
            self.piece_losses_.setdefault(step, []).append(
                (len(y_true), loss.item()))
        return loss


    def train_step_single(self, batch, **fit_params):
        """Keeps the rows trained on, in order, if ``trained_rows_`` is a
        list."""
        if getattr(self, 'trained_rows_', None) is not None and len(batch[0]):
            self.trained_rows_.append(batch[0].detach().clone())
        return super().train_step_single(batch, **fit_params)


class FSDPTokenNet(FullyShardedGradAccMixin, GradAccNeuralNet):
    def count_loss_items(self, batch):
        _, y = batch
        return int((y != IGNORE).sum())


def make_net(scenario, max_epochs=2, X=None):
    common = dict(batch_size=BATCH_SIZE, acc_steps=ACC_STEPS,
                  max_epochs=max_epochs, train_split=None, verbose=0,
                  optimizer__momentum=0.9)
    if scenario in ('tokens', 'masked'):
        criterion = dict(criterion=torch.nn.CrossEntropyLoss,
                         criterion__ignore_index=IGNORE,
                         iterator_train__shuffle=True)
        if scenario == 'masked':
            criterion = dict(criterion=MaskedMeanLoss)
        return FSDPTokenNet(
            TokenTagger, lr=0.5, shard_classes=[torch.nn.Embedding, 'Linear'],
            **criterion, **common)
    if scenario == 'fp16_tokens':
        common.update(acc_steps=FP16_ACC_STEPS, max_epochs=1)
        return FSDPTokenNet(
            FP16TokenModel, lr=FP16_LR, criterion=torch.nn.CrossEntropyLoss,
            mixed_precision='fp16',
            shard_classes=[torch.nn.Embedding, 'Linear'], **common)
    module = {'batchnorm': normalized_classifier}.get(scenario, sequential_classifier)
    if scenario == 'micro':
        common['micro_batch_size'] = 3
        module = lambda: RowsNeeded(*sequential_classifier())  # noqa: E731
    if scenario in MAX_ROWS:
        module = CappedClassifier
        common['micro_batch_size'] = 'auto'
        common['module__max_rows'] = MAX_ROWS[scenario][dist.get_rank()]
        common['module__armed'] = scenario == 'plan_fails'
        if scenario != 'plan_fails':  # after the plan's passes
            common['callbacks'] = [ArmAfterThePlan()]
    if scenario == 'lbfgs':
        common['optimizer'] = torch.optim.LBFGS
        del common['optimizer__momentum']
    if scenario == 'plan':
        common['micro_batch_size'] = 'auto'
        common['memory_budget'] = 1 if dist.get_rank() == 1 else None
    if scenario in ('skip', 'fp16_spike'):
        module = SpikyClassifier
        common['skip_nonfinite'] = scenario == 'skip'
    if scenario == 'iterable':
        common['iterator_train__batch_size'] = None
    if scenario == 'sampler':
        common['iterator_train__sampler'] = DistributedSampler(X, seed=0)
        common['callbacks'] = [RecordsEpoch()]
    if scenario == 'cuda':
        common['device'] = 'cuda:{}'.format(os.environ['LOCAL_RANK'])
    if scenario == 'clip':
        common['callbacks'] = [GradientNormClipping(CLIP_NORM)]
    if scenario == 'samples':  # what callbacks see of each step's batch
        common['callbacks'] = [('steps', RecordsStepBatches())]
    if scenario == 'criterion':
        common.update(criterion=ShiftedTemperedNLL, optimizer__weight_decay=0.01)
    if scenario == 'compile':
        common.update(COMPILED)
    if scenario == 'state':  # an RNN's state beside the outputs, read by a callback
        module = StateOutputMLP
        common['callbacks'] = [('records', RecordsTraining(outputs_of_step))]
    return FSDPClassifier(
        module, lr=0.1,
        sync_each_batch=scenario == 'samples_each',
        mixed_precision={'bf16': 'bf16', 'fp16': 'fp16',
                         'fp16_spike': 'fp16'}.get(scenario),
        **common)


def outputs_of_step(batch, y_pred):
    return y_pred


def fit(scenario, out_dir):
    if scenario == 'tokens':
        X, y = token_data(N_TOKEN_SAMPLES)
    elif scenario == 'masked':
        X, y = masked_data()
    elif scenario in ('skip', 'fp16_spike'):
        X, y = spiky_data()
    elif scenario == 'fp16_tokens':
        X, y = fp16_token_data()
    elif scenario == 'apart':
        X, y = classification_data(N_APART_SAMPLES)
    else:
        X, y = classification_data(N_SAMPLES)
    if scenario == 'iterable':
        X, y = MicroBatches(X, y), None
    if scenario == 'sampler':
        X, y = Dataset(X, y), None
    torch.manual_seed(0)  # the same initial weights on every rank
    if scenario not in ('resume', 'criterion'):
        net = make_net(scenario, X=X)
        PARAMS_KEYS[:] = [sorted(net.get_params(deep=False))]
        net.initialize()
        net.trained_rows_ = [] if scenario == 'sampler' else None
        net.forward_dtypes_ = set()
        first_layer = next(module for module in net.module_.modules()
                           if isinstance(module, torch.nn.Linear))
        first_layer.register_forward_hook(
            lambda module, args, output: net.forward_dtypes_.add(output.dtype))
        if scenario in ('plan', 'lbfgs'):
            return refuse(net, X, y)
        if scenario == 'state':
            net.get_loss = output_loss(net)  # of the probabilities
        net.partial_fit(X, y)
        if scenario in ('bf16', 'fp16', 'batchnorm', 'micro'):  # shared: every rank
            net.proba_ = torch.as_tensor(net.predict_proba(
                X if scenario == 'batchnorm' else X[:8]))
        if scenario == 'bf16':  # validation's outputs and loss, as EpochScoring's
            step = net.validation_step((torch.as_tensor(X[:8]), torch.as_tensor(y[:8])))
            net.valid_ = (step['y_pred'], step['loss'])
        return net
    first = make_net(scenario, max_epochs=1).fit(X, y)
    files = {'f_' + name: out_dir / 'epoch1_{}.{}'.format(name, ext) for name, ext
             in [('params', 'pt'), ('optimizer', 'pt'), ('criterion', 'pt'),
                 ('history', 'json')]}
    first.save_params(**files)
    torch.manual_seed(1)  # other initial weights: the checkpoint replaces them
    net = make_net(scenario, max_epochs=1).initialize()
    net.load_params(**files)
    return net.partial_fit(X, y)


def local_params(net):
    return [param.to_local().detach().clone()
            for param in net.module_.parameters()]


def refuse(net, X, y):
    """'plan', 'lbfgs': the ValueError on every rank, before the first
    step; returns it, and what training changed."""
    initial = local_params(net)
    try:
        net.partial_fit(X, y)
    except ValueError as error:
        message = str(error)
    else:
        message = None
    return {
        'message': message,
        'params_unchanged': all(
            torch.equal(value, before)
            for value, before in zip(local_params(net), initial)),
        'optimizer_state': len(net.optimizer_.state),
        'memory_plan_': net.memory_plan_,
        # the rows of the batches that trained: with a loss
        'trained_batches': sum('train_loss' in row for epoch in net.history
                               for row in epoch['batches']),
    }


# the keys of the net's get_params before its fit: runtime state that
# leaked into them would reach clone()
PARAMS_KEYS = []


def run(scenario, out_dir):
    # FSDP2's reduce-scatters, as they happen: their number and dtypes
    # (before torch 2.13 FSDP2 calls reduce_scatter_tensor)
    reduce_scatters = []
    name = ('reduce_scatter_single' if hasattr(dist, 'reduce_scatter_single')
            else 'reduce_scatter_tensor')
    reduce_scatter = getattr(dist, name)

    def counting_reduce_scatter(*args, **kwargs):
        # (output, input, ...): by keyword in FSDP2's own calls
        tensor = kwargs['input'] if 'input' in kwargs else args[1]
        reduce_scatters.append(tensor.dtype)
        return reduce_scatter(*args, **kwargs)

    setattr(dist, name, counting_reduce_scatter)
    try:
        net = fit(scenario, out_dir)
    finally:
        setattr(dist, name, reduce_scatter)
    if scenario in ('plan', 'lbfgs'):  # refused: net is what refuse() returned
        save_rank(dict(net, reduce_scatters=len(reduce_scatters)), out_dir)
        return
    net.save_params(f_params=out_dir / 'params.pt',
                    f_optimizer=out_dir / 'optimizer.pt',
                    f_history=out_dir / 'history.json')
    save_rank({
        'params_keys': PARAMS_KEYS + [sorted(net.get_params(deep=False))],
        'proba': getattr(net, 'proba_', None),
        'valid': getattr(net, 'valid_', None),
        'step_batches': getattr(dict(net.callbacks_).get('steps'), 'records_', None),
        'records': getattr(dict(net.callbacks_).get('records'), 'records_', None),
        'buffers': {name: buffer.detach().cpu().clone()
                    for name, buffer in net.module_.named_buffers()},
        'criterion': {key: value.detach().cpu() for key, value in getattr(
            net.criterion_, 'state_dict', dict)().items()},  # not a Module
        'shard_numel': sum(param.to_local().numel()
                           for param in net.module_.parameters()),
        'max_memory_allocated': (torch.cuda.max_memory_allocated()
                                 if scenario == 'cuda' else None),
        'forward_dtypes': getattr(net, 'forward_dtypes_', None),
        'shard_dtypes': {param.dtype for param in net.module_.parameters()},
        'units': sum(isinstance(module, torch.distributed.fsdp.FSDPModule)
                     for module in net.module_.modules()),
        'train_losses': [row['train_loss']
                         for epoch in net.history[:, 'batches']
                         for row in epoch],
        'train_batch_sizes': [row['train_batch_size']
                              for epoch in net.history[:, 'batches']
                              for row in epoch],
        'steps_skipped': [row.get('step_skipped')
                          for epoch in net.history[:, 'batches']
                          for row in epoch],
        'backoffs': [row.get('micro_batch_size_backoff')
                     for epoch in net.history[:, 'batches']
                     for row in epoch],
        'micro_batch_size_': net.micro_batch_size_,
        'memory_plan_': getattr(net, 'memory_plan_', None),
        'forward_rows': getattr(net.module_, 'rows_', None),
        'failed_rows': getattr(net.module_, 'failed_rows_', None),
        'scale': net.grad_scaler_ and net.grad_scaler_.get_scale(),
        'piece_losses': getattr(net, 'piece_losses_', None),
        'merged_losses': [row.get('piece_loss')
                          for epoch in net.history[:, 'batches']
                          for row in epoch],
        'reduce_scatters': len(reduce_scatters),
        'reduce_dtypes': set(reduce_scatters),
        'sampler_epochs': getattr(net, 'sampler_epochs_', None),
        'first_rows': getattr(net, 'first_rows_', None),
        'trained_rows': (torch.cat(net.trained_rows_)
                         if getattr(net, 'trained_rows_', None) else None),
    }, out_dir)


def main(out_dir, scenarios):
    cuda = 'cuda' in scenarios.split(',')
    run_scenarios(out_dir, scenarios, run, backend='nccl' if cuda else 'gloo')


if __name__ == '__main__':
    main(*sys.argv[1:3])
