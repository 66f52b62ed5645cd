"""``engine bench serving --dataset-name image``: chat requests that carry random images.

Each request holds ``--image-count`` images of ``--image-resolution`` pixels (random pixels, so no
two requests share an image and the prefix cache never reuses one), sent as ``data:`` URLs before
a random text of ``--random-input-len`` tokens, as SGLang's bench_serving image dataset does.
The client cannot count an image's tokens; the server's ``usage.prompt_tokens`` is the prompt's
length in the metrics.
"""

from __future__ import annotations

import base64
import io
import re

from engine.bench.requests import BenchRequest, TokenizerLike

IMAGE_FORMATS = ("jpeg", "png")
_RESOLUTION = re.compile(r"^(\d+)x(\d+)$")


def parse_resolution(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` as (width, height); raises ValueError naming the flag."""
    match = _RESOLUTION.match(text.strip().lower())
    if not match or min(int(match.group(1)), int(match.group(2))) < 1:
        raise ValueError(f"--image-resolution: invalid value {text!r}; expected WIDTHxHEIGHT, e.g. 1024x1024")
    return int(match.group(1)), int(match.group(2))


def random_image_url(width: int, height: int, image_format: str, seed: int) -> str:
    """A ``data:`` URL of an image of random pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=image_format.upper())
    return f"data:image/{image_format};base64," + base64.b64encode(buf.getvalue()).decode()


def sample_image_requests(num_prompts: int, image_count: int, resolution: str, image_format: str,
                          input_len: int, output_len: int, range_ratio: float, seed: int,
                          tokenizer: TokenizerLike | None) -> list[BenchRequest]:
    """``num_prompts`` chat requests of ``image_count`` distinct random images each and a random
    text (lengths drawn as the random dataset draws them)."""
    from engine.bench.datasets import sample_random_requests

    if image_count < 1:
        raise ValueError(f"--image-count: invalid value {image_count}; accepted: >= 1")
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"--image-format: invalid value {image_format!r}; accepted: {', '.join(IMAGE_FORMATS)}")
    width, height = parse_resolution(resolution)
    if tokenizer is None:
        raise ValueError("--dataset-name image: the text beside the images needs a tokenizer; pass --tokenizer "
                         "(or --model naming a local checkpoint) and drop --skip-tokenizer-init")
    texts = sample_random_requests(num_prompts, input_len, output_len, range_ratio, seed, tokenizer,
                                   return_text=True)
    requests = []
    for i, text in enumerate(texts):
        urls = [random_image_url(width, height, image_format, seed * 1_000_003 + i * image_count + j)
                for j in range(image_count)]
        requests.append(BenchRequest(text.prompt, text.prompt_len, text.output_len, images=urls))
    return requests
