"""The special symbols' fixed ids, which every stage relies on: pad 0, unk 1, bos 2, eos 3.

The bpe stage gives them to SentencePiece; batching pads with ``PAD_ID``, the model ignores it, the search
starts at ``BOS_ID`` and ends at ``EOS_ID``.
"""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
