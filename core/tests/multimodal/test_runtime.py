"""The multimodal runtime on a fake model: input embeddings of chunks that cut items, the
embedding cache's pins and budget, M-RoPE positions of extend, mixed and decode rows, and the
pad ids that key the prefix cache."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.layers.forward_batch import ForwardBatch, ForwardMode
from engine.multimodal import MultimodalItem, apply_pad_ids, features_hash, is_multimodal, pad_ids, uses_mrope
from engine.multimodal.runtime import (
    EmbeddingCache,
    attach_decode,
    attach_extend,
    build_input_embeds,
    row_mrope_positions,
)

HIDDEN = 4


class FakeVLM(nn.Module):
    """Text embedding = token id in every column; an item's row k = 1000 * (item number) + k."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, HIDDEN)
        with torch.no_grad():
            self.embed.weight.copy_(torch.arange(64, dtype=torch.float32)[:, None].expand(64, HIDDEN))
        self.calls: list[list[int]] = []

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def embed_multimodal(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        self.calls.append([it.hash for it in items])
        return [(1000.0 * it.features["n"].item() + torch.arange(it.length, dtype=torch.float32))[:, None]
                .expand(it.length, HIDDEN) for it in items]

    def mm_positions(self, input_ids: list[int], items: list[MultimodalItem]) -> tuple[torch.Tensor, int]:
        raise AssertionError("not called here")


def _item(n: int, offset: int, length: int) -> MultimodalItem:
    features = {"n": torch.tensor([n])}
    return MultimodalItem("image", features_hash("image", features), offset, length, features)


def _req(rid: str, items: list[MultimodalItem], mrope: torch.Tensor | None = None, delta: int = 0) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, mm_items=items, mrope_positions=mrope, mrope_delta=delta)


def test_chunks_take_the_rows_of_the_items_they_cover() -> None:
    model = FakeVLM()
    assert is_multimodal(model) and uses_mrope(model)
    a, b = _item(1, 2, 5), _item(2, 3, 4)  # a: positions 2..6 of row 0; b: 3..6 of row 1
    reqs = [_req("r0", [a]), _req("r1", [b]), _req("r2", [])]
    prefix, seq = [4, 0, 0], [9, 5, 3]  # row 0 resumes inside a; row 1 stops inside b
    ids = list(range(10, 15)) + list(range(20, 25)) + [30, 31, 32]
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [0, 1, 2], seq, prefix, torch.arange(13), "cpu")
    attach_extend(fb, reqs, prefix, seq)
    cache = EmbeddingCache(1 << 20)
    embeds = build_input_embeds(model, fb, cache)
    col = embeds[:, 0].tolist()
    assert col[:5] == [1002.0, 1003.0, 1004.0, 14.0, 14.0][:3] + [13.0, 14.0]  # a's rows 2..4, then text
    assert col[5:10] == [20.0, 21.0, 22.0, 2000.0, 2001.0]  # text, then b's first two rows
    assert col[10:] == [30.0, 31.0, 32.0]
    assert model.calls == [[a.hash, b.hash]]  # one batched call
    assert cache.pinned() == {b.hash}  # b goes on in row 1's next chunk; a is done
    # The next chunk of row 1 reuses the cached embedding.
    fb2 = ForwardBatch.build(ForwardMode.EXTEND, [40, 41, 42], [1], [8], [5], torch.arange(3), "cpu")
    attach_extend(fb2, [reqs[1]], [5], [8])
    assert build_input_embeds(model, fb2, cache)[:, 0].tolist() == [2002.0, 2003.0, 42.0]
    assert len(model.calls) == 1 and cache.hits == 1
    cache.release("r1")
    assert not cache.pinned()


def test_the_cache_evicts_unpinned_entries_beyond_its_budget() -> None:
    cache = EmbeddingCache(budget_bytes=2 * 16)  # two [1, 4] float32 entries
    for key in (1, 2):
        cache.put(key, torch.zeros(1, 4))
    cache.pin("r", 1)
    cache.put(3, torch.zeros(1, 4))
    assert cache.get(1) is not None and cache.get(2) is None and cache.get(3) is not None
    cache.pin("q", 3)
    cache.put(4, torch.zeros(1, 4))  # every other entry pinned: the new one is the one to go
    assert cache.get(4) is None and len(cache) == 2
    cache.release("r")
    cache.put(4, torch.zeros(1, 4))
    assert cache.get(1) is None and cache.get(4) is not None and cache.bytes <= cache.budget_bytes


def test_mrope_positions_of_extend_mixed_and_decode_rows() -> None:
    prompt = torch.tensor([[0, 1, 1, 1, 3], [0, 1, 2, 1, 3], [0, 1, 1, 2, 3]])  # a 5-token prompt
    delta = -1  # the prompt's last position is 3, so token i after it sits at i - 1
    assert row_mrope_positions(prompt, delta, 2, 5).tolist() == prompt[:, 2:].tolist()
    # A retracted request re-runs its prompt tail and two output tokens.
    assert row_mrope_positions(prompt, delta, 3, 7).tolist() == [[1, 3, 4, 5], [1, 3, 4, 5], [2, 3, 4, 5]]
    text = torch.arange(3)[None].expand(3, -1)
    reqs = [_req("a", [], prompt, delta), _req("t", [], text, 0), _req("d", [], prompt, delta)]
    prefix, seq = [0, 0, 6], [5, 3, 7]  # two extend rows, then a decode row (MIXED)
    fb = ForwardBatch.build(ForwardMode.MIXED, [1] * 9, [0, 1, 2], seq, prefix, torch.arange(9), "cpu",
                            num_extend_reqs=2)
    attach_extend(fb, reqs, prefix, seq)
    assert fb.mm_rows is None and fb.mrope_positions is not None
    assert fb.mrope_positions.shape == (3, 9)
    assert fb.mrope_positions[:, :5].tolist() == prompt.tolist()
    assert fb.mrope_positions[:, 5:8].tolist() == text.tolist()
    assert fb.mrope_positions[:, 8].tolist() == [5, 5, 5]
    decode = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=torch.tensor([1, 2]),
                          req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor([9, 4]),
                          out_cache_loc=torch.tensor([0, 1]), positions=torch.tensor([8, 3]), seq_lens_cpu=[9, 4])
    attach_decode(decode, [reqs[0], reqs[1]])
    assert decode.mrope_positions.tolist() == [[7, 3], [7, 3], [7, 3]]


def test_pad_ids_are_in_vocabulary_and_differ_between_images() -> None:
    a, b = _item(1, 1, 6), _item(2, 1, 6)
    same = _item(1, 1, 6)
    assert a.hash == same.hash and a.hash != b.hash
    ids = [7] * 9
    pa, pb = apply_pad_ids(ids, [a], 50), apply_pad_ids(ids, [b], 50)
    assert pa[0] == 7 and pa[7:] == [7, 7] and all(0 <= t < 50 for t in pa)
    assert pa == apply_pad_ids(ids, [same], 50) and pa != pb
    assert sum(x != y for x, y in zip(pad_ids(a.hash, 64, 50), pad_ids(b.hash, 64, 50))) > 50


def test_items_that_do_not_fit_the_prompt_are_this_requests_error() -> None:
    # An M-RoPE model's mm_positions refusing the items (ValueError) ends that request with the
    # reason; it must not escape into the scheduler loop, which serves every other request.
    from engine.managers.scheduler import Scheduler

    class Refusing(FakeVLM):
        def mm_positions(self, input_ids: list[int], items: list[MultimodalItem]) -> tuple[torch.Tensor, int]:
            raise ValueError("2 image placeholders in the prompt, 1 image given")

    scheduler = SimpleNamespace(runner=SimpleNamespace(multimodal=True, mrope=True, model=Refusing()))
    req = SimpleNamespace(origin_input_ids=[1, 2, 3], mm_items=[])
    error = Scheduler._attach_multimodal(scheduler, req, [_item(1, 1, 1)])  # type: ignore[arg-type]
    assert error == "image/video items: 2 image placeholders in the prompt, 1 image given"
