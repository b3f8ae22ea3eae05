"""SASRec multi-label training with CutBCE: data, model, loop, eval, checkpoints."""
