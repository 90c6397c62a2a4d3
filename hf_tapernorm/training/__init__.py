"""Training: the gate schedule, calibration, distillation, the divergence watch, and the two drivers
(``TaperController`` for any loop, ``TaperCallback`` for the Trainer). Depends on layers/ and below."""
