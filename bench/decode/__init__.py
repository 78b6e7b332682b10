"""Decoding: beam-search speed against MarianMT and CTranslate2, on a GPU, and why outputs are short."""
