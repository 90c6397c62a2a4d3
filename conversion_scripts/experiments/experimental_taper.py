#!/usr/bin/env python
"""``hf-tapernorm taper`` with the recipe's experimental options, which the command has no flag for.

Why: the options the project measured and did not adopt (``hf_tapernorm.config.ExperimentalOptions``: another
start of the linear branch, a multiplier on c, other teachers, a KL weight that fades with the gate;
docs/method.md and reports/fidelity_record.md say what each gave) stay in the config for the research, out of
the product's ``--help``. This script reads them, one flag per field (its help and choices come from the field),
and hands them to the whole ``taper`` command (run folder, report, ``--resume``) through its extension point,
``TaperExtension(experimental=...)``: they join the run's identity and its report's ``taper`` section (under
``experimental``). Every other option is ``taper``'s::

    python -m conversion_scripts.experiments.experimental_taper --distill_schedule gate \\
        --output_dir runs/x --max_steps 300 --baseline
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence
from typing import Any, Optional

from hf_tapernorm import ConfigurationError
from hf_tapernorm.app.taper import TaperExtension
from hf_tapernorm.cli.main import main as hf_tapernorm_main
from hf_tapernorm.config import ExperimentalOptions


def experimental_parser() -> argparse.ArgumentParser:
    """One optional flag per ExperimentalOptions field, unset by default (the recipe's behaviour)."""
    parser = argparse.ArgumentParser(
        prog="python -m conversion_scripts.experiments.experimental_taper",
        description=__doc__.split("\n\n")[0],
        epilog="Every other option is hf-tapernorm taper's (hf-tapernorm taper --help).",
        allow_abbrev=False,
    )
    hints = typing.get_type_hints(ExperimentalOptions)
    for option in dataclasses.fields(ExperimentalOptions):
        choices = ExperimentalOptions.choices(option.name)
        parser.add_argument(
            f"--{option.name}",
            choices=choices,
            type=None if choices else hints[option.name],
            help=f"{option.metadata['help']} Default: {option.default}.",
        )
    return parser


def split_arguments(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """The experimental options set in ``argv`` (checked by the config: a bad value exits 2 naming its flag), and
    the ``taper`` command's arguments."""
    parser = experimental_parser()
    known, rest = parser.parse_known_args(list(argv))
    options = {name: value for name, value in vars(known).items() if value is not None}
    try:
        ExperimentalOptions(**options)
    except ConfigurationError as error:
        parser.error(str(error).replace(f"{ExperimentalOptions.LABEL}.", "--"))
    return options, rest


def main(argv: Optional[Sequence[str]] = None) -> int:
    options, rest = split_arguments(sys.argv[1:] if argv is None else argv)
    return hf_tapernorm_main(["taper", *rest], extension=TaperExtension(experimental=options))


if __name__ == "__main__":
    sys.exit(main())
