"""One rank of data-parallel fits; started by tests/test_distributed.py
with ``torchrun --nproc_per_node 2`` (on GPUs: one rank per GPU and the
backend ``nccl``).

Usage: ddp_worker.py OUT_DIR SCENARIOS [BACKEND], a comma-separated list of
(run one after another, see worker_common.py; ``accelerate`` last, since
Accelerate's state lives as long as the process)

* ``samples``: a classifier on 195 rows, ``batch_size=8``: 25
  micro-batches, the last of 3 rows, so rank 1 has none in the last step;
  its module refuses zero rows (as in every scenario but a few); then
  ``predict_proba`` of 5 rows, one batch;
* ``shuffle``: 203 rows with ``iterator_train__shuffle=True``, and each
  rank seeded with its rank;
* ``drop_last``: 203 rows with ``iterator_train__drop_last=True``: 25
  micro-batches of 8 (3 rows dropped), and the short last step of one
  dropped too;
* ``batchnorm``: ``samples`` with a BatchNorm, whose running statistics
  each rank updates from its own rows;
* ``compile``: ``samples`` on 211 rows with skorch's ``compile=True``
  (in the last step rank 0 has two micro-batches, rank 1 one); saves the
  net's params and rank 0's pickle to OUT_DIR/compile;
* ``tokens``: a token-level loss whose item counts differ between ranks;
* ``bucket``: a bucketing ``batch_sampler`` with dynamic padding;
* ``iterable``: an ``IterableDataset`` of ready micro-batches, no length;
* ``groups``: ``samples`` with ``optimizer__param_groups`` that match
  ``hidden.*``;
* ``freeze``: ``samples`` with skorch's ``Freezer('hidden.*')`` and an
  ``Unfreezer`` of it at the second epoch;
* ``criterion``: ``samples`` with a criterion that has a parameter, and a
  frozen one, and weight decay;
* ``load_best``: ``samples`` with ``Checkpoint(load_best=True)`` of the
  first epoch, in OUT_DIR/load_best, and a draw of torch's random state
  after the fit;
* ``pickle``: ``samples`` with ``Checkpoint(f_pickle='net.pkl')`` (and no
  other file) in OUT_DIR/pickle, which counts the rank's pickles; then
  every rank unpickles rank 0's file and trains it one epoch more
  (``partial_fit``);
* ``outputs``: ``samples`` with a module that returns Hugging Face's
  ``SequenceClassifierOutput`` and a callback that records each training
  step's ``y_pred`` (its class and logits);
* ``accelerate``: skorch's AccelerateMixin composed with GradAccMixin, on
  188 rows without even batches (the last step's rows: 24 and 20);
* ``accelerate_criterion``: ``accelerate`` with a criterion that has a
  parameter, which the accelerator wraps in DDP, and a count of that
  wrapper's all-reduces;
* ``raise``: rank 1 fails in its first step;
* ``uneven``: ranks whose own samplers give them 2 and 1 steps;
* ``auto``: ``samples`` with ``micro_batch_size='auto'``, where only rank 1's
  module runs out of memory above 4 rows, armed after the plan (the first
  step's gradient): the plan was wrong;
* ``apart``: ``auto`` on 61 rows, armed on both ranks: rank 0's module
  runs out of memory above 6 rows, rank 1's above 3; in the second step
  rank 0 has a micro-batch of 8 rows and rank 1 one of 5, and both fail
  at once, wanting pieces of 4 and of 3: every rank takes the least;
* ``plan``: ``samples`` with ``micro_batch_size='auto'``, where only rank 1
  has a budget, of 1 byte: every rank raises the plan's ValueError before
  the first step, and saves it;
* ``plan_fails``: ``plan`` without budgets, where only rank 1's module
  runs out of memory above 4 rows from the start, in the plan's passes.

Each rank saves its parameters, history and counters to
OUT_DIR/SCENARIO/rank{r}.pt.
"""

import os
import pickle
import sys
import types

import skorch.callbacks.training
import torch
import torch.distributed as dist
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, Checkpoint, Freezer, Unfreezer
from worker_common import run_scenarios, save_rank  # puts tests/ on sys.path

# isort: split
from test_distributed import PicklableDDPClassifier
from test_inputs import (
    ModelOutputMLP,
    NLLOfOutputs,
    RecordOutputs,
    RecordsTraining,
    StateOutputMLP,
    output_loss,
)
from test_normalization import IGNORE, TokenTagger, token_data
from test_streaming import (
    BucketSampler,
    SequenceDataset,
    StreamedBatches,
    TokenCrossEntropy,
    TokenLM,
    TokenMixin,
    pad,
    ready_batches,
    sequences,
)

from skorch_gradacc import (
    GradAccMixin,
    GradAccNeuralNet,
    GradAccNeuralNetClassifier,
)
from skorch_gradacc.distributed import DistributedGradAccMixin

from conftest import (
    COMPILED,
    FirstIsBest,
    MLPClassifier,
    NormalizedMLP,
    RecordsGradBatches,
    RecordsStepBatches,
    RowsNeededMLP,
    TemperedNLL,
    classification_data,
)

BATCH_SIZE, ACC_STEPS = 8, 3
OUT_DIR = []  # the launch's, for the scenarios that write files
# 'apart': a first step of 6 micro-batches of 8 rows, then one of 8 rows
# (rank 0's) and one of 5 (rank 1's)
N_SAMPLES = {'samples': 195, 'shuffle': 203, 'drop_last': 203, 'raise': 195,
             'uneven': 195,
             'auto': 195, 'apart': 61, 'plan': 195, 'plan_fails': 195, 'groups': 195,
             'freeze': 195, 'criterion': 195, 'load_best': 195, 'pickle': 195,
             'outputs': 195, 'state': 195, 'batchnorm': 195, 'compile': 211}
# the most rows each rank's module takes, per scenario
MAX_ROWS = {'auto': (1000, 4), 'apart': (6, 3), 'plan_fails': (1000, 4)}


class CountsMicroBatches:
    """Counts the micro-batches (with rows) this rank trains on."""

    def train_step_single(self, batch, **fit_params):
        rows = len(batch[0])
        self.micro_batches_ = getattr(self, 'micro_batches_', 0) + bool(rows)
        self.rows_ = getattr(self, 'rows_', 0) + rows
        if rows:  # the rows of each forward pass, in order
            self.piece_rows_ = getattr(self, 'piece_rows_', []) + [rows]
        return super().train_step_single(batch, **fit_params)


class DDPClassifier(CountsMicroBatches, DistributedGradAccMixin,
                    GradAccNeuralNetClassifier):
    pass


class DDPTokenNet(CountsMicroBatches, DistributedGradAccMixin,
                  GradAccNeuralNet):
    def count_loss_items(self, batch):
        _, y = batch
        return int((y != IGNORE).sum())


class DDPTokenLMNet(CountsMicroBatches, TokenMixin, DistributedGradAccMixin,
                    GradAccNeuralNet):
    pass


class CappedMLP(MLPClassifier):
    """Raises torch.cuda.OutOfMemoryError (torch 2.3 has no
    torch.OutOfMemoryError) above ``max_rows`` rows, like a GPU that cannot
    hold more, once ``armed``; ``failed_rows_``: the rows of each pass
    that raised."""

    def __init__(self, max_rows=1000, armed=True):
        super().__init__()
        self.max_rows, self.armed = max_rows, armed
        self.failed_rows_ = []

    def forward(self, X):
        if len(X) > self.max_rows and self.armed:
            self.failed_rows_.append(len(X))
            raise torch.cuda.OutOfMemoryError('CUDA out of memory (simulated)')
        return super().forward(X)


class ArmAfterThePlan(Callback):
    """Arms the module's error after the first step: the plan was wrong."""

    train_batch_reads = ()  # nothing of the batch

    def on_grad_computed(self, net, **kwargs):
        module = net.module_
        getattr(module, 'module', module).armed = True  # unwrap DDP


class CountsCriterionAllReduces(Callback):
    """Counts the all-reduces of the criterion's own DDP wrapper."""

    train_batch_reads = ()  # nothing of the batch

    def on_train_begin(self, net, **kwargs):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.count = 0

        def counted(state, bucket):
            self.count += 1
            return default_hooks.allreduce_hook(state, bucket)

        net.criterion_.register_comm_hook(None, counted)


class FailingMLP(MLPClassifier):
    def forward(self, X):
        raise RuntimeError('rank 1 fails on purpose')


class NLLOfProbabilities:
    """NLLLoss on probabilities, as NeuralNetClassifier computes it, but not
    a torch Module: skorch's AccelerateMixin would wrap a criterion Module in
    DDP, which refuses modules without parameters."""

    def __call__(self, y_pred, y_true):
        eps = torch.finfo(y_pred.dtype).eps
        return torch.nn.functional.nll_loss(torch.log(y_pred + eps), y_true)


class UnevenShare(torch.utils.data.DistributedSampler):
    """A rank's own rows: 48 on rank 0, 24 on rank 1 (2 and 1 steps)."""

    def __iter__(self):
        return iter(range(48) if self.rank == 0 else range(48, 72))

    def __len__(self):
        return 48 if self.rank == 0 else 24


def make_accelerated_net(criterion=NLLOfProbabilities, even_batches=True, **common):
    from accelerate import Accelerator, DataLoaderConfiguration
    from skorch.hf import AccelerateMixin

    class AcceleratedGradAccNet(CountsMicroBatches, AccelerateMixin,
                                GradAccMixin, NeuralNetClassifier):
        pass

    return AcceleratedGradAccNet(
        MLPClassifier, device=None, accelerator=Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(
                even_batches=even_batches)),
        criterion=criterion, callbacks__print_log__sink=print, lr=0.1,
        **common)


STREAM = dict(criterion=TokenCrossEntropy, optimizer=torch.optim.Adam,
              lr=0.01)


def make_net_and_data(scenario, rank, device):
    """The rank's net and the data to fit it on: (net, X, y)."""
    common = dict(batch_size=BATCH_SIZE, acc_steps=ACC_STEPS, max_epochs=2,
                  train_split=None, verbose=0, device=device)
    if scenario == 'tokens':
        return DDPTokenNet(
            TokenTagger, criterion=torch.nn.CrossEntropyLoss,
            criterion__ignore_index=IGNORE, lr=0.5, optimizer__momentum=0.9,
            **common), *token_data(100)
    if scenario == 'bucket':
        seqs = sequences()
        return DDPTokenLMNet(
            TokenLM, iterator_train__batch_size=1,
            iterator_train__batch_sampler=BucketSampler(seqs, 4),
            iterator_train__collate_fn=pad, **STREAM,
            **common), SequenceDataset(seqs), None
    if scenario == 'iterable':
        return DDPTokenLMNet(
            TokenLM, iterator_train__batch_size=None, **STREAM,
            **common), StreamedBatches(ready_batches()), None
    common['optimizer__momentum'] = 0.9
    if scenario.startswith('accelerate'):
        del common['device']  # the accelerator places the module
        if scenario == 'accelerate_criterion':
            common.update(criterion=TemperedNLL,
                          callbacks=[CountsCriterionAllReduces()])
            return make_accelerated_net(**common), *classification_data(192)
        # the last step's rows unequal over ranks: 24 and 20
        return make_accelerated_net(even_batches=False, **common), *classification_data(
            188)
    # a module that refuses zero rows: a rank without rows runs a real one
    module = FailingMLP if scenario == 'raise' and rank == 1 else RowsNeededMLP
    if scenario == 'batchnorm':
        module = NormalizedMLP
    if scenario in MAX_ROWS:
        module = CappedMLP
        common.update(micro_batch_size='auto',
                      module__max_rows=MAX_ROWS[scenario][rank],
                      module__armed=scenario == 'plan_fails')
        if scenario != 'plan_fails':  # after the plan's passes
            common['callbacks'] = [ArmAfterThePlan()]
    if scenario == 'plan':
        common.update(micro_batch_size='auto',
                      memory_budget=1 if rank == 1 else None)
    if scenario == 'groups':
        common['optimizer__param_groups'] = [('hidden.*', {'lr': 0.0})]
    if scenario == 'freeze':
        common['callbacks'] = [Freezer('hidden.*'),
                               Unfreezer('hidden.*', at=2)]
    if scenario == 'criterion':
        common.update(criterion=TemperedNLL, optimizer__weight_decay=0.01)
    if scenario == 'drop_last':
        common['iterator_train__drop_last'] = True
    if scenario == 'uneven':
        common['iterator_train__sampler'] = UnevenShare(range(N_SAMPLES['uneven']))
    if scenario in ('shuffle', 'samples'):  # what callbacks read before its end
        common['callbacks'] = [('steps', (
            RecordsStepBatches if scenario == 'shuffle' else RecordsGradBatches)())]
    if scenario == 'load_best':
        common['callbacks'] = [FirstIsBest(), Checkpoint(
            monitor='first_best', load_best=True, dirname=os.path.join(
                OUT_DIR[0], 'load_best'))]
    if scenario == 'outputs':
        module = ModelOutputMLP
        common.update(criterion=NLLOfOutputs, callbacks=[
            ('outputs', RecordOutputs())])
    if scenario == 'state':  # an RNN's state beside the outputs, read by a callback
        module = StateOutputMLP
        common['callbacks'] = [('records', RecordsTraining(outputs_of_step))]
    if scenario == 'compile':
        common.update(COMPILED)
    if scenario == 'pickle':  # the net's file alone
        common['callbacks'] = [Checkpoint(
            monitor=None, f_params=None, f_optimizer=None, f_criterion=None,
            f_history=None, f_pickle='net.pkl', dirname=OUT_DIR[0])]
    net_cls = (PicklableDDPClassifier if scenario in ('pickle', 'compile')
               else DDPClassifier)
    return net_cls(
        module, lr=0.1, iterator_train__shuffle=scenario == 'shuffle',
        **common), *classification_data(N_SAMPLES[scenario])


def outputs_of_step(batch, y_pred):
    return y_pred


def run(scenario, out_dir, device):
    rank = int(os.environ['RANK'])  # set by torchrun
    # The same seed on every rank, except in 'shuffle': there rank 1 draws
    # other initial weights and another order, unless DDP gives it rank
    # 0's weights and the net rank 0's random state each epoch.
    torch.manual_seed(rank if scenario == 'shuffle' else 0)
    OUT_DIR[:] = [out_dir]
    net, X, y = make_net_and_data(scenario, rank, device)
    if scenario in ('plan', 'uneven'):
        return refuse(net, X, y, out_dir)
    if scenario == 'pickle':
        return pickle_and_resume(net, X, y, out_dir)
    if scenario == 'compile':
        return compile_and_pickle(net, X, y, out_dir)
    if scenario == 'state':
        net.get_loss = output_loss(net)  # of the probabilities
    params_before = sorted(net.get_params(deep=False))
    net.fit(X, y)
    draw = torch.rand(()).item() if scenario == 'load_best' else None
    module = net.module_
    module = getattr(module, 'module', module)  # unwrap DDP
    outputs = dict(net.callbacks_).get('outputs')
    criterion_allreduces = dict(net.callbacks_).get('CountsCriterionAllReduces')
    save_rank({
        'outputs': outputs and [(kind.__name__, logits)
                                for kind, logits in outputs.outputs_],
        'params_keys': (params_before, sorted(net.get_params(deep=False))),
        'params': {key: value.cpu()
                   for key, value in module.state_dict().items()},
        'allreduces': net.engine_.allreduces,
        'criterion_allreduces': getattr(criterion_allreduces, 'count', None),
        'draw_after_fit': draw,
        'criterion': {key: value.cpu() for key, value in getattr(
            net.criterion_, 'state_dict', dict)().items()},  # not a Module
        'param_groups': [len(group['params'])
                         for group in net.optimizer_.param_groups],
        'steps': sum(net.history[:, 'train_batch_count']),
        'micro_batches': net.micro_batches_,
        'rows': net.rows_,
        'micro_batch_size_': getattr(net, 'micro_batch_size_', None),
        'memory_plan_': getattr(net, 'memory_plan_', None),
        'piece_rows': net.piece_rows_,
        'failed_rows': getattr(module, 'failed_rows_', None),
        'backoffs': [[row.get('micro_batch_size_backoff') for row in rows]
                     for rows in net.history[:, 'batches']],
        'epoch_micro_batch_size': [row.get('micro_batch_size')
                                   for row in net.history],
        'train_loss': [float(loss) for loss in net.history[:, 'train_loss']],
        'batch_losses': [[float(loss) for loss in losses] for losses in
                         net.history[:, 'batches', :, 'train_loss']],
        'batch_sizes': [[int(size) for size in sizes] for sizes in
                        net.history[:, 'batches', :, 'train_batch_size']],
        'step_batches': getattr(dict(net.callbacks_).get('steps'), 'records_', None),
        'records': getattr(dict(net.callbacks_).get('records'), 'records_', None),
        # one batch: rank 1 pads
        'proba': torch.as_tensor(net.predict_proba(X[:5])) if scenario == 'samples'
        else None,
    }, out_dir)


def params_of(net):
    module = net.module_
    module = getattr(module, 'module', module)  # unwrap DDP
    return {key: value.detach().cpu().clone()
            for key, value in module.state_dict().items()}


def refuse(net, X, y, out_dir):
    """The ValueError that every rank raises before the first step ('plan':
    a budget too small for one row; 'uneven': unequal steps); saves it, and
    what training changed. The launch goes on."""
    net.initialize()
    initial = params_of(net)
    try:
        net.partial_fit(X, y)
    except ValueError as error:
        message = str(error)
    else:
        message = None
    save_rank({
        'message': message,
        'params_unchanged': all(
            torch.equal(value, initial[key])
            for key, value in params_of(net).items()),
        'optimizer_state': len(net.optimizer_.state),
        'allreduces': net.engine_.allreduces,
        'micro_batches': getattr(net, 'micro_batches_', 0),
        'memory_plan_': getattr(net, 'memory_plan_', None),
        # the rows of the batches that trained: with a loss
        'trained_batches': sum('train_loss' in row for epoch in net.history
                               for row in epoch['batches']),
    }, out_dir)


def pickle_and_resume(net, X, y, out_dir):
    """'pickle': fit, counting the pickles that skorch's Checkpoint writes;
    then unpickle rank 0's file on every rank and train one epoch more."""
    pickles = []

    def dump(obj, file, *args, **kwargs):
        pickles.append(type(obj).__name__)
        return pickle.dump(obj, file, *args, **kwargs)

    skorch.callbacks.training.pickle = types.SimpleNamespace(dump=dump)
    try:
        net.fit(X, y)
    finally:
        skorch.callbacks.training.pickle = pickle
    dist.barrier()  # rank 0's file is complete
    with open(os.path.join(out_dir, 'net.pkl'), 'rb') as f:
        resumed = pickle.load(f)
    unpickled = type(resumed.module_).__name__
    resumed.partial_fit(X, y, epochs=1)
    save_rank({
        'pickles': pickles,
        'unpickled_module': unpickled,
        'resumed_module': type(resumed.module_).__name__,
        'params': params_of(resumed),
        'train_loss': [float(loss) for loss in resumed.history[:, 'train_loss']],
    }, out_dir)


def compile_and_pickle(net, X, y, out_dir):
    """'compile': fit, save the params and (rank 0) pickle the net."""
    net.fit(X, y)
    net.save_params(f_params=os.path.join(out_dir, 'params.pt'))
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, 'net.pkl'), 'wb') as f:
            pickle.dump(net, f)
    wrapped = net.module_._orig_mod  # torch.compile's
    save_rank({
        'wrappers': [type(module).__name__ for module in (
            net.module_, wrapped, wrapped.module)],
        'names': [name for name, _ in net.get_all_learnable_params()],
        'params': {key: value.cpu() for key, value
                   in wrapped.module.state_dict().items()},
        'allreduces': net.engine_.allreduces,
        'steps': sum(net.history[:, 'train_batch_count']),
        'train_loss': [float(loss) for loss in net.history[:, 'train_loss']],
        'proba': torch.as_tensor(net.predict_proba(X)),
    }, out_dir)


def main(out_dir, scenarios, backend='gloo'):
    device = 'cpu'
    if backend == 'nccl':
        device = 'cuda:{}'.format(os.environ['LOCAL_RANK'])
        torch.cuda.set_device(device)
    # the accelerator sets up the processes, if it comes first
    run_scenarios(out_dir, scenarios,
                  lambda scenario, folder: run(scenario, folder, device),
                  backend=backend,
                  init_group=not scenarios.startswith('accelerate'))


if __name__ == '__main__':
    main(*sys.argv[1:4])
