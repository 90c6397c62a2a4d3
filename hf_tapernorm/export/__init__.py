"""Export: fold a tapered model into a norm-free one, check it, register its classes, write and push it.
``modeling_folded.py`` is copied next to every export and imports nothing from hf_tapernorm."""
