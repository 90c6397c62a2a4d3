"""``python -m hf_tapernorm.cli`` (what torchrun and accelerate launch run)."""

import sys

from .main import main

sys.exit(main())
