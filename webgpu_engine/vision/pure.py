"""Images without numpy or Pillow, for the page (Pyodide has neither): a decoded RGB picture with the
part of PIL.Image the families' processors use (`width`, `height`, `size`, `resize`, `crop`), resized
as Pillow resizes a uint8 picture (its separable antialiased convolution in 22-bit fixed point, in
Pillow 13's pass order; each pass a few big-integer sums per line), alpha composited on white as
transformers' convert_rgb does through Pillow, and pixel_values / patch rows as vision/config.py
computes them with numpy: the same values, from `array` and slicing.

The page decodes a picture in JavaScript (createImageBitmap, getImageData) and passes its RGBA bytes;
`from_rgba` makes it an `RGBImage`. tests/test_vision_pure.py holds these equal to Pillow and numpy.
"""
from __future__ import annotations

import math
import struct
from array import array

PRECISION_BITS = 32 - 8 - 2              # Pillow's Resample.c: coefficients in 22-bit fixed point
_HALF = 1 << (PRECISION_BITS - 1)


class RGBImage:
    """An RGB picture: `data` holds height rows of width x (r, g, b) bytes."""

    mode = "RGB"

    def __init__(self, width: int, height: int, data: bytes):
        if len(data) != 3 * width * height:
            raise ValueError(f"{len(data)} bytes for a {width}x{height} RGB picture")
        self.width, self.height, self.data = int(width), int(height), bytes(data)

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    def resize(self, size, resample: int = 2, reducing_gap=None) -> "RGBImage":
        """As PIL.Image.resize((width, height), resample) with no box and no reducing gap."""
        if reducing_gap is not None:
            raise ValueError("reducing_gap is not implemented")
        return resize(self, int(size[0]), int(size[1]), resample)

    def crop(self, box) -> "RGBImage":
        """As PIL.Image.crop((left, upper, right, lower)) inside the picture."""
        x0, y0, x1, y1 = (int(v) for v in box)
        if not (0 <= x0 <= x1 <= self.width and 0 <= y0 <= y1 <= self.height):
            raise ValueError(f"crop {box} outside a {self.width}x{self.height} picture")
        w, rows = self.width * 3, []
        for y in range(y0, y1):
            rows.append(self.data[y * w + 3 * x0: y * w + 3 * x1])
        return RGBImage(x1 - x0, y1 - y0, b"".join(rows))


def padded(img: RGBImage, width: int, height: int, left: int, top: int) -> RGBImage:
    """`img` pasted at (left, top) on a black width x height picture (PIL.Image.new + paste, inside)."""
    if not (0 <= left and left + img.width <= width and 0 <= top and top + img.height <= height):
        raise ValueError(f"a {img.width}x{img.height} picture at ({left}, {top}) outside {width}x{height}")
    out, row = bytearray(3 * width * height), 3 * img.width
    for y in range(img.height):
        at = 3 * ((top + y) * width + left)
        out[at:at + row] = img.data[y * row:(y + 1) * row]
    return RGBImage(width, height, bytes(out))


def from_rgba(rgba, width: int, height: int) -> RGBImage:
    """An RGBA picture's RGB: opaque pixels as they are, the others composited on white as
    PIL.Image.alpha_composite does (convert_rgb)."""
    rgba = bytes(rgba)
    n = width * height
    if len(rgba) != 4 * n:
        raise ValueError(f"{len(rgba)} bytes for a {width}x{height} RGBA picture")
    out = bytearray(3 * n)
    for c in range(3):
        out[c::3] = rgba[c::4]
    alpha = rgba[3::4]
    if alpha.count(255) != n:
        for i, a in enumerate(alpha):
            if a != 255:
                for c in range(3):
                    out[3 * i + c] = _over_white(rgba[4 * i + c], a)
    return RGBImage(width, height, bytes(out))


def _over_white(v: int, a: int) -> int:
    """Pillow's ImagingAlphaComposite of (v, a) over opaque white, in its 7-bit fixed point."""
    blend = 255 * (255 - a)
    outa255 = a * 255 + blend
    coef1 = a * 255 * 255 * 128 // outa255
    coef2 = 255 * 128 - coef1
    tmp = v * coef1 + 255 * coef2 + (0x80 << 7)
    return (((tmp >> 8) + tmp) >> 8) >> 7


# ----------------------------------------------------------------------------- Pillow's resample
def _bilinear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _bicubic(x: float) -> float:
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x *= math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    return _sinc(x) * _sinc(x / 3) if -3.0 <= x < 3.0 else 0.0


def _box(x: float) -> float:
    return 1.0 if -0.5 < x <= 0.5 else 0.0


_F054, _F046 = struct.unpack("<2f", struct.pack("<2f", 0.54, 0.46))     # C's 0.54f, 0.46f


def _hamming(x: float) -> float:
    x = abs(x)
    if x == 0.0:
        return 1.0
    if x >= 1.0:
        return 0.0
    x *= math.pi
    return math.sin(x) / x * (_F054 + _F046 * math.cos(x))


# PIL.Image.Resampling's numbers -> (filter, support)
FILTERS = {1: (_lanczos, 3.0), 2: (_bilinear, 1.0), 3: (_bicubic, 2.0), 4: (_box, 0.5), 5: (_hamming, 1.0)}


def coefficients(in_size: int, out_size: int, resample: int) -> list[tuple[int, list[int]]]:
    """(first input index, fixed-point weights) of each output index: Resample.c's precompute_coeffs
    and normalize_coeffs_8bpc over the whole input."""
    if resample not in FILTERS:
        raise ValueError(f"resample {resample} is not implemented (one of {sorted(FILTERS)})")
    fn, support = FILTERS[resample]
    scale = filterscale = in_size / out_size
    filterscale = max(filterscale, 1.0)
    support *= filterscale
    out = []
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        ss = 1.0 / filterscale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        w = [fn((x + xmin - center + 0.5) * ss) for x in range(xmax)]
        total = sum_f(w)
        if total != 0.0:
            w = [v / total for v in w]
        out.append((xmin, [int(-0.5 + v * (1 << PRECISION_BITS)) if v < 0 else int(0.5 + v * (1 << PRECISION_BITS))
                           for v in w]))
    return out


def sum_f(values: list[float]) -> float:
    """A left-to-right sum in doubles, as C adds (Python's sum() of floats may round otherwise)."""
    s = 0.0
    for v in values:
        s += v
    return s


# Each output line is a weighted sum of input lines, all its samples at once: a line's bytes packed
# into one integer, 40 bits a sample (a sum with Pillow's rounding half and a bias of 2^32 stays within
# 0 .. 2^34 in each), so a line of sums is a few big-integer multiply-adds; shifted left by 2, a
# sample's byte 3 holds its sum >> 22 and byte 4 says whether that needs clipping (4: no; less: 0;
# more: 255), as Pillow's clip8.
_LANE, _BIAS = 5, 1 << 32
_OK = bytes(255 if b == 4 else 0 for b in range(256))
_OVER = bytes(255 if b > 4 else 0 for b in range(256))


def _pack(line: bytes) -> int:
    buf = bytearray(_LANE * len(line))
    buf[0::_LANE] = line
    return int.from_bytes(buf, "little")


def _combine(lines: list[bytes], coeffs) -> list[bytes]:
    """For each (first, weights) of `coeffs`, the clipped fixed-point sum of lines first .. with those
    weights (Resample.c's inner loop over the lines' every sample)."""
    n = len(lines[0])
    packed = [_pack(ln) for ln in lines]
    start = _pack(b"\x01" * n) * (_BIAS + _HALF)
    out = []
    for x0, k in coeffs:
        acc = start
        for j, kj in enumerate(k):
            if kj:
                acc += kj * packed[x0 + j]
        raw = (acc << 2).to_bytes(_LANE * n + 1, "little")
        hi = raw[4::_LANE][:n]
        ok, over = int.from_bytes(hi.translate(_OK), "little"), int.from_bytes(hi.translate(_OVER), "little")
        out.append(((int.from_bytes(raw[3::_LANE][:n], "little") & ok) | over).to_bytes(n, "little"))
    return out


def resize(img: RGBImage, width: int, height: int, resample: int = 2) -> RGBImage:
    """Pillow's resize of a uint8 RGB picture to width x height: two passes, each clipped to uint8 and
    skipped where that side keeps its size; the horizontal one first unless the height shrinks by more
    than twice what the width does (Pillow 13's order: the passes do not commute in 8 bits)."""
    if width < 1 or height < 1:
        raise ValueError(f"cannot resize to {width}x{height}")
    w, h, data = img.width, img.height, img.data
    horizontal_first = not (h - height > 0 and h - height > (w - width) * 2)
    for axis in ("x", "y") if horizontal_first else ("y", "x"):
        if axis == "x" and width != w:   # columns (each channel's, one after another) as the lines
            planes = [data[c::3] for c in range(3)]
            cols = _combine([b"".join(p[x::w] for p in planes) for x in range(w)], coefficients(w, width, resample))
            out = bytearray(3 * width * h)
            for c in range(3):
                plane = bytearray(width * h)
                for x, col in enumerate(cols):
                    plane[x::width] = col[c * h:(c + 1) * h]
                out[c::3] = plane
            data, w = bytes(out), width
        elif axis == "y" and height != h:
            rows = [data[y * 3 * w:(y + 1) * 3 * w] for y in range(h)]
            data, h = b"".join(_combine(rows, coefficients(h, height, resample))), height
    return RGBImage(width, height, data)


# ----------------------------------------------------------------------------- pixel values and patches
def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


class PixelValues:
    """pixel_values (3, H, W) f32 as a flat array, channel-major."""

    def __init__(self, values: array, height: int, width: int):
        self.values, self.shape = values, (3, height, width)

    def tolist(self) -> list:
        _, h, w = self.shape
        v = self.values
        return [[list(v[(c * h + y) * w:(c * h + y + 1) * w]) for y in range(h)] for c in range(3)]


def pixels(cfg, img: RGBImage) -> PixelValues:
    """config.pixels without numpy: each byte times rescale (f64), to f32, minus mean, over std (f32),
    through a table per channel (a value depends only on its channel and byte)."""
    out = array("f")
    for c in range(3):
        m, s = f32(cfg.mean[c]), f32(cfg.std[c])
        table = [f32(f32(f32(b * cfg.rescale) - m) / s) for b in range(256)]
        out.extend(table[b] for b in img.data[c::3])
    return PixelValues(out, img.height, img.width)


def patches(cfg, pv: PixelValues) -> array:
    """config.patches without numpy: (P*P, 3 p p) rows, patch (r, c) row-major, each in the conv
    weight's (channel, y, x) order."""
    P = cfg.patches_per_side
    return grid_patches(pv, cfg.patch_size, P, P)


def grid_patches(pv: PixelValues, p: int, rows: int, cols: int, merge: int = 1, frames: int = 1) -> array:
    """The top-left rows x cols p x p patches of `pv` as (rows * cols, 3 frames p p) rows: in merge x
    merge blocks (blocks row-major, then the patches inside a block row-major), each patch in
    (channel, frame, y, x) order, the picture repeated over `frames` (Qwen2.5-VL's temporal patch)."""
    _, H, W = pv.shape
    v, out = pv.values, array("f")
    for br in range(rows // merge):
        for bc in range(cols // merge):
            for r in range(br * merge, (br + 1) * merge):
                for c in range(bc * merge, (bc + 1) * merge):
                    for ch in range(3):
                        plane = array("f")
                        for y in range(p):
                            at = (ch * H + r * p + y) * W + c * p
                            plane.extend(v[at:at + p])
                        for _ in range(frames):
                            out.extend(plane)
    return out


# ----------------------------------------------------------------------------- weight tables
def f32_values(raw: bytes, qtype: str) -> array:
    """A stored f32 / f16 / bf16 tensor's values as f32."""
    if qtype == "f32":
        out = array("f")
        out.frombytes(bytes(raw))
    elif qtype == "f16":
        out = array("f", struct.unpack(f"<{len(raw) // 2}e", raw))
    elif qtype == "bf16":                # bf16 is an f32's high half: zero low halves around it
        wide = bytearray(2 * len(raw))
        wide[2::4], wide[3::4] = raw[0::2], raw[1::2]
        out = array("f")
        out.frombytes(bytes(wide))
    else:
        raise ValueError(qtype)
    return out                           # (the hosts that run this are little-endian, as the files are)


def transposed(values: array, rows: int, cols: int) -> array:
    """A row-major (rows, cols) matrix as its (cols, rows) transpose."""
    out = array("f")
    for j in range(cols):
        out.extend(values[j::cols])
    return out
