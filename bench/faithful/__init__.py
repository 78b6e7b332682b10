"""The deliberate differences from the paper, each measured against the paper's choice: training choices over
seeds, the EOS-candidate rule, the checkpoint cadence, the reference side of tokenized BLEU, pieces per word."""
