"""Training: step speed against MarianMT and the matmul floor, steps on a GPU, learning-curve parity with
fairseq, step shapes, and the projection of a run's final dev perplexity."""
