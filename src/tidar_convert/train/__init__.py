"""Continual pretraining with the hybrid loss: the `fit` entry point (fit.py) and its up-front
checks, the Lightning module, loss glue, run folders, checkpoints and resume, distillation,
sharding and callbacks. Imports runtime/, models/, export/ and data/."""
