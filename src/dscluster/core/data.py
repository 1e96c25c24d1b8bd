"""Data sets as index-addressable batches: digits, CIFAR-10 (python folder), ImageFolder, synthetic, fractal.

Every data set answers `get_batch(indices, device, dtype)`. Samples are kept compactly (uint8 or small float
at native resolution: CIFAR-10 at 224×224 needs no 30 GB of RAM); synthetic data lives on the GPU. ImageFolder,
CIFAR-10 and fractal (core/fractal.py) batches are made on the host (`prepare`: decode, resize, augment, as
uint8), by DataLoader workers ahead of the step (core/loader.py), or once into memory (data.cache,
core/datacache.py); the device only normalises them. Digits, tiny and in memory, is resized and normalised
on the device. What crosses from the host goes through pinned memory, so no step waits for the GPU.
"""

from __future__ import annotations

import importlib.util
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from dscluster.core import fractal
from dscluster.core.config import DataConfig
from dscluster.core.loader import with_loader  # noqa: F401  (the one way the engine wraps its sampler)
from dscluster.errors import UsageError

_SPLIT_SEED = 1234  # the held-out split never depends on the training seed
_IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"}


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host → GPU without stalling the host: a plain `.to("cuda")` of pageable memory is a blocking
    copy that first waits for every kernel already queued (one host sync per training step, and the
    GPU idles while the next step is launched); pinned memory with non_blocking does not wait."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class ImageSet:
    """Images + labels; `get_batch` returns (x[B,C,S,S] float on device, y[B] long on device)."""

    feed = None
    """train/loader.Feed while the batches asked for are being made ahead by loader workers."""
    pass_feed: Callable | None = None
    """Starts a feed for a front-to-back read (evaluation); set by train/loader.with_loader."""
    cached: tuple[torch.Tensor, torch.Tensor] | None = None
    """The split's un-augmented uint8 images [N, C, S, S] and labels, made once (core/datacache.py);
    `prepare` reads them from here."""

    def __init__(self, name: str, num_classes: int, in_chans: int, img_size: int, mean, std):
        self.name = name
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.img_size = img_size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self._norm_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prefix: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def host_prepared(self) -> bool:
        """Whether batches are made on the host by `prepare` (and so by loader workers)."""
        return False

    @property
    def cacheable(self) -> bool:
        """Whether its images are made on the host (decoded, rendered) and so worth making once (data.cache)."""
        return False

    def make(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images [B, C, img_size, img_size] and int64 labels, un-augmented, made from the source."""
        raise NotImplementedError

    def prepare(self, indices: Sequence[int], seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images [B, C, img_size, img_size] and int64 labels on the host, from the cache where the
        split is cached; with a seed, augmented (what a loader worker runs). Cached or not, the same tensors."""
        if self.cached is not None:
            idx = list(indices)
            lo = idx[0] if idx else 0
            if idx == list(range(lo, lo + len(idx))):
                # a run of images (evaluation reads front to back): a view, no copy; gathering 256
                # images by index copied 38 MB element by element in the evaluating process
                x, y = self.cached[0][lo:lo + len(idx)], self.cached[1][lo:lo + len(idx)]
            else:
                at = torch.as_tensor(idx, dtype=torch.long)
                x, y = self.cached[0][at], self.cached[1][at]
        else:
            x, y = self.make(indices)
        if seed is not None:
            x = shift_on_host(x, seed, self.fill())
        return x, y

    def _host_batch(self, indices: Sequence[int], augment: bool) -> tuple[torch.Tensor, torch.Tensor]:
        feed = self.feed
        if feed is not None and feed.one_pass and feed.done:
            self.feed = feed = None
        if feed is None and self.pass_feed is not None and self.cached is None:
            self.feed = feed = self.pass_feed(indices)
        got = feed.take(indices) if feed is not None else None
        if got is not None:
            return got
        if augment:  # not from the plan (no loader): a seed of the process's own stream
            return self.prepare(indices, int(torch.randint(0, 2**62, (1,))))
        n = len(indices)
        if self.cached is not None or list(indices) != list(range(n)):
            return self.prepare(indices, None)
        # The memory fit and speed calibration ask for [0, b) again and again with growing b:
        # each image is made once.
        have = 0 if self._prefix is None else len(self._prefix[1])
        if have < n:
            x, y = self.prepare(range(have, n), None)
            self._prefix = (x, y) if self._prefix is None else (torch.cat([self._prefix[0], x]),
                                                                 torch.cat([self._prefix[1], y]))
        return self._prefix[0][:n], self._prefix[1][:n]

    def drop_prefix(self) -> None:
        """Forget the batches kept for the probes (training reads through the loader from now on)."""
        self._prefix = None

    def _finish(self, x: torch.Tensor, y: torch.Tensor, device, dtype, channels_last: bool):
        """uint8 host batch -> normalised float on the device (pinned memory: the copy does not wait)."""
        x = to_device(x, device).float()
        mean, std = self._mean_std(x.device)
        x = (x / 255.0 - mean) / std
        x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return x.to(dtype), to_device(y, device)

    def fill(self) -> torch.Tensor:
        """The uint8 colour an augmentation shift pads with: the mean, i.e. zero after normalisation."""
        return (self.mean.flatten() * 255).round().to(torch.uint8)

    def _mean_std(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """mean and std on `device`, copied there once (not once per batch)."""
        if device not in self._norm_on:
            self._norm_on[device] = (self.mean.to(device), self.std.to(device))
        return self._norm_on[device]

    def __len__(self) -> int:
        raise NotImplementedError

    def _raw(self, idx: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Float images in [0, 1] at native size, on device; labels on device."""
        raise NotImplementedError

    def get_batch(self, indices, device, dtype=torch.float32, *, augment: bool = False,
                  generator: torch.Generator | None = None, channels_last: bool = False):
        if self.host_prepared:  # augmented on the host, by the seed of its place in the plan
            return self._finish(*self._host_batch(indices, augment), device, dtype, channels_last)
        idx = torch.as_tensor(indices, dtype=torch.long)
        x, y = self._raw(idx, device)
        if x.shape[-1] != self.img_size or x.shape[-2] != self.img_size:
            x = F.interpolate(x, size=(self.img_size, self.img_size), mode="bilinear", align_corners=False)
        mean, std = self._mean_std(x.device)
        x = (x - mean) / std
        if augment:
            x = random_shift(x, generator)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x.to(dtype), y


class TensorImageSet(ImageSet):
    """Samples held in memory (uint8 or float in [0, 1]) at native resolution."""

    def __init__(self, name, x: torch.Tensor, y: torch.Tensor, num_classes: int, img_size: int, mean, std):
        super().__init__(name, num_classes, x.shape[1], img_size, mean, std)
        self.x, self.y = x, y

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def host_prepared(self) -> bool:
        return self.x.dtype == torch.uint8  # CIFAR-10's images; digits (float, 8×8) stay on the device path

    def make(self, indices):
        x = self.x[torch.as_tensor(list(indices), dtype=torch.long)]
        if x.shape[-1] != self.img_size or x.shape[-2] != self.img_size:
            x = F.interpolate(x.float(), size=(self.img_size, self.img_size), mode="bilinear", align_corners=False)
            x = x.round_().clamp_(0, 255).to(torch.uint8)
        return x, self.y[torch.as_tensor(list(indices), dtype=torch.long)]

    def _raw(self, idx, device):
        idx = to_device(idx, self.x.device)
        x = to_device(self.x[idx], device)
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        return x, to_device(self.y[idx], device)

    def subset(self, idx: torch.Tensor, name: str) -> "TensorImageSet":
        out = TensorImageSet(name, self.x[idx], self.y[idx], self.num_classes, self.img_size,
                             self.mean.flatten().tolist(), self.std.flatten().tolist())
        return out


class SyntheticImageSet(ImageSet):
    """Random images generated once on the device; an epoch indexes a small pool modulo its size."""

    POOL = 256

    def __init__(self, n: int, num_classes: int, img_size: int, device, seed: int):
        super().__init__("synthetic", num_classes, 3, img_size, [0.0] * 3, [1.0] * 3)
        self.n = n
        g = torch.Generator(device="cpu").manual_seed(seed)
        pool = min(n, self.POOL)
        self.x = torch.randn(pool, 3, img_size, img_size, generator=g).to(device)
        self.y = torch.randint(0, num_classes, (pool,), generator=g).to(device)

    def __len__(self) -> int:
        return self.n

    def get_batch(self, indices, device, dtype=torch.float32, *, augment=False, generator=None,
                  channels_last=False):
        idx = to_device(torch.as_tensor(indices, dtype=torch.long).remainder_(self.x.shape[0]), self.x.device)
        x = self.x.index_select(0, idx)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x.to(dtype), self.y.index_select(0, idx)


class FolderImageSet(ImageSet):
    """Users' own images: root/<class>/<image>; decoded with PIL by the loader's workers."""

    def __init__(self, name, files: list[Path], labels: list[int], classes: list[str], img_size: int):
        super().__init__(name, len(classes), 3, img_size, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        self.files = files
        self.labels = labels
        self.classes = classes

    def __len__(self) -> int:
        return len(self.files)

    @property
    def host_prepared(self) -> bool:
        return True

    @property
    def cacheable(self) -> bool:
        return True

    def make(self, indices):
        s = self.img_size
        out = np.empty((len(indices), s, s, 3), dtype=np.uint8)
        for j, i in enumerate(indices):
            try:
                with Image.open(self.files[i]) as im:
                    # JPEG: decode straight at the smallest scale still at least s (a photo several times
                    # larger than s decodes 4-64x fewer pixels).
                    im.draft("RGB", (s, s))
                    out[j] = np.asarray(im.convert("RGB").resize((s, s), Image.BILINEAR), dtype=np.uint8)
            except (OSError, ValueError) as e:
                raise UsageError(f"{self.files[i]}: not a readable image ({e}); replace or remove it from "
                                 "data.path") from None
        # NHWC as decoded, seen as NCHW: channels_last memory, which the device keeps when asked
        x = torch.from_numpy(out).permute(0, 3, 1, 2)
        return x, torch.tensor([self.labels[i] for i in indices], dtype=torch.long)

    def subset(self, idx: list[int], name: str) -> "FolderImageSet":
        return FolderImageSet(name, [self.files[i] for i in idx], [self.labels[i] for i in idx], self.classes,
                              self.img_size)


class FractalImageSet(ImageSet):
    """Fractal classes rendered from a seed (core/fractal.py): item i is image `first + i // C` of class
    `i % C`, so any prefix (data.limit) holds every class alike."""

    def __init__(self, name, renderer: fractal.FractalRenderer, num_classes: int, count: int, first: int):
        super().__init__(name, num_classes, 3, renderer.img_size, fractal.MEAN, fractal.STD)
        self.renderer = renderer
        self.count = count
        self.first = first

    def __len__(self) -> int:
        return self.count

    @property
    def host_prepared(self) -> bool:
        return True

    @property
    def cacheable(self) -> bool:
        return True

    def make(self, indices):
        idx = np.asarray(list(indices), dtype=np.int64)
        labels = idx % self.num_classes
        x = self.renderer.render(labels.tolist(), (self.first + idx // self.num_classes).tolist())
        return x, torch.from_numpy(labels)

    def subset(self, idx, name: str) -> "FractalImageSet":  # data.limit: a prefix
        return FractalImageSet(name, self.renderer, self.num_classes, len(idx), self.first)


@dataclass
class Splits:
    train: ImageSet
    holdout: ImageSet | None


def random_shift(x: torch.Tensor, generator: torch.Generator | None, pad: int = 1) -> torch.Tensor:
    """Shift every image by up to ±pad pixels (zero fill): cheap augmentation on the device."""
    b, c, h, w = x.shape
    p = F.pad(x, (pad, pad, pad, pad))
    gen_device = generator.device if generator is not None else x.device
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=gen_device).to(x.device)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=gen_device).to(x.device)
    rows = torch.arange(h, device=x.device)[None, :] + dy[:, None]
    cols = torch.arange(w, device=x.device)[None, :] + dx[:, None]
    bi = torch.arange(b, device=x.device)[:, None, None, None]
    ci = torch.arange(c, device=x.device)[None, :, None, None]
    return p[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


def shift_on_host(x: torch.Tensor, seed: int, fill: torch.Tensor, pad: int = 1) -> torch.Tensor:
    """random_shift for uint8 batches on the host: every image moved by up to ±pad pixels, the
    uncovered border filled with `fill` per channel."""
    b, c, h, w = x.shape
    g = torch.Generator().manual_seed(seed)
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=g).tolist()
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=g).tolist()
    padded = fill.view(1, c, 1, 1).expand(b, c, h + 2 * pad, w + 2 * pad).clone()
    padded[:, :, pad:pad + h, pad:pad + w] = x
    out = torch.empty_like(x)
    for i in range(b):
        out[i] = padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
    return out


def _split(n: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(_SPLIT_SEED)
    perm = torch.randperm(n, generator=g)
    n_hold = max(1, int(round(n * fraction)))
    return perm[n_hold:].sort().values, perm[:n_hold].sort().values


def _limit(ds, limit: int | None):
    if limit is None or limit >= len(ds):
        return ds
    if limit < 1:
        raise UsageError(f"data.limit must be at least 1, got {limit}")
    return ds.subset(torch.arange(limit) if isinstance(ds, TensorImageSet) else list(range(limit)), ds.name)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (images (1797, 8, 8) of 0-16, labels) from the file it ships, without importing
    it (with SciPy, a second of CPU at every rank's start); where the file is not found, its loader."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec and spec.submodule_search_locations) or []:
        if (path := Path(root) / "datasets" / "data" / "digits.csv.gz").is_file():
            data = np.loadtxt(path, delimiter=",")   # numpy reads .gz itself
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits as sk_digits  # only where the file is missing: see above

    x, y = sk_digits(return_X_y=True)
    return x.reshape(-1, 8, 8), y


def load_digits(cfg: DataConfig) -> Splits:
    images, target = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8) in [0, 1]
    y = torch.tensor(target, dtype=torch.long)
    full = TensorImageSet("digits", x, y, 10, cfg.img_size, [0.3], [0.4])
    tr, ho = _split(len(full), cfg.holdout_fraction)
    return Splits(_limit(full.subset(tr, "digits"), cfg.limit), full.subset(ho, "digits-holdout"))


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="latin1")
    except FileNotFoundError:
        raise UsageError(
            f"{path}: missing; data.path must be the cifar-10-batches-py folder "
            "(data_batch_1..5 and test_batch from the CIFAR-10 python version)"
        ) from None


def load_cifar10(cfg: DataConfig) -> Splits:
    root = Path(cfg.path)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    xs, ys = [], []
    for i in range(1, 6):
        b = _unpickle(root / f"data_batch_{i}")
        xs.append(np.asarray(b["data"], dtype=np.uint8))
        ys.extend(b["labels"])
    t = _unpickle(root / "test_batch")
    mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]

    def to_set(arr, labels, name):
        x = torch.from_numpy(np.concatenate(arr) if isinstance(arr, list) else arr).view(-1, 3, 32, 32)
        return TensorImageSet(name, x, torch.tensor(labels, dtype=torch.long), 10, cfg.img_size, mean, std)

    train = to_set(xs, ys, "cifar10")
    hold = to_set(np.asarray(t["data"], dtype=np.uint8), t["labels"], "cifar10-test")
    return Splits(_limit(train, cfg.limit), hold)


def _scan_folder(root: Path, img_size: int, name: str, classes: list[str] | None = None) -> FolderImageSet:
    if not root.is_dir():
        raise UsageError(f"{root}: not a folder; data.path must hold one sub-folder of images per class")
    classes = classes or sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise UsageError(f"{root}: no class folders (expected {root}/<class>/<image>.png)")
    files, labels = [], []
    for ci, cname in enumerate(classes):
        for f in sorted((root / cname).rglob("*")) if (root / cname).is_dir() else []:
            if f.suffix.lower() in _IMAGE_EXTS:
                files.append(f)
                labels.append(ci)
    if not files:
        raise UsageError(f"{root}: no images with extensions {', '.join(sorted(_IMAGE_EXTS))}")
    return FolderImageSet(name, files, labels, classes, img_size)


def load_imagefolder(cfg: DataConfig) -> Splits:
    root = Path(cfg.path)
    if (root / "train").is_dir():
        train = _scan_folder(root / "train", cfg.img_size, "imagefolder")
        val_dir = next((root / v for v in ("val", "test") if (root / v).is_dir()), None)
        hold = _scan_folder(val_dir, cfg.img_size, "imagefolder-val", train.classes) if val_dir else None
        return Splits(_limit(train, cfg.limit), hold)
    full = _scan_folder(root, cfg.img_size, "imagefolder")
    tr, ho = _split(len(full), cfg.holdout_fraction)
    return Splits(_limit(full.subset(tr.tolist(), "imagefolder"), cfg.limit),
                  full.subset(ho.tolist(), "imagefolder-holdout"))


def load_fractal(cfg: DataConfig) -> Splits:
    renderer = fractal.FractalRenderer(cfg.fractal_seed, cfg.num_classes, cfg.img_size, cfg.fractal_points)
    n_hold = round(cfg.images_per_class * cfg.holdout_fraction)
    n_train = cfg.images_per_class - n_hold
    c = cfg.num_classes
    train = FractalImageSet("fractal", renderer, c, n_train * c, 0)
    return Splits(_limit(train, cfg.limit), FractalImageSet("fractal-holdout", renderer, c, n_hold * c, n_train))


def load(cfg: DataConfig, device, seed: int = 0) -> Splits:
    if cfg.dataset == "digits":
        return load_digits(cfg)
    if cfg.dataset == "cifar10":
        return load_cifar10(cfg)
    if cfg.dataset == "imagefolder":
        return load_imagefolder(cfg)
    if cfg.dataset == "fractal":
        return load_fractal(cfg)
    if cfg.dataset == "synthetic":
        return Splits(SyntheticImageSet(cfg.synthetic_samples, cfg.num_classes, cfg.img_size, device, seed), None)
    raise UsageError(f"unknown data.dataset {cfg.dataset!r}")
