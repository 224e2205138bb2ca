"""The SFT and reward-model stages, and the SFT -> RM -> RL pipeline that chains them."""
