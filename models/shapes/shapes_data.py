"""The synthetic task the embedded default model is trained on.

32x32 RGB images hold one to three filled shapes (circle, square, triangle) in
four colours and two sizes, each in its own cell of a 2x2 grid, jittered
within the cell, over a dark noisy background. Each image comes with a
caption that names the shapes in reading order (top left, top right,
bottom left, bottom right) and counting questions with one-word answers.
Everything is deterministic in the seed, so a test can draw fresh images
from a seed the training never saw.
"""

import numpy as np

IMAGE_SIZE = 32
SHAPES = ["circle", "square", "triangle"]
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230),
           "yellow": (230, 210, 40)}
SIZES = {"small": 4, "large": 7}  # half-extent in pixels
NUMBERS = ["zero", "one", "two", "three"]
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}

# Every word the task uses; the tokenizer gives each one a single piece.
WORDS = (["a", "and", "describe", "how", "many", "shapes"] + list(SIZES) + list(COLOURS) +
         SHAPES + list(PLURAL.values()) + NUMBERS)


def _draw(img, shape, colour, half, cx, cy, rng):
    ys, xs = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE]
    dx, dy = xs + 0.5 - cx, ys + 0.5 - cy
    if shape == "circle":
        mask = dx * dx + dy * dy <= half * half
    elif shape == "square":
        mask = (np.abs(dx) <= half) & (np.abs(dy) <= half)
    else:  # triangle pointing up: apex at top, base at bottom
        mask = (dy <= half) & (dy >= -half) & (np.abs(dx) <= (dy + half) / 2)
    c = np.clip(np.array(colour) + rng.integers(-20, 21, 3), 0, 255)
    img[mask] = c


def make_sample(rng):
    """Returns (image uint8 HxWx3, objects [(cell, size, colour, shape)])."""
    img = rng.integers(0, 40, (IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.uint8)
    n = int(rng.integers(1, 4))
    cells = sorted(rng.choice(4, size=n, replace=False).tolist())
    objects = []
    for cell in cells:
        size = list(SIZES)[rng.integers(len(SIZES))]
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        half = SIZES[size]
        jitter = 8 - half - 1  # stay inside the 16x16 cell
        cx = (cell % 2) * 16 + 8 + rng.integers(-jitter, jitter + 1)
        cy = (cell // 2) * 16 + 8 + rng.integers(-jitter, jitter + 1)
        _draw(img, shape, COLOURS[colour], half, cx, cy, rng)
        objects.append((cell, size, colour, shape))
    return img, objects


def caption(objects):
    return " and ".join(f"a {size} {colour} {shape}" for _, size, colour, shape in objects)


def questions(objects):
    """All counting questions with their answers: colours, shapes, and all shapes."""
    qa = [("how many shapes", NUMBERS[len(objects)])]
    for colour in COLOURS:
        qa.append((f"how many {colour} shapes",
                   NUMBERS[sum(1 for o in objects if o[2] == colour)]))
    for shape in SHAPES:
        qa.append((f"how many {PLURAL[shape]}", NUMBERS[sum(1 for o in objects if o[3] == shape)]))
    return qa


def tasks(objects):
    """(prompt, answer) pairs for one image: the caption and every question."""
    return [("describe", caption(objects))] + questions(objects)


if __name__ == "__main__":
    rng = np.random.default_rng(1)
    for _ in range(3):
        img, objs = make_sample(rng)
        print(caption(objs), questions(objs)[:3])
