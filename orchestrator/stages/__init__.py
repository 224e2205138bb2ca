"""Runs in the driver; the training itself runs on the learner's ranks.
Owns the SFT and reward-model stages, and the SFT -> RM -> RL pipeline that chains them.
Contains no training math: the learner package owns the losses and the update.
"""
