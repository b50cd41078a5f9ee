"""A GradAcc net side by side with transformers' Trainer, on a causal LM.

    python -m benchmarks.trainer_comparison --out benchmark_results

The same tiny GPT-2 (float64, no dropout) and sequences in the same order, each
micro-batch padded to its longest sequence (labels -100 on padding), SGD at a
constant lr. Each of four runs (skorch or Trainer, ``k`` micro-batches of ``B``
or one batch of ``B * k``) trains in a fresh process and reports its time per
epoch and peak RSS growth. Trainer is exact through ``compute_loss_func`` and
``num_items_in_batch``, the GradAcc net through its default count. Writes
``trainer_comparison.json`` and ``.md``.
"""

import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks import harness
from skorch_gradacc.demo import max_param_diff

B, K, EPOCHS, LR, N_SEQ, IGNORE = 4, 8, 2, 0.1, 256, -100


def pad(sequences):
    """input_ids, attention_mask, and labels -100 on padding and position 0."""
    ids = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(s) for s in sequences],
                                          batch_first=True)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in sequences])[
        :, None]).long()
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, 0] = IGNORE  # never a target, so counting labels is exact
    return {'input_ids': ids, 'attention_mask': mask, 'labels': labels}


def shifted_loss(logits, labels, num_items_in_batch=None):
    """Cross-entropy of the next token: summed, or per item if counted."""
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
        ignore_index=IGNORE, reduction='sum' if num_items_in_batch else 'mean')
    return loss / num_items_in_batch if num_items_in_batch else loss


class ShiftedCrossEntropy(torch.nn.CrossEntropyLoss):
    """The next token's cross-entropy; the default count is its labels."""

    def forward(self, logits, labels):
        return shifted_loss(logits, labels)


def train_skorch(model, sequences, batch_size, acc_steps):
    from skorch_gradacc import GradAccNeuralNet
    from skorch_gradacc.counting import check_loss_is_mean

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, input_ids, attention_mask):
            return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits

    def collate(items):
        return (batch := pad(items)), batch.pop('labels')

    net = GradAccNeuralNet(
        LM, criterion=ShiftedCrossEntropy, batch_size=batch_size, acc_steps=acc_steps,
        optimizer=torch.optim.SGD, lr=LR, max_epochs=EPOCHS, train_split=None,
        verbose=0, iterator_train__collate_fn=collate, iterator_train__shuffle=False,
        dataset=lambda X, y=None: X)
    net.fit(sequences)
    if acc_steps == 1:  # plain skorch's training: no check
        return net.module_.lm, None
    # the cost of check_loss, paid once per fit: on the first micro-batch
    batch = next(iter(net.get_iterator(net.get_dataset(sequences), True)))
    start = time.perf_counter()
    check_loss_is_mean(net, batch)
    return net.module_.lm, time.perf_counter() - start


def train_trainer(model, sequences, batch_size, acc_steps):
    from transformers import Trainer, TrainingArguments
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=acc_steps, num_train_epochs=EPOCHS,
            learning_rate=LR, lr_scheduler_type='constant', optim='sgd',
            weight_decay=0.0, max_grad_norm=0.0, report_to=[], save_strategy='no',
            logging_strategy='no', use_cpu=True,
            train_sampling_strategy='sequential', dataloader_drop_last=False)
        Trainer(model=model, args=args, train_dataset=sequences,
                data_collator=pad, compute_loss_func=lambda out, labels, **kw:
                shifted_loss(out.logits, labels, **kw)).train()
    return model, None


def run(name):
    """One run, in this (fresh) process: its numbers and parameters."""
    import transformers.trainer  # noqa: F401, imports before the baseline
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=512, n_positions=256, n_embd=64, n_layer=2, n_head=4, embd_pdrop=0.0,
        resid_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).double()
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, 512, size=n) for n in rng.integers(8, 200, N_SEQ)]
    batch_size, acc_steps = (B, K) if name.endswith('_acc') else (B * K, 1)
    train = train_skorch if name.startswith('skorch') else train_trainer
    start = time.perf_counter()
    peak, _, (model, check) = harness.peak_growth_kib(
        lambda: train(model, sequences, batch_size, acc_steps))
    seconds = (time.perf_counter() - start) / EPOCHS
    # numpy: torch would share memory via file descriptors
    return {'s_per_epoch': seconds, 'peak_rss_mib': peak / 1024, 'check_s': check}, {
        key: value.numpy() for key, value in model.state_dict().items()}


def main(argv=None):
    args = harness.parser('benchmarks.trainer_comparison',
                          __doc__.splitlines()[0]).parse_args(argv)
    numbers, params = {}, {}
    for name in ('skorch_acc', 'skorch_large', 'trainer_acc', 'trainer_large'):
        numbers[name], state = harness.fresh_process(run, name)
        params[name] = {key: torch.from_numpy(value) for key, value in state.items()}
    pairs = [('skorch_acc', 'skorch_large'), ('trainer_acc', 'trainer_large'),
             ('skorch_large', 'trainer_large'), ('trainer_large', 'skorch_large')]
    rows = [[name, '{:.1e}'.format(max_param_diff(params[name], params[ref])), ref,
             '{:.2f}'.format(numbers[name]['s_per_epoch']),
             '{:.0f}'.format(numbers[name]['peak_rss_mib']),
             '-' if numbers[name]['check_s'] is None else '{:.3f}'.format(
                 numbers[name]['check_s'])] for name, ref in pairs]
    text = '\n'.join([
        '# GradAcc net and transformers Trainer: exactness, time, memory', '',
        'Tiny GPT-2 (2 layers, 64 dims, vocab 512), float64, {} sequences of 8 to 199 '
        'tokens, micro-batch {}, k={}, {} epochs, SGD lr={}, one thread; `python -m '
        'benchmarks.trainer_comparison`.'.format(N_SEQ, B, K, EPOCHS, LR), '',
        harness.markdown_table(['run', 'max abs param distance', 'to', 's / epoch',
                                'peak RSS (MiB)', 'loss check (s)'], rows),
        'The loss check runs once per fit: {:.1%} of one epoch here.'.format(
            numbers['skorch_acc']['check_s']
            / numbers['skorch_acc']['s_per_epoch'])]) + '\n'
    meta = harness.provenance('benchmarks.trainer_comparison', sys.argv[1:])
    harness.save(args.out, 'trainer_comparison', dict(numbers, meta=meta), text)


if __name__ == '__main__':
    main()
