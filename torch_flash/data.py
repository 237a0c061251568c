"""Multi-epoch training data: a resampler that turns the sequential sample indices of a
Megatron-style trainer (0, 1, 2, ... for the whole run) into shuffled passes over a
dataset, with no per-epoch index array however large the dataset.

    blocks = IdentityMultiEpochDatasetWrapper(my_int_indexed_dataset)
    train = MultiEpochDatasetResampler(blocks, num_samples=steps * global_batch, seed=0)
    train[i]  # == blocks[EpochIndex(i // n, permute(i % n, n, <seed of epoch i // n>))]

The sequence is a pure function of (seed, len(dataset), i): every rank, every DataLoader
worker and a run resumed from a checkpoint see the same sample at the same position, and a
prefix of it does not depend on num_samples.
"""
from __future__ import annotations

import functools
import math
import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, NamedTuple, Optional, Protocol, TypeVar, Union, runtime_checkable

import numpy as np
from torch.utils.data import Dataset

__all__ = [
    "EpochIndex", "SizedDataset", "MultiEpochDataset", "MultiEpochDatasetResampler",
    "MultiEpochDatasetWrapper", "IdentityMultiEpochDatasetWrapper", "permute",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
U_co = TypeVar("U_co", covariant=True)


class EpochIndex(NamedTuple):
    """Position of a sample in multi-epoch training: the epoch and the index in the dataset."""

    epoch: int
    idx: int


@runtime_checkable
class SizedDataset(Protocol[T_co]):
    """A dataset indexed by int in [0, len), with a fixed length."""

    def __getitem__(self, index: int) -> T_co: ...

    def __len__(self) -> int: ...


@runtime_checkable
class MultiEpochDataset(Protocol[T_co]):
    """A dataset indexed by EpochIndex that returns the same data for the same index on
    every call (data-parallel and model-parallel ranks must agree on every sample)."""

    def __getitem__(self, index: EpochIndex) -> T_co: ...

    def __len__(self) -> int: ...


_MASK64 = (1 << 64) - 1
_ROUNDS = 8  # 6 left measurable bias in the pairs (p(0), p(1)) of tiny domains
IntOrArray = Union[int, np.ndarray]


def _mix64(z: IntOrArray) -> IntOrArray:
    """SplitMix64's finaliser: a 64-bit bijective hash, on Python ints or uint64 arrays
    (where the masks are no-ops and products wrap)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=256)
def _round_keys(seed: int) -> tuple[int, ...]:
    return tuple(_mix64((seed + (r + 1) * 0x9E3779B97F4A7C15) & _MASK64) for r in range(_ROUNDS))


def _feistel(x: IntOrArray, hi_bits: int, lo_bits: int, keys: tuple[int, ...]) -> IntOrArray:
    """A keyed bijection of [0, 2 ** (hi_bits + lo_bits)). Each round XORs one half with a
    hash of the other; such a round is its own inverse, so every composition of rounds is
    a bijection, whatever the hash and however unequal the halves."""
    hi_mask, lo_mask = (1 << hi_bits) - 1, (1 << lo_bits) - 1
    hi, lo = x >> lo_bits, x & lo_mask
    for r, key in enumerate(keys):
        if r % 2:
            hi = hi ^ (_mix64(lo ^ key) & hi_mask)
        else:
            lo = lo ^ (_mix64(hi ^ key) & lo_mask)
    return (hi << lo_bits) | lo


def permute(index: IntOrArray, length: int, seed: int) -> IntOrArray:
    """Position of `index` under a pseudo-random permutation of [0, length) keyed by `seed`.

    index: an int, or an integer numpy array (the result is then an int64 array of its
    shape). O(1) memory per index, so a dataset of billions of samples needs no index
    array. The permutation is a Feistel network on [0, 2 ** k), 2 ** k the smallest power
    of two >= length, with cycle-walking: re-apply it until the value falls in range. The
    network is a bijection of [0, 2 ** k) (see _feistel); following its cycle from an
    index in range, the first return into [0, length) is again a bijection (the induced
    permutation), and it is reached because the cycle comes back to the index itself.
    2 ** k < 2 * length, so fewer than two rounds of walking are expected.
    seed: any int (used modulo 2 ** 64); the same (length, seed) always gives the same
    permutation, on any machine and in any process.
    """
    length = operator.index(length)
    if not 1 <= length <= 1 << 63:
        raise ValueError(f"permute: length must be in [1, 2**63], got {length}")
    bits = (length - 1).bit_length()
    hi_bits, lo_bits = bits // 2, bits - bits // 2
    keys = _round_keys(operator.index(seed) & _MASK64)
    if isinstance(index, np.ndarray):
        if not np.issubdtype(index.dtype, np.integer):
            raise ValueError(f"permute: index array must have an integer dtype, got {index.dtype}")
        if index.size and (index.min() < 0 or index.max() >= length):
            raise IndexError(f"permute: indices must be in [0, {length}), got [{index.min()}, {index.max()}]")
        out = np.atleast_1d(index).astype(np.uint64)  # >= 1-d: numpy scalars warn when products wrap
        walk = np.ones(out.shape, dtype=bool)
        while walk.any():
            out[walk] = _feistel(out[walk], hi_bits, lo_bits, keys)
            walk &= out >= length
        return out.astype(np.int64).reshape(index.shape)
    index = operator.index(index)
    if not 0 <= index < length:
        raise IndexError(f"permute: index {index} out of range [0, {length})")
    out = _feistel(index, hi_bits, lo_bits, keys)
    while out >= length:
        out = _feistel(out, hi_bits, lo_bits, keys)
    return out


@functools.lru_cache(maxsize=64)
def _epoch_seed(seed: int, epoch: int) -> int:
    """Output number `epoch` of numpy.random.default_rng(seed)'s PCG64 stream, i.e.
    default_rng(seed).bit_generator.random_raw(epoch + 1)[-1], reached by jumping ahead in
    O(log epoch) time instead of drawing (or storing) a seed for every epoch."""
    bit_generator = np.random.default_rng(seed).bit_generator
    bit_generator.advance(epoch)
    return int(bit_generator.random_raw())


@dataclass
class MultiEpochDatasetResampler(Dataset[T_co]):
    """Sequential indices [0, num_samples) -> samples of `dataset` in shuffled epochs.

    Give num_epochs (len(dataset) * num_epochs samples) or num_samples (as many epochs as
    it takes, ceil(num_samples / len(dataset)), the last one truncated), not both; neither
    means one epoch. Global index i reads dataset[EpochIndex(i // n, p_e(i % n))] with
    n = len(dataset) and p_e a permutation of [0, n) keyed by a seed per epoch (see
    epoch_seed), or the identity when shuffle=False. Fewer than one sample, an empty
    dataset or both counts given is a ValueError; an index outside [0, len) an IndexError.
    """

    dataset: MultiEpochDataset[T_co]
    num_epochs: Optional[int] = None
    num_samples: Optional[int] = None
    shuffle: bool = True
    seed: int = 42

    def __post_init__(self):
        n = len(self.dataset)
        if n < 1:
            raise ValueError("MultiEpochDatasetResampler: dataset is empty")
        if self.num_epochs is not None and self.num_samples is not None:
            raise ValueError("MultiEpochDatasetResampler: give num_epochs or num_samples, not both")
        if self.num_samples is not None:
            self.num_samples = operator.index(self.num_samples)
            if self.num_samples < 1:
                raise ValueError(f"MultiEpochDatasetResampler: num_samples must be >= 1, got {self.num_samples}")
            self.num_epochs = math.ceil(self.num_samples / n)
        else:
            self.num_epochs = 1 if self.num_epochs is None else operator.index(self.num_epochs)
            if self.num_epochs < 1:
                raise ValueError(f"MultiEpochDatasetResampler: num_epochs must be >= 1, got {self.num_epochs}")
            self.num_samples = n * self.num_epochs

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> T_co:
        return self.dataset[self.epoch_index(index)]

    def epoch_seed(self, epoch: int) -> int:
        """The permutation key of `epoch`: output `epoch` of numpy.random.default_rng(seed)'s
        bit generator (64-bit raw draws), the same in every process."""
        return _epoch_seed(self.seed, epoch)

    def epoch_index(self, index: int) -> EpochIndex:
        """The (epoch, dataset index) that global index `index` reads."""
        index = operator.index(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"MultiEpochDatasetResampler: index {index} out of range [0, {self.num_samples})")
        n = len(self.dataset)
        epoch, idx = divmod(index, n)
        return EpochIndex(epoch, permute(idx, n, self.epoch_seed(epoch)) if self.shuffle else idx)


@dataclass
class MultiEpochDatasetWrapper(Dataset[U_co], Generic[T, U_co], ABC):
    """An int-indexed dataset seen as a MultiEpochDataset: wrapper[EpochIndex(e, i)] is
    apply_transform(dataset[i], EpochIndex(e, i)).

    dataset[i] must be deterministic; randomness (augmentation) belongs in apply_transform,
    which must also be a pure function of (sample, epoch, idx), e.g. seeded by them, and
    may use the epoch to augment differently in each epoch.
    """

    dataset: SizedDataset[T]

    @abstractmethod
    def apply_transform(self, sample: T, index: EpochIndex) -> U_co:
        """The sample as training sees it at `index`."""

    def __getitem__(self, index: EpochIndex) -> U_co:
        return self.apply_transform(self.dataset[index.idx], index)

    def __len__(self) -> int:
        return len(self.dataset)


@dataclass
class IdentityMultiEpochDatasetWrapper(MultiEpochDatasetWrapper[T, T]):
    """MultiEpochDatasetWrapper that returns the sample unchanged."""

    def apply_transform(self, sample: T, index: EpochIndex) -> T:
        return sample
