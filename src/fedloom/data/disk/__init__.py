"""Datasets read from disk, in the layouts their publishers ship.

These machines cannot download CIFAR, FEMNIST or Tiny-ImageNet, but a user has
them on disk. Each loader reads the standard layout under the data root —
``data.root``, else ``$FEDLOOM_DATA``, else ``~/.cache/fedloom/data`` — and
never downloads anything:

- ``cifar10``: ``cifar-10-batches-py/`` (``data_batch_1`` … ``_5``,
  ``test_batch``: pickled dicts with ``data`` N×3072 uint8 and ``labels``) or
  the binary layout ``cifar-10-batches-bin/`` (records of 1 label byte and
  3072 pixel bytes). Krizhevsky (2009).
- ``cifar100``: ``cifar-100-python/`` (``train``, ``test``: ``fine_labels`` and
  ``coarse_labels``) or ``cifar-100-binary/`` (records of a coarse byte, a fine
  byte, 3072 pixel bytes); ``data.labels: fine | coarse``.
- ``femnist``: LEAF (Caldas et al. 2018) ``femnist/data/train/*.json`` and
  ``femnist/data/test/*.json`` (or ``femnist/train``, ``femnist/test``), each
  with ``users``, ``num_samples`` and ``user_data[user] = {x: [[784 floats]],
  y: [int]}``; one client per writer (the natural split), LEAF's own per-writer
  train/test split kept, and ``data.writer_fraction`` samples a fraction of the
  writers as LEAF's ``--sf`` does (drawn from ``(seed, "data")``).
- ``tiny-imagenet``: ``tiny-imagenet-200/`` with ``wnids.txt``,
  ``train/<wnid>/images/*.JPEG`` and ``val/images`` + ``val/val_annotations.txt``
  (the labelled validation set is the test set, as in the SA-PEF code).
- ``image-folder``: ``data.path`` with one sub-folder per class (torchvision's
  ImageFolder layout), or ``train/`` and ``test/`` (or ``val/``) folders of that
  layout; ``data.image_size`` resizes (0 = every image must have one size).
- ``hf``: a Hugging Face dataset saved with ``save_to_disk`` or parquet files
  (``data.path``; a relative path is also looked up under the data root), read
  offline with the ``datasets`` library; the image (or
  feature) column is ``data.image_column``, the label column ``data.label``;
  with ``data.client`` naming a column (e.g. ``writer_id`` of the Hub's
  FEMNIST), each of its values is one client (a natural split), and writers
  with ``data.min_samples`` … ``data.max_client_samples`` samples are eligible,
  ``data.num_clients`` of them drawn from ``(seed, "data")`` as the CRAFT code
  selects FEMNIST writers. Grayscale images keep one channel.

Checks on load: class counts against the published sizes for CIFAR-10/100 and
Tiny-ImageNet (``data.verify: false`` skips them, for tiny copies); FEMNIST has
no fixed size (LEAF's preprocessing flags choose it), so its check is
structural (``num_samples`` against the records, 784 pixels, labels in 0…61).
A missing or partial directory raises :class:`DatasetUnavailable`, one line
saying what is missing and where fedloom looked.

Normalisation: per-channel ``(x − μ)/σ`` with the published training-set
statistics of each named dataset (CIFAR-10 μ = (0.4914, 0.4822, 0.4465),
σ = (0.2470, 0.2435, 0.2616); CIFAR-100 μ = (0.5071, 0.4865, 0.4409),
σ = (0.2673, 0.2564, 0.2762); Tiny-ImageNet μ = (0.4802, 0.4481, 0.3975),
σ = (0.2770, 0.2691, 0.2821)); for an image folder or a Hugging Face dataset,
the statistics of its own training part. FEMNIST keeps LEAF's values in [0, 1]
(as the CRAFT and LEAF code feed them).

The package: :mod:`fedloom.data.disk.common` (the data root, the cache of decoded
arrays, normalisation, ``data.path``), :mod:`fedloom.data.disk.cifar` (CIFAR-10/100,
pickled or binary), :mod:`fedloom.data.disk.leaf` (FEMNIST's LEAF json),
:mod:`fedloom.data.disk.images` (Tiny-ImageNet and image folders, decoded with PIL)
and :mod:`fedloom.data.disk.huggingface` (``hf``). Importing the package registers
every source above.
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
# isort: on

__all__ = ["data_root", "read_cifar", "read_femnist", "read_image_folder", "read_tiny_imagenet"]
