"""The data stages: download, BPE and binarize, their time and memory."""
