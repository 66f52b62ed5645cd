"""Qwen2-VL's prompt processing for a machine without torchvision.

transformers' ``Qwen2VLProcessor`` always loads its video processor, which exists only as a
torchvision one, so ``AutoProcessor`` cannot build it without torchvision (nor with the PIL
backend the engine asks for). ``Qwen2VLProcessorPil`` does the same work from the checkpoint's
own files: the tokenizer and chat template, images through transformers'
``Qwen2VLImageProcessorPil`` (the same pixels as the processor's PIL backend), video frames
resized with PIL to one size, normalized like the images and cut into the video layout (two
consecutive frames per temporal patch), and each image or video placeholder expanded into its
run of pad tokens, one per merged patch.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch


class Qwen2VLProcessorPil:
    """The interface the engine's multimodal runtime uses of a Hugging Face processor."""

    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"

    def __init__(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        # Frames are processed here (``videos``): the runtime asks for a video processor.
        self.video_processor = self
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self._table: np.ndarray | None = None
        self._frame_table: np.ndarray | None = None

    @classmethod
    def from_pretrained(cls, path: str, trust_remote_code: bool = False) -> Qwen2VLProcessorPil:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        return cls(tokenizer, Qwen2VLImageProcessorPil.from_pretrained(path), _chat_template(path))

    def apply_chat_template(self, conversation: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=tokenize,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)

    def __call__(self, text: list[str], images: list[Any] | None = None, videos: list[list[Any]] | None = None,
                 return_tensors: str = "pt", add_special_tokens: bool = True, **_: Any) -> dict[str, torch.Tensor]:
        """Ids of each prompt with its placeholders expanded, and the pixels of all items.

        Raises:
            ValueError: the prompts hold another number of placeholders than there are images
                (or videos).
        """
        out: dict[str, torch.Tensor] = {}
        merge = int(self.image_processor.merge_size) ** 2
        runs = {self.image_token: [], self.video_token: []}
        if images:
            out["pixel_values"], out["image_grid_thw"] = self.image_pixels(images)
            runs[self.image_token] = [int(g.prod()) // merge for g in out["image_grid_thw"]]
        if videos:
            parts = [self.video_patches(frames) for frames in videos]
            out["pixel_values_videos"] = torch.cat([p for p, _ in parts])
            out["video_grid_thw"] = torch.cat([g for _, g in parts])
            runs[self.video_token] = [int(g.prod()) // merge for _, g in parts]
        expanded = [self._expand(prompt, runs) for prompt in text]
        for token, lengths in runs.items():
            if lengths:
                raise ValueError(f"{len(lengths)} item(s) have no '{token}' placeholder in the prompt")
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        if len({len(row) for row in ids}) > 1:
            raise ValueError("prompts of different lengths: process one prompt per call")
        out["input_ids"] = torch.tensor(ids, dtype=torch.int64)
        out["attention_mask"] = torch.ones_like(out["input_ids"])
        return out

    def image_pixels(self, images: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The images' ``pixel_values`` [patches, C*T*P*P] and ``image_grid_thw`` [n, 3], equal
        to those of transformers' ``Qwen2VLImageProcessorPil``.

        Resized as uint8 by PIL (as transformers does), cut into patches while still uint8, then
        rescaled and normalized in one pass through a per-channel table of the 256 values: the
        same float32 arithmetic per value as transformers' rescale-then-normalize, in a quarter
        of the memory traffic. A processor configured otherwise than resize-rescale-normalize of
        RGB images goes through transformers.
        """
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.image_processor
        if not (getattr(ip, "do_resize", False) and all(getattr(im, "mode", None) == "RGB" for im in images)):
            pixels = ip(images=images, return_tensors="pt")
            return pixels["pixel_values"], pixels["image_grid_thw"]
        patch, merge, temporal = int(ip.patch_size), int(ip.merge_size), int(ip.temporal_patch_size)
        sizes = [smart_resize(im.height, im.width, factor=patch * merge, min_pixels=ip.size.shortest_edge,
                              max_pixels=ip.size.longest_edge) for im in images]
        grids = [(1, h // patch, w // patch) for h, w in sizes]
        table = self._value_table()
        out = np.empty((sum(g * w for _, g, w in grids), 3, temporal, patch, patch), dtype=np.float32)
        row = 0
        for im, (h, w), (_, gh, gw) in zip(images, sizes, grids):
            pixels = np.asarray(im.resize((w, h), resample=ip.resample))
            # (block row, block column, row in block, column in block, channel, y, x), as transformers.
            blocks = pixels.reshape(gh // merge, merge, patch, gw // merge, merge, patch, 3)
            blocks = np.ascontiguousarray(blocks.transpose(0, 3, 1, 4, 6, 2, 5)).reshape(gh * gw, 3, patch, patch)
            mine = out[row:row + gh * gw]
            for c in range(3):
                np.take(table[c], blocks[:, c], out=mine[:, c, 0], mode="clip")
            mine[:, :, 1:] = mine[:, :, :1]  # one image fills every frame of its temporal patch
            row += gh * gw
        return (torch.from_numpy(out.reshape(row, 3 * temporal * patch * patch)),
                torch.tensor(grids, dtype=torch.int64))

    def _value_table(self) -> np.ndarray:
        """[3, 256] float32: what transformers' rescale (float64, then float32) and normalize
        (float32) make of each uint8 value of each channel."""
        if self._table is None:
            ip = self.image_processor
            values = np.arange(256, dtype=np.float64)
            if ip.do_rescale:
                values = values * float(ip.rescale_factor)
            values = np.broadcast_to(values.astype(np.float32), (3, 256))
            if ip.do_normalize:
                mean = np.broadcast_to(np.asarray(ip.image_mean, dtype=np.float32), (3,))[:, None]
                std = np.broadcast_to(np.asarray(ip.image_std, dtype=np.float32), (3,))[:, None]
                values = (values - mean) / std
            self._table = np.ascontiguousarray(values, dtype=np.float32)
        return self._table

    def _expand(self, prompt: str, runs: dict[str, list[int]]) -> str:
        """Each placeholder, in prompt order, becomes as many copies as its item has tokens."""
        pieces, i = [], 0
        while True:
            hits = [(prompt.find(t, i), t) for t in runs if prompt.find(t, i) >= 0]
            if not hits:
                return "".join(pieces) + prompt[i:]
            at, token = min(hits)
            if not runs[token]:
                raise ValueError(f"the prompt holds more '{token}' placeholders than items given")
            pieces.append(prompt[i:at] + token * runs[token].pop(0))
            i = at + len(token)

    def video_patches(self, frames: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Frames (PIL images) -> ``[t*h*w, C*T*P*P]`` patches and the grid ``[1, 3]``: every frame
        resized to the first one's ``smart_resize`` size, a last frame repeated to fill the last
        temporal patch."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.image_processor
        patch, merge, temporal = int(ip.patch_size), int(ip.merge_size), int(ip.temporal_patch_size)
        first = frames[0]
        h, w = smart_resize(first.height, first.width, factor=patch * merge, min_pixels=ip.size.shortest_edge,
                            max_pixels=ip.size.longest_edge)
        x = np.stack([np.asarray((f if f.mode == "RGB" else f.convert("RGB")).resize(
            (w, h), resample=Image.Resampling.BICUBIC)) for f in frames])
        if len(x) % temporal:
            x = np.concatenate([x, np.repeat(x[-1:], temporal - len(x) % temporal, axis=0)])
        t, gh, gw = len(x) // temporal, h // patch, w // patch
        # Cut while uint8: (t, block row, block column, row in block, column in block, channel, frame, y, x).
        x = x.reshape(t, temporal, gh // merge, merge, patch, gw // merge, merge, patch, 3)
        x = np.ascontiguousarray(x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)).reshape(t * gh * gw, 3, -1)
        table = self._video_table()
        out = np.empty(x.shape, dtype=np.float32)
        for c in range(3):
            np.take(table[c], x[:, c], out=out[:, c], mode="clip")
        return torch.from_numpy(out.reshape(t * gh * gw, -1)), torch.tensor([[t, gh, gw]])

    def _video_table(self) -> np.ndarray:
        """[3, 256] float32: each uint8 value of a frame's channel rescaled and normalized in float32."""
        if self._frame_table is None:
            ip = self.image_processor
            mean = np.asarray(ip.image_mean, dtype=np.float32)[:, None]
            std = np.asarray(ip.image_std, dtype=np.float32)[:, None]
            values = np.arange(256, dtype=np.float32)[None, :] * np.float32(ip.rescale_factor)
            self._frame_table = np.ascontiguousarray((values - mean) / std, dtype=np.float32)
        return self._frame_table


def _chat_template(path: str) -> str | None:
    """The processor's chat template file of a checkpoint (``chat_template.jinja`` or
    ``chat_template.json``), else None (the tokenizer's)."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    legacy = os.path.join(path, "chat_template.json")
    if os.path.isfile(legacy):
        with open(legacy, encoding="utf-8") as f:
            return json.load(f).get("chat_template")
    return None
