"""A small RGB canvas and a PNG encoder (numpy + zlib): enough to draw a memory curve with its
phases marked and a few words on it, without an image library."""

from __future__ import annotations

import functools
import struct
import zlib

import numpy as np

Color = tuple[int, int, int]


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an [height, width, 3] uint8 array (8-bit truecolour, no filtering)."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an [H, W, 3] uint8 array, got {rgb.dtype} {rgb.shape}")
    height, width, _ = rgb.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 1))
        + chunk(b"IEND", b"")
    )


# A 3x5 pixel font, upper case only: each glyph is five rows of three cells, '#' set.
_GLYPHS = {
    "0": "### #.# #.# #.# ###",
    "1": ".#. ##. .#. .#. ###",
    "2": "### ..# ### #.. ###",
    "3": "### ..# .## ..# ###",
    "4": "#.# #.# ### ..# ..#",
    "5": "### #.. ### ..# ###",
    "6": "### #.. ### #.# ###",
    "7": "### ..# ..# .#. .#.",
    "8": "### #.# ### #.# ###",
    "9": "### #.# ### ..# ###",
    "A": ".#. #.# ### #.# #.#",
    "B": "##. #.# ##. #.# ##.",
    "C": ".## #.. #.. #.. .##",
    "D": "##. #.# #.# #.# ##.",
    "E": "### #.. ##. #.. ###",
    "F": "### #.. ##. #.. #..",
    "G": ".## #.. #.# #.# .##",
    "H": "#.# #.# ### #.# #.#",
    "I": "### .#. .#. .#. ###",
    "J": "..# ..# ..# #.# .#.",
    "K": "#.# #.# ##. #.# #.#",
    "L": "#.. #.. #.. #.. ###",
    "M": "#.# ### ### #.# #.#",
    "N": "##. #.# #.# #.# #.#",
    "O": ".#. #.# #.# #.# .#.",
    "P": "##. #.# ##. #.. #..",
    "Q": ".#. #.# #.# ##. .##",
    "R": "##. #.# ##. #.# #.#",
    "S": ".## #.. .#. ..# ##.",
    "T": "### .#. .#. .#. .#.",
    "U": "#.# #.# #.# #.# ###",
    "V": "#.# #.# #.# #.# .#.",
    "W": "#.# #.# ### ### #.#",
    "X": "#.# #.# .#. #.# #.#",
    "Y": "#.# #.# .#. .#. .#.",
    "Z": "### ..# .#. #.. ###",
    " ": "... ... ... ... ...",
    ".": "... ... ... ... .#.",
    ":": "... .#. ... .#. ...",
    "-": "... ... ### ... ...",
    "/": "..# ..# .#. #.. #..",
    "(": ".#. #.. #.. #.. .#.",
    ")": ".#. ..# ..# ..# .#.",
    "%": "#.# ..# .#. #.. #.#",
    ",": "... ... ... .#. #..",
    "=": "... ### ... ### ...",
    "+": "... .#. ### .#. ...",
    "_": "... ... ... ... ###",
}
_MASKS = {
    ch: np.array([[cell == "#" for cell in row] for row in rows.split()], dtype=bool)
    for ch, rows in _GLYPHS.items()
}


@functools.cache
def _glyph(ch: str, scale: int) -> np.ndarray:
    return _MASKS.get(ch, _MASKS[" "]).repeat(scale, axis=0).repeat(scale, axis=1)


class Canvas:
    """An RGB image with the few drawing operations a chart needs; coordinates are pixels,
    (0, 0) top left. Everything is clipped to the image."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.pixels = np.empty((height, width, 3), np.uint8)
        self.pixels[:] = background

    @property
    def width(self) -> int:
        return self.pixels.shape[1]

    @property
    def height(self) -> int:
        return self.pixels.shape[0]

    def fill(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the rectangle [x0, x1) x [y0, y1)."""
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        if x0 < x1 and y0 < y1:
            self.pixels[y0:y1, x0:x1] = color

    def line(
        self, x0: float, y0: float, x1: float, y1: float, color: Color, width: int = 1
    ) -> None:
        self.segments([x0], [y0], [x1], [y1], color, width)

    def segments(self, x0, y0, x1, y1, color: Color, width: int = 1) -> None:
        """Straight lines from (x0[i], y0[i]) to (x1[i], y1[i]), all drawn in one go."""
        x0, y0, x1, y1 = (np.asarray(v, dtype=float) for v in (x0, y0, x1, y1))
        if x0.size == 0:
            return
        steps = (np.maximum(np.abs(x1 - x0), np.abs(y1 - y0)) + 1).astype(int)
        which = np.repeat(np.arange(x0.size), steps)
        frac = (np.arange(which.size) - np.repeat(np.cumsum(steps) - steps, steps)) / np.maximum(
            steps[which] - 1, 1
        )
        xs = np.rint(x0[which] + (x1 - x0)[which] * frac).astype(int)
        ys = np.rint(y0[which] + (y1 - y0)[which] * frac).astype(int)
        for dx in range(width):
            for dy in range(width):
                x, y = xs + dx, ys + dy
                keep = (x >= 0) & (x < self.width) & (y >= 0) & (y < self.height)
                self.pixels[y[keep], x[keep]] = color

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 2) -> int:
        """Write `text` with its top-left corner at (x, y); returns the x after the last glyph."""
        for ch in text.upper():
            mask = _glyph(ch, scale)
            h, w = mask.shape
            region = self.pixels[max(y, 0) : y + h, max(x, 0) : x + w]
            visible = mask[
                max(-y, 0) : max(-y, 0) + region.shape[0], max(-x, 0) : max(-x, 0) + region.shape[1]
            ]
            region[visible] = color
            x += 4 * scale
        return x


def text_width(text: str, scale: int = 2) -> int:
    return len(text) * 4 * scale
