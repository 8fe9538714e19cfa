"""Datasets read from disk, in the layouts their publishers ship.

Each loader reads the standard layout under the data root (``data.options.root``, else
``$FEDLOOM_DATA``, else ``~/.cache/fedloom/data``) and never downloads anything:
``cifar10`` and ``cifar100`` (Krizhevsky 2009; pickled or binary), ``femnist``
(LEAF, Caldas et al. 2018: one client per writer, LEAF's split kept),
``tiny-imagenet``, ``image-folder`` (torchvision's ImageFolder layout), ``hf``
(a Hugging Face dataset saved to disk or parquet), and the cross-device benchmarks
``stackoverflow`` and ``flair`` (pfl-research's HDF5 files), ``openimage`` and
``reddit`` (FedScale's client partitions). Class counts are checked
against the published sizes (``data.options.verify: false`` skips them); a missing or
partial directory raises :class:`DatasetUnavailable`. Inputs are normalised with
the published training-set statistics (FEMNIST keeps LEAF's [0, 1]).

The package: :mod:`fedloom.data.disk.common` (the data root, the cache of decoded
arrays, normalisation, ``data.options.path``), :mod:`fedloom.data.disk.cifar` (CIFAR-10/100,
pickled or binary), :mod:`fedloom.data.disk.leaf` (FEMNIST's LEAF json),
:mod:`fedloom.data.disk.images` (Tiny-ImageNet and image folders, decoded with PIL),
:mod:`fedloom.data.disk.huggingface` (``hf``), :mod:`~fedloom.data.disk.stackoverflow`,
:mod:`~fedloom.data.disk.flair` and :mod:`~fedloom.data.disk.fedscale`. Importing the
package registers every source above. Each layout, the checks and the statistics:
docs/howto/datasets.md (The loaders in detail).
"""

from __future__ import annotations

# The submodules register their sources when imported, in this order: the order
# `fedloom datasets` lists them in (CIFAR, FEMNIST, Tiny-ImageNet, image folders, hf).
# isort: off
from fedloom.data.disk.common import data_root
from fedloom.data.disk.cifar import cifar10, cifar100, read_cifar  # noqa: F401  (re-exported)
from fedloom.data.disk.leaf import femnist, read_femnist  # noqa: F401  (re-exported)
from fedloom.data.disk.images import (  # noqa: F401  (re-exported)
    image_folder,
    read_image_folder,
    read_tiny_imagenet,
    tiny_imagenet,
)
from fedloom.data.disk.huggingface import hf  # noqa: F401  (re-exported)
from fedloom.data.disk.stackoverflow import read_stackoverflow, stackoverflow  # noqa: F401
from fedloom.data.disk.flair import flair, read_flair  # noqa: F401  (re-exported)
from fedloom.data.disk.fedscale import openimage, reddit  # noqa: F401  (re-exported)
# isort: on

__all__ = ["data_root", "read_cifar", "read_femnist", "read_flair", "read_image_folder",
           "read_stackoverflow", "read_tiny_imagenet"]
