"""The C-bar corruptions (Mintun, Kirillov & Xie, NeurIPS 2021): ImageNet-C-bar's ten and
CIFAR-10-C-bar's ten (five shared, five of its own: pinch_and_twirl, ripple, circular_motion_blur,
lines, transverse_chromatic_abberation), written here in vectorised numpy from the published
definitions and severities.

Each corruption is a pair of small functions: a sampler that draws its random parameters from a
numpy Generator (seeded per image, so the same seed gives the same bytes) and a pure function
that applies given parameters to a uint8 HWC RGB image. Each set's severity table maps severities
1-5 to the published parameter levels (0-10 scale; a parameter with maximum M is level * M / 10),
typed once into pipeline/shifts/c_bar_levels.json from `imagenet_c_bar.csv` and `cifar10_c_bar.csv` of the
authors' repository (facebookresearch/augmentation-corruption). Sizes scale with the image side S
(the definitions are for square images; for others S is the longer side), so a set's corruptions
are those it publishes at its own image size (224 px, 32 px). Like the published code, results are
clipped to [0, 255] and truncated to uint8.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LEVELS_FILE = Path(__file__).with_name("c_bar_levels.json")


def _read_levels() -> dict[str, dict[str, tuple[float, ...]]]:
    sets = json.loads(LEVELS_FILE.read_text())
    return {name: {c: tuple(levels) for c, levels in entry["levels"].items()}
            for name, entry in sets.items() if name != "about"}


# The published C-bar sets (pipeline/shifts/c_bar_levels.json): name -> {corruption: the levels of severities 1-5}.
C_BAR_LEVELS: dict[str, dict[str, tuple[float, ...]]] = _read_levels()
IMAGENET_C_BAR_LEVELS: dict[str, tuple[float, ...]] = C_BAR_LEVELS["imagenet-c-bar"]
IMAGENET_C_BAR_CORRUPTIONS: tuple[str, ...] = tuple(IMAGENET_C_BAR_LEVELS)
CIFAR_C_BAR_CORRUPTIONS: tuple[str, ...] = tuple(C_BAR_LEVELS["cifar-10-c-bar"])
C_BAR_TITLES = {"imagenet-c-bar": "ImageNet-C-bar", "cifar-10-c-bar": "CIFAR-10-C-bar"}
LUMA = np.array([0.2126, 0.7152, 0.0722])


def corrupt_bar(image: np.ndarray, name: str, severity: int, seed: int, parameters: str = "imagenet-c-bar") -> np.ndarray:
    """Corrupt one uint8 HWC RGB image with C-bar corruption `name` at severity 1-5 of the set `parameters`
    (imagenet-c-bar, or cifar-10-c-bar: its own corruptions and levels, for 32 px images)."""
    levels = C_BAR_LEVELS.get(parameters)
    if levels is None:
        raise ValueError(f"unknown C-bar parameters {parameters!r}: expected one of {', '.join(C_BAR_LEVELS)}")
    if name not in levels:
        raise ValueError(f"unknown {C_BAR_TITLES[parameters]} corruption {name!r}: expected one of {', '.join(levels)}")
    if not 1 <= int(severity) <= 5:
        raise ValueError(f"severity {severity}: expected 1 to 5")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 HWC RGB image, got {image.dtype} {image.shape}")
    sample, apply = CORRUPTIONS[name]
    level = levels[name][int(severity) - 1]
    return apply(image, **sample(np.random.default_rng(seed), image.shape[:2], level))


def scaled(level: float, maximum: float) -> float:
    """A parameter at `level` on the 0-10 scale whose level 10 is `maximum`."""
    return level * maximum / 10.0


def to_uint8(values: np.ndarray) -> np.ndarray:
    return np.clip(values, 0, 255).astype(np.uint8)


def pixel_grid(shape) -> tuple[np.ndarray, np.ndarray]:
    """Row (y) and column (x) coordinates of every pixel, float64 [H, W]."""
    ys, xs = np.mgrid[0:shape[0], 0:shape[1]]
    return ys.astype(np.float64), xs.astype(np.float64)


def side(shape) -> int:
    return max(shape[0], shape[1])


# ----------------------------------------------------------------------------------------------
# single_frequency_greyscale: one grey plane wave added to the image


def sample_single_frequency(rng, shape, level):
    magnitude = rng.uniform(-np.pi, np.pi)
    other = rng.uniform(-abs(magnitude), abs(magnitude))
    frequency = np.array([magnitude, other])[rng.permutation(2)]
    return {"frequency": frequency, "phase": rng.uniform(0, 2 * np.pi), "intensity": scaled(level, 196)}


def single_frequency_greyscale(image, frequency, phase, intensity):
    """image + intensity * sin(x * frequency[0] + y * frequency[1] + phase), the same on every channel."""
    ys, xs = pixel_grid(image.shape)
    wave = np.sin(xs * frequency[0] + ys * frequency[1] + phase)
    return to_uint8(image + intensity * wave[..., None])


# ----------------------------------------------------------------------------------------------
# cocentric_sine_waves: wobbly rings around a random centre


def sample_cocentric_sine_waves(rng, shape, level):
    size = side(shape)
    return {"centre_xy": rng.uniform(0, size, 2), "frequency": rng.uniform(0, 10), "amplitude": rng.uniform(0, size / 10),
            "ring_width": rng.uniform(0, size / 10), "intensity": scaled(level, 128)}


def cocentric_sine_waves(image, centre_xy, frequency, amplitude, ring_width, intensity):
    ys, xs = pixel_grid(image.shape)
    dx, dy = xs - centre_xy[0], ys - centre_xy[1]
    wobble = np.sin(np.arctan2(dx, dy) * frequency) * amplitude
    ring_position = np.mod(np.hypot(dx, dy) + wobble, ring_width) / ring_width - 0.5
    return to_uint8(image + intensity * ring_position[..., None])


# ----------------------------------------------------------------------------------------------
# plasma_noise: a domain-warped colour pattern blended over the image


def sample_plasma_noise(rng, shape, level):
    return {"time": rng.uniform(0, 6 * np.pi), "iterations": int(rng.integers(4, 7)), "sharpness": rng.uniform(0.5, 1.0),
            "scale": rng.uniform(0.075, 0.2) * side(shape), "intensity": scaled(level, 64)}


def plasma_pattern(shape, time, iterations, sharpness, scale) -> np.ndarray:
    """RGB pattern in [-1, 1], [H, W, 3]."""
    y, x = (c / scale for c in pixel_grid(shape))
    frequency, damping, gain, offset = 1.0, 1.0, 1.0, 0.0
    for _ in range(iterations):
        step_x = np.cos(y * frequency - offset + time / damping) / gain
        step_y = np.sin(x * frequency - offset + time / damping) / gain
        step_x, step_y = step_x - 0.3 * step_y, step_y + 0.3 * step_x
        x, y = x + step_x, y + step_y
        frequency, damping, gain, offset = frequency * 1.93, damping * 1.15, gain * (2.25 - sharpness), offset * time * damping
    red, blue = np.sin(x - time), np.sin(y + time)
    green = np.sin((x + y + np.sin(time)) * 0.5)
    return np.stack([red, green, blue], axis=-1)


def plasma_noise(image, time, iterations, sharpness, scale, intensity):
    pattern = plasma_pattern(image.shape, time, iterations, sharpness, scale)
    return to_uint8((1 - intensity / 255) * image + intensity * pattern)


# ----------------------------------------------------------------------------------------------
# sparkles / inverse_sparkles: star-shaped bursts of rays


def sparkle_strength(shape, centre_yx, ray_lengths, exponent) -> np.ndarray:
    """Per-pixel strength in [0, 1] of a burst of len(ray_lengths) rays around centre (row, column)."""
    ys, xs = pixel_grid(shape)
    dy, dx = ys - centre_yx[0], xs - centre_yx[1]
    rays = len(ray_lengths)
    around = (np.arctan2(dx, dy) + np.pi) / (2 * np.pi) * rays  # position between rays, in rays
    ray = np.floor(around).astype(np.int64)
    between = around - ray
    first, second = ray_lengths[ray % rays], ray_lengths[(ray + 1) % rays]
    length = first + between * (second - first)
    falloff = (length ** 2 / (dy ** 2 + dx ** 2 + 1e-4)) ** exponent
    return np.clip((1 - (between - 0.5) ** 2) * falloff, 0, 1)


def sample_sparkles(rng, shape, level):
    size = side(shape)
    centres = rng.uniform(0, size, (5, 2))
    radius = scaled(level, 0.1) * size
    rays = rng.integers(50, 200, 5)
    ray_lengths = [np.maximum(1.0, radius + 0.25 * radius * rng.standard_normal(n)) for n in rays]
    return {"centres_yx": centres, "ray_lengths": ray_lengths}


def sparkles(image, centres_yx, ray_lengths):
    """Five white bursts (amount 50: the falloff is linear in length^2 / distance^2), one over the other."""
    out = image.astype(np.float64)
    for centre, lengths in zip(centres_yx, ray_lengths):
        strength = sparkle_strength(image.shape, centre, lengths, exponent=1.0)[..., None]
        out = out + strength * (255 - out)
    return to_uint8(out)


def sample_inverse_sparkles(rng, shape, level):
    size = side(shape)
    centre = rng.uniform(0.25, 0.75, 2) * size
    rays = int(rng.integers(50, 200))
    radius = 0.25 * size
    return {"centre_yx": centre, "ray_lengths": radius + 0.25 * radius * rng.standard_normal(rays),
            "amount": 100 - scaled(level, 65)}


def inverse_sparkles(image, centre_yx, ray_lengths, amount):
    """White everywhere except a burst of rays through which the image shows."""
    strength = sparkle_strength(image.shape, centre_yx, ray_lengths, exponent=(100 - amount) / 50)[..., None]
    return to_uint8(255 + strength * (image - 255.0))


# ----------------------------------------------------------------------------------------------
# perlin_noise: turbulence (sum of |gradient noise| over octaves) blended over the image


def sample_perlin_noise(rng, shape, level):
    angles = rng.uniform(0, 2 * np.pi, 256)
    return {"permutation": rng.permutation(256), "gradients": np.stack([np.cos(angles), np.sin(angles)], axis=1),
            "alpha": scaled(level, 0.5)}


def gradient_noise(u, v, permutation, gradients) -> np.ndarray:
    """Perlin's 2-D gradient noise (scaled by 1.5) at points (u, v), with a 256-entry lattice hash."""
    cell_u, cell_v = np.floor(u), np.floor(v)
    fu, fv = u - cell_u, v - cell_v
    iu, iv = cell_u.astype(np.int64) % 256, cell_v.astype(np.int64) % 256

    def corner(du, dv):
        g = gradients[permutation[(permutation[(iu + du) % 256] + iv + dv) % 256]]
        return (fu - du) * g[..., 0] + (fv - dv) * g[..., 1]

    su, sv = fu * fu * (3 - 2 * fu), fv * fv * (3 - 2 * fv)
    low = corner(0, 0) + su * (corner(1, 0) - corner(0, 0))
    high = corner(0, 1) + su * (corner(1, 1) - corner(0, 1))
    return 1.5 * (low + sv * (high - low))


def perlin_noise(image, permutation, gradients, alpha, octaves: int = 16, gain: float = 0.5, bias: float = 0.5):
    ys, xs = pixel_grid(image.shape)
    cell = 32 * side(image.shape) / 224  # lattice spacing in pixels
    turbulence = np.zeros(image.shape[:2])
    frequency = 1.0
    while frequency <= octaves:
        turbulence += np.abs(gradient_noise(frequency * ys / cell, frequency * xs / cell, permutation, gradients)) / frequency
        frequency *= 2
    value = np.clip(gain * turbulence + bias, 0, 1)
    return to_uint8((1 - alpha) * image.astype(np.float64) + 255 * alpha * value[..., None])


# ----------------------------------------------------------------------------------------------
# blue_noise_sample / brownish_noise: noise with a prescribed amplitude spectrum


def spectral_noise(rng, shape, amplitude_of_frequency) -> np.ndarray:
    """Real part of the inverse FFT of amplitude(|k|) * exp(i * uniform phase), scaled to unit std."""
    ky = np.fft.fftfreq(shape[0]) * shape[0]
    kx = np.fft.fftfreq(shape[1]) * shape[1]
    amplitude = amplitude_of_frequency(np.hypot(ky[:, None], kx[None, :]))
    phase = rng.uniform(0, 2 * np.pi, shape)
    field = np.real(np.fft.ifft2(amplitude * np.exp(1j * phase)))
    return field / field.std()


def sample_blue_noise_sample(rng, shape, level):
    return {"noise": spectral_noise(rng, shape, lambda k: k), "threshold": scaled(level, 3.0) - 2.5}


def blue_noise_sample(image, noise, threshold):
    """Keep the pixels where blue noise (amplitude growing with frequency) exceeds the threshold, black elsewhere."""
    return to_uint8(image * (noise > threshold)[..., None])


def sample_brownish_noise(rng, shape, level):
    noise = np.stack([spectral_noise(rng, shape, lambda k: 1 / (k ** 2 + 1)) for _ in range(3)], axis=-1)
    return {"noise": noise, "intensity": scaled(level, 64)}


def brownish_noise(image, noise, intensity):
    return to_uint8(image + intensity * noise)


# ----------------------------------------------------------------------------------------------
# checkerboard_cutout: grey cells of a rotated checkerboard


def sample_checkerboard_cutout(rng, shape, level):
    size = side(shape)
    angle = rng.uniform(0, 2 * np.pi)
    cell = max(rng.uniform(0.1, 0.25) * size, 1.0)
    cells = int(4 * size // cell)
    return {"angle": angle, "cell": cell, "cut": rng.uniform(size=(cells, cells)) < scaled(level, 1.0)}


def checkerboard_cutout(image, angle, cell, cut):
    """Set to grey (128) the pixels of the checkerboard's even cells that `cut` marks (cells of side `cell`, rotated by angle)."""
    ys, xs = pixel_grid(image.shape)
    u = (np.cos(angle) * ys + np.sin(angle) * xs) / cell
    v = (-np.sin(angle) * ys + np.cos(angle) * xs) / cell
    odd_cell = np.floor(np.mod(u, 2)) != np.floor(np.mod(v, 2))
    marked = cut[np.trunc(u).astype(np.int64) % cut.shape[0], np.trunc(v).astype(np.int64) % cut.shape[1]]
    keep = odd_cell | ~marked
    return np.where(keep[..., None], image, np.uint8(128)).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# caustic_refraction: the image seen through water, refracted and lit by a caustic pattern


def sample_caustic_refraction(rng, shape, level):
    size = side(shape)
    return {"time": rng.uniform(0.5, 2.0), "pattern_size": rng.uniform(0.75, 1.25) * size, "eta": 4.0,
            "lens_scale": scaled(level, 0.5 * size), "lighting": scaled(level, 2.0)}


def caustic_pattern(shape, time, pattern_size) -> np.ndarray:
    """Caustic light intensity in [0, 1], [H, W], smoothed by a Gaussian of 1 pixel."""
    ys, xs = pixel_grid(shape)
    p0 = np.mod(ys / pattern_size, 1) * 2 * np.pi - 250
    p1 = np.mod(xs / pattern_size, 1) * 2 * np.pi - 250
    i0, i1 = p0, p1
    brightness = np.ones_like(ys)
    for n in range(5):
        t = time * (1.0 - 3.5 / (n + 1))
        i0, i1 = p0 + np.cos(t - i0) + np.sin(t + i1), p1 + np.sin(t - i1) + np.cos(t + i0)
        brightness += 1.0 / np.hypot(p0 / (np.sin(i0 + t) / 0.005), p1 / (np.cos(i1 + t) / 0.005))
    brightness = 1.17 - (brightness / 5.0) ** 1.4
    from scipy.ndimage import gaussian_filter  # scipy comes with the eval extra

    return gaussian_filter(np.clip(np.abs(brightness) ** 8.0, 0, 1), sigma=1)


def bilinear_sample(image: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """image (float [H, W, C]) at fractional positions, zero outside the image."""
    height, width = image.shape[:2]
    top, left = np.floor(rows).astype(np.int64), np.floor(cols).astype(np.int64)
    down, right = (rows - top)[..., None], (cols - left)[..., None]

    def at(r, c):
        inside = (r >= 0) & (r < height) & (c >= 0) & (c < width)
        return np.where(inside[..., None], image[np.clip(r, 0, height - 1), np.clip(c, 0, width - 1)], 0.0)

    upper = at(top, left) * (1 - right) + at(top, left + 1) * right
    lower = at(top + 1, left) * (1 - right) + at(top + 1, left + 1) * right
    return upper * (1 - down) + lower * down


def caustic_refraction(image, time, pattern_size, eta, lens_scale, lighting):
    caustics = np.pad(caustic_pattern(image.shape, time, pattern_size), 1)  # zero outside the image
    up, down = caustics[:-2, 1:-1], caustics[2:, 1:-1]  # the pattern one row above / below
    left, right = caustics[1:-1, :-2], caustics[1:-1, 2:]  # one column left / right
    # the water surface's normal from the pattern's slopes, then Snell refraction of a vertical ray
    normal = np.stack([down - up, right - left, np.ones_like(up)], axis=-1)
    normal /= np.linalg.norm(normal, axis=-1, keepdims=True)
    tilt = np.maximum(np.hypot(normal[..., 0], normal[..., 1]), 1e-12)
    incidence = np.arccos(np.clip(normal[..., 2], -1, 1))
    refracted = np.arcsin(np.sin(incidence) / eta)
    along_normal = np.cos(refracted) - np.sin(refracted) * normal[..., 2] / tilt
    refracts = normal[..., 2] < 1.0 - 1e-3
    shift_rows = np.where(refracts, np.round(normal[..., 0] * along_normal * lens_scale, 3), 0.0)
    shift_cols = np.where(refracts, np.round(normal[..., 1] * along_normal * lens_scale, 3), 0.0)
    ys, xs = pixel_grid(image.shape)
    seen = bilinear_sample(image.astype(np.float64) / 255, ys + shift_rows, xs + shift_cols)
    lit = seen + ((left - right) + (down - up))[..., None] * lighting
    return (np.clip(lit, 0, 1) * 255).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# ripple (CIFAR-10-C-bar): each row and column displaced along itself by a sine wave


def sample_ripple(rng, shape, level):
    size = side(shape)
    return {"amplitude": scaled(level, 0.025) * size, "wavelengths": rng.uniform(0.1, 0.3, 2) * size,
            "phases": rng.uniform(0, 2 * np.pi, 2)}


def ripple(image, amplitude, wavelengths, phases):
    """Pixel (y, x) shows the image at (y + A sin(2 pi y / wl_y + ph_y), x + A sin(2 pi x / wl_x + ph_x)), bilinear, black outside."""
    ys, xs = pixel_grid(image.shape)
    rows = ys + amplitude * np.sin(2 * np.pi * ys / wavelengths[0] + phases[0])
    cols = xs + amplitude * np.sin(2 * np.pi * xs / wavelengths[1] + phases[1])
    return to_uint8(bilinear_sample(image.astype(np.float64), rows, cols))


# ----------------------------------------------------------------------------------------------
# pinch_and_twirl (CIFAR-10-C-bar): a grid of discs, each pinched and twirled about its centre


def sample_pinch_and_twirl(rng, shape, level):
    cells = 5 if side(shape) >= 224 else 3  # the published 5 x 5 grid at 224 px, 3 x 3 at 32 px
    return {"angles": rng.choice([1.0, -1.0], size=(cells, cells)) * scaled(level, np.pi / 2),
            "amount": scaled(level, 0.4) + 0.1}


def pinch_and_twirl(image, angles, amount):
    """In each square cell (column i, row j) of side S // n, the pixels of its inscribed disc (radius r)
    show the image at the centre + (offset * sin(pi d / 2) ** -amount) rotated by angle * (1 - d) ** 2,
    d = |offset| / r; pixels outside the discs (and the rows/columns past n cells) are kept."""
    cells = angles.shape[0]
    grid = side(image.shape) // cells
    radius = grid / 2
    ys, xs = pixel_grid(image.shape)
    rows, cols = ys.copy(), xs.copy()
    for i in range(cells):  # column of cells
        for j in range(cells):  # row of cells
            block = (slice(j * grid, (j + 1) * grid), slice(i * grid, (i + 1) * grid))
            dy, dx = ys[block] - (j * grid + radius), xs[block] - (i * grid + radius)
            dist = np.hypot(dy, dx)
            inside = (dist <= radius) & (np.round(dist, 3) != 0.0)
            d = np.where(inside, dist / radius, 1.0)
            stretch = np.sin(np.pi * 0.5 * d) ** -amount
            angle = angles[i, j] * (1 - d) ** 2
            sy, sx = dy * stretch, dx * stretch
            rows[block] = np.where(inside, j * grid + radius + sy * np.cos(angle) - sx * np.sin(angle), ys[block])
            cols[block] = np.where(inside, i * grid + radius + sy * np.sin(angle) + sx * np.cos(angle), xs[block])
    return to_uint8(bilinear_sample(image.astype(np.float64), rows, cols))


# ----------------------------------------------------------------------------------------------
# circular_motion_blur (CIFAR-10-C-bar): the image rotated back and forth about its centre, averaged


def sample_circular_motion_blur(rng, shape, level):
    return {"degrees": scaled(level, 15)}


def circular_motion_blur(image, degrees, steps: int = 21):
    """Weighted mean of `steps` rotations by t * degrees, t evenly in [-1, 1], weights exp(-2 t^2)
    (cubic-spline rotation, black outside, as scipy.ndimage.rotate)."""
    from scipy.ndimage import rotate  # scipy comes with the eval extra

    x = image.astype(np.float64) / 255
    t = np.linspace(-1.0, 1.0, steps)
    weights = np.exp(-2 * t ** 2)
    out = sum(w * rotate(x, a * degrees, reshape=False) for w, a in zip(weights, t)) / weights.sum()
    return (np.clip(out, 0, 1) * 255).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# lines (CIFAR-10-C-bar): grey anti-aliased strokes across the image


def sample_lines(rng, shape, level):
    size = side(shape)
    count = int(scaled(level, 1.0) * size)
    base, spread = rng.uniform(0, 2 * np.pi), rng.uniform(0.1, 1.0)
    return {"centres": rng.uniform(0, size, (count, 2)), "angles": base + 2 * np.pi * spread * (rng.uniform(size=count) - 0.5),
            "half_length": float(size)}


def lines(image, centres, angles, half_length):
    """Each line from centre - L (cos a, sin a) to centre + L (cos a, sin a) (first coordinate the row),
    ends truncated to integers, drawn anti-aliased (scikit-image's line_aa) in grey 128 over the image so far."""
    from skimage.draw import line_aa  # scikit-image comes with the eval extra (imagecorruptions)

    out = image.copy()
    height, width = image.shape[:2]
    for (row, col), angle in zip(centres, angles):
        dr, dc = np.cos(angle) * half_length, np.sin(angle) * half_length
        rr, cc, value = line_aa(int(row - dr), int(col - dc), int(row + dr), int(col + dc))
        keep = (rr >= 0) & (cc >= 0) & (rr < height) & (cc < width)
        rr, cc, value = rr[keep], cc[keep], value[keep, None]
        out[rr, cc] = ((1.0 - value) * out[rr, cc].astype(np.float32) + value * 128).astype(np.uint8)
    return out


# ----------------------------------------------------------------------------------------------
# transverse_chromatic_abberation (CIFAR-10-C-bar; the published spelling): channels magnified differently


def sample_transverse_chromatic_abberation(rng, shape, level):
    scale = scaled(level, 0.5)
    return {"scales": np.array([1.0, 1.0 + scale / 2, 1.0 + scale])[rng.permutation(3)]}


def transverse_chromatic_abberation(image, scales):
    """Each channel zoomed about the centre by its scale (cubic spline without prefilter, as
    scipy.ndimage.zoom(prefilter=False)), its central H x W kept."""
    from scipy.ndimage import zoom

    out = image.copy()
    height, width = image.shape[:2]
    for channel, scale in enumerate(scales):
        zoomed = zoom(image[..., channel], scale, prefilter=False)
        top, left = (zoomed.shape[0] - height) // 2, (zoomed.shape[1] - width) // 2
        out[..., channel] = zoomed[top:top + height, left:left + width]
    return out


CORRUPTIONS = {
    "caustic_refraction": (sample_caustic_refraction, caustic_refraction),
    "inverse_sparkles": (sample_inverse_sparkles, inverse_sparkles),
    "sparkles": (sample_sparkles, sparkles),
    "perlin_noise": (sample_perlin_noise, perlin_noise),
    "blue_noise_sample": (sample_blue_noise_sample, blue_noise_sample),
    "plasma_noise": (sample_plasma_noise, plasma_noise),
    "checkerboard_cutout": (sample_checkerboard_cutout, checkerboard_cutout),
    "cocentric_sine_waves": (sample_cocentric_sine_waves, cocentric_sine_waves),
    "single_frequency_greyscale": (sample_single_frequency, single_frequency_greyscale),
    "brownish_noise": (sample_brownish_noise, brownish_noise),
    "ripple": (sample_ripple, ripple),
    "pinch_and_twirl": (sample_pinch_and_twirl, pinch_and_twirl),
    "circular_motion_blur": (sample_circular_motion_blur, circular_motion_blur),
    "lines": (sample_lines, lines),
    "transverse_chromatic_abberation": (sample_transverse_chromatic_abberation, transverse_chromatic_abberation),
}
