"""The Hugging Face fine-tuning recipe: its parts and exactness.

The recipe is ``docs/fine_tuning_transformers.rst``; ``tests/test_docs.py``
runs it as a script. Its building blocks are the module
``docs/fine_tuning_transformers.py``, which the page shows (the first test
checks that it includes the module's marked region) and imports, as does
the notebook. The oracle for exactness is
plain skorch trained on the unions of ``acc_steps`` consecutive
micro-batches, in float64 without dropout.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.base import clone

from skorch_gradacc import LossItemsWarning

pytest.importorskip('transformers')
pytest.importorskip('tokenizers')

from test_docs import extract_blocks  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / 'docs'
sys.path.insert(0, str(DOCS))
import fine_tuning_transformers as recipe  # noqa: E402

sys.path.remove(str(DOCS))

ATOL = 1e-8
BEGIN = '# --- begin: the code of docs/fine_tuning_transformers.rst ---'
END = '# --- end: the code of docs/fine_tuning_transformers.rst ---'
FIRST_USAGE_SECTION = 'Fine-tune in a pipeline, and search ``acc_steps``'


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def code_lines(text):
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def test_page_shows_the_module_and_imports_it():
    page = (DOCS / 'fine_tuning_transformers.rst').read_text(encoding='utf-8')
    include = ('.. literalinclude:: fine_tuning_transformers.py\n'
               '   :language: python\n'
               '   :start-after: {}\n'
               '   :end-before: {}\n'.format(BEGIN, END))
    assert include in page
    module = (DOCS / 'fine_tuning_transformers.py').read_text(encoding='utf-8')
    region = module.split(BEGIN + '\n')[1].split(END)[0]
    assert len(code_lines(region)) > 200
    blocks = extract_blocks(DOCS / 'fine_tuning_transformers.rst')
    assert blocks[0].section == FIRST_USAGE_SECTION
    assert 'from fine_tuning_transformers import (' in blocks[0].source


@pytest.fixture(scope='module')
def data():
    """Tokenized sentences: 60 make 8 micro-batches of 8, the last of 4."""
    texts, tags = recipe.make_sentences(60, seed=3)
    return recipe.make_tokenizer().fit(texts).transform(texts), tags


# The samplers and the collate function


def test_bucket_batch_sampler_covers_each_sentence_once_per_epoch():
    lengths = np.random.default_rng(0).integers(3, 40, size=61)
    sampler = recipe.BucketBatchSampler(lengths, 8, seed=0)
    epochs = [list(sampler), list(sampler)]
    for batches in epochs:
        assert len(batches) == len(sampler) == 8
        assert sorted(i for batch in batches for i in batch) == list(range(61))
        assert sorted(len(batch) for batch in batches) == [5] + [8] * 7
        # sorted by length before cutting: the batches' length ranges do not
        # overlap
        ranges = sorted((lengths[b].min(), lengths[b].max()) for b in batches)
        assert all(hi <= lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))
    assert epochs[0] != epochs[1]  # another order every epoch
    assert list(recipe.BucketBatchSampler(lengths, 8, seed=0)) == epochs[0]


def test_bucket_batch_sampler_draws_its_seed_from_torch():
    torch.manual_seed(0)
    first = list(recipe.BucketBatchSampler(range(40), 4))
    torch.manual_seed(0)
    assert list(recipe.BucketBatchSampler(range(40), 4)) == first
    assert list(recipe.BucketBatchSampler(range(40), 4)) != first


def test_union_batch_sampler_concatenates_consecutive_batches():
    batches = [[0, 1], [2], [3, 4], [5, 6], [7]]
    union = recipe.UnionBatchSampler(batches, 2)
    assert list(union) == [[0, 1, 2], [3, 4, 5, 6], [7]]
    assert len(union) == 3
    assert list(recipe.UnionBatchSampler(batches, 5)) == [list(range(8))]


def test_pad_batch_pads_to_the_longest_and_aligns_the_tags():
    items = [([2, 10, 11, 3], np.array([0, 2])), ([2, 12, 3], np.array([5]))]
    X, targets = recipe.pad_batch(items)
    ignore = recipe.IGNORE_INDEX
    assert X['input_ids'].tolist() == [[2, 10, 11, 3], [2, 12, 3, 0]]
    assert X['attention_mask'].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert targets.tolist() == [[ignore, 0, 2, ignore],
                                [ignore, 5, ignore, ignore]]
    X, targets = recipe.pad_batch([(ids, None) for ids, _ in items])
    assert targets is None and X['input_ids'].shape == (2, 4)
    with pytest.raises(ValueError, match='one token per word'):
        recipe.pad_batch([([2, 10, 3], np.array([0, 1]))])


def test_tokenizer_gives_one_token_per_word_framed_by_cls_and_sep():
    texts, tags = recipe.make_sentences(30)
    tokenizer = recipe.make_tokenizer().fit(texts[:20])
    # unknown words, in sentences the tokenizer was not trained on, too
    encoded = tokenizer.transform(texts + ['zebra ' + texts[0]])
    vocabulary = tokenizer.vocabulary_
    assert [vocabulary[token] for token in ('[PAD]', '[CLS]', '[SEP]')] == [
        0, 2, 3]
    for ids, text in zip(encoded['input_ids'], texts + ['zebra ' + texts[0]]):
        assert len(ids) == len(text.split()) + 2
        assert ids[0] == 2 and ids[-1] == 3
    assert max(map(max, encoded['input_ids'])) < recipe.VOCAB_SIZE
    assert encoded['input_ids'][-1][1] == vocabulary['[UNK]']


def test_cloned_tokenizer_keeps_its_trainer():
    texts, _ = recipe.make_sentences(20)
    tokenizer = clone(recipe.make_tokenizer()).fit(texts)
    assert tokenizer.vocabulary_['[UNK]'] == 1
    tokenizer.transform(['zebra'])  # unknown words need [UNK]


def test_skorch_clone_drops_the_tokenizers_trainer_params():
    # why make_tokenizer passes a trainer instance: in skorch 1.4, clone()
    # loses trainer__ parameters, and the clone cannot encode unknown words
    from skorch.hf import HuggingfaceTokenizer
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tokenizer = HuggingfaceTokenizer(
        Tokenizer(WordLevel(unk_token='[UNK]')), return_tensors=None,
        trainer__special_tokens=['[PAD]', '[UNK]'])
    tokenizer.fit(['a b'])
    tokenizer.transform(['zebra'])
    cloned = clone(tokenizer)
    assert not hasattr(cloned, 'trainer__special_tokens')
    cloned.fit(['a b'])
    with pytest.raises(Exception, match='Missing \\[UNK\\] token'):
        cloned.transform(['zebra'])


def test_padding_waste_bucketed_against_split_from_padded_groups():
    texts, tags = recipe.make_sentences(256, seed=2)
    dataset = recipe.TaggingDataset(
        recipe.make_tokenizer().fit(texts).transform(texts), tags)
    bucketed = recipe.padding_waste(recipe.bucketed_loader(dataset, 8, seed=0))
    grouped = recipe.padding_waste(
        recipe.bucketed_loader(dataset, 8, union=4, seed=0))
    torch.manual_seed(0)
    shuffled = recipe.padding_waste(torch.utils.data.DataLoader(
        dataset, batch_size=8, shuffle=True, collate_fn=recipe.pad_batch))
    assert bucketed < 0.1 < 0.3 < grouped
    assert bucketed < 0.1 < 0.3 < shuffled
    # counted from the attention masks: one micro-batch of 3 + 5 tokens
    X = {'input_ids': [[2, 4, 3], [2, 4, 4, 4, 3]]}
    loader = recipe.bucketed_loader(recipe.TaggingDataset(X), 2, seed=0)
    assert recipe.padding_waste(loader) == 2 / 10


def test_predict_returns_the_tags_of_each_word(data):
    X, tags = data
    net = recipe.GradAccTagger(**recipe.tagger_params(
        max_epochs=1, batch_size=8, lr=1e-3))
    net.fit(X, tags)
    predicted = net.predict(X)
    assert predicted.dtype == object and len(predicted) == len(tags)
    assert [len(p) for p in predicted] == [len(t) for t in tags]
    assert all(set(p) <= set(range(len(recipe.TAGS))) for p in predicted)


# Exactness: the large-batch run is plain skorch on the unions of acc_steps
# consecutive micro-batches.


class RecordingTagger(recipe.BertTagger):
    """Records the rows and the padding of every training micro-batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen_ = []

    def forward(self, input_ids, attention_mask):
        if self.training:
            # padded to its own longest sentence: no column of padding only
            self.seen_.append((len(input_ids),
                               bool(attention_mask[:, -1].any())))
        return super().forward(input_ids, attention_mask)


def exact_params(**params):
    return recipe.tagger_params(**{
        'module': RecordingTagger, 'module__dropout': 0.0,
        'module__dtype': torch.float64, 'lr': 3e-3, 'max_epochs': 2,
        'batch_size': 8, 'iterator_train__seed': 0, **params})


def fit_seeded(net, X, y):
    torch.manual_seed(0)
    return net.fit(X, y)


def max_param_diff(net, other):
    params = dict(other.module_.named_parameters())
    return max((param - params[name]).abs().max().item()
               for name, param in net.module_.named_parameters())


def assert_large_batch_run(accumulated, large_batch, n_micro_batches,
                           acc_steps):
    assert max_param_diff(accumulated, large_batch) <= ATOL
    np.testing.assert_allclose(accumulated.history[:, 'train_loss'],
                               large_batch.history[:, 'train_loss'],
                               rtol=0, atol=ATOL)
    steps = -(-n_micro_batches // acc_steps)
    assert accumulated.history[:, 'train_batch_count'] == [steps] * 2
    assert large_batch.history[:, 'train_batch_count'] == [steps] * 2
    # the module saw every micro-batch, each padded to its own length
    seen = accumulated.module_.seen_
    assert len(seen) == 2 * n_micro_batches
    assert all(rows <= 8 and own_length for rows, own_length in seen)


@pytest.mark.parametrize('acc_steps', [2, 3, 8])
def test_pipeline_loader_is_the_large_batch_run(data, acc_steps):
    X, tags = data
    large_batch = fit_seeded(recipe.Tagger(
        **exact_params(iterator_train__union=acc_steps)), X, tags)
    accumulated = fit_seeded(recipe.GradAccTagger(
        **exact_params(), acc_steps=acc_steps), X, tags)
    assert_large_batch_run(accumulated, large_batch, 8, acc_steps)


def test_batch_sampler_as_plain_skorch_takes_it_is_the_large_batch_run(data):
    X, tags = data
    lengths = [len(ids) for ids in X['input_ids']]

    def loader_params(batch_sampler):
        params = exact_params(
            iterator_train=torch.utils.data.DataLoader,
            iterator_train__batch_size=1,
            iterator_train__batch_sampler=batch_sampler,
            iterator_train__collate_fn=recipe.pad_batch)
        del params['iterator_train__seed']  # bucketed_loader's, not DataLoader's
        return params

    large_batch = fit_seeded(recipe.Tagger(**loader_params(
        recipe.UnionBatchSampler(recipe.BucketBatchSampler(lengths, 8, seed=0),
                                 3))), X, tags)
    accumulated = fit_seeded(recipe.GradAccTagger(
        **loader_params(recipe.BucketBatchSampler(lengths, 8, seed=0)),
        acc_steps=3), X, tags)
    assert_large_batch_run(accumulated, large_batch, 8, 3)


def test_without_token_counts_it_is_not_the_large_batch_run(data):
    # the exactness tests above can fail: weighting the micro-batches by
    # sentences instead of tokens gives another update
    class SentenceWeightedTagger(recipe.GradAccTagger):
        def count_loss_items(self, batch):
            return len(batch[1])

    X, tags = data
    large_batch = fit_seeded(recipe.Tagger(
        **exact_params(iterator_train__union=4)), X, tags)
    with pytest.warns(LossItemsWarning):  # and the check says so
        weighted = fit_seeded(SentenceWeightedTagger(
            **exact_params(), acc_steps=4), X, tags)
    assert max_param_diff(weighted, large_batch) > 1e-6


def test_with_accelerate_mixin_it_is_the_large_batch_run(data):
    accelerate = pytest.importorskip('accelerate')
    from skorch.hf import AccelerateMixin

    class AcceleratedTagger(AccelerateMixin, recipe.GradAccTagger):
        pass

    X, tags = data
    large_batch = fit_seeded(recipe.Tagger(
        **exact_params(iterator_train__union=4)), X, tags)
    try:
        accelerated = fit_seeded(AcceleratedTagger(
            **exact_params(), acc_steps=4,
            accelerator=accelerate.Accelerator(cpu=True, mixed_precision='no'),
            callbacks__print_log__sink=print), X, tags)
    finally:
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert_large_batch_run(accelerated, large_batch, 8, 4)


# Memory: the notebook measures the recipe's peaks in fresh processes and
# asserts them (GradAcc within 1.25x plain skorch at the micro-batch, under
# half the large batch's), where tests/test_notebooks.py runs it
