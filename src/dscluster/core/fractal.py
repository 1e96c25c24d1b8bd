"""Fractal images from random iterated function systems: a learnable data set that needs no download.

After FractalDB (Kataoka et al., ACCV 2020): each class is one random IFS, a few contractive affine maps
of the plane, and each image its attractor drawn by the chaos game with per-image jitter (maps, scale,
position, flip, colours), so a class is a family of shapes and never a colour. An image is a pure
function of (data-set seed, class, index): every node renders the same set with no shared filesystem,
and loader workers render batches ahead of the step, vectorised in numpy. How the maps are drawn and
how fast they render: docs/training-config.md, "Data: fractal classes, no download".
"""

from __future__ import annotations

import numpy as np
import torch

# The chaos game runs CHAINS walkers per image, all started on the attractor (the fixed point of map 0
# is on it), so no burn-in iterations are thrown away.
CHAINS = 256
MAPS = (2, 3, 4)
SINGULAR = (0.2, 0.85)
DET_SUM = (0.35, 1.1)
COVERAGE = (0.04, 0.45)
INK_LEVELS = 16
RENDER_CHUNK = 32  # images rendered together (vectorised); see FractalRenderer.render
JITTER = 0.06  # per-image relative perturbation of every map parameter
SCALE = (0.6, 0.95)  # share of the image side the attractor's longer side takes
# Normalisation of the rendered images (their mean and std over many classes, rounded).
MEAN, STD = [0.21, 0.21, 0.21], [0.16, 0.16, 0.16]


def default_points(img_size: int) -> int:
    """Points per image when data.fractal_points is null: about a fifth of the pixels, at least 2,048."""
    return max(2048, img_size * img_size // 5)


def _random_map(rng: np.random.Generator) -> np.ndarray:
    """[a, b, c, d, e, f]: the map (x, y) -> (a·x + b·y + e, c·x + d·y + f)."""
    s1 = rng.uniform(*SINGULAR)
    s2 = rng.uniform(SINGULAR[0], s1) * rng.choice((-1.0, 1.0))
    t, p = rng.uniform(0, 2 * np.pi, 2)
    rot = lambda a: np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])  # noqa: E731
    m = rot(t) @ np.diag([s1, s2]) @ rot(p)
    return np.array([m[0, 0], m[0, 1], m[1, 0], m[1, 1], *rng.uniform(-1, 1, 2)])


def _chaos_game(maps: np.ndarray, probs: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Points (x, y), each [B, T·CHAINS], of B IFSs: maps [B, K, 6], probs [B, K], u [B, T, CHAINS]
    uniform draws (which map each walker takes at each step)."""
    b, k, _ = maps.shape
    cum = np.cumsum(probs, axis=1)
    # exactly 1 from each IFS's last map on (maps past its own K, zero-padded for the batch, never drawn):
    # an image must not depend on what else is in its batch
    cum = cum / cum[:, -1:]
    choice = np.zeros(u.shape, np.int64)
    for i in range(k - 1):
        choice += u >= cum[:, i, None, None]
    flat = maps.reshape(b * k, 6)[choice + (np.arange(b) * k)[:, None, None]]  # [B, T, C, 6]
    a0 = maps[:, 0]
    det = (1 - a0[:, 0]) * (1 - a0[:, 3]) - a0[:, 1] * a0[:, 2]
    det = np.where(np.abs(det) < 1e-6, 1e-6, det)
    x0 = ((1 - a0[:, 3]) * a0[:, 4] + a0[:, 1] * a0[:, 5]) / det  # fixed point of map 0
    y0 = (a0[:, 2] * a0[:, 4] + (1 - a0[:, 0]) * a0[:, 5]) / det
    x = np.repeat(x0[:, None], u.shape[2], 1).astype(np.float32)
    y = np.repeat(y0[:, None], u.shape[2], 1).astype(np.float32)
    xs, ys = np.empty(u.shape, np.float32), np.empty(u.shape, np.float32)
    for t in range(u.shape[1]):
        m = flat[:, t]
        x, y = m[..., 0] * x + m[..., 1] * y + m[..., 4], m[..., 2] * x + m[..., 3] * y + m[..., 5]
        xs[:, t], ys[:, t] = x, y
    # finite: a few dozen steps of maps near contraction cannot overflow float32
    return xs.reshape(b, -1), ys.reshape(b, -1)


def _raster(xy: tuple[np.ndarray, np.ndarray], size: int, scale: np.ndarray, offset: np.ndarray,
            flip: np.ndarray) -> np.ndarray:
    """Point counts [B, size, size]: each image's points fitted into its box (scale, offset in [0, 1]),
    aspect kept, mirrored where `flip`."""
    x, y = xy
    b = x.shape[0]
    x0, y0 = x.min(1, keepdims=True), y.min(1, keepdims=True)
    w, h = x.max(1, keepdims=True) - x0, y.max(1, keepdims=True) - y0
    side = np.maximum(np.maximum(w, h), 1e-6)
    f = (scale[:, None] * size / side).astype(np.float32)  # pixels per unit
    px = (x - x0) * f
    px = np.where(flip[:, None], w * f - px, px) + (offset[:, 0, None] * size).astype(np.float32)
    py = (y - y0) * f + (offset[:, 1, None] * size).astype(np.float32)
    i = np.clip(px.astype(np.int32), 0, size - 1)
    j = np.clip(py.astype(np.int32), 0, size - 1)
    flat = (np.arange(b, dtype=np.int32)[:, None] * size + j) * size + i
    return np.bincount(flat.ravel(), minlength=b * size * size).reshape(b, size, size)


def _class_ifs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One class: (maps [K, 6], probs [K]) passing the determinant and coverage filters."""
    while True:
        k = int(rng.choice(MAPS))
        maps = np.stack([_random_map(rng) for _ in range(k)])
        dets = np.abs(maps[:, 0] * maps[:, 3] - maps[:, 1] * maps[:, 2])
        if not DET_SUM[0] <= dets.sum() <= DET_SUM[1]:
            continue
        probs = dets / dets.sum()
        u = rng.random((1, 16, CHAINS))
        counts = _raster(_chaos_game(maps[None], probs[None], u), 48, np.array([1.0]), np.zeros((1, 2)),
                         np.array([False]))
        if COVERAGE[0] <= (counts > 0).mean() <= COVERAGE[1]:
            return maps, probs


class FractalRenderer:
    """The classes of one data-set seed, and `render(labels, indices)` -> uint8 [B, 3, S, S]."""

    def __init__(self, seed: int, num_classes: int, img_size: int, points: int | None = None):
        self.seed, self.img_size = seed, img_size
        self.points = points or default_points(img_size)
        rngs = [np.random.default_rng([seed, 0x1F5, k]) for k in range(num_classes)]
        classes = [_class_ifs(r) for r in rngs]
        self.maps = [m for m, _ in classes]
        self.probs = [p for _, p in classes]
        self._ink = 1 - np.exp(-np.arange(INK_LEVELS) / 1.5)  # share of foreground colour by point count

    def render(self, labels, indices) -> torch.Tensor:
        # In chunks: a whole micro-batch at once (512 images: ~100 MB of per-point arrays) runs out of
        # cache and rendered 2.3x slower per image than chunks of 64.
        s = self.img_size
        out = np.empty((len(labels), s, s, 3), np.uint8)
        for lo in range(0, len(labels), RENDER_CHUNK):
            out[lo:lo + RENDER_CHUNK] = self._render(labels[lo:lo + RENDER_CHUNK], indices[lo:lo + RENDER_CHUNK])
        # NHWC as made, seen as NCHW: channels_last memory, as decoded images are (data.FolderImageSet)
        return torch.from_numpy(out).permute(0, 3, 1, 2)

    def _render(self, labels, indices) -> np.ndarray:
        """uint8 [B, S, S, 3] of one chunk."""
        steps = -(-self.points // CHAINS)
        kmax = max(len(self.maps[c]) for c in labels)
        b = len(labels)
        maps = np.zeros((b, kmax, 6), np.float32)
        probs = np.zeros((b, kmax))
        u = np.empty((b, steps, CHAINS), np.float32)
        scale = np.empty(b)
        offset = np.empty((b, 2))
        flip = np.empty(b, bool)
        colours = np.empty((b, 2, 3), np.float32)
        for j, (c, i) in enumerate(zip(labels, indices, strict=True)):
            rng = np.random.default_rng([self.seed, int(c), int(i)])
            m = self.maps[c]
            maps[j, :len(m)] = m * (1 + JITTER * rng.standard_normal(m.shape))
            probs[j, :len(m)] = self.probs[c]
            u[j] = rng.random((steps, CHAINS), np.float32)
            scale[j] = rng.uniform(*SCALE)
            offset[j] = rng.uniform(0, 1 - scale[j], 2)
            flip[j] = rng.random() < 0.5
            colours[j, 0] = rng.uniform(0, 90, 3)  # background: dark
            colours[j, 1] = rng.uniform(150, 255, 3)  # foreground: bright
        counts = _raster(_chaos_game(maps, probs, u), self.img_size, scale, offset, flip)
        # each image's colour per point count, looked up as one RGBA word per pixel
        table = colours[:, None, 0] + self._ink[None, :, None] * (colours[:, None, 1] - colours[:, None, 0])
        rgba = np.zeros((b * INK_LEVELS, 4), np.uint8)
        rgba[:, :3] = table.round().reshape(-1, 3)
        idx = np.minimum(counts, INK_LEVELS - 1).astype(np.int32)
        idx += (np.arange(b, dtype=np.int32) * INK_LEVELS)[:, None, None]
        pixels = rgba.view(np.uint32).ravel()[idx].view(np.uint8).reshape(b, self.img_size, self.img_size, 4)
        return pixels[..., :3]
