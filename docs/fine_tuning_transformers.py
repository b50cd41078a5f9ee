"""The building blocks of the recipe in ``fine_tuning_transformers.rst``.

The page shows the code between the two marker comments below with
``literalinclude``, and its code blocks import it; so do the notebook
``notebooks/Fine_Tuning_Transformers.ipynb`` and
``tests/test_transformers_recipe.py``.

After the second marker come the measurements that the notebook plots and
asserts: padding waste, and the peak memory of ``fit``, measured in a fresh
process by running this file as a script.
"""

# --- begin: the code of docs/fine_tuning_transformers.rst ---
import numpy as np
import torch
from skorch import NeuralNet
from skorch.hf import HuggingfaceTokenizer
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing
from tokenizers.trainers import WordLevelTrainer
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForTokenClassification

from skorch_gradacc import GradAccMixin

TAGS = ['DET', 'ADJ', 'NOUN', 'VERB', 'ADV', 'CONJ']
WORDS = {
    'DET': ['the', 'a', 'every', 'some', 'this', 'that'],
    'ADJ': ['small', 'red', 'quiet', 'old', 'bright', 'heavy', 'green', 'cold'],
    'NOUN': ['cat', 'dog', 'river', 'teacher', 'city', 'garden', 'bird',
             'farmer', 'window', 'song'],
    'VERB': ['sees', 'likes', 'finds', 'follows', 'paints', 'hears',
             'carries', 'visits'],
    'ADV': ['slowly', 'often', 'today', 'quietly', 'again'],
    'CONJ': ['and', 'but', 'while'],
}
# a noun after a determiner or an adjective, a verb after a noun
AMBIGUOUS = ['watch', 'light', 'park', 'plant', 'ship', 'train', 'book', 'fish']


def make_sentences(n, max_clauses=4, seed=0):
    """Return ``n`` sentences of 1 to ``max_clauses`` clauses, and their tags.

    Each sentence is a string of lowercase words separated by spaces; its
    tags are an array with one index into ``TAGS`` per word. Words in
    ``AMBIGUOUS`` are nouns or verbs depending on the word before them.
    """
    rng = np.random.default_rng(seed)

    def word(tag):
        if tag in ('NOUN', 'VERB') and rng.random() < 0.3:
            return rng.choice(AMBIGUOUS)
        return rng.choice(WORDS[tag])

    def noun_phrase():
        return ['DET'] + ['ADJ'] * rng.integers(0, 3) + ['NOUN']

    texts, tags = [], np.empty(n, dtype=object)
    for i in range(n):
        sentence = []
        for clause in range(rng.integers(1, max_clauses + 1)):
            if clause:
                sentence.append('CONJ')
            sentence += noun_phrase() + ['VERB']
            if rng.random() < 0.7:
                sentence += noun_phrase()
            if rng.random() < 0.3:
                sentence.append('ADV')
        texts.append(' '.join(word(tag) for tag in sentence))
        tags[i] = np.array([TAGS.index(tag) for tag in sentence])
    return texts, tags


PAD, UNK, CLS, SEP = '[PAD]', '[UNK]', '[CLS]', '[SEP]'
VOCAB_SIZE = 128  # an upper bound: the model's embedding has this many rows
IGNORE_INDEX = -100  # the targets of [CLS], [SEP] and padding


def make_tokenizer():
    """Return a word-level tokenizer, trained on the text it is fitted to.

    One token per word (split at spaces), unknown words become ``[UNK]``,
    and each sentence is framed as ``[CLS] ... [SEP]``; ``[PAD]`` is id 0.
    The token lists are not padded (``return_tensors=None``): each
    micro-batch is padded when it is collated.
    """
    return HuggingfaceTokenizer(
        tokenizer=Tokenizer(WordLevel(unk_token=UNK)),
        pre_tokenizer=WhitespaceSplit(),
        post_processor=TemplateProcessing(
            single=f'{CLS} $A {SEP}', special_tokens=[(CLS, 2), (SEP, 3)]),
        # an initialized trainer: clone() keeps it, unlike trainer__ params
        trainer=WordLevelTrainer(vocab_size=VOCAB_SIZE, show_progress=False,
                                 special_tokens=[PAD, UNK, CLS, SEP]),
        return_tensors=None,
        pad_token=PAD,
    )


class TaggingDataset(torch.utils.data.Dataset):
    """The token ids of each sentence, with its word tags (or None)."""

    def __init__(self, X, y=None):
        self.X = X
        self.y = y

    def __len__(self):
        return len(self.X['input_ids'])

    def __getitem__(self, i):
        return self.X['input_ids'][i], None if self.y is None else self.y[i]


def pad_batch(items):
    """Collate sentences, padded to the longest of them: dynamic padding.

    Returns the inputs, a dict with ``input_ids`` and the ``attention_mask``
    (0 on padding), and the token targets: each word's tag, and
    ``IGNORE_INDEX`` on ``[CLS]``, ``[SEP]`` and padding. The targets are
    None when the sentences have no tags (prediction).
    """
    length = max(len(ids) for ids, _ in items)
    input_ids = torch.zeros((len(items), length), dtype=torch.long)  # [PAD]
    attention_mask = torch.zeros((len(items), length), dtype=torch.long)
    targets = torch.full((len(items), length), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, tags) in enumerate(items):
        input_ids[row, :len(ids)] = torch.as_tensor(ids)
        attention_mask[row, :len(ids)] = 1
        if tags is not None:
            if len(ids) != len(tags) + 2:
                raise ValueError('expected one token per word')
            targets[row, 1:len(ids) - 1] = torch.as_tensor(tags)
    X = {'input_ids': input_ids, 'attention_mask': attention_mask}
    return X, None if items[0][1] is None else targets


class BucketBatchSampler(torch.utils.data.Sampler):
    """Micro-batches of sentences of similar length, in random order.

    Each epoch, the sentences are shuffled, sorted by length (a stable sort,
    so ties stay shuffled), cut into batches of ``batch_size``, and the
    batches are shuffled. ``seed=None`` draws the seed from torch's random
    number generator, as torch's own samplers do.
    """

    def __init__(self, lengths, batch_size, seed=None):
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        if seed is None:
            seed = int(torch.randint(2**31, ()))
        self.seed = seed
        self.epoch = 0

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        self.epoch += 1
        order = rng.permutation(len(self.lengths))
        order = order[np.argsort(self.lengths[order], kind='stable')]
        batches = [order[start:start + self.batch_size].tolist()
                   for start in range(0, len(order), self.batch_size)]
        for index in rng.permutation(len(batches)):
            yield batches[index]

    def __len__(self):
        return -(-len(self.lengths) // self.batch_size)


class UnionBatchSampler(torch.utils.data.Sampler):
    """The union of every ``k`` consecutive batches of ``batch_sampler``.

    Plain skorch with these batches is the large-batch run that accumulating
    ``k`` micro-batches of ``batch_sampler`` reproduces.
    """

    def __init__(self, batch_sampler, k):
        self.batch_sampler = batch_sampler
        self.k = k

    def __iter__(self):
        group = []
        for count, batch in enumerate(self.batch_sampler, start=1):
            group += batch
            if count % self.k == 0:
                yield group
                group = []
        if group:
            yield group

    def __len__(self):
        return -(-len(self.batch_sampler) // self.k)


def bucketed_loader(dataset, batch_size, union=1, seed=None, **kwargs):
    """Return a DataLoader of bucketed micro-batches of ``dataset``.

    skorch calls this with the training data it has just built (in a
    pipeline, the tokenizer's output), so the sampler is made for the data
    at hand. With ``union=k``, each batch is the union of ``k`` consecutive
    micro-batches: the large-batch reference.
    """
    lengths = [len(dataset[i][0]) for i in range(len(dataset))]
    batch_sampler = BucketBatchSampler(lengths, batch_size, seed=seed)
    if union > 1:
        batch_sampler = UnionBatchSampler(batch_sampler, union)
    return DataLoader(dataset, batch_sampler=batch_sampler,
                      collate_fn=pad_batch, **kwargs)


class BertTagger(torch.nn.Module):
    """A small ``BertForTokenClassification`` built from a config.

    Nothing is downloaded: the weights are initialized at random, as for
    pre-training from scratch; fine-tuning a pre-trained model differs only
    in where the weights come from. Returns the logits, of shape
    ``(batch, tokens, len(TAGS))``.
    """

    def __init__(self, hidden_size=32, num_layers=2, dropout=0.1,
                 dtype=torch.float32):
        super().__init__()
        config = BertConfig(
            vocab_size=VOCAB_SIZE, hidden_size=hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=2,
            intermediate_size=2 * hidden_size, max_position_embeddings=512,
            num_labels=len(TAGS), pad_token_id=0,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        self.bert = BertForTokenClassification(config).to(dtype)

    def forward(self, input_ids, attention_mask):
        """Return the logits of each token's tag."""
        return self.bert(input_ids=input_ids,
                         attention_mask=attention_mask).logits


class Tagger(NeuralNet):
    """A plain skorch net for token tagging.

    The loss is the cross-entropy of each token's logits, averaged over the
    tokens that have a target (``ignore_index``); ``predict`` returns each
    sentence's word tags.
    """

    def get_loss(self, y_pred, y_true, *args, **kwargs):
        """Return the mean cross-entropy over the tokens that have a target."""
        # (batch, tokens, tags) logits against (batch, tokens) targets
        return super().get_loss(y_pred.flatten(0, 1), y_true.flatten(),
                                *args, **kwargs)

    def predict(self, X):
        """Return an object array with the predicted tags of each sentence."""
        tags = []
        for batch in self.get_iterator(self.get_dataset(X)):
            lengths = batch[0]['attention_mask'].sum(dim=1)
            predicted = self.evaluation_step(batch).argmax(dim=-1)
            tags += [row[1:length - 1].cpu().numpy()
                     for row, length in zip(predicted, lengths)]
        result = np.empty(len(tags), dtype=object)
        result[:] = tags
        return result


class GradAccTagger(GradAccMixin, Tagger):
    """The tagger, with gradient accumulation normalized by tokens.

    The default ``count_loss_items`` counts the targets that
    ``CrossEntropyLoss`` does not ignore: the tokens that have a tag.
    """


def tagger_params(**params):
    """Return the parameters of a tagger net: these, and the recipe's own."""
    return {
        'module': BertTagger,
        'criterion': torch.nn.CrossEntropyLoss,
        'criterion__ignore_index': IGNORE_INDEX,
        'optimizer': torch.optim.AdamW,
        'dataset': TaggingDataset,
        'iterator_train': bucketed_loader,
        'iterator_valid__collate_fn': pad_batch,
        'train_split': None,
        'verbose': 0,
        **params,
    }


def token_accuracy(estimator, X, y):
    """Return the share of words whose tag ``estimator`` predicts right."""
    predicted = estimator.predict(X)
    right = sum(int((tags == true).sum()) for tags, true in zip(predicted, y))
    return right / sum(len(true) for true in y)
# --- end: the code of docs/fine_tuning_transformers.rst ---

# Measurements for the notebook and the tests; not part of the page.

import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def padding_waste(loader):
    """Return the share of padding among the tokens of a loader's batches.

    That is the share of the tokens that the module processes in vain: the
    zeros of the batches' attention masks, as collated by ``pad_batch``.
    """
    padded = total = 0
    for X, _ in loader:
        mask = X['attention_mask']
        padded += int((mask == 0).sum())
        total += mask.numel()
    return padded / total


MEMORY_KINDS = ('plain', 'large', 'gradacc')


def measure_peak_memory(runs, n_sentences=64, max_clauses=16, hidden_size=64,
                        timeout=600):
    """Return the peak memory that ``fit`` takes for each run, in MiB.

    Each run is ``(kind, batch_size, acc_steps)``: ``'plain'`` is plain
    skorch (:class:`Tagger`) at the micro-batch ``batch_size``, ``'large'``
    plain skorch at the effective batch (the union of ``acc_steps``
    consecutive micro-batches), and ``'gradacc'`` the :class:`GradAccTagger`
    with ``batch_size`` and ``acc_steps``. All train one epoch on the same
    ``n_sentences`` sentences of up to ``max_clauses`` clauses, with a
    :class:`BertTagger` of ``hidden_size``, in float32.

    This file is run as a script in a fresh process, with glibc told to
    return every freed block of 64 KiB or more at once
    (``MALLOC_MMAP_THRESHOLD_=65536``), so that the resident set tracks the
    memory in use. The script tokenizes the text, then forks a child per run
    from that state: the child builds its net, pays torch's one-time costs
    on a copy of the module, reads its resident set size, trains, and
    reports its peak resident set size minus that baseline.
    """
    for kind, _, _ in runs:
        if kind not in MEMORY_KINDS:
            raise ValueError(f'unknown kind {kind!r}')
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536',
               TOKENIZERS_PARALLELISM='false', OMP_NUM_THREADS='1')
    env['PYTHONPATH'] = os.pathsep.join(
        filter(None, [root, os.environ.get('PYTHONPATH')]))
    spec = {'runs': [list(run) for run in runs], 'n_sentences': n_sentences,
            'max_clauses': max_clauses, 'hidden_size': hidden_size}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=root)
    if proc.returncode:
        raise RuntimeError('the memory measurement failed:\n' + proc.stderr)
    return json.loads(proc.stdout.splitlines()[-1])


def _resident_kib(field):
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'{field} not in /proc/self/status')


def _reset_peak_resident():
    """Reset the peak resident set size of this process (Linux 4.0+)."""
    try:
        with open('/proc/self/clear_refs', 'w') as clear_refs:
            clear_refs.write('5')
        return True
    except OSError:
        return False


def _train_and_measure(kind, batch_size, acc_steps, X, y, hidden_size):
    """Train one run in this (forked) process; return its peak in KiB."""
    torch.set_num_threads(1)
    params = tagger_params(
        module__hidden_size=hidden_size, lr=1e-3, max_epochs=1,
        batch_size=batch_size, iterator_train__seed=0)
    if kind == 'plain':
        net = Tagger(**params)
    elif kind == 'large':
        net = Tagger(**params, iterator_train__union=acc_steps)
    else:
        net = GradAccTagger(**params, acc_steps=acc_steps)
    torch.manual_seed(0)
    net.initialize()
    # torch's one-time costs (kernels, the autograd engine, the optimizer's
    # first step), paid on a copy so that the baseline includes them
    module = BertTagger(hidden_size=hidden_size)
    optimizer = torch.optim.AdamW(module.parameters())
    inputs, _ = pad_batch([(X['input_ids'][i], None) for i in range(2)])
    module(**inputs).sum().backward()
    optimizer.step()
    del module, optimizer, inputs
    gc.collect()
    baseline = _resident_kib('VmRSS')
    if not _reset_peak_resident():
        baseline = max(baseline, resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss)
    net.partial_fit(X, y)
    return _resident_kib('VmHWM') - baseline


def _main(spec):
    """Measure the runs of ``spec``, each in a child forked from here."""
    import torch._dynamo  # noqa: F401  (the first optimizer step imports it)

    texts, tags = make_sentences(spec['n_sentences'],
                                 max_clauses=spec['max_clauses'])
    X = make_tokenizer().fit(texts).transform(texts)
    X = {'input_ids': X['input_ids']}
    results = []
    for kind, batch_size, acc_steps in spec['runs']:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            os.close(read)
            code = 1
            try:
                kib = _train_and_measure(kind, batch_size, acc_steps, X, tags,
                                         spec['hidden_size'])
                os.write(write, json.dumps(kib).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as pipe:
            reported = pipe.read()
        _, status = os.waitpid(pid, 0)
        if status or not reported:
            raise RuntimeError(f'run {kind, batch_size, acc_steps} failed')
        results.append({'kind': kind, 'batch_size': batch_size,
                        'acc_steps': acc_steps,
                        'peak_mib': json.loads(reported) / 1024})
    print(json.dumps(results))


if __name__ == '__main__':
    _main(json.loads(sys.argv[1]))
