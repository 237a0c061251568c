"""torch_flash.data: the seeded permutation and the multi-epoch resampler."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_flash.data
from torch_flash.data import (EpochIndex, IdentityMultiEpochDatasetWrapper, MultiEpochDataset,
                              MultiEpochDatasetResampler, MultiEpochDatasetWrapper, SizedDataset, permute)

seeds = st.integers(0, 2**64 - 1)


class Squares:
    """A deterministic int-indexed dataset (module level: DataLoader workers may pickle it)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i * i


class EpochTagged(MultiEpochDatasetWrapper):
    """Per-epoch 'augmentation': a noise value seeded by (epoch, idx)."""

    def apply_transform(self, sample, index):
        noise = np.random.default_rng([index.epoch, index.idx]).integers(1000)
        return sample, index.epoch, int(noise)


def resampler(n, **kwargs):
    return MultiEpochDatasetResampler(IdentityMultiEpochDatasetWrapper(list(range(n))), **kwargs)


@settings(max_examples=150, deadline=None)
@given(length=st.integers(1, 3000), seed=seeds)
def test_permute_is_a_bijection(length, seed):
    out = permute(np.arange(length), length, seed)
    assert np.array_equal(np.sort(out), np.arange(length))


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 300), seed=seeds)
def test_scalar_and_array_paths_agree(length, seed):
    scalar = [permute(i, length, seed) for i in range(length)]
    assert all(type(p) is int for p in scalar)
    assert scalar == permute(np.arange(length), length, seed).tolist()
    assert permute(np.arange(length).reshape(1, -1, 1), length, seed).shape == (1, length, 1)


@settings(max_examples=60, deadline=None)
@given(length=st.integers(2**20, 2**63), seed=seeds, data=st.data())
def test_permute_huge_lengths(length, seed, data):
    """Billions of samples and more: in range and injective on a sample of indices."""
    idx = data.draw(st.lists(st.integers(0, length - 1), min_size=1, max_size=40, unique=True))
    out = [permute(i, length, seed) for i in idx]
    assert all(0 <= p < length for p in out)
    assert len(set(out)) == len(out)
    if length < 2**62:
        assert permute(np.array(idx, dtype=np.int64), length, seed).tolist() == out


def test_permute_shuffles_and_depends_on_seed():
    n = 1000
    a, b = (permute(np.arange(n), n, s) for s in (1, 2))
    assert (a == np.arange(n)).mean() < 0.05 and (a == b).mean() < 0.05
    assert np.array_equal(a, permute(np.arange(n), n, 1))


def test_permute_errors():
    with pytest.raises(ValueError, match="length must be in"):
        permute(0, 0, 1)
    with pytest.raises(IndexError, match="out of range"):
        permute(5, 5, 1)
    with pytest.raises(IndexError, match="out of range"):
        permute(-1, 5, 1)
    with pytest.raises(IndexError, match="indices must be in"):
        permute(np.array([0, 5]), 5, 1)
    with pytest.raises(ValueError, match="integer dtype"):
        permute(np.array([0.5]), 5, 1)


# loads data.py alone: the whole package (ops, compile passes) would cost seconds per process
_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("flash_data", sys.argv[1])
data = importlib.util.module_from_spec(spec)
sys.modules["flash_data"] = data
spec.loader.exec_module(data)
permute, MultiEpochDatasetResampler, IdentityMultiEpochDatasetWrapper = (
    data.permute, data.MultiEpochDatasetResampler, data.IdentityMultiEpochDatasetWrapper)
r = MultiEpochDatasetResampler(IdentityMultiEpochDatasetWrapper(list(range(97))), num_epochs=3, seed=7)
json.dump({"perm": [permute(i, 10**12 + 39, 2**63 + 5) for i in range(0, 10**12, 10**10)],
           "resampled": [r[i] for i in range(len(r))]}, sys.stdout)
"""


def test_deterministic_across_processes():
    source = torch_flash.data.__file__
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, source], stdout=subprocess.PIPE, text=True,
                                 env={"PYTHONHASHSEED": str(h), "PATH": ""}) for h in (1, 2)]
    runs = [json.loads(c.communicate(timeout=300)[0]) for c in children]
    assert [c.returncode for c in children] == [0, 0]
    assert runs[0] == runs[1]
    here = resampler(97, num_epochs=3, seed=7)
    assert runs[0]["resampled"] == [here[i] for i in range(len(here))]


@pytest.mark.parametrize("n,epochs", [(1, 3), (2, 4), (61, 3)])
def test_each_epoch_is_a_full_permutation(n, epochs):
    r = resampler(n, num_epochs=epochs, seed=3)
    assert len(r) == n * epochs and r.num_samples == n * epochs
    seen = [r.epoch_index(i) for i in range(len(r))]
    assert all(isinstance(e, EpochIndex) for e in seen)
    orders = [[e.idx for e in seen[k * n:(k + 1) * n]] for k in range(epochs)]
    assert [{e.epoch for e in seen[k * n:(k + 1) * n]} for k in range(epochs)] == [{k} for k in range(epochs)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert [r[i] for i in range(len(r))] == [i for o in orders for i in o]  # identity wrapper: sample == idx
    if n > 10:
        assert len({tuple(o) for o in orders}) == epochs  # each epoch its own order


def test_epoch_seeds_come_from_default_rng():
    r = resampler(5, num_epochs=6, seed=11)
    expected = np.random.default_rng(11).bit_generator.random_raw(6)
    assert [r.epoch_seed(e) for e in range(6)] == [int(s) for s in expected]
    # a far epoch costs no more than a near one: nothing per epoch is stored
    far = resampler(1, num_samples=10**12, seed=11)
    assert far.num_epochs == 10**12 and far.epoch_index(10**12 - 1) == EpochIndex(10**12 - 1, 0)


@pytest.mark.parametrize("num_samples", [1, 40, 41, 99, 120])
def test_num_samples_truncates_the_last_epoch(num_samples):
    r = resampler(40, num_samples=num_samples)
    assert len(r) == num_samples and r.num_epochs == -(-num_samples // 40)
    longer = resampler(40, num_epochs=4)
    # the sequence is the same whatever its length: a longer run has this one as its prefix
    assert [r[i] for i in range(num_samples)] == [longer[i] for i in range(num_samples)]
    last = [r.epoch_index(i) for i in range((r.num_epochs - 1) * 40, num_samples)]
    assert len(last) == num_samples - (r.num_epochs - 1) * 40 and len({e.idx for e in last}) == len(last)


def test_defaults_shuffle_false_and_seed():
    r = resampler(30)
    assert r.num_epochs == 1 and len(r) == 30 and r.seed == 42 and r.shuffle
    assert sorted(r[i] for i in range(30)) == list(range(30))
    plain = resampler(30, num_epochs=2, shuffle=False)
    assert [plain[i] for i in range(60)] == list(range(30)) * 2
    assert [resampler(30, seed=1)[i] for i in range(30)] != [r[i] for i in range(30)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_epochs=2, num_samples=10), "not both"),
    (dict(num_epochs=0), "num_epochs must be >= 1"),
    (dict(num_epochs=-1), "num_epochs must be >= 1"),
    (dict(num_samples=0), "num_samples must be >= 1"),
])
def test_resampler_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resampler(10, **kwargs)


def test_resampler_errors():
    with pytest.raises(ValueError, match="empty"):
        resampler(0)
    r = resampler(10, num_samples=15)
    for bad in (-1, 15, 16):
        with pytest.raises(IndexError, match="out of range"):
            r[bad]
    assert r[np.int64(14)] == r[14]


def test_wrappers():
    data = Squares(7)
    assert isinstance(data, SizedDataset)
    ident = IdentityMultiEpochDatasetWrapper(data)
    assert isinstance(ident, MultiEpochDataset) and len(ident) == 7
    assert ident[EpochIndex(3, 4)] == 16
    with pytest.raises(TypeError):
        MultiEpochDatasetWrapper(data)  # abstract
    tagged = EpochTagged(data)
    assert tagged[EpochIndex(2, 3)] == tagged[EpochIndex(2, 3)]  # deterministic per (epoch, idx)
    assert tagged[EpochIndex(2, 3)][:2] == (9, 2)
    per_epoch = {tagged[EpochIndex(e, 3)][2] for e in range(20)}
    assert len(per_epoch) > 1  # the epoch changes the augmentation


def test_dataloader_with_workers():
    r = MultiEpochDatasetResampler(EpochTagged(Squares(23)), num_samples=60, seed=5)
    loader = torch.utils.data.DataLoader(r, batch_size=8, num_workers=2, shuffle=False)
    got = [tuple(int(t[j]) for t in batch) for batch in loader for j in range(len(batch[0]))]
    assert got == [r[i] for i in range(60)]
    assert sorted(g[0] for g in got[:23]) == [i * i for i in range(23)]
