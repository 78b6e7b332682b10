"""Incremental decoding (src/aiayn/speed/incremental.py) equals the model's own forward pass (src/aiayn/model.py)."""

from __future__ import annotations

import pytest
import torch

from aiayn.model import DecoderLayer, EncoderLayer, Transformer
from aiayn.speed.decoder_cache import ScratchBuffers
from aiayn.speed.incremental import (DECODER_LAYER_PARTS, ENCODER_LAYER_PARTS, InferenceModel,
                                    layer_parts)
from aiayn.speed.packed import _onednn_linear_available
from test_model import PAD, VOCAB, tiny_config, tiny_model, tokens  # the same tiny float64 models


# The cached step, against the full forward pass.


# float32 takes the CPU's fast paths (oneDNN-packed weights, explicit few-query attention).
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_decode_step_reproduces_full_decode_logits_at_every_position(dtype, tolerance):
    model = tiny_model(d_head=6, d_value=10).to(dtype)
    inference = InferenceModel(model)
    src = tokens(3, 7, seed=1)
    src[0, 5:] = PAD
    tgt = tokens(3, 6, seed=2)
    with torch.no_grad():
        full = model(src, tgt)
        cache = inference.init_cache(*inference.encode(src), max_len=10)
        for position in range(6):
            step = inference.decode_step(tgt[:, position], position, cache)
            torch.testing.assert_close(step, full[:, position], rtol=0, atol=tolerance)


def test_decode_step_after_a_cache_reorder_matches_the_reordered_batch():
    model = tiny_model()
    inference = InferenceModel(model)
    src = tokens(3, 7, seed=1)
    src[1, 4:] = PAD
    tgt = tokens(3, 6, seed=2)
    index = torch.tensor([2, 0, 1])
    with torch.no_grad():
        cache = inference.init_cache(*inference.encode(src), max_len=6)
        for position in range(3):
            inference.decode_step(tgt[:, position], position, cache)
        cache = cache.reorder(index)
        reordered = model(src[index], tgt[index])
        for position in range(3, 6):
            step = inference.decode_step(tgt[index, position], position, cache)
            torch.testing.assert_close(step, reordered[:, position], rtol=0, atol=1e-10)


def test_cache_reorder_can_grow_the_batch_for_beams():
    model = tiny_model()
    inference = InferenceModel(model)
    src, tgt = tokens(2, 5, seed=1), tokens(2, 4, seed=2)
    beams = torch.tensor([0, 0, 1, 1])
    with torch.no_grad():
        cache = inference.init_cache(*inference.encode(src), max_len=4).reorder(beams)
        full = model(src[beams], tgt[beams])
        for position in range(4):
            step = inference.decode_step(tgt[beams, position], position, cache)
            torch.testing.assert_close(step, full[:, position], rtol=0, atol=1e-10)


def two_sources_in_beams_of_two():
    """A model, its inference wrapper, two sources (the second padded) and four target rows (two beams each)."""
    model = tiny_model(d_head=6, d_value=10)
    src = tokens(2, 5, seed=1)
    src[1, 3:] = PAD
    return model, InferenceModel(model), src, tokens(4, 6, seed=2)


def test_grouped_cache_keeps_one_memory_per_source_and_matches_the_repeated_batch():
    model, inference, src, tgt = two_sources_in_beams_of_two()
    rows = torch.tensor([0, 0, 1, 1])  # two beams per source
    with torch.no_grad():
        cache = inference.init_cache(*inference.encode(src), max_len=6, group=2)
        assert cache.memory_keys.shape[1] == 2 and cache.rows == 4
        for position in range(3):
            inference.decode_step(tgt[:, position], position, cache)
        # Beams move within their sentence: row 0 takes row 1's history, rows 2 and 3 swap.
        index = torch.tensor([1, 1, 3, 2])
        cache = cache.reorder(index)
        full = model(src[rows], tgt[index])
        for position in range(3, 5):
            step = inference.decode_step(tgt[index, position], position, cache)
            torch.testing.assert_close(step, full[:, position], rtol=0, atol=1e-10)
        # The first sentence leaves: its memory goes with it, the second keeps its two beams.
        buffer = cache.key_buffer.data_ptr()
        cache = cache.reorder(torch.tensor([2, 3]), sources=torch.tensor([1]))
        assert cache.memory_keys.shape[1] == 1 and cache.rows == 2
        assert cache.key_buffer.data_ptr() == buffer  # shrunk in place
        full = model(src[[1, 1]], tgt[index][[2, 3]])
        step = inference.decode_step(tgt[index][[2, 3], 5], 5, cache)
        torch.testing.assert_close(step, full[:, 5], rtol=0, atol=1e-10)


def test_cache_reorder_regroups_one_row_per_source_into_beams():
    model, inference, src, tgt = two_sources_in_beams_of_two()
    tgt[1, 0], tgt[3, 0] = tgt[0, 0], tgt[2, 0]  # beams of a source share their first token
    with torch.no_grad():
        cache = inference.init_cache(*inference.encode(src), max_len=6, capacity=4)  # one row per source
        buffer = cache.key_buffer.data_ptr()
        inference.decode_step(tgt[[0, 2], 0], 0, cache)
        cache = cache.reorder(torch.tensor([0, 0, 1, 1]), sources=torch.tensor([0, 1]))
        assert cache.group == 2 and cache.rows == 4 and cache.memory_keys.shape[1] == 2
        assert cache.key_buffer.data_ptr() == buffer  # grown within its capacity, in place
        full = model(src[[0, 0, 1, 1]], tgt)
        for position in range(1, 6):
            step = inference.decode_step(tgt[:, position], position, cache)
            torch.testing.assert_close(step, full[:, position], rtol=0, atol=1e-10)
        with pytest.raises(ValueError, match="3 rows do not divide among 2 sources"):
            fresh = inference.init_cache(*inference.encode(src), max_len=6)
            fresh.reorder(torch.tensor([0, 0, 1]), sources=torch.tensor([0, 1]))


def test_cache_reorder_copies_a_moved_row_from_where_its_fed_tokens_differ_up_to_the_positions_fed():
    model = tiny_model()
    inference = InferenceModel(model)
    index = torch.tensor([0, 0, 1])
    with torch.no_grad():
        cache = inference.init_cache(*inference.encode(tokens(1, 4, seed=1)), max_len=6, group=3)
        for buffer in (cache.self_keys, cache.self_values):  # every value its own number, to trace moves
            buffer.copy_(torch.arange(buffer.numel(), dtype=buffer.dtype).view_as(buffer))
        # Four positions fed: row 1 shares row 0's first two tokens, row 2 only its first.
        cache.fed[:4, :3] = torch.tensor([[1, 5, 6, 7], [1, 5, 8, 9], [1, 4, 4, 4]]).T
        cache.filled = filled = 4
        before = (cache.self_keys.clone(), cache.self_values.clone())
        starts = [4, 2, 1]  # row 0 stays; row 1 takes row 0's history, row 2 row 1's
        assert cache.copy_starts(index).tolist() == starts
        assert (cache.filled - cache.copy_starts(index)).tolist() == [0, 2, 3]  # the copy lengths
        cache.reorder(index)
    assert cache.fed[:4, :3].T.tolist() == [[1, 5, 6, 7], [1, 5, 6, 7], [1, 5, 8, 9]]
    for after, old in zip((cache.self_keys, cache.self_values), before):
        for row, (origin, start) in enumerate(zip(index.tolist(), starts)):
            assert torch.equal(after[:, row, :, :start], old[:, row, :, :start])  # below the start: as it was
            # Row 2 reads row 1's old values although row 1 is rewritten.
            assert torch.equal(after[:, row, :, start:filled], old[:, origin, :, start:filled])
            assert torch.equal(after[:, row, :, filled:], old[:, row, :, filled:])  # unfed positions untouched


def test_copy_starts_copy_all_of_a_row_that_takes_another_source_s_row():
    inference = InferenceModel(tiny_model())
    with torch.no_grad():
        cache = inference.init_cache(*inference.encode(tokens(2, 4, seed=1)), max_len=6, group=2)
        fed = torch.tensor([[1, 5, 6], [1, 5, 8], [1, 5, 6], [1, 4, 4]])  # sources 0 and 1, two rows each
        cache.fed[:3, :4], cache.filled = fed.T, 3
        # Rows move within their source: row 0 takes row 1 (shares BOS and 5), rows 2 and 3 swap.
        assert cache.copy_starts(torch.tensor([1, 1, 3, 2])).tolist() == [2, 3, 1, 1]
        # The first source ends and the second moves into its rows: nothing of theirs is shared,
        # although row 2 was fed the same tokens as row 0.
        assert cache.copy_starts(torch.tensor([2, 3]), sources=torch.tensor([1])).tolist() == [0, 0]


@pytest.mark.parametrize("positional", ["learned", "none"])
def test_learned_and_none_positions_build_run_and_decode_incrementally(positional):
    model = tiny_model(positional=positional)
    inference = InferenceModel(model)
    src, tgt = tokens(2, 5, seed=1), tokens(2, 4, seed=2)
    with torch.no_grad():
        logits = model(src, tgt)
        cache = inference.init_cache(*inference.encode(src), max_len=4)
        last = [inference.decode_step(tgt[:, position], position, cache) for position in range(4)][-1]
    assert logits.shape == (2, 4, VOCAB)
    torch.testing.assert_close(last, logits[:, -1], rtol=0, atol=1e-10)


# The encoder for inference.


def test_encoder_without_gradients_uses_packed_weights_and_gives_the_model_s_memory():
    model = tiny_model().float()  # packing is for float32
    inference = InferenceModel(model)
    src = tokens(3, 7, seed=1)
    src[1, 4:] = PAD
    expected, _ = model.encode(src)  # the model's own linear maps
    assert torch.equal(inference.encode(src)[0], expected)  # with gradients: the model's path
    assert not inference.packed._packed
    with torch.inference_mode():
        memory, src_pad = inference.encode(src)
    if _onednn_linear_available():
        assert "encoder.0.qkv" in inference.packed._packed
    torch.testing.assert_close(memory, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(src_pad, src.eq(PAD))


def test_encoder_in_training_mode_keeps_its_dropout_without_gradients():
    model = tiny_model(dropout=0.5).float().train()
    inference = InferenceModel(model)
    src = tokens(2, 6, seed=2)
    with torch.no_grad():
        first, _ = inference.encode(src)
        second, _ = inference.encode(src)
    assert not inference.packed._packed  # the modules' path, dropout and all
    assert not torch.allclose(first, second)


# The CPU's attention for a few queries, and the caches' memory.


def test_scratch_buffers_reuse_their_memory_until_a_tensor_does_not_fit():
    scratch, like = ScratchBuffers(), torch.zeros(1)
    first = scratch.take("keys", (2, 3, 4), like)
    assert first.shape == (2, 3, 4) and first.is_contiguous()
    assert scratch.take("keys", (5, 4), like).data_ptr() == first.data_ptr()  # fits: the same memory
    assert scratch.take("values", (2, 3), like).data_ptr() != first.data_ptr()  # another name, other memory
    grown = scratch.take("keys", (7, 4), like)
    assert grown.shape == (7, 4) and grown.data_ptr() != first.data_ptr()
    assert scratch.take("keys", (2, 2), like.double()).dtype == torch.float64


# Mixed precision.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_autocast_on_cpu_gives_finite_incremental_logits(dtype):
    """The source padding bias and the step's attention stay finite in fp16 as in bf16, over several steps."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(dropout=0.1)).eval()
    inference = InferenceModel(model)
    src, tgt = tokens(2, 6, seed=1), tokens(2, 5, seed=2)
    src[0, 4:] = PAD
    with torch.autocast(device_type="cpu", dtype=dtype), torch.no_grad():
        cache = inference.init_cache(*inference.encode(src), max_len=5)
        steps = [inference.decode_step(tgt[:, position], position, cache) for position in range(5)]
    assert cache.key_buffer.dtype == dtype
    assert all(torch.isfinite(step).all() for step in steps)


# The contract: the cached path carries every part of the model's layers.


def test_the_layers_have_exactly_the_parts_the_cached_path_declares_it_carries():
    """Fails when EncoderLayer or DecoderLayer gains (or loses) a submodule or parameter: the cached
    path (InferenceEncoderLayer, CachedDecoderLayer, StepLinears) must then learn it, and its
    declaration in aiayn.speed.incremental change with it."""
    config = tiny_config()
    assert layer_parts(EncoderLayer(config)) == ENCODER_LAYER_PARTS
    assert layer_parts(DecoderLayer(config)) == DECODER_LAYER_PARTS


@pytest.mark.parametrize("layers", ["encoder", "decoder"])
@pytest.mark.parametrize("part", ["submodule", "parameter", "parameter of a sub-layer"])
def test_a_layer_part_the_cached_path_does_not_carry_is_caught(layers, part):
    """The check above, and InferenceModel, see a part added to a layer that the cached path would drop."""
    model = tiny_model()
    layer = getattr(model, layers)[0]
    if part == "submodule":
        layer.gate = torch.nn.Linear(layer.self_attention_norm.normalized_shape[0], 1)
    elif part == "parameter":
        layer.scale = torch.nn.Parameter(torch.ones(1))
    else:
        layer.feed_forward.bias = torch.nn.Parameter(torch.zeros(1))
    declared = ENCODER_LAYER_PARTS if layers == "encoder" else DECODER_LAYER_PARTS
    assert layer_parts(layer) != declared
    with pytest.raises(TypeError, match="teach the cached path"):
        InferenceModel(model)
